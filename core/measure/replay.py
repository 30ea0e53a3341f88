"""A method's steps along a known answer at any setting, replayed without the target.

At temperature 0 the target accepts a draft path exactly as far as its tokens are the greedy
answer's next tokens, so the steps a setting would take follow from the drafter alone, fed the
true prefix (:mod:`specplay.core.measure.tune` times them and proves the best): speculative decoding's
chain from the draft's run of matches at every position, prompt lookup from its own index, and
EAGLE's dynamic tree grown once per position at the deepest setting from the target's features,
every smaller depth and budget a part of it. Each replay sizes its drafts as the method does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from specplay.core.decoding.calibration import Calibration
from specplay.core.decoding.costmodel import CostCurve, best_size
from specplay.core.methods.prompt_lookup import PromptLookup, PromptLookupConfig
from specplay.core.methods.speculative import ChainAcceptance

@dataclass(frozen=True)
class StepCosts:
    """What one step costs on this machine, in seconds: the model every prediction uses."""

    verify: CostCurve  # seconds of the target's pass over n tokens at this prompt's context (not relative)
    draft_unit: float  # drafting per unit: a drafted token (speculative), a step (prompt lookup), a tree level (EAGLE)
    other: float  # bookkeeping per step (commit)
    prefill: float
    handover: float = 0.0  # a step that runs a draft model: its passes and the target's taking turns

    def step(self, nodes: int, draft_units: float) -> float:
        turns = self.handover if draft_units > 0 else 0.0
        return draft_units * self.draft_unit + self.verify(1 + nodes) + self.other + turns

    def to_dict(self) -> dict:
        return {"verify_ms": {str(n): round(t * 1e3, 3) for n, t in zip(self.verify.sizes, self.verify.relative)},
                "draft_unit_ms": round(self.draft_unit * 1e3, 3), "other_ms": round(self.other * 1e3, 3),
                "handover_ms": round(self.handover * 1e3, 3),
                "prefill_s": round(self.prefill, 4)}


@dataclass
class Replay:
    """A setting's steps along the answer: (tokens the step adds, nodes verified, draft units) each."""

    steps: list[tuple[int, int, float]] = field(default_factory=list)

    def add(self, added: int, nodes: int, units: float) -> None:
        self.steps.append((added, nodes, units))

    @property
    def tau(self) -> float:
        return sum(s[0] for s in self.steps) / max(len(self.steps), 1)

    def seconds(self, costs: StepCosts) -> float:
        return costs.prefill + sum(costs.step(nodes, units) for _, nodes, units in self.steps)


def match_runs(guesses: list[int], answer: list[int]) -> list[int]:
    """For every answer position j, how many of the answer's tokens from j on a greedy chain matches, from
    each position's guess (``guesses[j]``: the drafter's next token after the answer's first j)."""
    runs = [0] * (len(answer) + 1)
    for j in range(len(answer) - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if guesses[j] == answer[j] else 0
    return runs[:-1]


def _match_run(drafted: list[int], wanted: list[int]) -> int:
    n = 0
    while n < len(drafted) and n < len(wanted) and drafted[n] == wanted[n]:
        n += 1
    return n


def _lookup_step(lookup: PromptLookup, tokens: list[int], answer: list[int], pos: int, budget: int):
    """Prompt lookup's proposal at answer position ``pos`` and how much of it the target accepts
    (its learnt lengths updated as the method's ``observe`` would); None where nothing matched."""
    draft = lookup.propose(SimpleNamespace(tokens=tokens), budget)
    if not len(draft):
        return None
    accepted = _match_run(draft.tokens, answer[pos:])
    lookup.observe(None, SimpleNamespace(draft=draft, verdict=SimpleNamespace(accepted=list(range(accepted)))))
    return len(draft), accepted


def new_lookup(config: PromptLookupConfig, target_lm, prompt_ids: list[int]) -> PromptLookup:
    lookup = PromptLookup(config, target_lm)
    lookup.start(SimpleNamespace(tokens=list(prompt_ids)))
    return lookup


def replay_speculative(runs: list[int], answer: list[int], prompt_ids: list[int], gamma: int, adaptive: bool,
                       max_gamma: int, lookup: PromptLookup | None,
                       catch_up: Callable[[int], float] = lambda n: 1.0,
                       sizing: tuple[float, Callable[[int], float]] | None = None) -> Replay:
    """Speculative decoding's steps along the answer. Units: one-token draft passes; a step's first
    pass feeds what the draft's cache lacks (the last step's bonus token, or everything copies
    added), which costs ``catch_up(tokens)`` of them. ``sizing`` (c, the verify ratio): γ cost-sized
    as the method sizes it, from the replay's acceptance by position after its first drafting step; the
    draft's first run reads what it lacks as a prefill (timed apart), copies before it included."""
    out, pos, g, n = Replay(), 0, gamma, len(answer)
    acceptance = ChainAcceptance()
    lacks = None  # tokens the draft's cache lacks (None: it has not run, its prefill reads them)
    while pos < n:
        budget = n - pos - 1
        if lookup is not None and budget > 0:
            copied = _lookup_step(lookup, list(prompt_ids) + answer[:pos], answer, pos, budget)
            if copied is not None:
                out.add(copied[1] + 1, copied[0], 0.0)
                pos += copied[1] + 1
                lacks = lacks and lacks + copied[1] + 1
                continue
        k = min(g, budget)
        accepted = min(runs[pos], k)
        out.add(accepted + 1, k, catch_up(lacks or 1) + k - 1 if k else 0.0)
        pos += accepted + 1
        # The cache keeps the accepted drafts but the last drafted, then lacks the step's own token.
        lacks = (2 if accepted == k else 1) if k else lacks and lacks + 1
        if adaptive and k:
            g = min(g + 2, max_gamma) if accepted == k else max(g - 1, 1)
        elif sizing is not None and k:
            acceptance.add(k, accepted)
            g = acceptance.best_gamma(sizing[0], sizing[1], max_gamma)[0]
    return out


def replay_lookup(config: PromptLookupConfig, target_lm, prompt_ids: list[int], answer: list[int]) -> Replay:
    """Prompt lookup's steps along the answer (units: steps, matched or not)."""
    lookup, out, pos, n = new_lookup(config, target_lm, prompt_ids), Replay(), 0, len(answer)
    while pos < n:
        budget = n - pos - 1
        copied = _lookup_step(lookup, list(prompt_ids) + answer[:pos], answer, pos, budget) if budget > 0 else None
        nodes, accepted = copied if copied is not None else (0, 0)
        out.add(accepted + 1, nodes, 1.0)
        pos += accepted + 1
    return out


@dataclass
class _Tree:
    """EAGLE's dynamic tree at one root, grown to the deepest setting: what any smaller one keeps."""

    parents: list[int]
    level: list[int]
    score: list[float]
    matched: list[bool]  # the node's path is the answer's next tokens
    levels: int  # levels grown
    prob: list[float]  # the head's probability of each node given its parent


#: EAGLE's tree budgets tuned over; auto size grows a tree for each (it stops levels by the budget's nodes).
EAGLE_TOTALS = (4, 8, 16, 32, 64)


@torch.inference_mode()
def eagle_trees(method, target_lm, prompt_ids: list[int], answer: list[int], depth: int,
                totals: tuple[int, ...] = (), check: Callable[[], None] = lambda: None) -> tuple[dict, float, float]:
    """EAGLE's trees at every answer position, grown to ``depth`` levels from the target's features of
    one teacher-forced pass with the method's own drafter and growth: ``trees[None]`` unsized, and
    ``trees[t]`` for each of ``totals`` as auto size grows them for a budget of t nodes (levels no node
    of which can pay are not grown); the seconds a level took; and what a step's work before its
    tree (its accepted features, the drafter's run over them) costs, in levels; ``check`` before each tree."""
    from specplay.core.methods.eagle import grow_tree

    tokens = list(prompt_ids) + list(answer)
    check()
    target_lm.reset()
    try:
        out = target_lm.forward_chain(tokens[:-1], hidden=True, layers=method.feature_layers, logit_rows=[],
                                      prefill=True)
        feats = method._features_of(out).float()
    finally:
        target_lm.reset()
    d = method.drafter
    d.crop(0)
    # The head's cache starts where the method's does: at its window of the prompt.
    window = method.config.window
    head_from = max(0, len(prompt_ids) - 1 - window) if window else 0
    pred = torch.zeros_like(feats)  # pred[i]: from the pair (f_i, x_{i+1})
    pred[head_from:] = d.run(feats[head_from:], tokens[head_from + 1:], torch.arange(head_from, len(tokens) - 1))
    trees: dict = {key: [None] * len(answer) for key in (None, *totals)}
    p = len(prompt_ids)
    grown, levels, first = 0.0, 0, 0.0
    for pos in range(len(answer) - 1, -1, -1):  # latest root first: a tree is drafted past its root
        root = p - 1 + pos
        if root <= head_from:
            continue
        wanted = tokens[root + 1:root + 1 + depth]
        # What a step does before its tree: the accepted rows' features, then the drafter's run over
        # them (two pairs: about what a step accepts), as the method's observe and propose do.
        started = time.perf_counter()
        since = max(root - 2, head_from)
        method._features_of(out, list(range(since, root)))
        d.crop(since - head_from)
        d.run(feats[since:root], tokens[since + 1:root + 1], torch.arange(since, root))
        first += time.perf_counter() - started
        for key in trees:
            check()
            d.crop(root - head_from)
            sized = dict(total=key, cost=method.cost, worth_adding=method._worth_adding) if key else \
                dict(total=1 << 20)
            started = time.perf_counter()
            draft = grow_tree(d, method._log_probs, method.vocab_ids, pred[root - 1], root, depth,
                              top_k=method.config.top_k, grown_only=True, **sized)
            grown += time.perf_counter() - started
            levels += draft.shown["levels_grown"]
            trees[key][pos] = _tree(draft, wanted)
    d.crop(0)
    per_level = grown / max(levels, 1)
    return trees, per_level, first / max(len(answer), 1) / per_level if per_level else 1.0


def _tree(draft, wanted: list[int]) -> _Tree:
    level, score, matched = [], [], []
    for par, tok, q in zip(draft.parents, draft.tokens, draft.q_token):
        lv = 1 if par < 0 else level[par] + 1
        level.append(lv)
        score.append(math.log(max(q, 1e-300)) + (0.0 if par < 0 else score[par]))
        matched.append(lv <= len(wanted) and tok == wanted[lv - 1] and (par < 0 or matched[par]))
    return _Tree(draft.parents, level, score, matched, draft.shown["levels_grown"], list(draft.q_token))


def replay_eagle(trees: list[_Tree | None], n: int, depth: int, total: int, top_k: int,
                 curve: CostCurve | None, first: float = 1.0) -> Replay:
    """EAGLE's steps along the answer at one setting, from trees grown for it (``curve``: auto size's,
    which keeps nodes by their chances as the replayed run calibrates them, as the method does).
    Units: tree levels grown, plus ``first`` for the step's work before its tree."""
    out, pos = Replay(), 0
    calibration = Calibration()
    while pos < n:
        budget = n - pos - 1
        tree = trees[pos]
        if budget <= 0 or tree is None:
            out.add(1, 0, 0.0)
            pos += 1
            continue
        deep = min(depth, budget)
        cap = min(total, budget * top_k)
        within = [i for i in range(len(tree.level)) if tree.level[i] <= deep]
        if curve is None:
            ranked = sorted(within, key=lambda i: (-tree.score[i], i))[:cap]
        else:
            at = {node: k for k, node in enumerate(within)}  # parents come first: nodes are grown level by level
            chance = dict(zip(within, calibration.values([at.get(tree.parents[i], -1) for i in within],
                                                         [tree.prob[i] for i in within])))
            ranked = sorted(within, key=lambda i: (-chance[i], i))[:cap]
            ranked = ranked[:best_size([chance[i] for i in ranked], curve)]  # none: a plain step
            keep = sorted(ranked)
            index = {old: new for new, old in enumerate(keep)}
            if keep:
                calibration.observe([index.get(tree.parents[i], -1) for i in keep], [tree.prob[i] for i in keep],
                                    [index[i] for i in keep if tree.matched[i]])
            else:  # as the method: a look that kept nothing is judged by its likeliest token (node 0)
                calibration.observe_look(tree.prob[0], tree.matched[0])
        accepted = max((tree.level[i] for i in ranked if tree.matched[i]), default=0)
        out.add(accepted + 1, len(ranked), min(deep, tree.levels) + first)
        pos += accepted + 1
    return out


# ----------------------------------------------------------------------------- settings
