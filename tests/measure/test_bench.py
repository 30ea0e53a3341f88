"""The benchmark harness: metric arithmetic against hand-computed values, multi-turn, equality, files."""

import json
import re

import pytest

from specplay.core.errors import ConfigError
from specplay.core.measure.bench import BenchSpec, format_summary, run_bench, summarize
from specplay.core.measure.prompts import Question, load_questions
from tiny import loaded, native_from_hf, tiny_hf_model

QUESTIONS = [Question(1, "code", ("a",)), Question(2, "code", ("b",)), Question(3, "qa", ("c", "d"))]


def rec(qid, cat, new_tokens, wall, accept=None, token_ids=None, repeat=0, drafted=0, accepted=0):
    return {"question_id": qid, "category": cat, "repeat": repeat, "new_tokens": new_tokens, "wall_time": wall,
            "accept_lengths": accept, "token_ids": token_ids or [[qid]], "drafted": drafted, "accepted": accepted}


def test_summary_arithmetic_matches_hand_computation():
    answers = {
        "autoregressive": [rec(1, "code", [10], [1.0], [[1] * 10]), rec(2, "code", [20], [4.0], [[1] * 20]),
                           rec(3, "qa", [5, 5], [1.0, 1.0], [[1] * 5, [1] * 5], token_ids=[[3], [4]])],
        "fast": [rec(1, "code", [10], [0.5], [[2, 3, 5]], drafted=12, accepted=7),
                 rec(2, "code", [20], [2.0], [[4] * 5], drafted=20, accepted=15),
                 rec(3, "qa", [5, 5], [0.5, 0.5], [[5], [1, 4]], token_ids=[[3], [9]], drafted=8, accepted=6)],
    }
    s = summarize(answers, QUESTIONS)
    # Per-question speeds: baseline 10, 5 | 5 (10 tokens / 2 s); fast 20, 10 | 10.
    assert s["autoregressive"]["code"]["tokens_per_s"] == pytest.approx(7.5)
    assert s["fast"]["code"]["tokens_per_s"] == pytest.approx(15.0)
    assert s["fast"]["code"]["speedup"] == pytest.approx(2.0)
    assert s["fast"]["overall"]["tokens_per_s"] == pytest.approx((20 + 10 + 10) / 3)
    assert s["fast"]["overall"]["speedup"] == pytest.approx(((20 + 10 + 10) / 3) / ((10 + 5 + 5) / 3))
    # τ pools steps: code has steps 2,3,5,4,4,4,4,4 -> 30/8.
    assert s["fast"]["code"]["mean_accepted"] == pytest.approx(30 / 8)
    assert s["fast"]["overall"]["acceptance_rate"] == pytest.approx(28 / 40)
    assert s["autoregressive"]["overall"]["mean_accepted"] == pytest.approx(1.0)
    assert s["fast"]["code"]["identical"] is True
    assert s["fast"]["qa"]["identical"] is False and s["fast"]["overall"]["identical"] is False


def test_repeats_average_speedups_per_repeat():
    answers = {"autoregressive": [rec(1, "code", [10], [1.0]), rec(1, "code", [10], [2.0], repeat=1)],
               "m": [rec(1, "code", [10], [0.5]), rec(1, "code", [10], [0.5], repeat=1)]}
    s = summarize(answers, QUESTIONS[:1])
    assert s["m"]["code"]["speedup"] == pytest.approx((2.0 + 4.0) / 2)
    assert s["m"]["code"]["speedup_std"] > 0


def test_the_speedup_interval_spans_what_other_questions_would_give():
    ids = range(1, 9)
    qs = [Question(i, "code", ("x",)) for i in ids]
    base = [rec(i, "code", [10], [1.0]) for i in ids]
    # Every question twice as fast: no draw of the questions gives anything else.
    even = summarize({"autoregressive": base, "m": [rec(i, "code", [10], [0.5]) for i in ids]}, qs)
    assert even["m"]["overall"]["speedup_interval"] == pytest.approx([2.0, 2.0])
    # Half the questions 3x, half 1x (speedup 2): the interval holds 2, stays inside 1..3 and is wide.
    mixed = [rec(i, "code", [10], [1 / 3 if i % 2 else 1.0]) for i in ids]
    s = summarize({"autoregressive": base, "m": mixed}, qs)
    lo, hi = s["m"]["overall"]["speedup_interval"]
    assert s["m"]["overall"]["speedup"] == pytest.approx(2.0)
    assert 1.0 <= lo < 1.8 and 2.2 < hi <= 3.0
    assert summarize({"autoregressive": base, "m": mixed}, qs)["m"]["overall"]["speedup_interval"] == [lo, hi]
    assert f"{lo:.2f}-{hi:.2f}" in format_summary(s) and "95% range" in format_summary(s)
    # One question: nothing to draw from.
    one = summarize({"autoregressive": base[:1], "m": mixed[:1]}, qs[:1])
    assert one["m"]["overall"]["speedup_interval"] is None
    assert "95% range:" not in format_summary(one)


def test_question_files_are_validated_line_by_line(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n{"question_id": 2, "turns": []}\n')
    with pytest.raises(ConfigError, match="line 2: 'turns'"):
        load_questions(str(p))
    p.write_text('{"question_id": 1, "turns": ["hi"]}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2: not valid JSON"):
        load_questions(str(p))
    p.write_bytes(b'{"question_id": 1, "turns": ["\xff"]}\n')
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        load_questions(str(p))
    assert len(load_questions("code")) == 32
    assert len(load_questions("completion")) == 24
    two_each = load_questions("spec_bench", per_category=2)
    cats = {q.category for q in two_each}
    assert len(two_each) == 2 * len(cats) and len(cats) == 13
    assert {q.category for q in load_questions("spec_bench", ["mt_bench"])} <= {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_run_bench_writes_answer_files_and_feeds_answers_back(tmp_path):
    import torch

    from specplay.core.methods.prompt_lookup import PromptLookupConfig

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), model_id="tiny")
    questions = [Question(7, "code", ("ab cd ab", "cd ab")), Question(8, "qa", ("ab ab",))]
    spec = BenchSpec(methods=["prompt_lookup"], configs={"prompt_lookup": PromptLookupConfig()}, max_new_tokens=12,
                     chat_template=False)

    result = run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)
    s = result["summary"]
    assert s["prompt_lookup"]["overall"]["identical"] is True
    lines = [json.loads(x) for x in (tmp_path / "prompt_lookup.jsonl").read_text().splitlines()]
    assert [x["question_id"] for x in lines] == [7, 8]
    first = lines[0]["choices"][0]
    assert len(first["turns"]) == 2 and len(first["new_tokens"]) == 2
    assert sum(first["accept_lengths_per_turn"][0]) == first["new_tokens"][0]
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["baseline"] == "autoregressive" and "verify_cost" in doc
    assert (tmp_path / "autoregressive.jsonl").is_file()
    # Time to first token: per turn in the answers, the first turns' mean in the summary and table.
    assert 0 < s["prompt_lookup"]["overall"]["time_to_first_token"] <= max(x["choices"][0]["wall_time"][0] for x in lines)
    assert "TTFT s" in format_summary(s)


def test_multi_turn_history_contains_the_methods_own_answer(tmp_path, monkeypatch):
    import torch

    import specplay.core.text as text

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), model_id="tiny")
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    calls = []
    real = text.encode_messages

    def spy(tok, messages):
        calls.append([m["content"] for m in messages])
        return real(tok, messages)

    monkeypatch.setattr(text, "encode_messages", spy)
    run_bench(target, None, [Question(1, "writing", ("ab", "cd"))], BenchSpec(methods=["autoregressive"],
              max_new_tokens=5, warmup=0), tmp_path, log=lambda m: None)
    answer = json.loads((tmp_path / "autoregressive.jsonl").read_text())["choices"][0]["turns"][0]
    assert calls[-1] == ["ab", answer, "cd"]


def test_a_run_that_runs_out_of_memory_is_a_failure_not_an_answer(tmp_path, monkeypatch):
    import torch

    from specplay.core.measure.bench import format_summary
    from specplay.core.methods.prompt_lookup import PromptLookup, PromptLookupConfig

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), model_id="tiny")
    marker = target.tokenizer.convert_tokens_to_ids("z")
    real = PromptLookup.propose

    def oom_on_marked_prompts(self, ctx, budget):
        if marker in ctx.tokens[:ctx.prompt_len]:
            raise RuntimeError("CPU out of memory: tried to allocate 8 GiB")
        return real(self, ctx, budget)

    monkeypatch.setattr(PromptLookup, "propose", oom_on_marked_prompts)
    questions = [Question(1, "code", ("ab cd ab",)), Question(2, "code", ("zz ab",))]
    spec = BenchSpec(methods=["prompt_lookup"], configs={"prompt_lookup": PromptLookupConfig()}, max_new_tokens=8,
                     chat_template=False)
    s = run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)["summary"]

    lines = {name: [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
             for name in ("autoregressive", "prompt_lookup")}
    assert [x["error"] for x in lines["autoregressive"]] == [None, None]
    assert lines["prompt_lookup"][0]["error"] is None and "out of memory" in lines["prompt_lookup"][1]["error"]
    got = s["prompt_lookup"]["overall"]
    assert got["failures"] == 1 and len(got["errors"]) == 1 and "out of memory" in got["errors"][0]
    assert s["autoregressive"]["overall"]["failures"] == 0

    def speed(line):
        c = line["choices"][0]
        return sum(c["new_tokens"]) / sum(c["wall_time"])

    # Only question 1 counts: speed, speedup against the baseline's question 1, and τ.
    ok, base = lines["prompt_lookup"][0], lines["autoregressive"][0]
    assert got["tokens_per_s"] == pytest.approx(speed(ok))
    assert got["speedup"] == pytest.approx(speed(ok) / speed(base))
    steps = ok["choices"][0]["accept_lengths"]
    assert got["mean_accepted"] == pytest.approx(sum(steps) / len(steps))
    table = format_summary(s)
    assert "prompt_lookup: 1 failed" in table and "out of memory" in table


def test_the_transformers_peers_ignore_the_model_folders_generation_settings(tmp_path, monkeypatch):
    from transformers import GenerationConfig as HFGenerationConfig

    from specplay.core.decoding.types import GenerationConfig, SamplingConfig
    from specplay.core.measure.peers import HFPeer
    from specplay.core.models.loader import load_model
    from tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "m")
    HFGenerationConfig(do_sample=True, temperature=1.3, top_p=0.5, top_k=5, repetition_penalty=1.5,
                       eos_token_id=2).save_pretrained(str(folder))
    target = load_model(str(folder), "cpu", "float32")
    peer = HFPeer("hf_generate", target, None, {})
    effective = []
    real = peer.model._prepare_generation_config

    def capture(*args, **kwargs):
        config, model_kwargs = real(*args, **kwargs)
        effective.append(config)
        return config, model_kwargs

    monkeypatch.setattr(peer.model, "_prepare_generation_config", capture)
    peer.run([4, 5, 3, 6], GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0.7, top_p=0.9)))
    config = effective[-1]
    assert config.do_sample is True and config.temperature == 0.7 and config.top_p == 0.9
    assert config.top_k in (0, None) and config.repetition_penalty == 1.0
    assert config.max_new_tokens == 6 and config.eos_token_id == [2]


def _check_int8_assistant(tmp_path, **draft_info):
    """hf_assisted with a draft of the target's weights whose model reports ``draft_info`` runs it in int8,
    with the output of plain greedy generation."""
    from dataclasses import replace

    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.kernels.linear import int8_supported
    from specplay.core.measure.peers import HFPeer
    from specplay.core.models.loader import LoadedModel, load_model
    from tiny import save_tiny_model

    if not int8_supported():
        pytest.skip("no int8 kernel on this machine")
    folder = save_tiny_model(tmp_path / "m")
    target = load_model(str(folder), "cpu", "float32")
    stored = type("Draft", (), {"info": replace(target.model.info, **draft_info)})()
    copy = save_tiny_model(tmp_path / "draft")  # the same weights in the draft's own folder
    draft = LoadedModel(model=stored, tokenizer=target.tokenizer, model_id=str(copy), path=copy)
    hf_models: dict = {}
    assisted = HFPeer("hf_assisted", target, draft, hf_models)
    assert type(assisted.assistant.model.layers[0].mlp.down_proj).__name__ == "_Int8"
    gen = GenerationConfig(max_new_tokens=8, stop_at_eos=False)
    plain = HFPeer("hf_generate", target, None, {})
    assert assisted.run([4, 5, 3, 6], gen).token_ids == plain.run([4, 5, 3, 6], gen).token_ids


def test_assisted_generation_takes_a_llama_cpp_draft_as_an_int8_transformers_assistant(tmp_path):
    """The default CPU draft runs on llama.cpp in 4 bits; transformers gets the same model in int8."""
    _check_int8_assistant(tmp_path, backend="llama.cpp", dtype="q4_0")


def test_assisted_generation_takes_a_native_int4_draft_as_an_int8_transformers_assistant(tmp_path):
    """A draft in SpecPlay's int4 layers: transformers has no int4 dtype to load it in (it raised), so int8 too."""
    _check_int8_assistant(tmp_path, backend="native", dtype="int4")


# ----------------------------------------------------------------------------- nothing lost, nothing leaked
def tiny_target():
    import torch

    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), model_id="tiny")


def answer_lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def fake_endpoints(monkeypatch, target, suffix=None):
    """Endpoints answer with the target's own greedy text (``suffix``: name -> text appended), with no server."""
    import specplay.core.remote.runs as remote
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig, SamplingConfig
    from specplay.core.methods import build_method

    def stream_completion(endpoint, prompt, max_tokens, **_):
        ids = target.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        method = build_method("autoregressive", None, target, None)
        gen = GenerationConfig(max_new_tokens=max_tokens, sampling=SamplingConfig(temperature=0.0))
        text = drain(generate(target.model, target.tokenizer, method, ids, gen)).text
        text += (suffix or {}).get(endpoint.label, "")
        return remote.RemoteRun(endpoint, prompt, text=text, chunks=[(0.01, text)], wall_time=0.02)

    monkeypatch.setattr(remote, "stream_completion", stream_completion)


def test_file_stems_are_plain_names_kept_apart():
    from specplay.core.measure.bench import file_stems

    names = ["autoregressive", "remote:fake", "remote:h:8000/Org/Name", "remote:../../x", "remote:a/b", "remote:a-b",
             "remote:A-B", "remote:" + "n" * 300]
    stems = file_stems(names)
    assert stems["autoregressive"] == "autoregressive" and stems["remote:fake"] == "remote-fake"  # as before
    assert stems["remote:h:8000/Org/Name"] == "remote-h-8000-Org-Name"
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", s) for s in stems.values())
    assert not any(s.startswith(".") or len(s) > 120 for s in stems.values())
    assert len({s.lower() for s in stems.values()}) == len(names)  # apart even where case is not
    assert file_stems(list(reversed(names))) == stems  # the same from one run to the next


def test_endpoint_labels_with_slashes_or_dots_write_inside_out_and_keep_everything(tmp_path, monkeypatch):
    from specplay.core.remote.endpoint import Endpoint

    target = tiny_target()
    fake_endpoints(monkeypatch, target)
    url = "http://h:8000/v1"
    endpoints = {f"remote:{ep.label}": ep for ep in (Endpoint(url, model="Org/Name"), Endpoint(url, name="../../evil"),
                                                     Endpoint(url, name="a/b"), Endpoint(url, name="a-b"))}
    spec = BenchSpec(methods=list(endpoints), endpoints=endpoints, max_new_tokens=4, chat_template=False, warmup=0)
    out = tmp_path / "out"
    run_bench(target, None, [Question(1, "code", ("ab",))], spec, out, log=lambda m: None)
    assert all(p.parent == out and p.is_file() for p in tmp_path.rglob("*") if p != out)
    doc = json.loads((out / "summary.json").read_text())
    files = doc["answer_files"]
    assert set(files) == {"autoregressive", *endpoints} and len(set(files.values())) == len(files)
    for name, file in files.items():
        assert [x["method"] for x in answer_lines(out / file)] == [name]
        assert doc["summary"][name]["overall"]["failures"] == 0


def test_an_interrupted_bench_keeps_its_answers_and_a_rerun_resumes_it(tmp_path, monkeypatch):
    from specplay.core.measure.peers import OurMethod
    from specplay.core.methods.prompt_lookup import PromptLookupConfig

    target = tiny_target()
    real = OurMethod.run
    runs, interrupt_at = [], [("prompt_lookup", "cd")]

    def counted(self, prompt_ids, gen):
        run = (self.name, self.target.tokenizer.decode(prompt_ids))
        if run in interrupt_at:
            raise KeyboardInterrupt
        runs.append(run)
        return real(self, prompt_ids, gen)

    monkeypatch.setattr(OurMethod, "run", counted)
    questions = [Question(1, "code", ("ab",)), Question(2, "code", ("cd",)), Question(3, "qa", ("ab cd",))]

    def bench():
        spec = BenchSpec(methods=["prompt_lookup"], configs={"prompt_lookup": PromptLookupConfig()}, max_new_tokens=6,
                         chat_template=False, warmup=0)
        return run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)

    with pytest.raises(KeyboardInterrupt):
        bench()
    assert runs == [("autoregressive", "ab"), ("prompt_lookup", "ab"), ("autoregressive", "cd")]
    assert [x["question_id"] for x in answer_lines(tmp_path / "autoregressive.jsonl")] == [1, 2]
    with open(tmp_path / "prompt_lookup.jsonl", "a") as f:
        f.write('{"question_id": 2, "catego')  # and a process killed mid-line leaves half an answer
    runs.clear()
    interrupt_at.clear()

    s = bench()["summary"]
    assert runs == [("prompt_lookup", "cd"), ("autoregressive", "ab cd"), ("prompt_lookup", "ab cd")]
    assert [x["question_id"] for x in answer_lines(tmp_path / "prompt_lookup.jsonl")] == [1, 2, 3]
    assert [x["question_id"] for x in answer_lines(tmp_path / "autoregressive.jsonl")] == [1, 2, 3]
    got = s["prompt_lookup"]["overall"]
    assert got["questions"] == 3 and got["failures"] == 0 and got["identical"] is True
    assert got["mean_accepted"] is not None and s["autoregressive"]["code"]["tokens_per_s"] > 0


def test_a_rerun_with_another_setting_starts_afresh_and_says_so(tmp_path):
    target = tiny_target()
    logs = []

    def bench(max_new_tokens):
        spec = BenchSpec(methods=["autoregressive"], max_new_tokens=max_new_tokens, warmup=0, chat_template=False)
        run_bench(target, None, [Question(1, "code", ("ab",))], spec, tmp_path, log=logs.append)

    bench(4)
    first = (tmp_path / "autoregressive.jsonl").read_text()
    bench(6)
    assert any("max_new_tokens 4 -> 6" in m and "starts afresh" in m for m in logs)
    assert [x["settings"]["max_new_tokens"] for x in answer_lines(tmp_path / "autoregressive.jsonl")] == [6]
    aside = list(tmp_path.glob("autoregressive.jsonl.superseded-*"))
    assert len(aside) == 1 and aside[0].read_text() == first  # kept, not mixed in


def test_a_rerun_with_another_draft_backend_or_dtype_measures_afresh_and_the_same_one_resumes(tmp_path, monkeypatch):
    """Answers name every model's resolved device, dtype and backend, and are read back only under the same."""
    import dataclasses

    import torch

    from specplay.core.measure.peers import OurMethod

    target = tiny_target()
    hf = tiny_hf_model(seed=0, dtype=torch.float32)
    native = loaded(native_from_hf(hf, dtype=torch.float32), model_id="tiny")
    as_float64 = loaded(native_from_hf(hf, dtype=torch.float64), model_id="tiny")
    on_llamacpp = loaded(native_from_hf(hf, dtype=torch.float32), model_id="tiny")
    on_llamacpp.model.info = dataclasses.replace(on_llamacpp.model.info, backend="llama.cpp")
    real, runs, logs = OurMethod.run, [], []

    def counted(self, prompt_ids, gen):
        runs.append(self.name)
        return real(self, prompt_ids, gen)

    monkeypatch.setattr(OurMethod, "run", counted)

    def bench(draft):
        runs.clear()
        spec = BenchSpec(methods=["speculative"], max_new_tokens=4, warmup=0, chat_template=False)
        run_bench(target, draft, [Question(1, "code", ("ab",))], spec, tmp_path, log=logs.append)
        return list(runs)

    assert bench(native) == ["autoregressive", "speculative"]
    settings = answer_lines(tmp_path / "speculative.jsonl")[0]["settings"]
    assert (settings["draft_backend"], settings["draft_dtype"], settings["draft_device"]) == ("native", "float32",
                                                                                             "cpu")
    assert (settings["target_backend"], settings["target_dtype"], settings["target_device"]) == ("native", "float64",
                                                                                                "cpu")
    assert settings["specplay"] and "speculative.jsonl" not in " ".join(logs)
    assert bench(native) == []  # the same settings: every answer read back
    assert bench(on_llamacpp) == ["autoregressive", "speculative"]
    assert any("draft_backend 'native' -> 'llama.cpp'" in m and "starts afresh" in m for m in logs)
    assert bench(as_float64) == ["autoregressive", "speculative"]
    assert any("draft_dtype 'float32' -> 'float64'" in m for m in logs)
    assert [x["settings"]["draft_dtype"] for x in answer_lines(tmp_path / "speculative.jsonl")] == ["float64"]


def test_a_rerun_under_another_specplay_version_measures_afresh(tmp_path, monkeypatch):
    import specplay.core as core

    target, logs = tiny_target(), []

    def bench():
        spec = BenchSpec(methods=["autoregressive"], max_new_tokens=4, warmup=0, chat_template=False)
        run_bench(target, None, [Question(1, "code", ("ab",))], spec, tmp_path, log=logs.append)

    bench()
    monkeypatch.setattr(core, "__version__", "99.0")
    bench()
    assert any("specplay" in m and "-> '99.0'" in m and "starts afresh" in m for m in logs)


def read_like_spec_bench(path):
    """What Spec-Bench's evaluation/speed.py takes from an answer file: per line, the first
    choice's flat accept lengths (extended over the turns), and the sums of its new tokens, wall
    times and decoding steps; numpy arrays of them."""
    import numpy as np

    lengths, speeds, steps = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        choice = json.loads(line)["choices"][0]
        lengths.extend(choice["accept_lengths"])
        speeds.append(sum(choice["new_tokens"]) / sum(choice["wall_time"]))
        steps.append(sum(choice["decoding_steps"]))
        assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"])
        assert len(choice["decoding_steps"]) in (0, len(choice["turns"]))  # none where no steps are known
    return np.array(lengths), np.array(speeds), np.array(steps)


def test_spec_bench_reads_a_bench_folder_as_it_reads_its_own(tmp_path, monkeypatch):
    """Spec-Bench's record, choice by choice: one flat accept_lengths list over the turns and one
    decoding_steps entry per turn; the turns apart stay under our own key. Two turns of unequal
    lengths made a ragged array numpy refused ("inhomogeneous shape")."""
    from specplay.core.remote.endpoint import Endpoint

    target = tiny_target()
    fake_endpoints(monkeypatch, target)
    endpoint = Endpoint("http://h:8000/v1", name="peer")
    spec = BenchSpec(methods=["prompt_lookup", "remote:peer"], endpoints={"remote:peer": endpoint}, max_new_tokens=7,
                     chat_template=False, warmup=0)
    questions = [Question(1, "code", ("ab cd ab", "cd")), Question(2, "qa", ("ab",))]
    run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)
    for name in ("autoregressive", "prompt_lookup"):
        lengths, speeds, steps = read_like_spec_bench(tmp_path / f"{name}.jsonl")
        assert lengths.ndim == 1 and lengths.dtype.kind == "i" and speeds.ndim == 1 and (speeds > 0).all()
        assert steps.sum() == len(lengths)
        for line in answer_lines(tmp_path / f"{name}.jsonl"):
            c = line["choices"][0]
            per_turn = c["accept_lengths_per_turn"]
            assert [x for turn in per_turn for x in turn] == c["accept_lengths"]
            assert [len(turn) for turn in per_turn] == c["decoding_steps"]
            assert [sum(turn) for turn in per_turn] == c["new_tokens"]
    # an endpoint says no steps: nothing to extend with and no steps, not a None numpy cannot read
    lengths, speeds, steps = read_like_spec_bench(tmp_path / "remote-peer.jsonl")
    assert len(lengths) == 0 and (steps == 0).all() and (speeds > 0).all()
    assert answer_lines(tmp_path / "remote-peer.jsonl")[0]["choices"][0]["accept_lengths_per_turn"] is None
    # and the bench reads its own files back the same (a resume)
    again = run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)["summary"]
    assert again["prompt_lookup"]["overall"]["mean_accepted"] == pytest.approx(
        read_like_spec_bench(tmp_path / "prompt_lookup.jsonl")[0].mean())


def test_a_method_that_cannot_load_or_run_is_a_failure_and_the_others_keep_their_results(tmp_path, monkeypatch):
    from specplay.core.measure.peers import HFPeer
    from specplay.core.methods.prompt_lookup import PromptLookup, PromptLookupConfig

    target = tiny_target()

    def cannot_load(self, *args):
        raise ValueError("Qwen2ForCausalLM cannot be instantiated under dtype=torch.int4")

    marker = target.tokenizer.convert_tokens_to_ids("z")
    real = PromptLookup.propose

    def bug_on_marked_prompts(self, ctx, budget):
        if marker in ctx.tokens[:ctx.prompt_len]:
            raise IndexError("a bug")
        return real(self, ctx, budget)

    monkeypatch.setattr(HFPeer, "__init__", cannot_load)
    monkeypatch.setattr(PromptLookup, "propose", bug_on_marked_prompts)
    questions = [Question(1, "code", ("ab cd ab",)), Question(2, "code", ("zz ab",))]
    spec = BenchSpec(methods=["hf_assisted", "prompt_lookup"], configs={"prompt_lookup": PromptLookupConfig()},
                     max_new_tokens=8, chat_template=False)
    s = run_bench(target, None, questions, spec, tmp_path, log=lambda m: None)["summary"]

    assisted, lookup = s["hf_assisted"]["overall"], s["prompt_lookup"]["overall"]
    assert assisted["failures"] == 2 and assisted["tokens_per_s"] is None
    assert assisted["errors"] == ["could not load: ValueError: Qwen2ForCausalLM cannot be instantiated under "
                                  "dtype=torch.int4"]
    assert lookup["failures"] == 1 and lookup["errors"] == ["IndexError: a bug"] and lookup["tokens_per_s"] > 0
    assert s["autoregressive"]["overall"]["failures"] == 0 and s["autoregressive"]["overall"]["questions"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["summary"] == json.loads(json.dumps(s))
    table = format_summary(s)
    assert "hf_assisted: 2 failed" in table and "dtype=torch.int4" in table and "prompt_lookup: 1 failed" in table


def test_an_endpoint_is_identical_when_its_text_is_the_baselines(tmp_path, monkeypatch):
    """The target's tokenizer reads an endpoint's text back without the special tokens the baseline
    emitted (here a <s> mid-answer), so the token ids differ where the texts are the same."""
    from specplay.core.remote.endpoint import Endpoint

    target = tiny_target()
    fake_endpoints(monkeypatch, target, suffix={"off": "z"})
    endpoints = {"remote:same": Endpoint("http://h:8000/v1", name="same"),
                 "remote:off": Endpoint("http://h:8000/v1", name="off")}
    spec = BenchSpec(methods=list(endpoints), endpoints=endpoints, max_new_tokens=24, chat_template=False, warmup=0)
    s = run_bench(target, None, [Question(1, "code", ("xy",))], spec, tmp_path, log=lambda m: None)["summary"]
    base, same = (answer_lines(tmp_path / f"{n}.jsonl")[0]["choices"][0] for n in ("autoregressive", "remote-same"))
    assert same["turns"] == base["turns"] and same["token_ids"] != base["token_ids"]
    assert s["remote:same"]["overall"]["identical"] is True
    assert s["remote:off"]["overall"]["identical"] is False


def test_a_temperature_sweep_reports_each_temperature_and_a_single_one_writes_what_it_did(tmp_path):
    import torch

    from specplay.core.cli.commands import _temperatures
    from specplay.core.errors import SpecPlayError
    from specplay.core.measure.bench import format_sweep

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), model_id="tiny")
    questions = [Question(7, "code", ("ab cd ab",)), Question(8, "qa", ("ab ab cd",))]
    settings = dict(methods=["prompt_lookup"], max_new_tokens=12, chat_template=False, warmup=0)
    sweep = run_bench(target, None, questions, BenchSpec(**settings, temperatures=(0.0, 1.0)), tmp_path / "sweep",
                      log=lambda m: None)
    assert list(sweep["by_temperature"]) == [0.0, 1.0] and sweep["summary"] == sweep["by_temperature"][0.0]
    for summary in sweep["by_temperature"].values():
        for group in ("code", "qa", "overall"):
            entry = summary["prompt_lookup"][group]
            assert {"speedup", "mean_accepted", "acceptance_rate"} <= set(entry) and entry["speedup"] is not None
    doc = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert doc["settings"]["temperatures"] == [0.0, 1.0] and list(doc["by_temperature"]) == ["0", "1"]
    assert doc["summary"] == doc["by_temperature"]["0"]
    assert doc["answer_files_by_temperature"]["1"]["prompt_lookup"] == "prompt_lookup-T1.jsonl"
    table = format_sweep(sweep["by_temperature"])
    assert "T=0: speedup" in table and "T=1: speedup" in table
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("prompt_lookup")] == [
        ["prompt_lookup", "code"]]
    # at T > 0 outputs are not expected to equal the baseline's, and the table does not judge them by it
    row = next(line for line in format_summary(sweep["by_temperature"][1.0], temperature=1.0).splitlines()
               if line.startswith("prompt_lookup"))
    assert row.endswith("  -")

    # A single temperature writes summary.json and the answer files as before a sweep existed,
    # and its answers are the sweep's at that temperature (same seed, same settings; compared on the
    # baseline, whose steps never depend on timing as a drafting method's may, see core/decoding/standdown.py).
    run_bench(target, None, questions, BenchSpec(**settings, temperature=1.0), tmp_path / "single",
              log=lambda m: None)
    doc = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert "by_temperature" not in doc and doc["settings"]["temperature"] == 1.0
    assert doc["answer_files"]["prompt_lookup"] == "prompt_lookup.jsonl"

    def token_ids(path):
        return [json.loads(x)["choices"][0]["token_ids"] for x in path.read_text().splitlines()]

    assert token_ids(tmp_path / "single" / "autoregressive.jsonl") == token_ids(
        tmp_path / "sweep" / "autoregressive-T1.jsonl") != token_ids(tmp_path / "sweep" / "autoregressive-T0.jsonl")
    assert _temperatures("0, 1") == (0.0, 1.0)
    for bad in ("0,x", "0,0", "-1"):
        with pytest.raises(SpecPlayError):
            _temperatures(bad)
