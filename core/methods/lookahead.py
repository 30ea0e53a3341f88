"""Lookahead decoding (Fu et al. 2024): Jacobi iteration over a window plus an n-gram pool.

No draft model and no training. Each step runs one forward pass over three parts that
share the committed prefix and one attention mask:

* the root (the last committed token);
* the **verification branch**: up to G n-grams from the pool that start with the root,
  merged into a trie and checked by the shared verifier (deterministic drafts, so lossless);
* the **lookahead branch**: a 2-D window of N-1 levels x W columns. Level j, column i sits
  at position root + i + j + 1 and attends to the root, level 0's columns 0..i and, above
  them, column i of levels 1..j: one token per position, a plausible context along which
  the Jacobi iteration runs. The last level's predictions become the next level; each
  column then yields an N-gram (level 0..N-2 of the column, then the new prediction),
  which enters the pool keyed by its first token. The oldest level is dropped.

The window tokens are never committed; their logits are computed only for the last level.

How much of that pass to run is priced by default (``cost_sized``): on a CPU every row of a
verification costs a share of a step, and the window's rows pay only later, through the pool.
Each step takes the number of pool guesses, how deep to verify them, and whether to run the window
that give the most expected tokens per unit of time, from the target's verify curve (corrected by
the run's passes) and two kinds of rate this run measures: the tokens accepted per guessed node
verified at each depth, and the tokens accepted from the pool per window column run, each leaning
on a prior until it has its own counts (the guesses' prior: the rate the last run on the same target
ended with). A guess's first token is right more often than its third
is (given the two before), so where a row costs a large share of a step a guess is verified only
as deep as its nodes pay. Where rows are cheap (a GPU's flat curve) the whole window and every
guess run whole; where a row costs a tenth of a step and the pool seldom hits, the window waits
and only the guesses, and the depths, that pay are verified.
"""

from __future__ import annotations

import random
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specplay.core.decoding.costmodel import cost_curve
from specplay.core.decoding.method import Method, MethodConfig, RunContext, StepOutcome, param
from specplay.core.decoding.tree import build_trie, depths
from specplay.core.decoding.types import Draft
from specplay.core.methods.speculative import RECALL_BUDGET

#: Each target's rate of tokens accepted per guessed node as the last run on it ended (its counts over
#: its prior), the next run's prior, weighing as :data:`Lookahead.GUESS_PRIOR` does: a run starts where
#: the last one left off instead of at the first run's 0.3, which had each run on the AMD EPYC model 17
#: verify guesses at a loss until its own misses pulled the rate down (the code prompts' guesses were
#: right 14% of the time). Runs shorter than :data:`RECALL_BUDGET` (a warm-up) leave it as it was.
_RECALL: "weakref.WeakKeyDictionary[object, float]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LookaheadConfig(MethodConfig):
    window: int = param(5, "Window size W: future positions the Jacobi iteration works on", label="W",
                        minimum=1, maximum=64, cli="--window")
    ngram: int = param(4, "N-gram size N: the window keeps N-1 levels, the pool holds N-grams", label="N",
                       minimum=2, maximum=16, cli="--ngram")
    guesses: int = param(5, "G: most pool n-grams verified per step", label="G", minimum=1, maximum=64,
                         cli="--guesses")
    pool_from_prompt: bool = param(True, "Seed the n-gram pool with the prompt's n-grams", label="pool from prompt",
                                   cli="--pool-from-prompt")
    max_pool: int = param(20000, "Most n-grams kept in the pool (oldest keys evicted first)", label="pool size",
                          minimum=1, maximum=10_000_000, cli="--max-pool")
    cost_sized: bool = param(True, "Each step verifies the guesses and runs the window only as far as they pay: "
                             "this run's acceptance per guessed token and the pool's yield per window column "
                             "against the measured verification cost (off: G guesses and the whole window "
                             "every step)", label="cost-sized", cli="--sized-lookahead")


class NgramPool:
    """N-gram continuations keyed by their first token; the most recent first, bounded per key and in total.
    Each remembers whether the lookahead window made it (rather than the prompt it was seeded from)."""

    def __init__(self, per_key: int, max_total: int):
        self.per_key = per_key
        self.max_total = max_total
        self._by_key: OrderedDict[int, OrderedDict[tuple[int, ...], bool]] = OrderedDict()  # -> made by the window
        self.size = 0

    def add(self, ngram: tuple[int, ...], by_window: bool = False) -> None:
        key, cont = ngram[0], tuple(ngram[1:])
        bucket = self._by_key.get(key)
        if bucket is None:
            bucket = self._by_key[key] = OrderedDict()
        self._by_key.move_to_end(key)
        if cont in bucket:  # kept as who made it first: a window that finds the prompt's n-gram adds nothing
            bucket.move_to_end(cont)
            return
        bucket[cont] = by_window
        self.size += 1
        if len(bucket) > self.per_key:
            bucket.popitem(last=False)
            self.size -= 1
        while self.size > self.max_total:
            _, oldest = self._by_key.popitem(last=False)
            self.size -= len(oldest)

    def candidates(self, key: int, limit: int) -> list[tuple[int, ...]]:
        bucket = self._by_key.get(key)
        if not bucket:
            return []
        return list(reversed(bucket))[:limit]

    def by_window(self, key: int, cont: tuple[int, ...]) -> bool:
        """Whether the window made the n-gram ``key`` + ``cont`` (False for the prompt's, or one not held)."""
        return bool(self._by_key.get(key, {}).get(tuple(cont), False))


class Lookahead(Method):
    name = "lookahead"
    draft_source = "lookahead pool"

    @property
    def max_draft_depth(self) -> int:
        return self.config.ngram - 1  # its candidates are pool n-grams past the root; the window is never checked

    #: Priors, as (rate, weight): tokens accepted per guessed node verified, and tokens accepted from
    #: the window's n-grams per window column run. Only the n-grams the window made count for it: the
    #: prompt's, seeded at the start, had made the window look worth running where the answer repeated
    #: the prompt (a 10-15-row window, 2.5-3.5 one-token steps, on the AMD EPYC model 17 at T = 0.7).
    GUESS_PRIOR, WINDOW_PRIOR = (0.3, 10.0), (0.1, 20.0)
    #: The weight, in nodes, of the rate over all depths in each depth's own: a depth seldom verified
    #: takes the guesses' rate until it has counts of its own.
    DEPTH_WEIGHT = 4.0

    def __init__(self, config: LookaheadConfig, target_lm=None):
        super().__init__(config)
        self.cost = cost_curve(target_lm) if (config.cost_sized and target_lm is not None) else None
        self._target = target_lm
        self._guess_prior = self.GUESS_PRIOR
        if self.cost is not None:
            self.timing_sized = "guesses and window follow the measured verification cost"
        c = config
        self.levels_needed = c.ngram - 1
        self.max_draft_nodes = c.guesses * (c.ngram - 1) + c.window * (c.ngram - 1)
        self.pool = NgramPool(per_key=c.guesses, max_total=c.max_pool)
        self.levels: list[list[int]] = []
        self.hits = 0
        self._mask_cache: dict[tuple[int, int], torch.Tensor] = {}
        # Guessed nodes verified and tokens accepted at each depth (0: the first past the root), window
        # columns run, tokens accepted from the window's n-grams.
        self._nodes, self._accepted = [0] * self.levels_needed, [0] * self.levels_needed
        self._columns = self._window_accepted = 0

    def start(self, ctx: RunContext) -> None:
        c = self.config
        self.pool = NgramPool(per_key=c.guesses, max_total=c.max_pool)
        self.hits = 0
        self._nodes, self._accepted = [0] * self.levels_needed, [0] * self.levels_needed
        self._columns = self._window_accepted = 0
        recalled = _RECALL.get(self._target) if self._target is not None else None
        self._guess_prior = self.GUESS_PRIOR if recalled is None else (recalled, self.GUESS_PRIOR[1])
        prompt = ctx.tokens
        if c.pool_from_prompt:
            for i in range(len(prompt) - c.ngram + 1):
                self.pool.add(tuple(prompt[i:i + c.ngram]))
        # The Jacobi window starts from tokens of the prompt (a better guess than random ids),
        # drawn with the run's seed so runs are reproducible.
        rng = random.Random(ctx.config.sampling.seed)
        self.levels = [[rng.choice(prompt) for _ in range(c.window)]]

    def _window_mask(self, n_verify: int) -> torch.Tensor:
        """Aux mask rows ``[levels * W, n_verify + levels * W]``: root, no trie node, the window's diagonal."""
        w, levels = self.config.window, len(self.levels)
        key = (n_verify, levels)
        cached = self._mask_cache.get(key)
        if cached is not None:
            return cached
        m = levels * w
        mask = torch.zeros(m, n_verify + m, dtype=torch.bool)
        mask[:, 0] = True  # the root
        for j in range(levels):
            for i in range(w):
                row = j * w + i
                mask[row, n_verify: n_verify + i + 1] = True  # level 0, columns 0..i
                for jj in range(1, j + 1):
                    mask[row, n_verify + jj * w + i] = True  # column i of the levels above
        self._mask_cache[key] = mask
        return mask

    def propose(self, ctx: RunContext, budget: int) -> Draft:
        if budget <= 0:  # a plain step (the run's last token, or drafting stood down): no window either
            return Draft()
        c = self.config
        root = ctx.tokens[-1]
        depth = min(c.ngram - 1, budget)
        pooled = self.pool.candidates(root, c.guesses) if depth > 0 else []
        cands = [g[:depth] for g in pooled]
        by_window = [self.pool.by_window(root, g) for g in pooled]
        window = True
        shown = {}
        if self.cost is not None:
            cands, window, gain = self._sized(cands)
            shown["sized"] = {"guesses": len(cands), "depth": max(map(len, cands), default=0), "window": window,
                              "gain": round(gain, 3)}
        tokens, parents, _ = build_trie(cands)
        shown.update({"window": [list(l) for l in self.levels], "pool_size": self.pool.size,
                      "candidates": [list(g) for g in cands], "won": None, "hits": self.hits})
        memo = {"candidates": cands, "by_window": by_window[:len(cands)]}
        if not window:  # the window waits where it is; only the guesses are verified
            return Draft(tokens=tokens, parents=parents, shown=shown, memo=memo)
        base = len(ctx.tokens) - 1
        w = c.window
        aux = [t for level in self.levels for t in level]
        positions = [base + 1 + i + j for j in range(len(self.levels)) for i in range(w)]
        last = len(self.levels) - 1
        return Draft(
            tokens=tokens, parents=parents, aux_tokens=aux, aux_positions=positions,
            aux_mask=self._window_mask(len(tokens) + 1), aux_logit_rows=[last * w + i for i in range(w)],
            shown=shown, memo=memo,
        )

    @staticmethod
    def _rate(prior: tuple[float, float], accepted: int, over: int) -> float:
        """``accepted`` tokens over ``over`` (nodes verified or columns run), leaning on ``prior``."""
        rate, weight = prior
        return (accepted + rate * weight) / (over + weight)

    def _guess_rate(self) -> float:
        """Tokens accepted per guessed node verified over all depths, leaning on the last run's rate
        (:data:`_RECALL`) or :data:`GUESS_PRIOR`."""
        return self._rate(self._guess_prior, sum(self._accepted), sum(self._nodes))

    def _depth_rates(self) -> list[float]:
        """Tokens accepted per guessed node verified at each depth, each leaning on :meth:`_guess_rate`
        (:data:`DEPTH_WEIGHT`)."""
        pooled = self._guess_rate()
        return [self._rate((pooled, self.DEPTH_WEIGHT), a, n) for a, n in zip(self._accepted, self._nodes)]

    def _sized(self, cands: list) -> tuple[list, bool, float]:
        """The first guesses to verify, as deep as they are verified, and whether to run the window: the
        most expected tokens per unit of time (the step's 1 + each depth's guessed nodes x their acceptance
        there + window columns x the window's yield, over the verify curve at the pass's rows), and that
        gain over a plain step."""
        per_node = self._depth_rates()
        per_column = self._rate(self.WINDOW_PRIOR, self._window_accepted, self._columns)
        window_rows = len(self.levels) * self.config.window
        best = (1.0 / self.cost(1), [], False)
        alone = (1 + self.config.window * per_column) / self.cost(1 + window_rows)  # the window, no guess
        if alone > best[0]:
            best = (alone, [], True)
        for depth in range(1, max(map(len, cands), default=0) + 1):
            cut = [g[:depth] for g in cands]
            for g in range(1, len(cut) + 1):
                tokens, parents, _ = build_trie(cut[:g])
                guessed = sum(per_node[d - 1] for d in depths(parents))
                for window in (False, True):
                    rows = 1 + len(tokens) + (window_rows if window else 0)
                    expected = 1 + guessed + (self.config.window * per_column if window else 0)
                    rate = expected / self.cost(rows)
                    if rate > best[0]:
                        best = (rate, cut[:g], window)
        rate, chosen, window = best
        return chosen, window, rate * self.cost(1)

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> dict | None:
        c = self.config
        draft = outcome.draft
        accepted = outcome.verdict.accepted
        for d in draft.depths():
            self._nodes[d - 1] += 1
        for d in range(len(accepted)):
            self._accepted[d] += 1
        if self._target is not None and len(draft) and ctx.config.max_new_tokens >= RECALL_BUDGET:
            _RECALL[self._target] = self._guess_rate()
        won = None
        if accepted:
            self.hits += 1
            path = [draft.tokens[i] for i in accepted]
            won = next(k for k, g in enumerate(draft.memo["candidates"]) if list(g[:len(path)]) == path)
            if draft.memo["by_window"][won]:
                self._window_accepted += len(accepted)
        if not draft.aux_tokens:  # a plain step, or the window not run: it waits where it was
            return {"won": won, "hits": self.hits} if len(draft) else None
        self._columns += c.window
        n_verify = len(draft) + 1
        new_level = outcome.target_out.logits[n_verify:n_verify + c.window].argmax(-1).tolist()
        if len(self.levels) == self.levels_needed:
            for i in range(c.window):
                self.pool.add(tuple(level[i] for level in self.levels) + (new_level[i],), by_window=True)
            self.levels = self.levels[1:]
        self.levels.append(new_level)
        return {"won": won, "hits": self.hits}

