"""Prompt lookup decoding: draft by copying what followed an earlier occurrence of the last n tokens.

No draft model: the text so far (prompt included) is the draft source. An index from every
n-gram (n = 1..max) to the position after its most recent occurrence is updated as tokens
are committed, so a lookup costs O(max n) instead of a scan. The longest matching n wins;
its continuation is proposed as a deterministic chain.

How much of it to propose: verifying k extra tokens is not free (on a CPU each costs a few
percent of a step), and a one-token match is a much weaker guess than a three-token one.
With ``adaptive`` (the default) the method learns, per match length, how often its guesses
are accepted and, with the target's measured verification cost (:mod:`specplay.core.decoding.costmodel`),
proposes the length that maximises expected tokens per unit of time (possibly none).
Without it, every match proposes ``num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from specplay.core.errors import ConfigError
from specplay.core.decoding.costmodel import best_size, cost_curve
from specplay.core.decoding.method import Method, MethodConfig, RunContext, StepOutcome, param
from specplay.core.decoding.types import Draft


@dataclass(frozen=True)
class PromptLookupConfig(MethodConfig):
    max_ngram: int = param(3, "Longest n-gram to match (tried first)", label="max n", minimum=1, maximum=16)
    min_ngram: int = param(1, "Shortest n-gram to match", label="min n", minimum=1, maximum=16)
    num_tokens: int = param(10, "Most tokens proposed after a match", label="tokens", minimum=1, maximum=64)
    adaptive: bool = param(True, "Propose as many tokens as pays off, learned from this run's acceptance and "
                           "verification cost", label="adaptive length", cli="--adaptive-lookup")

    def __post_init__(self):
        super().__post_init__()
        if self.min_ngram > self.max_ngram:
            raise ConfigError(f"min n ({self.min_ngram}) must be <= max n ({self.max_ngram})")


class NgramIndex:
    """Most recent end position of every n-gram (n <= max_n) in a growing token list."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions <= indexed are in the table

    def extend_to(self, tokens: list[int], end: int) -> None:
        for e in range(self.indexed + 1, end + 1):
            for n in range(1, min(self.max_n, e) + 1):
                self.last_end[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)

    def lookup(self, tokens: list[int], min_n: int) -> tuple[int, int] | None:
        """(n, end of the earlier occurrence) of the longest suffix seen before, or None."""
        for n in range(min(self.max_n, len(tokens) - 1), min_n - 1, -1):
            e = self.last_end.get(tuple(tokens[-n:]))
            if e is not None:
                return n, e
        return None


class PromptLookup(Method):
    name = "prompt_lookup"
    draft_source = "copy"

    def __init__(self, config: PromptLookupConfig, target_lm=None):
        super().__init__(config)
        self.max_draft_nodes = config.num_tokens
        self.cost = cost_curve(target_lm) if (config.adaptive and target_lm is not None) else None
        if self.cost is not None:
            self.timing_sized = "proposal lengths follow the measured verification cost"

    def start(self, ctx: RunContext) -> None:
        self.index = NgramIndex(self.config.max_ngram)
        # Per match length n: accepted draft tokens and rejections (a Beta(1, 1) prior), learnt afresh each run.
        self.hits = [1.0] * (self.config.max_ngram + 1)
        self.misses = [1.0] * (self.config.max_ngram + 1)

    def acceptance(self, n: int) -> float:
        return self.hits[n] / (self.hits[n] + self.misses[n])

    def propose(self, ctx: RunContext, budget: int) -> Draft:
        tokens = ctx.tokens
        # Index every n-gram that ends before the current one, so a match is an *earlier* occurrence.
        self.index.extend_to(tokens, len(tokens) - 1)
        k = min(self.config.num_tokens, budget)
        hit = self.index.lookup(tokens, self.config.min_ngram) if k > 0 else None
        if hit is None:
            return Draft(shown={"match": None})
        n, end = hit
        shown = {"match": {"ngram": n, "at": end}}
        if self.cost is not None:
            alpha = self.acceptance(n)
            k = best_size([alpha ** i for i in range(1, k + 1)], self.cost)
            shown["acceptance"] = round(alpha, 3)
        proposal = tokens[end:end + k]
        shown["match"]["proposed"] = len(proposal)
        return Draft.chain(proposal, shown=shown, memo={"ngram": n})

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> None:
        n = outcome.draft.memo.get("ngram")
        if n is not None and len(outcome.draft):
            accepted = len(outcome.verdict.accepted)
            self.hits[n] += accepted
            self.misses[n] += accepted < len(outcome.draft)
