"""The engine loop: exactness at temperature 0, cache consistency, stopping, cancelling, events.

Tiny models take microseconds a step, where the stand-down gate's timings are noise: the tests
that study a method as it drafts turn the gate off (``stand_down=False``); the gate itself is
tested below and, on a deterministic cost model, in test_standdown.py.
"""

import dataclasses
import itertools
import json

import pytest
import torch

from specplay.core.decoding.engine import commit, decode_step, drain, finish, generate, prefill, should_end, start_run, verify_draft
from specplay.core.errors import ConfigError
from specplay.core.methods import build_method
from specplay.core.decoding.costmodel import CostCurve, best_size
from specplay.core.methods.lookahead import LookaheadConfig
from specplay.core.methods.prompt_lookup import PromptLookupConfig
from specplay.core.methods.speculative import SpeculativeConfig
from specplay.core.decoding.sampling import probabilities
from specplay.core.decoding.types import Fate, GenerationConfig, SamplingConfig, StopReason
from stats import chi_square_pvalue
from tiny import loaded, native_from_hf, perturbed_copy, tiny_hf_model

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]


@pytest.fixture(scope="module")
def models():
    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target = loaded(native_from_hf(base), model_id="target")
    near = loaded(native_from_hf(perturbed_copy(base, 0.08)), model_id="near-draft")
    same = loaded(native_from_hf(base), model_id="same-draft")
    unrelated = loaded(native_from_hf(tiny_hf_model(seed=9, layers=1, dtype=torch.float64)), model_id="bad-draft")
    return target, near, same, unrelated


def run(target, name, config=None, draft=None, gen=None, prompt=PROMPT, should_stop=None, on_event=None):
    gen = gen or GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    method = build_method(name, config, target, draft)
    return drain(generate(target.model, target.tokenizer, method, prompt, gen, should_stop), on_event)


def check_target_cache(target, result):
    """The target cache must hold the whole sequence but its last token, with correct keys and values."""
    model = target.model
    seq = result.prompt_ids + result.token_ids
    assert model.cache_len == len(seq) - 1
    got = model.forward(torch.tensor(seq[-1:])).logits
    want = _clone(model).forward(torch.tensor(seq)).logits[-1:]
    assert torch.allclose(got, want, atol=1e-9)


def _clone(model):
    """The same weights with an empty cache of its own."""
    import copy

    other = copy.copy(model)
    other._kv = torch.empty(0)
    other._capacity = 0
    other.reset()
    return other


@pytest.mark.parametrize("gamma", range(1, 9))
def test_speculative_greedy_equals_autoregressive(models, gamma):
    target, near, *_ = models
    base = run(target, "autoregressive")
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=gamma), near)
    assert res.token_ids == base.token_ids
    assert 1.0 < res.metrics.mean_accepted <= gamma + 1
    check_target_cache(target, res)


def test_copies_and_draft_model_proposals_mix_and_stay_exact(models):
    target, near, *_ = models
    base = run(target, "autoregressive", gen=GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False))
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4, lookup_ngram=2), near,
              gen=GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False))
    assert res.token_ids == base.token_ids
    sources = {e.internals.get("source") for e in res.events if e.num_drafted}
    assert sources == {"copy", "draft"}
    check_target_cache(target, res)


@pytest.mark.parametrize("cfg", [SpeculativeConfig(gamma=2, adaptive=True, max_gamma=8),
                                 SpeculativeConfig(cost_sized=False, gamma=6, confidence=0.5),
                                 SpeculativeConfig(gamma=2, cost_sized=True, max_gamma=8)])
def test_adaptive_confidence_and_cost_sized_drafts_stay_exact(models, cfg):
    target, near, *_ = models
    base = run(target, "autoregressive")
    res = run(target, "speculative", cfg, near)
    assert res.token_ids == base.token_ids
    gammas = {e.internals["gamma"] for e in res.events if e.num_drafted}
    if cfg.adaptive:
        assert len(gammas) > 1  # it did adapt
    elif cfg.cost_sized:
        assert gammas <= set(range(1, 9)) and len(gammas) > 1  # chosen each step, within the bound
        # Each chosen γ comes with the speed over plain steps it was chosen for (the first step's γ
        # is the configured one, chosen for nothing yet).
        gains = [e.internals["gain"] for e in res.events if e.num_drafted]
        assert gains[0] is None and all(isinstance(g, float) and g > 0 for g in gains[1:])
    else:
        assert any(e.internals.get("stopped_early") for e in res.events)


def test_the_cost_sized_gamma_follows_acceptance_draft_cost_and_the_verification_curve():
    from specplay.core.methods.speculative import best_gamma

    flat = CostCurve.linear(0.0)
    assert best_gamma([0.9] * 16, 0.0, flat) == 16  # free, well-accepted drafts: as long as allowed
    assert best_gamma([0.3] * 16, 0.5, flat) == 1  # costly, poorly accepted drafts: one at a time
    assert best_gamma([0.8] * 16, 0.2, flat) < best_gamma([0.9] * 16, 0.2, flat)
    steep = CostCurve((1, 4, 8), (1.0, 1.05, 2.0))  # verification turns compute-bound past 4 rows
    assert best_gamma([0.85] * 16, 0.19, steep) <= 3 < best_gamma([0.85] * 16, 0.19, flat)
    # The AMD EPYC: 87% acceptance, a draft token 0.35 of a step, T(2) 1.18, T(4) 1.90, T(8) 3.41.
    epyc = CostCurve((1, 2, 4, 8), (1.0, 1.18, 1.90, 3.41))
    assert best_gamma([0.87] * 16, 0.35, epyc) == 1
    assert SpeculativeConfig(adaptive=True).sized is False  # adaptive γ, where chosen, is used instead
    assert SpeculativeConfig().sized and not SpeculativeConfig(cost_sized=False).sized


def test_the_cost_sized_gamma_reads_acceptance_at_each_draft_position():
    from specplay.core.methods.speculative import ChainAcceptance

    acc = ChainAcceptance()
    for _ in range(40):  # the first token almost always right, the second seldom
        acc.add(drafted=3, accepted=1)
    first, second, third = acc.alphas(3)
    assert first > 0.9 and second < 0.15
    assert third == pytest.approx((40 + 0.7 * 4) / (80 + 4))  # never judged: the chain's pooled α
    assert acc.best_gamma(0.1, CostCurve.linear(0.1), 8)[0] == 1  # a pooled α of 0.5 would not say so


def test_full_acceptance_and_zero_acceptance_keep_both_caches_consistent(models):
    target, _, same, unrelated = models
    base = run(target, "autoregressive")
    full = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), same)
    assert full.token_ids == base.token_ids
    assert full.metrics.mean_accepted == pytest.approx(40 / 8)  # 4 accepted + bonus every step
    assert all(e.tokens[-1].fate is Fate.BONUS for e in full.events)
    check_target_cache(target, full)
    # The draft's cache: everything it has cached must match a fresh pass over the sequence.
    d = same.model
    seq = full.prompt_ids + full.token_ids
    cached = d.cache_len
    got = d.forward(torch.tensor(seq[cached:cached + 1])).logits
    want = _clone(d).forward(torch.tensor(seq[:cached + 1])).logits[-1:]
    assert torch.allclose(got, want, atol=1e-9)

    zero = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), unrelated)
    assert zero.token_ids == base.token_ids
    assert zero.metrics.accepted < zero.metrics.drafted / 4
    check_target_cache(target, zero)


def test_prompt_lookup_greedy_equals_autoregressive(models):
    target, *_ = models
    base = run(target, "autoregressive", gen=GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False))
    for cfg in (PromptLookupConfig(), PromptLookupConfig(max_ngram=1, num_tokens=2, adaptive=False),
                PromptLookupConfig(max_ngram=5, min_ngram=2, num_tokens=20, adaptive=False)):
        res = run(target, "prompt_lookup", cfg, gen=GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False))
        assert res.token_ids == base.token_ids
        check_target_cache(target, res)
        # Greedy output of a tiny model repeats itself, so lookup must find matches that hold.
        assert cfg.adaptive or res.metrics.accepted > 0


# ----------------------------------------------------------------------------------- the step functions alone
def started(target, name, config=None, draft=None, max_new_tokens=20):
    """A run of ``name`` on ``target``, set up and prefilled, before its first step."""
    method = build_method(name, config, target, draft)
    state = start_run(target.model, target.tokenizer, method, PROMPT,
                      GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False, stand_down=False))
    prefill(target.model, method, state)
    return method, state


def test_prefill_fills_the_cache_with_the_prompt_but_its_last_token(models):
    target, near, *_ = models
    method, state = started(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near)
    assert target.model.cache_len == len(PROMPT) - 1 and state.ctx.prefill is not None
    assert state.stop is None and state.ctx.tokens == PROMPT and state.prefill_s > 0
    # The draft reads the prompt at its first proposal, not at the start: where the first step is plain
    # (the gate's first step) its read never delays the first token.
    assert near.model.cache_len == 0
    draft = method.propose(state.ctx, state.remaining - 1)
    assert len(draft) == 3 and near.model.cache_len == len(PROMPT) + 2  # the prompt, then two drafts fed


def test_with_the_gate_on_the_first_token_is_the_targets_alone(models):
    """The stand-down gate's first step is plain: the first token comes as plain decoding's would (the
    draft reads the prompt at the second step), and the X-ray says why; without the gate every step drafts."""
    target, near, *_ = models
    gen = GenerationConfig(max_new_tokens=12, stop_at_eos=False)
    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=3), target, near)
    state = start_run(target.model, target.tokenizer, method, PROMPT, gen)
    prefill(target.model, method, state)
    first = decode_step(target.model, method, state)
    assert first.num_drafted == 0 and near.model.cache_len == 0 and "first token" in first.stood_down
    second = decode_step(target.model, method, state)
    assert second.num_drafted == 3 and near.model.cache_len >= len(PROMPT) and second.stood_down is None
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near, gen=gen)
    assert res.token_ids == run(target, "autoregressive", gen=gen).token_ids
    assert [e.num_drafted > 0 for e in res.events[:2]] == [False, True]
    assert run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near).events[0].num_drafted == 3


def test_the_drafts_read_of_the_prompt_is_not_held_against_drafting(models, monkeypatch):
    """The draft reads the prompt once, inside the first step that drafts. On a clock only the passes
    advance, where that read costs 40 plain steps and every later draft pass a tenth of one, the
    stand-down gate never stands down: it judges drafting without the read (it had stood down after
    two drafting steps and backed off further at each probe)."""
    from specplay.core.decoding import costmodel
    from tiny import on_a_clock

    target, _, same, _ = models
    # More than two tokens of the draft at once: the prompt's read.
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + 0.25 * (n - 1)),
                             same.model: lambda n: 0.4 if n > 2 else 0.001})
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.25))
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), same,
              gen=GenerationConfig(max_new_tokens=40, stop_at_eos=False))  # the gate on, as by default
    assert res.events[1].num_drafted == 3 and res.metrics.wall_time > 0.4  # the read happened, in step 2
    assert res.metrics.stood_down_steps == 0 and all(e.num_drafted for e in res.events[1:-1])


@pytest.mark.parametrize("look", [0.006, 0.0005])
def test_a_look_that_drafts_nothing_is_held_against_drafting(models, monkeypatch, look):
    """A method let draft may look and draft nothing (an EAGLE tree none of whose nodes pay). On a clock
    the passes and its looks advance, where it drafts two right tokens at every fourth look, a look of
    0.6 plain steps loses more than the drafts earn: the gate charges the looks to drafting and stands
    down (it counted such a step as a plain one, slow, and looked at every step for ever). A look of 0.05
    steps costs less than they earn: it keeps drafting. The tokens are greedy decoding's either way."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.method import Method
    from specplay.core.decoding.types import Draft
    from specplay.core.methods.autoregressive import AutoregressiveConfig
    from tiny import on_a_clock

    target = models[0]
    greedy = run(target, "autoregressive", gen=GenerationConfig(max_new_tokens=80, stop_at_eos=False)).token_ids
    clock = on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + 0.25 * (n - 1))})
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.25))

    class Looking(Method):
        name = "looking"
        looks = 0

        def propose(self, ctx, budget):
            if budget <= 0:
                return Draft()
            clock[0] += look
            self.looks += 1
            return Draft() if self.looks % 4 else Draft.chain(greedy[ctx.new_tokens:ctx.new_tokens + min(2, budget)])

    method = Looking(AutoregressiveConfig())
    res = drain(generate(target.model, target.tokenizer, method, PROMPT,
                         GenerationConfig(max_new_tokens=80, stop_at_eos=False)))
    assert res.token_ids == greedy
    if look > 0.001:
        assert res.metrics.stood_down_steps > 30
    else:
        assert res.metrics.stood_down_steps == 0 and method.looks >= len(res.events) - 2  # not the first, the last


@pytest.mark.parametrize("draft_index,accepted", [(2, [0, 1, 2, 3]), (3, [])])
def test_one_step_commits_exactly_the_tokens_the_verifier_accepted(models, draft_index, accepted):
    """The target's own weights as the draft: all four accepted; an unrelated draft: none."""
    target = models[0]
    method, state = started(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4),
                            models[draft_index])
    draft = method.propose(state.ctx, state.remaining - 1)
    out, verdict = verify_draft(target.model, method, draft, state)
    new, pieces, text = commit(target.model, draft, verdict, state)
    assert len(draft) == 4 and verdict.accepted == accepted
    assert new == [draft.tokens[i] for i in verdict.accepted] + [verdict.next_token]
    assert state.ctx.tokens == PROMPT + new and text == "".join(pieces) == state.text
    assert target.model.cache_len == len(PROMPT) - 1 + len(new)  # the root and the accepted path


def test_decode_step_adds_one_event_and_the_loop_ends_where_a_step_says(models):
    target, near, *_ = models
    base = run(target, "autoregressive")
    method, state = started(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near, max_new_tokens=6)
    while not should_end(state, lambda: False):
        event = decode_step(target.model, method, state)
        assert state.events[-1] is event and event.total_new_tokens == state.ctx.new_tokens
    result = finish(method, state)
    assert result.stop_reason is StopReason.MAX_TOKENS and result.token_ids == base.token_ids[:6]
    assert sum(len(e.committed) for e in result.events) == 6 == result.metrics.new_tokens
    method, state = started(target, "autoregressive")
    assert should_end(state, lambda: True) and finish(method, state).cancelled


def test_eos_inside_an_accepted_draft_stops_there(models):
    target, _, same, _ = models
    base = run(target, "autoregressive")
    eos_token = base.token_ids[13]
    first = base.token_ids.index(eos_token)
    target.model.info = target.model.info.__class__(**{**target.model.info.__dict__, "eos_token_ids": (eos_token,)})
    try:
        gen = GenerationConfig(max_new_tokens=40, stop_at_eos=True)
        for name, cfg, draft in [("autoregressive", None, None), ("speculative", SpeculativeConfig(cost_sized=False, gamma=8), same),
                                 ("prompt_lookup", None, None)]:
            res = run(target, name, cfg, draft, gen=gen)
            assert res.token_ids == base.token_ids[: first + 1]
            assert res.stop_reason is StopReason.EOS
    finally:
        target.model.info = target.model.info.__class__(**{**target.model.info.__dict__, "eos_token_ids": (2,)})


def test_max_new_tokens_is_exact_even_when_a_step_overshoots(models):
    target, _, same, _ = models
    for n in (1, 2, 7, 9):
        res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), same,
                  gen=GenerationConfig(max_new_tokens=n, stop_at_eos=False, stand_down=False))
        assert len(res.token_ids) == n and res.stop_reason is StopReason.MAX_TOKENS


def test_stop_string_truncates_text(models):
    target, *_ = models
    base = run(target, "autoregressive")
    stop = base.text[10:12]
    res = run(target, "autoregressive", gen=GenerationConfig(max_new_tokens=40, stop_strings=(stop,), stop_at_eos=False, stand_down=False))
    assert res.stop_reason is StopReason.STOP_STRING
    assert res.text == base.text[: base.text.index(stop)]


@pytest.mark.parametrize("name,config,draft_index", [
    ("speculative", SpeculativeConfig(cost_sized=False, gamma=6), 2),
    ("prompt_lookup", PromptLookupConfig(max_ngram=3, num_tokens=8, adaptive=False), None),
    ("lookahead", LookaheadConfig(window=3, ngram=3, guesses=3, cost_sized=False), None),
])
def test_a_stop_string_cuts_the_tokens_of_every_method_alike(models, name, config, draft_index):
    """Tokens drafted past the stop string are not output: ids, counts and τ follow the cut."""
    target = models[0]
    base = run(target, "autoregressive")
    # A stop string completed by a token deep inside the answer, so multi-token steps overshoot it.
    pieces = [target.tokenizer.decode([t]) for t in base.token_ids]
    end = 17
    stop = "".join(pieces[end - 1 : end + 1])
    first = base.text.index(stop)
    assert first + len(stop) == len("".join(pieces[: end + 1])), "pick a stop string that first completes at `end`"
    gen = GenerationConfig(max_new_tokens=40, stop_strings=(stop,), stop_at_eos=False, stand_down=False)
    want = run(target, "autoregressive", gen=gen)
    assert want.token_ids == base.token_ids[: end + 1] and want.text == base.text[:first]
    draft = models[draft_index] if draft_index is not None else None
    res = run(target, name, config, draft, gen=gen)
    assert res.stop_reason is StopReason.STOP_STRING
    assert res.token_ids == want.token_ids and res.text == want.text
    assert res.metrics.new_tokens == len(want.token_ids) == sum(res.metrics.accept_lengths)
    assert sum(len(e.committed) for e in res.events) == len(want.token_ids)
    assert max(res.metrics.accept_lengths) > 1, "the method must have drafted multi-token steps for this to test"


def test_cancel_returns_what_was_produced(models):
    target, near, *_ = models
    calls = itertools.count()
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near, should_stop=lambda: next(calls) >= 3)
    assert res.cancelled and res.stop_reason is StopReason.CANCELLED
    assert len(res.events) == 3 and 0 < len(res.token_ids) < 40
    base = run(target, "autoregressive")
    assert base.token_ids[: len(res.token_ids)] == res.token_ids


def test_events_carry_fates_and_text_in_reading_order(models):
    target, near, *_ = models
    events = []
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), near, on_event=events.append)
    assert [t for e in events for t in e.committed] == res.token_ids
    assert "".join(e.text for e in events) == res.text
    for e in events:
        fates = [t.fate for t in e.tokens]
        kept = [t for t in e.tokens if t.fate is not Fate.REJECTED]
        assert [t.token_id for t in kept] == e.committed
        assert fates[-1] in ((Fate.BONUS, Fate.RESAMPLED) if e.num_drafted else (Fate.TARGET,))
        if Fate.REJECTED in fates:  # a rejection is followed only by other rejections and the correction
            i = fates.index(Fate.REJECTED)
            assert set(fates[i:-1]) == {Fate.REJECTED} and fates[-1] is Fate.RESAMPLED
        assert e.timing.verify_s > 0 and e.timing.draft_s > 0
    m = res.metrics
    assert m.steps == len(events) and sum(m.accept_lengths) == m.new_tokens == 40
    assert m.mean_accepted == pytest.approx(40 / len(events))


def test_bad_generation_settings_are_rejected():
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ConfigError, match="top-p"):
        SamplingConfig(top_p=0)
    with pytest.raises(ConfigError, match="max new tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="γ"):
        SpeculativeConfig(cost_sized=False, gamma=0)
    with pytest.raises(ConfigError, match="min n"):
        PromptLookupConfig(min_ngram=3, max_ngram=2)


def test_empty_prompt_and_context_overflow_are_rejected(models):
    target, *_ = models
    with pytest.raises(ConfigError, match="empty"):
        run(target, "autoregressive", prompt=[])
    with pytest.raises(ConfigError, match="context"):
        run(target, "autoregressive", gen=GenerationConfig(max_new_tokens=10_000))


def test_adaptive_prompt_lookup_learns_to_propose_less_after_rejections(models):
    target, *_ = models
    method = build_method("prompt_lookup", PromptLookupConfig(), target)
    method.cost = CostCurve.linear(0.05)  # a CPU-like curve, so the test does not depend on timing
    res = drain(generate(target.model, target.tokenizer, method, PROMPT, GenerationConfig(max_new_tokens=60,
                                                                                         stop_at_eos=False, stand_down=False)))
    proposed = [e.internals["match"]["proposed"] for e in res.events if e.internals.get("match")]
    assert proposed and max(proposed) <= 10
    assert len(set(proposed)) > 1  # the length adapted during the run
    weak = [n for n in range(1, 4) if method.misses[n] > method.hits[n]]
    assert weak  # the tiny model's unigram matches mostly fail
    for n in weak:  # where guesses mostly fail (α < 0.5), at most 3 of the 10 tokens pay off at 5% a token
        assert best_size([method.acceptance(n) ** i for i in range(1, 11)], method.cost) <= 3


def test_runs_past_the_first_cache_allocation_commit_tree_paths():
    """A run longer than the first 256 cache slots grows the cache inside a forward pass;
    committing a tree path afterwards (a copy inside the cache) must still work and stay exact."""
    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)), model_id="target")
    gen = GenerationConfig(max_new_tokens=300, stop_at_eos=False, stand_down=False)
    base = run(target, "autoregressive", gen=gen)
    target.model._kv, target.model._capacity = torch.empty(0), 0  # start from the first allocation again
    target.model.reset()
    res = run(target, "lookahead", LookaheadConfig(cost_sized=False), gen=gen)
    assert res.token_ids == base.token_ids and res.metrics.mean_accepted > 1
    check_target_cache(target, res)


def test_adaptive_prompt_lookup_starts_each_run_afresh(models):
    """What a run learns about match lengths does not carry into the next run of the same method."""
    target, *_ = models
    method = build_method("prompt_lookup", PromptLookupConfig(), target)
    method.cost = CostCurve.linear(0.05)
    gen = GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False)
    first, second = (drain(generate(target.model, target.tokenizer, method, PROMPT, gen)) for _ in range(2))
    assert [e.internals.get("match") for e in second.events] == [e.internals.get("match") for e in first.events]


def first_token_samples(target, method, trials: int) -> list[int]:
    """The first new token of ``trials`` two-token runs at temperature 1 and seeds 0, 1, …: each decided by
    verifying a draft token."""
    firsts = []
    for seed in range(trials):
        gen = GenerationConfig(max_new_tokens=2, stop_at_eos=False, stand_down=False, sampling=SamplingConfig(temperature=1.0, seed=seed))
        res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
        assert res.events[0].num_drafted == 1, "the first token must be decided on a draft token"
        firsts.append(res.token_ids[0])
    return firsts


def next_token_probabilities(model, prefix: list[int]) -> dict:
    """Token -> the model's probability of it after ``prefix``, at temperature 1."""
    model.reset()
    p = probabilities(model.forward(torch.tensor(prefix)).logits[-1], 1.0)
    model.reset()
    return dict(enumerate(p.tolist()))


@pytest.mark.parametrize("draft_rows", [60, 72])
def test_a_draft_padded_to_another_vocabulary_size_stays_exact(draft_rows):
    """Same tokenizer, different embedding rows (a 7B target with the 0.5B draft): aligned, not a crash;
    greedy stays greedy, and sampling draws the first token from the target's own distribution."""
    from specplay.core.models import check_draft_compatible
    from tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer(60)
    target = loaded(native_from_hf(tiny_hf_model(seed=0, vocab=64, dtype=torch.float64)), tokenizer=tokenizer)
    draft = loaded(native_from_hf(tiny_hf_model(seed=3, vocab=draft_rows, layers=1, dtype=torch.float64)),
                   tokenizer=tokenizer, model_id="draft")
    warnings = check_draft_compatible(target, draft)
    assert any(f"{draft_rows:,} vocabulary rows" in w for w in warnings)
    base = run(target, "autoregressive")
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), draft)
    assert res.token_ids == base.token_ids
    # γ = 1 over two new tokens: the first is the draft's token accepted, or the target's resampled in its place.
    first_drafted = SpeculativeConfig(cost_sized=False, gamma=1)
    firsts = first_token_samples(target, build_method("speculative", first_drafted, target, draft), 1500)
    pvalue = chi_square_pvalue(firsts, next_token_probabilities(target.model, PROMPT))
    assert pvalue > 1e-3, f"p = {pvalue:.2e}"


def test_a_ranked_draft_vocabulary_drafts_only_its_ids_and_stays_lossless(models):
    """A draft vocabulary ranked by use (the ids of a ranking first, not the first ids): every drafted
    token is one of them, greedy stays greedy, and sampling draws the first token from the target's own
    distribution (q = 0 outside the vocabulary, which the verifier's rule handles as any q)."""
    from specplay.core.methods.speculative import Speculative

    target, near, *_ = models
    ranking = [40, 13, 36, 5, 3, 22, 7, 51, 9, 60, 2, 31]  # the tiny target's likely tokens come first
    config = SpeculativeConfig(cost_sized=False, gamma=4, draft_vocab=8)
    method = Speculative(config, near.model, target.model, ranking)
    assert method.draft_ids.tolist() == ranking[:8]
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
    assert res.token_ids == run(target, "autoregressive").token_ids
    drafted = {t.token_id for e in res.events for t in e.tokens if t.node >= 0}
    assert drafted and drafted <= set(ranking[:8]) and res.metrics.accepted > 0
    sampling = Speculative(SpeculativeConfig(cost_sized=False, gamma=1, draft_vocab=8), near.model, target.model, ranking)
    firsts = first_token_samples(target, sampling, 1500)
    pvalue = chi_square_pvalue(firsts, next_token_probabilities(target.model, PROMPT))
    assert pvalue > 1e-3, f"p = {pvalue:.2e}"
    # A ranking shorter than the vocabulary is filled up with the other ids in order.
    assert Speculative(SpeculativeConfig(draft_vocab=4), near.model, target.model, [9, 2]).draft_ids.tolist() == [9, 2, 0, 1]


def test_the_default_draft_vocabulary_is_dropped_for_the_run_whose_answer_leaves_it(monkeypatch):
    """A CPU draft drafts its target's most used ids by default; a run whose answer's tokens lie
    outside them drafts from the whole head once that pays (here after its first drafts, every one
    outside), a run inside them keeps them to its end, and the next run starts on them again. Every
    run stays greedy. On a clock the passes advance (a draft pass 0.4 of a target step), the curve
    pinned."""
    from specplay.core.decoding import costmodel
    from specplay.core.methods import speculative
    from tiny import on_a_clock

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target, draft = loaded(native_from_hf(base)), loaded(native_from_hf(perturbed_copy(base, 0.01)))
    on_a_clock(monkeypatch, {target.model: lambda n: 0.010 * (1 + 0.15 * (n - 1)), draft.model: lambda n: 0.004})
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.15))
    gen = GenerationConfig(max_new_tokens=160, stop_at_eos=False)
    plain = run(target, "autoregressive", gen=gen).token_ids
    used = list(dict.fromkeys(plain))
    unused = [t for t in range(target.model.info.vocab_size) if t not in used]

    def runs(ranking, size, times=1):
        monkeypatch.setattr(speculative, "AUTO_VOCAB", size)
        method = speculative.Speculative(SpeculativeConfig(), draft.model, target.model, ranking)
        assert method.draft_ids.tolist() == ranking[:size]
        for _ in range(times):
            res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
            assert res.token_ids == plain
            yield [e for e in res.events if e.num_drafted]

    (inside,) = runs(used, len(used))
    assert inside and all(e.internals["vocabulary"] == len(used) for e in inside)
    for outside in runs(unused[:8], 8, times=2):
        kinds = [e.internals["vocabulary"] for e in outside]
        cut = kinds.index("all")  # the vocabulary's drafts are judged before it goes, then it stays gone
        assert 1 <= cut <= 3 and set(kinds[:cut]) == {8} and set(kinds[cut:]) == {"all"}
        assert sum(e.num_accepted for e in outside[:cut]) == 0 < sum(e.num_accepted for e in outside[cut:])
    # A GPU draft's head costs little of its time: it keeps it whole by default.
    monkeypatch.setattr(draft.model, "info", dataclasses.replace(draft.model.info, device="cuda:0"))
    assert speculative.Speculative(SpeculativeConfig(), draft.model, target.model, used).draft_ids is None


def test_a_draft_with_more_vocabulary_rows_samples_the_target_and_never_its_own_extra_tokens():
    """A draft whose rows past the target's carry much of its mass: those ids are never drafted,
    and sampled continuations follow the target's distribution (chi-square; a continuation with
    an id the target lacks is outside its support and makes p zero)."""
    from tiny import tiny_tokenizer

    vocab, length, trials = 8, 3, 2000
    prompt = [4, 5, 6, 3, 7, 4, 5, 6]
    tokenizer = tiny_tokenizer(vocab)
    target = loaded(native_from_hf(tiny_hf_model(seed=11, vocab=vocab, dtype=torch.float64)), tokenizer=tokenizer)
    wide = tiny_hf_model(seed=5, vocab=vocab + 4, layers=1, dtype=torch.float64)
    with torch.no_grad():
        wide.lm_head.weight[vocab:] *= 3
    draft = loaded(native_from_hf(wide), tokenizer=tokenizer, model_id="draft")
    extra = sum(p for t, p in next_token_probabilities(draft.model, prompt).items() if t >= vocab)
    assert extra > 0.3, "the draft's own extra tokens must be likely, or dropping them would go untested"

    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=3), target, draft)
    samples, drafted, fates = [], set(), set()
    for seed in range(trials):
        gen = GenerationConfig(max_new_tokens=length, stop_at_eos=False, stand_down=False,
                               sampling=SamplingConfig(temperature=1.0, seed=seed))
        res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
        samples.append(tuple(res.token_ids))
        drafted.update(t.token_id for e in res.events for t in e.tokens if t.node >= 0)
        fates.update(t.fate for e in res.events for t in e.tokens)
    assert max(drafted) < vocab
    assert {Fate.ACCEPTED, Fate.REJECTED, Fate.RESAMPLED} <= fates

    exact: dict = {}

    def walk(seq: tuple, prob: float) -> None:
        if len(seq) == length:
            exact[seq] = prob
            return
        for token, p in next_token_probabilities(target.model, prompt + list(seq)).items():
            walk(seq + (token,), prob * p)

    walk((), 1.0)
    pvalue = chi_square_pvalue(samples, exact)
    assert pvalue > 1e-3, f"p = {pvalue:.2e}"


def test_the_prefill_asks_for_no_logits_and_the_time_to_first_token_is_recorded(models):
    target, near, *_ = models
    asked = {"target": [], "draft": []}
    for name, model in (("target", target.model), ("draft", near.model)):
        forward = model.forward
        model.forward = lambda *a, _f=forward, _n=name, **kw: asked[_n].append(kw.get("logit_rows")) or _f(*a, **kw)
    try:
        res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near)
    finally:
        del target.model.forward, near.model.forward
    assert asked["target"][0] == [] and asked["draft"][0] == []  # each model's prefill
    m = res.metrics
    assert m.prefill_time < m.time_to_first_token == res.events[0].elapsed_s < m.wall_time


def test_a_run_record_is_written_back_as_it_was_read(models):
    """A record read from a log, the history or an older version writes back key for key: the keys it
    lacks stay out, keys the schema does not know stay in, a key set later is written."""
    from specplay.core.records.runlog import RunRecord, run_record

    target, near, *_ = models
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=3), near)
    for include_events in (False, True):
        written = json.loads(json.dumps(run_record(res, target=target, draft=near, prompt="p",
                                                   include_events=include_events, extra={"chat_template": True})))
        record = RunRecord.from_dict(written)
        assert record.to_dict() == written and list(record.to_dict()) == list(written)
        assert record.new_tokens == len(res.token_ids) and record.extra == {"chat_template": True}
        assert ("events" in written) == include_events and "speedup" not in written and "engine" not in written
    old = {"method": "speculative", "new_tokens": 3, "wall_time": 1.5, "tokens_per_s": 2.0, "stop_reason": "eos",
           "from_the_future": [1]}
    record = RunRecord.from_dict(old)
    assert record.to_dict() == old and record.mean_accepted is None and record.extra == {"from_the_future": [1]}
    record.speedup = 1.25
    assert record.to_dict() == {**old, "speedup": 1.25}


def test_token_events_and_run_logs_carry_the_rule_per_draft_token(models):
    """Deterministic candidates carry a display q, yet are verified as one-hot: the event says so."""
    from specplay.core.records.runlog import event_from_dict, event_to_dict
    from specplay.core.decoding.types import Rule

    target, near, *_ = models
    sampled = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stand_down=False, sampling=SamplingConfig(temperature=0.9))
    cases = [("prompt_lookup", PromptLookupConfig(adaptive=False), None, Rule.ONE_HOT),
             ("speculative", SpeculativeConfig(cost_sized=False, gamma=3), near, Rule.SAMPLED)]
    for name, config, draft, rule in cases:
        res = run(target, name, config, draft, gen=sampled)
        drafted = [t for e in res.events for t in e.tokens if t.node >= 0 and t.accept_prob is not None]
        assert drafted and {t.rule for t in drafted} == {rule}
        again = [event_from_dict(event_to_dict(e)) for e in res.events]
        assert [t.rule for e in again for t in e.tokens] == [t.rule for e in res.events for t in e.tokens]


def sampled(seed: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False, sampling=SamplingConfig(temperature=1.0, seed=seed))


@pytest.mark.parametrize("name,config,draft_index", [
    ("autoregressive", None, None),
    ("speculative", SpeculativeConfig(cost_sized=False, gamma=4), 1),
    ("speculative", SpeculativeConfig(gamma=2, adaptive=True, max_gamma=8), 1),  # γ from acceptance, not time
    ("speculative", SpeculativeConfig(cost_sized=False, gamma=6, confidence=0.5), 1),
    ("prompt_lookup", PromptLookupConfig(adaptive=False), None),
    ("lookahead", LookaheadConfig(window=3, ngram=3, guesses=3, cost_sized=False), None),
])
def test_a_seed_reproduces_a_sampled_run_whose_draft_sizes_do_not_come_from_timings(models, name, config, draft_index):
    target = models[0]
    draft = models[draft_index] if draft_index is not None else None
    first, again = (run(target, name, config, draft, gen=sampled(7)) for _ in range(2))
    assert again.token_ids == first.token_ids
    assert [e.tree for e in again.events] == [e.tree for e in first.events]  # the same drafts, the same fates
    assert run(target, name, config, draft, gen=sampled(8)).token_ids != first.token_ids  # the seed matters


def test_the_same_seed_with_other_draft_sizes_samples_another_output(models):
    """Why a sampled run whose draft sizes come from timings (cost-sized γ, adaptive lookup lengths,
    auto-sized trees) is not repeatable by its seed: lossless verification decides a position by
    accepting or rejecting the token drafted there, or, past the draft's end, by a plain draw from
    the target, so which output a seed gives depends on where the drafts end (docs/seeds.md)."""
    target, near, *_ = models
    outputs = {gamma: run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=gamma), near, gen=sampled(7)).token_ids
               for gamma in (2, 4)}
    assert outputs[2] != outputs[4]


def test_a_draft_that_is_never_accepted_stands_down_and_stays_exact(models, monkeypatch):
    """A draft model that never agrees with the target: the run takes plain steps, says so on those
    steps and in its metrics, and still emits greedy decoding's tokens."""
    target, draft = models[0], models[3]
    import specplay.core.decoding.engine
    from specplay import core
    # A flat cost curve: a plain step costs a drafting step's verification pass alone, so a step that
    # adds one token always loses to it, whatever the machine's timings.
    monkeypatch.setattr(core.decoding.engine, "cost_curve", lambda model: CostCurve.linear(0.0))
    gen = GenerationConfig(max_new_tokens=60, stop_at_eos=False)
    base = run(target, "autoregressive", gen=gen)
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), draft, gen=gen)
    assert res.token_ids == base.token_ids
    if res.metrics.accepted * 4 > res.metrics.drafted:
        pytest.skip("this tiny draft agrees with the target too often to test standing down")
    assert "first token" in res.events[0].stood_down  # the gate's first step, plain but not standing down
    stood = [e for e in res.events[1:] if e.stood_down]
    assert res.metrics.stood_down_steps == len(stood) > 0
    assert all(e.num_drafted == 0 and "stood down" in e.stood_down for e in stood)
    off = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4), draft,
              gen=GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False))
    assert off.metrics.stood_down_steps == 0 and off.token_ids == base.token_ids


def test_every_token_names_who_offered_it(models):
    target, draft = models[0], models[1]
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    res = run(target, "speculative", SpeculativeConfig(cost_sized=False, gamma=4, lookup_ngram=2), draft, gen=gen)
    sources = {t.source for e in res.events for t in e.tokens}
    assert None not in sources and sources <= {"draft model", "copy", "bonus", "target"}
    for e in res.events:
        for t in e.tokens:
            if t.node >= 0:
                assert t.source == ("copy" if e.internals.get("source") == "copy" else "draft model")
            else:
                assert t.source == ("bonus" if t.fate is Fate.BONUS else "target")


def test_the_record_says_when_a_seed_would_not_repeat_a_sampled_run(models):
    from specplay.core.records.runlog import run_record

    target, draft = models[0], models[1]

    def record(config, temperature, stand_down):
        gen = GenerationConfig(max_new_tokens=8, stop_at_eos=False, stand_down=stand_down,
                               sampling=SamplingConfig(temperature=temperature, seed=3))
        return run_record(run(target, "speculative", config, draft, gen=gen), target=target, draft=draft)

    assert record(SpeculativeConfig(cost_sized=False, gamma=3), 0.0, True)["repeatable"] is True  # greedy: always
    fixed = record(SpeculativeConfig(cost_sized=False, gamma=3), 1.0, False)
    assert fixed["repeatable"] is True and fixed["unrepeatable_because"] is None
    assert "stands down" in record(SpeculativeConfig(cost_sized=False, gamma=3), 1.0, True)["unrepeatable_because"]
    sized = record(SpeculativeConfig(gamma=3, cost_sized=True), 1.0, False)
    assert sized["repeatable"] is False and "timings" in sized["unrepeatable_because"]
