"""The only place tokens are accepted.

The draft is a tree hanging off the root (the last committed token); a chain is a tree
whose nodes each have one child. ``target_logits`` has one row per forward position:
row 0 is the root, row ``i + 1`` is draft node ``i``. The row of a node's *parent* holds the
target's distribution over that node's token.

Greedy (temperature 0): walk down from the root, at each node following the child whose
token is the target's argmax; the first position with no such child gets the argmax itself.
This emits exactly what greedy decoding emits.

Sampling: recursive rejection sampling over siblings (SpecInfer's multi-step speculative
sampling). At a node with target distribution p and children c_1..c_m:

* sampled children (drawn i.i.d. from q):
      accept c_k  with probability  min(1, p_k(c_k) / q(c_k))
      on rejection  p_{k+1} = normalize(max(0, p_k - q))
* deterministic children (n-grams, top-k of a head), i.e. one-hot q = delta(c_k):
      accept c_k  with probability  p_k(c_k)
      on rejection  p_{k+1} = normalize(p_k with c_k removed)

An accepted child becomes the new node (with its own fresh p); when every child is
rejected the next token is drawn from the last residual p_{m+1} (RESAMPLED), and at a leaf
from p itself (BONUS). Either way the emitted token is distributed exactly as p: the output
distribution is the target's (``tests/decoding/test_verification.py`` checks it with chi-square).
"""

from __future__ import annotations

import math

import torch

from specplay.core.decoding.sampling import probabilities, sample, token_probability, uniform
from specplay.core.decoding.types import Draft, Fate, Rule, SamplingConfig, Verdict


def _children(draft: Draft) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(draft.parents):
        kids.setdefault(p, []).append(i)
    return kids


def _next_fate(n: int, kids: dict[int, list[int]], node: int) -> Fate:
    """The target's own token: plain (nothing drafted), bonus (after a leaf) or resampled (a child was rejected)."""
    if n == 0:
        return Fate.TARGET
    return Fate.RESAMPLED if kids.get(node) else Fate.BONUS


def verify(draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None = None, typical: tuple[float, float] | None = None) -> Verdict:
    """Decide which draft tokens to accept, and the target's next token.

    ``typical`` = (threshold, alpha) switches sampling to Medusa's typical acceptance,
    which is faster but does not preserve the target distribution (see
    :func:`verify_typical`). At temperature 0 verification is always exact.
    """
    if target_logits.shape[0] < len(draft) + 1:
        raise ValueError("target logits need one row for the root and one per draft node")
    if sampling.greedy:
        return verify_greedy(draft, target_logits)
    if generator is None:
        raise ValueError("sampling verification needs a random generator")
    if typical is not None:
        return verify_typical(draft, target_logits, sampling, generator, *typical)
    return verify_sampling(draft, target_logits, sampling, generator)


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    n = len(draft)
    kids = _children(draft)
    argmax = target_logits[: n + 1].argmax(dim=-1).tolist()
    fates = [Fate.REJECTED] * n
    p: list[float | None] = [None] * n
    path: list[int] = []
    node = -1
    while True:
        row = node + 1
        best = argmax[row]
        nxt = next((c for c in kids.get(node, []) if draft.tokens[c] == best), None)
        # The candidates tried at this position, for the X-ray.
        for c in kids.get(node, []):
            p[c] = token_probability(target_logits[row], draft.tokens[c])
        if nxt is None:
            next_p = token_probability(target_logits[row], best)
            break
        fates[nxt] = Fate.ACCEPTED
        path.append(nxt)
        node = nxt
    next_fate = _next_fate(n, kids, node)
    accept_prob = [None if pi is None else (1.0 if f is Fate.ACCEPTED else 0.0) for pi, f in zip(p, fates)]
    rule = [None if pi is None else Rule.GREEDY for pi in p]
    return Verdict(accepted=path, next_token=best, next_fate=next_fate, next_p=next_p, fates=fates, p=p,
                   u=[None] * n, accept_prob=accept_prob, rule=rule)


def verify_sampling(draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
                    generator: torch.Generator) -> Verdict:
    n = len(draft)
    kids = _children(draft)
    fates = [Fate.REJECTED] * n
    p_out: list[float | None] = [None] * n
    u_out: list[float | None] = [None] * n
    a_out: list[float | None] = [None] * n
    path: list[int] = []
    node = -1

    def target_p(row: int) -> torch.Tensor:
        return probabilities(target_logits[row].cpu(), sampling.temperature, sampling.top_p)

    while True:
        p = target_p(node + 1)
        p_first = p
        residual = p
        accepted = None
        for c in kids.get(node, []):
            x = draft.tokens[c]
            p_x = float(residual[x])
            if draft.sampled:
                q = draft.q[c].to(residual)
                q_x = float(q[x])
                # min(1, p/q): q_x > 0 because x was drawn from q.
                accept = 1.0 if q_x <= 0 else min(1.0, p_x / q_x)
            else:
                accept = p_x  # one-hot q: min(1, p(x) / 1)
            u = uniform(generator)
            p_out[c], u_out[c], a_out[c] = float(p_first[x]), u, accept
            if u < accept:
                accepted = c
                break
            # Rejected: take x's share (or q's) out of the target distribution and renormalise.
            residual = torch.clamp(residual - q, min=0.0) if draft.sampled else residual.clone()
            if not draft.sampled:
                residual[x] = 0.0
            mass = residual.sum()
            # Mass 0 means p was entirely covered (numerically); p is then the exact fallback.
            residual = residual / mass if float(mass) > 0 else p
        if accepted is None:
            next_token = sample(residual, generator)
            break
        fates[accepted] = Fate.ACCEPTED
        path.append(accepted)
        node = accepted
    rule = [None if a is None else (Rule.SAMPLED if draft.sampled else Rule.ONE_HOT) for a in a_out]
    return Verdict(accepted=path, next_token=next_token, next_fate=_next_fate(n, kids, node),
                   next_p=float(p_first[next_token]),
                   fates=fates, p=p_out, u=u_out, accept_prob=a_out, rule=rule)


def verify_typical(draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator,
                   threshold: float, alpha: float) -> Verdict:
    """Medusa's typical acceptance. LOSSY: the output no longer follows the target distribution.

    At each node, the first child (in candidate order) whose target probability exceeds
    min(threshold, alpha * exp(-H(p))) is accepted, H being the entropy of the target's
    distribution there: confident positions demand a likely token, uncertain ones accept
    any plausible token. The next token is then sampled from p at the last accepted node.
    """
    n = len(draft)
    kids = _children(draft)
    fates = [Fate.REJECTED] * n
    p_out: list[float | None] = [None] * n
    a_out: list[float | None] = [None] * n
    path: list[int] = []
    node = -1
    while True:
        p = probabilities(target_logits[node + 1].cpu(), sampling.temperature, sampling.top_p)
        entropy = float(-(p * torch.log(p.clamp_min(1e-30))).sum())
        bar = min(threshold, alpha * math.exp(-entropy))
        accepted = None
        for c in kids.get(node, []):
            p_x = float(p[draft.tokens[c]])
            p_out[c] = p_x
            a_out[c] = 1.0 if p_x > bar else 0.0
            if p_x > bar:
                accepted = c
                break
        if accepted is None:
            next_token = sample(p, generator)
            break
        fates[accepted] = Fate.ACCEPTED
        path.append(accepted)
        node = accepted
    return Verdict(accepted=path, next_token=next_token, next_fate=_next_fate(n, kids, node), next_p=float(p[next_token]),
                   fates=fates, p=p_out, u=[None] * n, accept_prob=a_out,
                   rule=[None if a is None else Rule.TYPICAL for a in a_out])
