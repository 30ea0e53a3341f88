"""The losslessness audit: its statistics on known distributions, its target-side probabilities
against brute force, and audits of exact, biased and lossy methods on tiny float64 models."""

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch
from scipy import stats as scipy_stats

from specplay.core.measure import audit
from specplay.core.measure.audit import AuditConfig, audit_record, fit_known, format_audit, run_audit, score_samples
from specplay.core.errors import ConfigError
from specplay.core.heads import MedusaHeads, save_heads
from specplay.core.methods import build_method
from specplay.core.methods.medusa import MedusaConfig
from specplay.core.methods.speculative import SpeculativeConfig
from specplay.core.decoding.sampling import probabilities
from specplay.core.decoding.types import SamplingConfig
from stats import chi_square_pvalue
from tiny import loaded, native_from_hf, perturbed_copy, save_tiny_model, tiny_hf_model

VOCAB = 16
PROMPT = [4, 5, 6, 4, 5]
T1 = SamplingConfig(temperature=1.0, seed=0)


# ----------------------------------------------------------------------------- the laws
@pytest.mark.parametrize("x,df", [(0.5, 1), (3.0, 2), (12.0, 7), (40.0, 25), (140.0, 100)])
def test_chi_square_tail_and_critical_value_match_scipy(x, df):
    assert audit.chi2_sf(x, df) == pytest.approx(scipy_stats.chi2.sf(x, df), rel=1e-9)
    for alpha in (0.05, 0.01, 0.001 / 3):
        assert audit.chi2_isf(alpha, df) == pytest.approx(scipy_stats.chi2.isf(alpha, df), rel=1e-7)


@pytest.mark.parametrize("x,df,nc", [(5.0, 1, 2.0), (20.0, 4, 10.0), (30.0, 12, 0.0), (60.0, 30, 45.0)])
def test_noncentral_tail_matches_scipy(x, df, nc):
    expected = scipy_stats.ncx2.sf(x, df, nc) if nc > 0 else scipy_stats.chi2.sf(x, df)
    assert audit.ncx2_sf(x, df, nc) == pytest.approx(expected, rel=1e-7)


def test_the_noncentrality_found_gives_the_power_asked_for():
    for df, alpha in ((1, 0.01), (10, 0.0033), (60, 0.001)):
        nc = audit.noncentrality_for_power(df, alpha, 0.8)
        assert scipy_stats.ncx2.sf(scipy_stats.chi2.isf(alpha, df), df, nc) == pytest.approx(0.8, abs=1e-6)


# ----------------------------------------------------------------------------- the test
def draws(probs: dict, n: int, seed: int) -> list:
    keys = list(probs)
    idx = torch.multinomial(torch.tensor([probs[k] for k in keys], dtype=torch.float64), n, replacement=True,
                            generator=torch.Generator().manual_seed(seed))
    return [keys[i] for i in idx.tolist()]


def geometric(size: int, ratio: float = 0.8) -> dict:
    weights = [ratio ** i for i in range(size)]
    return {i: w / sum(weights) for i, w in enumerate(weights)}


def test_pearson_test_matches_scipy_on_the_same_bins():
    probs = geometric(40)
    samples = draws(probs, 500, seed=1)
    fit = fit_known(samples, probs)
    # every outcome with an expected count of 5 has its bin, the rest are pooled: tests/stats.py bins alike
    assert fit.p_value == pytest.approx(chi_square_pvalue(samples, probs), rel=1e-9)
    named = [b for b in fit.bins if b.key is not None]
    assert [b.key for b in named] == [k for k, p in probs.items() if 500 * p >= 5]
    assert fit.bins[-1].label == audit.POOLED and fit.bins[-1].expected >= 5
    assert sum(b.observed for b in fit.bins) == 500 and sum(b.expected for b in fit.bins) == pytest.approx(500)
    assert fit.df == len(fit.bins) - 1


def test_a_small_pooled_bin_is_merged_and_an_impossible_sample_decides_alone():
    probs = {0: 0.5, 1: 0.3, 2: 0.195, 3: 0.005}  # at N = 200 the pool (outcome 3) expects 1 sample
    samples = [0] * 100 + [1] * 60 + [2] * 38 + [3] * 2
    fit = fit_known(samples, probs)
    merged = [[100, 100.0], [60, 60.0], [40, 40.0]]  # the pool joined outcome 2, the smallest bin
    statistic = sum((o - e) ** 2 / e for o, e in merged)
    assert fit.df == 2 and fit.statistic == pytest.approx(statistic)
    assert fit.p_value == pytest.approx(scipy_stats.chi2.sf(statistic, 2))
    assert fit_known(samples[:-1] + [9], probs).p_value == 0.0  # 9 has probability 0
    assert fit_known([0] * 50, {0: 1.0}).df == 0  # one bin: nothing to test, and nothing wrong


def test_p_values_are_uniform_under_the_null_and_the_stated_power_holds():
    """300 seeded experiments at N = 400: about 5 % of p-values fall under 0.05 when the samples
    follow the distribution, and an alternative at the stated total-variation distance (the
    least visible kind: mass moved in proportion between two halves) is seen about 80 % of the time."""
    probs = geometric(30)
    n, level = 400, 0.01
    null = [fit_known(draws(probs, n, seed), probs) for seed in range(300)]
    rate = sum(f.p_value < 0.05 for f in null) / len(null)
    assert 0.02 <= rate <= 0.09
    df = null[0].df
    delta = audit.detectable_tv(n, df, level)
    keys = sorted(probs, key=probs.get, reverse=True)
    half = set(keys[0::2])  # alternate, so the halves carry nearly equal mass
    mass_a = sum(probs[k] for k in half)
    shifted = {k: p * (1 + delta / mass_a if k in half else 1 - delta / (1 - mass_a)) for k, p in probs.items()}
    assert sum(abs(shifted[k] - probs[k]) for k in probs) / 2 == pytest.approx(delta)
    power = sum(fit_known(draws(shifted, n, 1000 + s), probs).p_value < level for s in range(300)) / 300
    assert 0.7 <= power <= 0.92, power
    assert audit.samples_needed(delta, df, level) == pytest.approx(n, rel=0.01)


def test_the_audit_settings_are_checked():
    for bad in (dict(samples=5), dict(depth=0), dict(depth=2.0), dict(alpha=0.0), dict(min_expected=0)):
        with pytest.raises(ConfigError):
            AuditConfig(**bad)


# ----------------------------------------------------------------------------- the target's side
@pytest.fixture(scope="module")
def target_model():
    return tiny_hf_model(seed=11, vocab=VOCAB, dtype=torch.float64)


@pytest.fixture(scope="module")
def target(target_model):
    return loaded(native_from_hf(target_model))


def exact_sequences(native, sampling: SamplingConfig, length: int) -> dict:
    """Probability of every continuation of PROMPT of ``length`` tokens, one chain forward per prefix."""
    probs: dict = {}

    def walk(prefix: list[int], prob: float) -> None:
        if len(prefix) == len(PROMPT) + length:
            probs[tuple(prefix[len(PROMPT):])] = prob
            return
        native.reset()
        p = probabilities(native.forward(torch.tensor(prefix)).logits[-1], sampling.temperature, sampling.top_p)
        for token in torch.nonzero(p).flatten().tolist():
            walk(prefix + [token], prob * float(p[token]))

    walk(list(PROMPT), 1.0)
    native.reset()
    return probs


@pytest.mark.parametrize("depth,top_p", [(2, 1.0), (3, 0.9)])
def test_the_target_side_matches_brute_force(target, target_model, depth, top_p):
    sampling = SamplingConfig(temperature=0.9, top_p=top_p)
    exact = exact_sequences(native_from_hf(target_model), sampling, depth)
    samples = draws(exact, 300, seed=3)
    view = score_samples(target.model, PROMPT, samples, sampling)
    # the named sequences are exactly those expected 5 times or more, with N·P(s) (to float32 logits'
    # precision: the model's logits are float32 whichever its dtype, and a tree pass rounds unlike a chain)
    assert view.joint_named == pytest.approx({s: 300 * p for s, p in exact.items() if 300 * p >= 5}, rel=1e-6)
    assert view.joint_impossible == 0
    # position k: the sum over samples of the target's p(v | the sample's own first k - 1 tokens)
    for k in range(depth):
        conditional: dict[tuple, Counter] = {}
        for seq, p in exact.items():
            conditional.setdefault(seq[:k], Counter())[seq[k]] += p
        expected = Counter()
        for s in samples:
            given = conditional[s[:k]]
            for v, p in given.items():
                expected[v] += p / sum(given.values())
        assert view.position_named[k] == pytest.approx({v: e for v, e in expected.items() if e >= 5}, rel=1e-6)
    if top_p < 1:  # a token outside the nucleus is a sequence the target cannot produce
        first = samples[0]
        outside = next(t for t in range(VOCAB) if first[:1] + (t,) not in {s[:2] for s in exact})
        bad = score_samples(target.model, PROMPT, samples[1:] + [first[:1] + (outside,) + first[2:]], sampling)
        assert bad.joint_impossible == 1


# ----------------------------------------------------------------------------- audits of methods
def audited(target, name, config=None, draft=None, samples=800, sampling=T1, **kw):
    return run_audit(target, draft, name, config, PROMPT, sampling, AuditConfig(samples=samples, **kw))


def test_exact_methods_pass(target, target_model):
    plain = audited(target, "autoregressive", depth=2)
    assert plain.verdict == "consistent" and plain.samples == 800 and all(len(s) == 2 for s in plain.sequences)
    assert plain.joint.df >= 8, "too few bins for the audit to mean anything here"
    assert (plain.deepest_draft, plain.deepest_verified) == (0, 0)
    draft = loaded(native_from_hf(perturbed_copy(target_model, 0.3)))
    spec = audited(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), draft)
    assert spec.verdict == "consistent", [spec.joint.p_value] + spec.p_values
    assert spec.drafted > 0 and 0 < spec.accepted < spec.drafted  # drafts were verified, some rejected
    # every sample's first step drafts γ deep, and the verifier was tested down to the last tested token
    assert spec.deepest_draft == 4 and spec.deepest_verified == audit.DEFAULT_DEPTH == spec.config.depth
    assert all(len(s) == spec.config.depth for s in spec.sequences)


def sharpened(model, factor: float):
    """A copy of ``model`` whose logits are ``factor`` times its own: a draft that agrees with it often."""
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.mul_(factor)
    return other


def biased_from(monkeypatch, depth: int) -> None:
    """The engine's verifier accepts a drafted token at draft depth >= ``depth`` with min(1, 2p/q)
    instead of min(1, p/q) (its q halved), which leans the output there towards the draft; shallower
    tokens it judges exactly."""
    import specplay.core.decoding.engine as engine

    real = engine.verify

    def biased(draft, logits, sampling, generator, typical=None):
        deep = [i for i, d in enumerate(draft.depths()) if d >= depth]
        if draft.sampled and deep:
            q = draft.q.clone()
            q[deep] *= 0.5
            draft = dataclasses.replace(draft, q=q)
        return real(draft, logits, sampling, generator, typical=typical)

    monkeypatch.setattr(engine, "verify", biased)


@pytest.mark.parametrize("depth", [2, audit.DEFAULT_DEPTH])
def test_a_verifier_biased_only_at_the_last_tested_depth_fails(target, target_model, monkeypatch, depth):
    """A bias at draft depth K alone is seen: each step drafts as deep as in a real run (γ), not
    one token less than the K tokens tested (at K = 2 the drafts were one token deep, and this
    verifier passed)."""
    biased_from(monkeypatch, depth)
    draft = loaded(native_from_hf(sharpened(target_model, 2.0)))  # the target's own likeliest tokens, over-drawn
    result = audited(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=5), draft, depth=depth)
    assert result.verdict == "differs" and min([result.joint.p_value] + result.p_values) < 1e-3, \
        [result.joint.p_value] + result.p_values
    assert result.deepest_verified == depth


def test_each_sample_is_the_run_it_would_be_without_reading_the_prompt_once(target, target_model):
    """Sample i is what a plain run with seed 2i makes, token for token, though the audit's target
    and draft read the prompt once and crop back to it (core.measure.audit.ReusedPrompt), and each sample
    ends once it holds its K tokens: a run of K + γ tokens, its first K."""
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig

    draft = loaded(native_from_hf(perturbed_copy(target_model, 0.3)))
    config = SpeculativeConfig(cost_sized=False, gamma=3)
    # Every step drafts (no stand-down gate): a sample never depends on how long a step took.
    result = audited(target, "speculative", config, draft, samples=30, depth=3)
    plain = []
    for i in range(30):
        gen = GenerationConfig(max_new_tokens=3 + 3, stop_at_eos=False, stand_down=False,
                               sampling=SamplingConfig(1.0, seed=2 * i))
        method = build_method("speculative", config, target, draft)
        plain.append(tuple(drain(generate(target.model, target.tokenizer, method, PROMPT, gen)).token_ids[:3]))
    assert result.sequences == plain and len(set(plain)) > 10 and result.deepest_verified == 3


def test_a_biased_verifier_fails(target, monkeypatch):
    """Accepting every drafted token with min(1, 2p/q) instead of min(1, p/q) leans the output towards the draft."""
    biased_from(monkeypatch, 1)
    draft = loaded(native_from_hf(tiny_hf_model(seed=99, vocab=VOCAB, layers=1, dtype=torch.float64)))
    result = audited(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), draft)
    assert result.verdict == "differs" and min([result.joint.p_value] + result.p_values) < 1e-3


def medusa_heads(path, hidden=32, num_heads=2):
    torch.manual_seed(0)
    heads = MedusaHeads(hidden, num_heads)
    for block in heads.blocks:
        torch.nn.init.normal_(block.linear.weight, std=0.3)
    tensors = {**heads.state_dict(), "vocab_ids": torch.arange(VOCAB)}
    save_heads(path, tensors, {"kind": "medusa", "target": "tiny", "hidden_size": hidden, "vocab_size": VOCAB,
                               "num_heads": num_heads,
                               # eight ranks at depth 1: the tree tries enough of the 16 tokens for typical
                               # acceptance to find one above its bar (with three it found none here: exact)
                               "accuracy": [[0.5, 0.2, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03], [0.3, 0.1, 0.05]]})
    return path


def test_medusa_passes_and_its_lossy_typical_acceptance_fails(target, tmp_path):
    heads = str(medusa_heads(tmp_path / "heads.safetensors"))
    exact = audited(target, "medusa", MedusaConfig(heads=heads, tree="small"))
    assert exact.verdict == "consistent" and exact.drafted > 0
    assert exact.deepest_draft == 2 and exact.deepest_verified == 2  # two heads: a tree two deep
    lossy = audited(target, "medusa", MedusaConfig(heads=heads, tree="small", typical=True))
    assert lossy.lossy and lossy.verdict == "differs" and lossy.joint.p_value < 1e-3


def test_a_method_sized_to_a_steep_cost_curve_is_audited_at_its_full_depth(target, tmp_path, monkeypatch):
    """Each sample is a fresh run, sized from half the drafter's word: against a curve where a drafted
    token costs a whole step a sized tree drafts nothing, and the verifier went unjudged. The audit
    sizes against a flat curve instead, and leaves the model's own curve as it found it."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve, cost_curve

    steep = CostCurve.linear(1.0)
    monkeypatch.setitem(costmodel._CURVES, target.model, steep)
    heads = str(medusa_heads(tmp_path / "heads.safetensors"))
    result = audited(target, "medusa", MedusaConfig(heads=heads, tree="auto"), samples=200)
    assert result.verdict == "consistent" and result.drafted > 0
    assert result.deepest_draft == 2 and result.deepest_verified == 2
    assert cost_curve(target.model) is steep


def test_each_method_drafts_as_deep_as_its_settings_say(target):
    from specplay.core.methods.lookahead import LookaheadConfig
    from specplay.core.methods.prompt_lookup import PromptLookupConfig

    assert audit.deepest_draft(build_method("lookahead", LookaheadConfig(window=7, ngram=5), target, None)) == 4
    assert audit.deepest_draft(build_method("prompt_lookup", PromptLookupConfig(num_tokens=6), target, None)) == 6
    assert audit.deepest_draft(build_method("autoregressive", None, target, None)) == 0
    adaptive = SpeculativeConfig(gamma=3, adaptive=True, max_gamma=9)
    assert audit.deepest_draft(build_method("speculative", adaptive, target, target)) == 9


def test_cancel_tests_the_samples_drawn_so_far_and_the_record_reads_like_a_run(target):
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 120

    result = run_audit(target, None, "autoregressive", None, PROMPT, T1, AuditConfig(samples=500),
                       should_stop=should_stop)
    assert result.cancelled and 0 < result.samples < 500 and result.joint is not None
    record = audit_record(result, target=target, prompt="ab")
    assert record["kind"] == "audit" and record["stop_reason"] == "cancelled"
    assert record["samples"] == result.samples and record["samples_requested"] == 500
    assert record["new_tokens"] == audit.DEFAULT_DEPTH * result.samples and record["p_values"] == result.p_values
    json.dumps(record)  # a history line


def test_the_text_report_shows_the_tests_verdict_power_and_histogram(target):
    result = audited(target, "autoregressive", samples=300)
    text = format_audit(audit_record(result, target=target, prompt="ab"))
    assert "joint" in text and "position 1" in text and "position 2" in text
    assert "Consistent with the target" in text and "80% power" in text and "needs N = " in text
    assert "judged no draft token within the 3 tested tokens" in text
    bars = [line for line in text.splitlines() if "█" in line]
    assert bars and all("|" in line for line in bars)
    assert audit.POOLED in text


def test_the_audit_command_prints_one_json_record(tmp_path, capsys):
    from specplay.core.cli import main

    folder = save_tiny_model(tmp_path / "target", seed=0, vocab=VOCAB)
    # Copies of a fixed length: sized by this machine's verify curve they once stopped at 2 tokens under load.
    code = main(["audit", "--method", "prompt_lookup", "--target", str(folder), "--device", "cpu", "--dtype",
                 "float32", "--prompt", "ab cd ab cd ab", "--no-chat-template", "--samples", "200", "--json",
                 "--no-adaptive-lookup"])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out)
    for key in ("method", "temperature", "samples", "depth", "p_value", "p_values"):
        assert key in record
    assert (record["method"], record["temperature"], record["samples"], record["depth"]) == ("prompt_lookup", 1.0,
                                                                                              200, audit.DEFAULT_DEPTH)
    assert len(record["p_values"]) == audit.DEFAULT_DEPTH and 0 <= record["p_value"] <= 1
    assert math.isfinite(record["detectable_tv"])
    # the copy drafts up to its 10 tokens; the verifier was judged down to the last tested token
    assert record["deepest_draft"] == 10 and record["deepest_verified"] == audit.DEFAULT_DEPTH


def test_the_audit_view_says_how_deep_the_verifier_was_judged(target, target_model, qtbot):
    from specplay.app.audit_view import AuditView

    draft = loaded(native_from_hf(sharpened(target_model, 2.0)))
    result = audited(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), draft, samples=100)
    record = audit_record(result, target=target, draft=draft, prompt="ab")
    assert record["deepest_verified"] == 3 and record["deepest_draft"] == 4
    view = AuditView()
    qtbot.addWidget(view)
    view.show_record(record, "speculative")
    assert "judged draft positions down to 3 within the 3 tested tokens (the method drafts up to 4 deep)" \
        in view.power.text()
    older = {k: v for k, v in record.items() if k not in ("deepest_verified", "deepest_draft")}
    view.show_record(older, "speculative")  # a record from before the field: shown without it
    assert "judged" not in view.power.text()
