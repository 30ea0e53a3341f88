"""Tune: every setting's replayed steps are the steps a real run takes, and the command proves its pick."""

import json
from types import SimpleNamespace

import pytest
import torch

from specplay.core.cli import main
from specplay.core.measure import replay as replaying, tune as tuning
from specplay.core.decoding import costmodel
from specplay.core.decoding.costmodel import CostCurve
from specplay.core.decoding.engine import drain, generate
from specplay.core.methods import build_method
from specplay.core.methods.eagle import EagleConfig
from specplay.core.methods.prompt_lookup import PromptLookupConfig
from specplay.core.methods.speculative import SpeculativeConfig
from specplay.core.decoding.types import GenerationConfig
from test_eagle import make_head_file
from tiny import loaded, native_from_hf, on_a_clock, perturbed_copy, save_tiny_model, tiny_hf_model

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7, 9, 10, 4, 5]
N = 40


@pytest.fixture(scope="module")
def pair():
    hf = tiny_hf_model(seed=0, dtype=torch.float64)
    target = loaded(native_from_hf(hf))
    draft = loaded(native_from_hf(perturbed_copy(hf, scale=0.02)), model_id="draft")
    return target, draft


def _run(target, draft, name, config):
    gen = GenerationConfig(max_new_tokens=N, stop_at_eos=False, stand_down=False)
    method = build_method(name, config, target, draft)
    return drain(generate(target.model, target.tokenizer, method, PROMPT, gen))


def _answer(target):
    return _run(target, None, "autoregressive", None).token_ids


def _on_a_clock(monkeypatch, target, draft, curve):
    """The target's pass of n rows takes 10 ms x ``curve(n)``, a draft pass 1 ms, on a clock only they
    advance; ``curve`` is held as the target's (uncorrected): cost-sized γ then sees c = 0.1 exactly."""
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * curve(n), draft.model: lambda n: 0.001})
    monkeypatch.setitem(costmodel._CURVES, target.model, curve)


@pytest.mark.parametrize("gamma,adaptive,sized,lookup", [(1, False, False, 0), (3, False, False, 0),
                                                         (7, False, False, 0), (2, True, False, 0),
                                                         (4, False, False, 3), (3, True, False, 2),
                                                         (3, False, True, 0), (6, False, True, 2)])
def test_speculative_replay_takes_the_steps_a_run_takes(pair, gamma, adaptive, sized, lookup, monkeypatch):
    target, draft = pair
    answer = _answer(target)
    config = SpeculativeConfig(gamma=gamma, adaptive=adaptive, cost_sized=sized, max_gamma=16, lookup_ngram=lookup)
    curve = CostCurve((1, 2, 4, 8, 16), (1.0, 1.2, 1.7, 2.8, 5.0))  # a CPU's: compute-bound past a few rows
    if sized:
        _on_a_clock(monkeypatch, target, draft, curve)
    fed, forward = [], draft.model.forward_chain
    monkeypatch.setattr(draft.model, "forward_chain", lambda tokens, **kw: fed.append(len(tokens)) or forward(tokens, **kw))
    # Copy lengths are sized by the verify curve too: pinned, or the run's own passes would correct it.
    monkeypatch.setitem(costmodel._CURVES, target.model, curve)
    run = _run(target, draft, "speculative", config)
    monkeypatch.undo()
    monkeypatch.setitem(costmodel._CURVES, target.model, curve)
    del fed[0]  # the prompt
    first_passes = []  # what the draft's cache lacked at each drafting step: its first pass, after its read
    for event in run.events:  # of what copies added (``caught_up``) where they came before it
        if event.num_drafted and event.internals.get("source") == "draft":
            first_passes.append((fed.pop(0) if event.internals.get("caught_up") else 0) + fed.pop(0))
            del fed[:event.num_drafted - 1]
    method = build_method("speculative", config, target, draft)
    runs, prefill = tuning.draft_matches(method, PROMPT, answer, target.model.info.vocab_size)
    assert prefill > 0
    look = None
    if lookup:
        look = replaying.new_lookup(PromptLookupConfig(min_ngram=lookup, max_ngram=max(lookup, 3)), target.model,
                                  PROMPT)
    lacked = []
    replay = replaying.replay_speculative(runs, answer, PROMPT, gamma, adaptive, 16, look,
                                       lambda n: lacked.append(n) or 1.0, (0.1, curve) if sized else None)
    assert lacked == first_passes
    if sized:  # γ was chosen: not the first step's everywhere
        assert len({e.internals["gamma"] for e in run.events if e.internals.get("source") == "draft"}) > 1
    assert run.token_ids == answer
    assert [s[0] for s in replay.steps] == run.metrics.accept_lengths
    assert [s[1] for s in replay.steps] == [e.num_drafted for e in run.events]
    assert any(a > 1 for a in run.metrics.accept_lengths)  # the draft is good enough to be accepted


@pytest.mark.parametrize("adaptive,num_tokens,max_ngram", [(True, 10, 3), (False, 4, 2), (False, 10, 1)])
def test_prompt_lookup_replay_takes_the_steps_a_run_takes(pair, adaptive, num_tokens, max_ngram, monkeypatch):
    target, _ = pair
    # Adaptive lengths are sized by the verify curve: pinned, or the run's own passes would correct it.
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.4, 2.2)))
    answer = _answer(target)
    config = PromptLookupConfig(adaptive=adaptive, num_tokens=num_tokens, max_ngram=max_ngram)
    run = _run(target, None, "prompt_lookup", config)
    replay = replaying.replay_lookup(config, target.model, PROMPT, answer)
    assert [s[0] for s in replay.steps] == run.metrics.accept_lengths
    assert [s[1] for s in replay.steps] == [e.num_drafted for e in run.events]


@pytest.mark.parametrize("depth,total,auto,window", [(2, 4, False, 0), (3, 64, False, 0), (5, 16, False, 0),
                                                     (8, 64, False, 0), (3, 8, True, 0), (5, 32, True, 0),
                                                     (3, 64, False, 4), (5, 32, True, 4)])
def test_eagle_replay_from_one_grown_tree_takes_the_steps_of_each_setting(pair, tmp_path, monkeypatch, depth, total,
                                                                         auto, window):
    """The deepest tree, grown once per position (once per budget for auto size), holds every smaller
    setting's tree: the replay of each equals a real run with that setting, step for step (also where
    the head reads only the prompt's last tokens, and where auto size calibrates the head's word)."""
    target, _ = pair
    # Auto size sizes by the machine's verify cost: pinned, so that where a level stops is the same in
    # every session (a timed curve moves the floor a node must pass, and a near-tie can land either side).
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.4, 2.2)))
    head = make_head_file(tmp_path / "eagle.safetensors", target.model, scale=0.05)
    answer = _answer(target)
    config = EagleConfig(head=str(head), depth=depth, total_tokens=total, auto_size=auto, window=window)
    run = _run(target, None, "eagle", config)
    method = build_method("eagle", EagleConfig(head=str(head), window=window), target)
    trees, per_level, first = replaying.eagle_trees(method, target.model, PROMPT, answer, 8, (total,))
    replay = replaying.replay_eagle(trees[total if auto else None], len(answer), depth, total, method.config.top_k,
                                 method.cost if auto else None)
    assert [s[0] for s in replay.steps] == run.metrics.accept_lengths
    assert [s[1] for s in replay.steps] == [e.num_drafted for e in run.events]
    levels = [min(e.internals["levels_grown"], depth) for e in run.events if e.num_drafted]
    assert [s[2] - 1 for s in replay.steps if s[1]] == levels  # the levels a step grows, its first run aside
    assert per_level > 0 and first > 0


def test_a_step_costs_its_drafting_verification_and_bookkeeping():
    costs = replaying.StepCosts(verify=CostCurve((1, 3), (0.010, 0.014)), draft_unit=0.002, other=0.001, prefill=0.5)
    assert costs.step(2, 2.0) == pytest.approx(0.004 + 0.014 + 0.001)
    replay = replaying.Replay()
    for added, nodes, units in ((3, 2, 2.0), (1, 0, 0.0)):
        replay.add(added, nodes, units)
    assert replay.tau == 2.0
    assert replay.seconds(costs) == pytest.approx(0.5 + 0.019 + 0.011)


def test_a_step_with_a_draft_model_pays_the_handover_and_one_without_does_not():
    costs = replaying.StepCosts(verify=CostCurve((1, 3), (0.010, 0.014)), draft_unit=0.002, other=0.001, prefill=0.5,
                             handover=0.004)
    assert costs.step(2, 2.0) == pytest.approx(0.004 + 0.014 + 0.001 + 0.004)
    assert costs.step(0, 0.0) == pytest.approx(0.010 + 0.001)  # copies alone: the draft model never ran


def test_the_handover_is_what_each_models_pass_loses_right_after_the_others(pair, monkeypatch):
    """On a clock the passes advance: a draft pass costs 3 ms more right after the target's, a
    target pass 5 ms more right after the draft's, so a step's handover is 8 ms."""
    target, draft = pair
    method = build_method("speculative", SpeculativeConfig(), target, draft)
    clock, last = [0.0], [None]

    def timed(fn, own, extra):
        def run(*args, **kw):
            clock[0] += (0.010 if own == "draft" else 0.030) + (extra if last[0] not in (None, own) else 0.0)
            last[0] = own
            return fn(*args, **kw)
        return run

    monkeypatch.setattr(tuning, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(method, "_next_logits", timed(method._next_logits, "draft", 0.003))
    monkeypatch.setattr(target.model, "forward", timed(target.model.forward, "target", 0.005))
    got = tuning.time_handover(method, target.model, PROMPT, target.model.info.vocab_size)
    assert got == pytest.approx(0.008)


def test_tune_predicts_every_setting_and_proves_the_default_and_the_best(pair):
    target, draft = pair
    stages = []
    result = tuning.tune(target, draft, "speculative", None, PROMPT,
                         GenerationConfig(max_new_tokens=N, stop_at_eos=False), warmup_tokens=2,
                         on_stage=lambda text, fraction: stages.append(fraction))
    doc = result.to_dict()
    for key in ("default", "best"):
        for field in ("params", "predicted_tokens_per_s", "measured_tokens_per_s", "identical"):
            assert field in doc[key]
        assert doc[key]["identical"] is True
    assert doc["default"]["params"] == {"gamma": 3, "adaptive": False, "cost_sized": True, "lookup_ngram": 0}
    runs = result.default.measured_runs
    assert len(runs) == tuning.PROOF_ROUNDS and result.default.measured_tokens_per_s == pytest.approx(sum(runs) / len(runs))
    assert len(doc["settings"]) == 72 and all(s["predicted_tokens_per_s"] > 0 for s in doc["settings"])
    best = max(s["predicted_tokens_per_s"] for s in doc["settings"])
    assert doc["best"]["predicted_tokens_per_s"] >= best / (1 + tuning.MARGIN)
    assert stages[0] == 0.0 and stages[-1] == 1.0
    json.dumps(result.to_dict(with_records=True))  # a record a file can keep
    assert "speculative" in tuning.format_tune(result)


def test_tune_refuses_sampling_and_methods_it_cannot_replay(pair):
    target, draft = pair
    with pytest.raises(tuning.ConfigError, match="temperature 0"):
        tuning.tune(target, draft, "speculative", None, PROMPT,
                    GenerationConfig(sampling=tuning.replace(GenerationConfig().sampling, temperature=0.7)))
    with pytest.raises(tuning.ConfigError, match="lookahead"):
        tuning.tune(target, draft, "lookahead", None, PROMPT, GenerationConfig())


def test_the_command_prints_the_documented_json(tmp_path, capsys):
    target = save_tiny_model(tmp_path / "target", seed=0, layers=2)
    code = main(["tune", "--method", "prompt_lookup", "--target", str(target), "--prompt", "ab cd ab cd ab cd",
                 "--no-chat-template", "--max-new-tokens", "24", "--warmup-tokens", "0", "--json",
                 "--log", str(tmp_path / "tune.jsonl")])
    out, err = capsys.readouterr()
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "tune" and doc["method"] == "prompt_lookup"
    assert doc["best"]["identical"] and doc["default"]["identical"]
    logged = json.loads((tmp_path / "tune.jsonl").read_text())
    assert logged["default"]["record"]["method"] == "prompt_lookup"
    assert main(["tune", "--method", "prompt_lookup", "--target", str(target), "--prompt", "ab",
                 "--temperature", "0.5"]) != 0
    assert "temperature" in capsys.readouterr().err


def test_the_draft_is_replayed_and_timed_through_an_engine_that_gives_the_last_tokens_logits_only(pair, monkeypatch):
    """A llama.cpp draft computes the last new token's logits only: the replay feeds it token by token
    and times it as the method runs it, with the same matches as a draft that gives every row."""
    target, draft = pair
    answer = _answer(target)
    method = build_method("speculative", SpeculativeConfig(), target, draft)
    vocab = target.model.info.vocab_size
    free, _ = tuning.draft_matches(method, PROMPT, answer, vocab)
    forward = draft.model.forward

    def last_row_only(tokens, *args, logit_rows=None, **kw):
        n = torch.as_tensor(tokens).numel()
        rows = list(range(n)) if logit_rows is None else list(logit_rows)
        if rows not in ([], [n - 1]):
            raise NotImplementedError("the last new token's logits only")
        return forward(tokens, *args, logit_rows=logit_rows, **kw)

    monkeypatch.setattr(draft.model, "forward", last_row_only)
    assert tuning.draft_matches(method, PROMPT, answer, vocab)[0] == free
    times = tuning.draft_passes(method, PROMPT + answer[:10], (1, 2, 4), vocab, repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
