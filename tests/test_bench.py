"""The benchmark harness: metric arithmetic against hand-computed values, multi-turn, equality, files."""

import json

import pytest

from core.bench import BenchSpec, Question, load_questions, run_bench, summarize
from core.errors import ConfigError
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
    two_each = load_questions("spec_bench", per_category=2)
    cats = {q.category for q in two_each}
    assert len(two_each) == 2 * len(cats) and len(cats) == 13
    assert {q.category for q in load_questions("spec_bench", ["mt_bench"])} <= {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def test_run_bench_writes_answer_files_and_feeds_answers_back(tmp_path):
    import torch

    from core.methods.prompt_lookup import PromptLookupConfig

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), spec="tiny")
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
    assert sum(first["accept_lengths"][0]) == first["new_tokens"][0]
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert doc["baseline"] == "autoregressive" and "verify_cost" in doc
    assert (tmp_path / "autoregressive.jsonl").is_file()


def test_multi_turn_history_contains_the_methods_own_answer(tmp_path, monkeypatch):
    import torch

    import core.text as text

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)), spec="tiny")
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
