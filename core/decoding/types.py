"""The engine's vocabulary: generation settings, drafts, verdicts, step events and run results.

Everything the GUI and the run logs show comes from these objects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from specplay.core.errors import ConfigError
from specplay.core.decoding.tree import depths


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Fate(str, Enum):
    """What happened to a token in a step."""

    ACCEPTED = "accepted"  # a draft token the verifier accepted
    REJECTED = "rejected"  # a draft token the verifier rejected, or never reached after a rejection
    RESAMPLED = "resampled"  # the target's own token in place of a rejected draft token
    BONUS = "bonus"  # the target's extra token after a fully accepted draft
    TARGET = "target"  # the target's token in a step that drafted nothing (plain decoding)


class Rule(str, Enum):
    """The acceptance rule the verifier applied to a draft token."""

    GREEDY = "greedy"  # temperature 0: accepted iff it is the target's argmax
    SAMPLED = "sampled"  # drawn from q: accepted with min(1, p(x) / q(x))
    ONE_HOT = "one_hot"  # a deterministic candidate (n-gram, head top-k): accepted with p(x)
    TYPICAL = "typical"  # Medusa's typical acceptance (lossy): p(x) above an entropy-dependent bar


@dataclass(frozen=True)
class SamplingConfig:
    """Temperature 0 is greedy decoding; top-p is applied to target and draft alike."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ConfigError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_at_eos: bool = True
    #: Take plain steps while drafting runs slower than plain decoding (core/decoding/standdown.py); off for study.
    stand_down: bool = True

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise ConfigError(f"max new tokens must be a positive integer, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ConfigError("stop strings must be non-empty text")


@dataclass
class Draft:
    """What a method proposes: a tree of draft tokens hanging off the last committed token.

    Node ``i`` holds ``tokens[i]``; ``parents[i]`` is its parent node, or -1 for the root (the
    last committed token, whose KV is not cached yet). A chain has ``parents == [-1, 0, 1, ...]``.
    Parents always come before their children.

    ``sampled`` says how a node's token was chosen. True: drawn from the draft distribution
    ``q[i]`` (``[n, vocab]``, the distribution at node i's parent, after the same temperature
    and top-p as the target), siblings i.i.d.; the verifier accepts with min(1, p/q).
    False: chosen deterministically (n-grams, top-k of heads); the verifier treats each
    candidate as a one-hot q, which is lossless. ``q_token`` is the draft's probability of each
    node's token, for display only.

    ``aux_*`` are extra tokens run in the same forward pass but never committed (lookahead's
    Jacobi window); ``aux_mask`` is ``[m, 1 + n + m]`` over (root, nodes, aux), and
    ``aux_logit_rows`` lists the aux tokens whose logits the method needs (None: all).
    The method finds those logits after the ``n + 1`` verification rows of the output.

    ``shown`` is what the method reports about this draft to people: the step's ``internals``
    (the GUI's internals panel, the run logs). ``memo`` is the method's own note from
    ``propose`` to its ``observe`` of the same step; nothing else reads it.
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    sampled: bool = False
    q: torch.Tensor | None = None
    q_token: list[float | None] | None = None
    aux_tokens: list[int] = field(default_factory=list)
    aux_positions: list[int] = field(default_factory=list)
    aux_mask: torch.Tensor | None = None
    aux_logit_rows: list[int] | None = None
    shown: dict[str, Any] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)
    #: Who proposed the nodes, ``{depth}`` filled in per node; empty: the method's ``draft_source``.
    source: str = ""
    #: Seconds of work inside this proposal that drafting pays once a run or once a pause (a draft model
    #: reading the prompt, or what plain steps added while it stood down): part of the step's time, but
    #: the steps drafting on do not pay it again, so the stand-down gate judges drafting without it.
    setup_s: float = 0.0

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft needs one parent per token")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft node {i} has parent {p}; parents must precede their children")
        if self.sampled and (self.q is None or self.q.shape[0] != len(self.tokens)):
            raise ValueError("a sampled draft needs one q distribution per token")

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def chain(tokens: list[int], **kw) -> "Draft":
        return Draft(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)), **kw)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        return depths(self.parents)


@dataclass
class Verdict:
    """The verifier's decision on a draft.

    ``accepted``: the accepted root-to-node path, as draft node indices. ``next_token``: the
    target's own token after that path (bonus, resampled, or plain). Per draft node:
    ``fates``, the target probability ``p`` of its token (where it was evaluated), the draw
    ``u``, the acceptance probability that decided it and the ``rule`` that gave that
    probability (None where the node was never evaluated).
    """

    accepted: list[int]
    next_token: int
    next_fate: Fate
    next_p: float | None
    fates: list[Fate]
    p: list[float | None]
    u: list[float | None]
    accept_prob: list[float | None]
    rule: list[Rule | None]


@dataclass
class TokenEvent:
    """One token of a step as the views show it (the X-ray's numbers)."""

    token_id: int
    text: str
    fate: Fate
    depth: int  # position in the draft (1 = first drafted token); 0 for the target's own token
    node: int  # draft node index, -1 for the target's own token
    p: float | None = None
    q: float | None = None
    u: float | None = None
    accept_prob: float | None = None
    rule: Rule | None = None  # how accept_prob was decided (draft tokens the verifier evaluated)
    #: Who offered the token: a proposer (``draft model``, ``copy``, ``Medusa head 2``, ``EAGLE level 1``,
    #: ``lookahead pool``) for draft tokens, ``bonus`` or ``target`` for the target's own token.
    source: str | None = None

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id, "text": self.text, "fate": self.fate.value, "depth": self.depth,
            "node": self.node, "p": self.p, "q": self.q, "u": self.u, "accept_prob": self.accept_prob,
            "rule": None if self.rule is None else self.rule.value, "source": self.source,
        }


@dataclass
class StepTiming:
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0


@dataclass
class StepEvent:
    """Everything that happened in one propose -> verify -> commit -> observe step.

    ``tokens`` lists, in reading order, the committed tokens with rejected candidates placed
    just before the token that took their place. ``committed`` holds the ids added to the
    output; ``text`` the text they added. ``tree`` describes the whole draft for tree views.
    """

    step: int
    tokens: list[TokenEvent]
    committed: list[int]
    text: str
    num_drafted: int
    num_accepted: int
    timing: StepTiming
    elapsed_s: float
    total_new_tokens: int
    tree: dict[str, Any] = field(default_factory=dict)
    internals: dict[str, Any] = field(default_factory=dict)
    #: Why the step was plain although the method drafts (the gate stood down), else None.
    stood_down: str | None = None


class StopReason(str, Enum):
    MAX_TOKENS = "max_tokens"
    EOS = "eos"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class RunResult:
    """A finished (or cancelled) run: what was generated, why it stopped, how fast."""

    method: str
    method_params: dict[str, Any]
    lossy: bool
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: StopReason
    metrics: "RunMetrics"
    config: GenerationConfig
    events: list[StepEvent] = field(default_factory=list)
    error: str | None = None  # why a run stopped with StopReason.ERROR
    #: Why the seed would not repeat this sampled run (draft sizes or plain steps that follow timings).
    unrepeatable: str | None = None
    #: The method's :attr:`~specplay.core.decoding.method.Method.warnings`.
    warnings: list[str] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.stop_reason is StopReason.CANCELLED


from specplay.core.decoding.metrics import RunMetrics  # noqa: E402  (type used in annotations above)
