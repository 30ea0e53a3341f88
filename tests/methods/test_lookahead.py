"""Lookahead decoding: exactness, the one-pass mask against running each context alone, bad input."""

import pytest
import torch

from specplay.core.decoding.engine import _forward_inputs, drain, generate
from specplay.core.errors import ConfigError
from specplay.core.methods import build_method
from specplay.core.decoding.method import RunContext
from specplay.core.methods.lookahead import Lookahead, LookaheadConfig, NgramPool
from specplay.core.decoding.tree import path_to
from specplay.core.decoding.types import GenerationConfig
from tiny import loaded, native_from_hf, tiny_hf_model

PROMPT = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)))


@pytest.fixture(autouse=True)
def first_run():
    """Every test's runs start at the guesses' prior, whatever the runs before it measured."""
    from specplay.core.methods import lookahead

    lookahead._RECALL.clear()
    yield
    lookahead._RECALL.clear()


def run(target, config, n=80):
    gen = GenerationConfig(max_new_tokens=n, stop_at_eos=False, stand_down=False)
    return drain(generate(target.model, target.tokenizer, build_method("lookahead", config, target), PROMPT, gen))


@pytest.mark.parametrize("w,n,g", [(1, 2, 1), (5, 4, 5), (7, 5, 7), (3, 3, 2), (12, 2, 12), (2, 8, 1), (4, 3, 64)])
def test_greedy_lookahead_equals_autoregressive(target, w, n, g):
    gen = GenerationConfig(max_new_tokens=80, stop_at_eos=False, stand_down=False)
    base = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), PROMPT, gen))
    res = run(target, LookaheadConfig(window=w, ngram=n, guesses=g))
    assert res.token_ids == base.token_ids
    assert target.model.cache_len == len(PROMPT) + 80 - 1  # window tokens never stay in the cache


def test_lookahead_accepts_guesses_and_reports_internals(target):
    res = run(target, LookaheadConfig(window=5, ngram=4, guesses=5, pool_from_prompt=False, cost_sized=False))
    assert res.metrics.mean_accepted > 1.2
    # The run's last token is a plain step (nothing left to draft for): the last step with a window.
    last = next(e.internals for e in reversed(res.events) if e.internals)
    assert not res.events[-1].internals and res.events[-1].num_drafted == 0
    assert len(last["window"]) == 3 and all(len(r) == 5 for r in last["window"])
    assert last["pool_size"] > 0 and last["hits"] > 0
    won = [e.internals for e in res.events if e.internals.get("won") is not None]
    assert won and all(0 <= i["won"] < len(i["candidates"]) for i in won)


@pytest.mark.parametrize("w,n,g", [(3, 3, 3), (4, 4, 2), (2, 2, 4)])
def test_one_pass_mask_equals_running_each_context_alone(target, w, n, g):
    """Every row of the combined forward (trie nodes and window tokens) gives the logits of its own context."""
    model = target.model
    method = Lookahead(LookaheadConfig(window=w, ngram=n, guesses=g))
    seq = PROMPT + [5, 6, 3, 7, 8]
    ctx = RunContext(target_lm=model, tokens=list(seq), prompt_len=len(PROMPT), config=GenerationConfig(),
                     draft_generator=torch.Generator())
    method.start(ctx)
    method.levels = [[(3 * j + i) % 60 + 3 for i in range(w)] for j in range(n - 1)]  # a full window
    method.pool.add((seq[-1], 9, 10, 11, 12)[:n])
    method.pool.add((seq[-1], 9, 13, 14, 15)[:n])
    draft = method.propose(ctx, budget=10)
    draft.aux_logit_rows = None  # all rows, for the check
    assert len(draft) > 0
    model.reset()
    model.forward_chain(seq[:-1])
    tokens, positions, mask = _forward_inputs(draft, seq[-1], model.cache_len)
    logits = model.forward(tokens, positions, mask).logits

    def alone(context):
        fresh = native_from_hf_copy(model)
        return fresh.forward(torch.tensor(seq + context)).logits[-1]

    for node in range(len(draft)):
        ctx_tokens = [draft.tokens[k] for k in path_to(draft.parents, node)]
        assert torch.allclose(logits[node + 1], alone(ctx_tokens), atol=1e-9)
    n_verify = len(draft) + 1
    for j in range(n - 1):
        for i in range(w):
            diagonal = method.levels[0][: i + 1] + [method.levels[jj][i] for jj in range(1, j + 1)]
            assert torch.allclose(logits[n_verify + j * w + i], alone(diagonal), atol=1e-9), (j, i)


def native_from_hf_copy(model):
    import copy

    other = copy.copy(model)
    other._kv, other._capacity = torch.empty(0), 0
    other.reset()
    return other


def test_pool_is_bounded_per_key_and_in_total():
    pool = NgramPool(per_key=2, max_total=5)
    for k in range(3):
        for c in range(4):
            pool.add((k, c, c))
    assert pool.candidates(2, 10) == [(3, 3), (2, 2)]
    assert pool.size <= 5
    pool.add((2, 2, 2))  # re-adding refreshes, does not duplicate
    assert pool.candidates(2, 10) == [(2, 2), (3, 3)]


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=0), "W must be >= 1"), (dict(ngram=1), "N must be >= 2"), (dict(guesses=0), "G must be >= 1"),
    (dict(window=1000), "W must be <= 64"),
])
def test_out_of_range_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LookaheadConfig(**kwargs)


def test_observing_a_step_leaves_the_proposed_draft_as_it_was(target):
    """What observe learns (the winning candidate) reaches the step's internals without being
    written into what the draft itself shows, which the method proposed and may share."""
    method = build_method("lookahead", LookaheadConfig(window=5, ngram=4, guesses=5, pool_from_prompt=False,
                                                       cost_sized=False), target)
    drafts = []
    propose = method.propose

    def spy(ctx, budget):
        drafts.append(propose(ctx, budget))
        return drafts[-1]

    method.propose = spy
    gen = GenerationConfig(max_new_tokens=60, stop_at_eos=False, stand_down=False)
    res = drain(generate(target.model, target.tokenizer, method, PROMPT, gen))
    assert any(e.internals.get("won") is not None for e in res.events)
    assert all(d.shown.get("won") is None for d in drafts)


def test_cost_sized_lookahead_runs_everything_where_rows_are_free_and_waits_where_they_are_dear(target, monkeypatch):
    """On a pinned flat curve (a GPU's) every drafting step verifies all guesses and runs the whole window,
    as unsized lookahead does, step for step; where each row costs 15% of a step, the window's 15 rows
    cost more than its prior yield pays, and with no pool from the prompt nothing is ever worth
    verifying: every step is plain. Greedy decoding's tokens either way."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.methods import lookahead

    base = run(target, LookaheadConfig(window=5, ngram=4, guesses=5, cost_sized=False))
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.0))
    flat = run(target, LookaheadConfig(window=5, ngram=4, guesses=5))
    assert flat.token_ids == base.token_ids
    assert [e.num_drafted for e in flat.events] == [e.num_drafted for e in base.events]
    assert all(e.internals["sized"]["window"] for e in flat.events[:-1])
    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.15))
    dear = run(target, LookaheadConfig(window=5, ngram=4, guesses=5, pool_from_prompt=False))
    assert dear.token_ids == base.token_ids and dear.metrics.drafted == 0
    assert all(not e.internals["sized"]["window"] for e in dear.events[:-1])
    # With the prompt's n-grams in the pool, guesses are verified at first (their prior pays for a row);
    # this tiny model never follows them, and once the run has seen that it verifies none. (A first run
    # on this target: the runs above left it their rate.)
    lookahead._RECALL.clear()
    guessing = run(target, LookaheadConfig(window=5, ngram=4, guesses=5))
    assert guessing.token_ids == base.token_ids and guessing.metrics.drafted > 0 == guessing.metrics.accepted
    assert all(e.num_drafted == 0 for e in guessing.events[len(guessing.events) // 2:])


def test_only_the_windows_own_ngrams_make_the_window_worth_running(target, monkeypatch):
    """The window is run for the n-grams it adds to the pool. Guesses from the prompt's own n-grams,
    accepted step after step (an answer repeating its prompt), leave the window's yield at its prior,
    so on a curve where a row costs 15% of a step it still waits (it had counted every pool hit as the
    window's and run its 5-15 rows); the same hits credited to n-grams the window made set it running."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.decoding.method import StepOutcome
    from specplay.core.decoding.types import Fate, GenerationConfig, Verdict

    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.15))

    def window_runs_after_hits(by_window: bool) -> bool:
        """Whether, after up to six steps accepting a pool guess whole, a step runs the window."""
        method = build_method("lookahead", LookaheadConfig(window=5, ngram=4, guesses=5, pool_from_prompt=False),
                              target)
        ctx = RunContext(target_lm=target.model, tokens=[9, 8, 7], prompt_len=3, config=GenerationConfig(),
                         draft_generator=torch.Generator())
        method.start(ctx)
        for _ in range(6):
            method.pool.add((7, 1, 2, 3), by_window=by_window)
            draft = method.propose(ctx, budget=10)
            assert draft.tokens == [1, 2, 3]  # the guess is verified
            if draft.aux_tokens:
                return True
            verdict = Verdict(accepted=[0, 1, 2], next_token=7, next_fate=Fate.BONUS, next_p=None,
                              fates=[Fate.ACCEPTED] * 3, p=[None] * 3, u=[None] * 3, accept_prob=[None] * 3,
                              rule=[None] * 3)
            method.observe(ctx, StepOutcome(draft=draft, verdict=verdict, target_out=None, kept_rows=[0, 1, 2, 3],
                                            new_tokens=[1, 2, 3, 7]))
        return bool(method.propose(ctx, budget=10).aux_tokens)

    assert not window_runs_after_hits(by_window=False)
    assert window_runs_after_hits(by_window=True)


def test_guesses_are_verified_only_as_deep_as_they_pay(target, monkeypatch):
    """Each depth of a guess has its own acceptance: a pool whose guesses are right at their first token
    and wrong past it, on a curve where a row costs a quarter of a step, ends up verified one token deep
    (1.6 expected tokens for 1.25 steps), where pricing every node at the guesses' mean rate had verified
    all three (1.6 for 1.75 steps) or, once the misses had pulled that rate down, none. On a flat curve
    the same counts keep every guess whole."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.decoding.method import StepOutcome
    from specplay.core.decoding.types import Fate, Verdict

    from types import SimpleNamespace

    def drafts(per_row: float) -> list[tuple[list[int], int]]:
        """The guessed tokens each of twelve steps verifies, and how deep, when every guess's first token is
        accepted and its next rejected."""
        monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(per_row))
        method = build_method("lookahead", LookaheadConfig(window=5, ngram=4, guesses=5, pool_from_prompt=False),
                              target)
        ctx = RunContext(target_lm=target.model, tokens=[9, 8, 7], prompt_len=3, config=GenerationConfig(),
                         draft_generator=torch.Generator())
        method.start(ctx)
        seen = []
        for _ in range(12):
            method.pool.add((7, 1, 2, 3))
            draft = method.propose(ctx, budget=10)
            seen.append((list(draft.tokens), draft.shown["sized"]["depth"]))
            if not len(draft):
                continue
            n = len(draft)
            verdict = Verdict(accepted=[0], next_token=5, next_fate=Fate.RESAMPLED, next_p=None,
                              fates=[Fate.ACCEPTED] + [Fate.REJECTED] * (n - 1), p=[None] * n, u=[None] * n,
                              accept_prob=[None] * n, rule=[None] * n)
            rows = SimpleNamespace(logits=torch.zeros(1 + n + len(draft.aux_tokens), 16))  # the window's guesses
            method.observe(ctx, StepOutcome(draft=draft, verdict=verdict, target_out=rows, kept_rows=[0, 1],
                                            new_tokens=[1, 5]))
        return seen

    steep = drafts(0.25)
    assert steep[0] == ([1, 2, 3], 3)  # the prior prices every depth alike
    assert steep[-4:] == [([1], 1)] * 4
    assert [depth for _, depth in drafts(0.0)] == [3] * 12  # (the window's n-grams join the guesses there)


def test_a_run_starts_at_the_rate_the_last_run_on_its_target_ended_with(target, monkeypatch):
    """The guesses' prior is the last run's rate on the same target: where a row costs 15% of a step, a
    first run verifies the prompt's n-grams at the 0.3 prior until its misses pull the rate down; the
    next, starting where that one ended, stops sooner, and the one after verifies none. A warm-up (a run
    shorter than the recall's budget) leaves the rate as it was, and another target starts at the prior."""
    from specplay.core.decoding import costmodel
    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.methods import lookahead
    from specplay.core.methods.speculative import RECALL_BUDGET

    monkeypatch.setitem(costmodel._CURVES, target.model, CostCurve.linear(0.15))
    config = LookaheadConfig(window=5, ngram=4, guesses=5)
    first = run(target, config)
    assert first.events[0].num_drafted > 0 and first.metrics.accepted == 0
    ended = lookahead._RECALL[target.model]
    assert ended < Lookahead.GUESS_PRIOR[0]
    run(target, config, n=RECALL_BUDGET - 1)
    assert lookahead._RECALL[target.model] == ended
    second, third = run(target, config), run(target, config)
    assert second.token_ids == third.token_ids == first.token_ids
    assert 0 < second.metrics.drafted < first.metrics.drafted and third.metrics.drafted == 0
    other = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64)))
    monkeypatch.setitem(costmodel._CURVES, other.model, CostCurve.linear(0.15))
    assert run(other, config).events[0].num_drafted > 0
