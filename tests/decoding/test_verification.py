"""The verifier: greedy equals argmax decoding; sampling preserves the target distribution.

Sampling tests draw many verdicts with fixed seeds and compare the emitted first token with
the target's exact distribution by chi-square. Each has a negative control: the same test
on a verifier that is wrong in a plausible way must fail, so the test has the power to.
"""

import pytest
import torch

from specplay.core.decoding.sampling import probabilities
from specplay.core.decoding.tree import TreeSpec
from specplay.core.decoding.types import Draft, Fate, Rule, SamplingConfig
from specplay.core.decoding.verification import verify, verify_greedy, verify_sampling
from stats import chi_square_pvalue

V = 6


def _rows(seed: int, n: int, sharp: float = 1.5) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * sharp


# ----------------------------------------------------------------------------- greedy
def test_greedy_chain_accepts_longest_matching_prefix_plus_target_token():
    logits = torch.full((4, V), -5.0, dtype=torch.float64)
    for row, tok in enumerate([3, 1, 4, 2]):
        logits[row, tok] = 5.0
    v = verify_greedy(Draft.chain([3, 1, 5]), logits)
    assert v.accepted == [0, 1]
    assert v.next_token == 4 and v.next_fate is Fate.RESAMPLED
    assert v.fates == [Fate.ACCEPTED, Fate.ACCEPTED, Fate.REJECTED]
    full = verify_greedy(Draft.chain([3, 1, 4]), logits)
    assert full.accepted == [0, 1, 2] and full.next_token == 2 and full.next_fate is Fate.BONUS
    none = verify_greedy(Draft(), logits[:1])
    assert none.accepted == [] and none.next_token == 3 and none.next_fate is Fate.TARGET


def test_greedy_tree_follows_the_argmax_branch():
    # root -> {0: tok 1, 1: tok 3}; node 1 -> {2: tok 0, 3: tok 4}; node 3 -> {4: tok 2}
    d = Draft(tokens=[1, 3, 0, 4, 2], parents=[-1, -1, 1, 1, 3])
    logits = torch.full((6, V), -5.0, dtype=torch.float64)
    argmax_per_row = {0: 3, 1: 0, 2: 4, 3: 0, 4: 5, 5: 0}  # row = node + 1
    for row, tok in argmax_per_row.items():
        logits[row, tok] = 5.0
    v = verify_greedy(d, logits)
    assert v.accepted == [1, 3]  # root->3 (node 1), then 4 (node 3); node 3's row says 5, node 4 has 2
    assert v.next_token == 5 and v.next_fate is Fate.RESAMPLED


@pytest.mark.parametrize("seed", range(20))
def test_greedy_tree_on_chain_shaped_tree_equals_chain(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, V, generator=g, dtype=torch.float64)
    argmax = logits.argmax(-1).tolist()
    # Draft that follows the argmax for a random number of steps, then deviates.
    k = int(torch.randint(0, 5, (1,), generator=g))
    tokens = argmax[:k] + [(argmax[k] + 1) % V] if k < 4 else argmax[:4]
    chain = Draft.chain(tokens)
    tree_spec = TreeSpec.from_paths([(0,) * i for i in range(1, len(tokens) + 1)])
    tree = Draft(tokens=tokens, parents=list(tree_spec.parents))
    a, b = verify_greedy(chain, logits), verify_greedy(tree, logits)
    assert (a.accepted, a.next_token, a.fates) == (b.accepted, b.next_token, b.fates)


# ----------------------------------------------------------------------------- sampling
def _first_token_samples(make_draft, logits, sampling, trials, verifier=verify_sampling):
    gen = torch.Generator().manual_seed(1234)
    out = []
    for t in range(trials):
        draft = make_draft(gen)
        v = verifier(draft, logits, sampling, gen)
        out.append(draft.tokens[v.accepted[0]] if v.accepted else v.next_token)
    return out


def _sampled_chain_maker(q_logits, sampling, k=3):
    q = probabilities(q_logits, sampling.temperature, sampling.top_p)

    def make(gen):
        toks = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        return Draft.chain(toks, sampled=True, q=q[:k])
    return make


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sampled_chain_preserves_target_distribution(temperature, top_p):
    sampling = SamplingConfig(temperature=temperature, top_p=top_p)
    logits = _rows(1, 4)
    q_logits = _rows(2, 4)  # a different, mediocre draft
    p0 = probabilities(logits[0], temperature, top_p)
    samples = _first_token_samples(_sampled_chain_maker(q_logits, sampling), logits, sampling, 6000)
    assert chi_square_pvalue(samples, {i: float(p0[i]) for i in range(V)}) > 1e-3


def test_deliberately_bad_draft_still_gives_target_distribution():
    sampling = SamplingConfig(temperature=1.0)
    logits = _rows(3, 4)
    bad = torch.full((4, V), -8.0, dtype=torch.float64)
    bad[:, int(logits[0].argmin())] = 8.0  # the draft insists on the target's least likely token
    p0 = probabilities(logits[0], 1.0)
    samples = _first_token_samples(_sampled_chain_maker(bad, sampling), logits, sampling, 6000)
    assert chi_square_pvalue(samples, {i: float(p0[i]) for i in range(V)}) > 1e-3


def test_chi_square_detects_a_biased_verifier():
    """Negative control: accepting every draft token returns the draft's distribution, and the test sees it."""
    sampling = SamplingConfig(temperature=1.0)
    logits, q_logits = _rows(1, 4), _rows(2, 4)

    def accept_all(draft, logits, sampling, gen):
        v = verify_sampling(Draft(), logits, sampling, gen)
        v.accepted = list(range(len(draft)))
        return v

    p0 = probabilities(logits[0], 1.0)
    samples = _first_token_samples(_sampled_chain_maker(q_logits, sampling), logits, sampling, 6000, accept_all)
    assert chi_square_pvalue(samples, {i: float(p0[i]) for i in range(V)}) < 1e-6


@pytest.mark.parametrize("sampled", [False, True])
def test_tree_sampling_preserves_target_distribution(sampled):
    """Recursive rejection over siblings: deterministic (top-k) children, and children drawn i.i.d. from q."""
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    logits = _rows(5, 6)
    q_all = probabilities(_rows(6, 1)[0], sampling.temperature, sampling.top_p)
    topk = q_all.argsort(descending=True)[:3].tolist()
    p0 = probabilities(logits[0], sampling.temperature, sampling.top_p)
    # Tree: three children of the root, the first two with one child each.
    parents = [-1, -1, -1, 0, 1]

    def make(gen):
        if sampled:
            kids = [int(torch.multinomial(q_all, 1, generator=gen)) for _ in range(3)]
            grand = [int(torch.multinomial(q_all, 1, generator=gen)) for _ in range(2)]
            return Draft(tokens=kids + grand, parents=parents, sampled=True, q=q_all.expand(5, V).clone())
        return Draft(tokens=topk + topk[:2], parents=parents)

    samples = _first_token_samples(make, logits, sampling, 6000)
    assert chi_square_pvalue(samples, {i: float(p0[i]) for i in range(V)}) > 1e-3


def test_second_token_conditional_on_accepted_first_matches_target():
    """Given the first token accepted from a sibling, the next token follows that child's row of p."""
    sampling = SamplingConfig(temperature=1.0)
    logits = _rows(8, 3)
    p0 = probabilities(logits[0], 1.0)
    first = int(p0.argmax())
    d = Draft(tokens=[first, (first + 1) % V], parents=[-1, -1])
    p1 = probabilities(logits[1], 1.0)
    gen = torch.Generator().manual_seed(7)
    seconds = []
    for _ in range(8000):
        v = verify_sampling(d, logits, sampling, gen)
        if v.accepted == [0]:
            assert v.next_fate is Fate.BONUS  # node 0 is a leaf
            seconds.append(v.next_token)
    assert len(seconds) > 2000
    assert chi_square_pvalue(seconds, {i: float(p1[i]) for i in range(V)}) > 1e-3


def test_verdict_reports_p_q_u_for_the_xray():
    sampling = SamplingConfig(temperature=1.0)
    logits = _rows(9, 3)
    q = probabilities(_rows(10, 3), 1.0)
    d = Draft.chain([1, 2], sampled=True, q=q[:2], q_token=[float(q[0, 1]), float(q[1, 2])])
    v = verify(d, logits, sampling, torch.Generator().manual_seed(0))
    p0 = probabilities(logits[0], 1.0)
    assert v.p[0] == pytest.approx(float(p0[1]))
    assert v.accept_prob[0] == pytest.approx(min(1.0, float(p0[1]) / float(q[0, 1])))
    assert 0.0 <= v.u[0] < 1.0
    assert (v.u[0] < v.accept_prob[0]) == (v.fates[0] is Fate.ACCEPTED)


def test_the_verdict_records_the_rule_applied_to_each_evaluated_node():
    """The verifier knows which rule decided a node; unevaluated nodes have none."""
    logits = _rows(9, 4)
    gen = torch.Generator().manual_seed(0)
    q = probabilities(_rows(10, 3), 1.0)
    wrong_first = Draft.chain([int(logits[0].argmax()) - 1 if int(logits[0].argmax()) else 1, 2, 3])
    greedy = verify(wrong_first, logits, SamplingConfig())
    assert greedy.rule == [Rule.GREEDY, None, None]  # the first was rejected: the rest never evaluated
    sampled = verify(Draft.chain([1, 2, 3], sampled=True, q=q), logits, SamplingConfig(temperature=1.0), gen)
    one_hot = verify(Draft.chain([1, 2, 3], q_token=[0.9, 0.9, 0.9]), logits, SamplingConfig(temperature=1.0), gen)
    typical = verify(Draft.chain([1, 2, 3]), logits, SamplingConfig(temperature=1.0), gen, typical=(0.3, 0.1))
    for verdict, rule in ((sampled, Rule.SAMPLED), (one_hot, Rule.ONE_HOT), (typical, Rule.TYPICAL)):
        evaluated = [a is not None for a in verdict.accept_prob]
        assert verdict.rule == [rule if e else None for e in evaluated] and evaluated[0]


def test_sampling_needs_a_generator():
    with pytest.raises(ValueError):
        verify(Draft(), _rows(0, 1), SamplingConfig(temperature=1.0), None)


# ----------------------------------------------------------------------------- one draw
def test_sample_draws_each_id_by_its_weight_across_blocks():
    from specplay.core.decoding import sampling

    n = 3 * sampling._SAMPLE_BLOCK + 5  # the last block not whole
    ids = [0, 127, 128, 200, 383, 384, n - 1]  # both sides of block edges, and the tail
    w = torch.zeros(n)
    w[ids] = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5, 0.75])  # weights, not summing to 1
    g = torch.Generator().manual_seed(0)
    draws = [sampling.sample(w, g) for _ in range(6000)]
    exact = {i: float(w[i] / w.sum()) for i in ids}
    assert set(draws) <= set(ids)  # an id of weight 0 is never drawn
    assert chi_square_pvalue(draws, exact) > 1e-3
    swapped = dict(exact)  # the control: the same draws fail against two ids' weights swapped
    swapped[127], swapped[383] = exact[383], exact[127]
    assert chi_square_pvalue(draws, swapped) < 1e-6


def test_a_draw_rounded_past_the_total_takes_the_last_id_of_weight():
    from specplay.core.decoding.sampling import _last_within

    cumulative = torch.tensor([0.1, 0.4, 0.4], dtype=torch.float64)
    assert _last_within(cumulative, 0.05) == 0
    assert _last_within(cumulative, 0.1) == 1  # an id's interval holds its lower end
    assert _last_within(cumulative, 0.4) == 1  # past the total: not the last id, of weight 0
