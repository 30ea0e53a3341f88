"""What a decoding method is: a proposer with its own drafting state.

A method never accepts tokens. Each step it *proposes* a :class:`~specplay.core.decoding.types.Draft` (a
chain or a tree, with draft probabilities when it has them); the engine runs the target,
the verifier decides, the target cache commits the accepted path, and the method
*observes* the outcome to update its own state (draft caches, n-gram pools, γ).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import types
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar

import torch

from specplay.core.models.base import CausalLM, ForwardOutput
from specplay.core.decoding.types import Draft, GenerationConfig, Verdict


@dataclass
class RunContext:
    """The run as a method sees it.

    ``tokens`` is prompt + committed output. The target's cache holds all of them but the
    last, which is the root of the next draft.
    """

    target_lm: CausalLM
    tokens: list[int]
    prompt_len: int
    config: GenerationConfig
    draft_generator: torch.Generator
    eos_token_ids: tuple[int, ...] = ()
    #: The target's output over the prompt (all tokens but the last); hidden states included
    #: when the method ``needs_hidden``, and its ``feature_layers``. None for a one-token prompt.
    prefill: ForwardOutput | None = None
    #: Seconds the target's read of the prompt took (None before it, or for a one-token prompt).
    prefill_s: float | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class StepOutcome:
    """What the method learns after verification and the target's commit.

    ``kept_rows``: forward rows committed to the target cache (row 0 = root, then the
    accepted path). ``target_out``: the target's forward output (logits, and hidden states
    when the method asked for them). ``new_tokens``: tokens appended to ``ctx.tokens``.
    """

    draft: Draft
    verdict: Verdict
    target_out: ForwardOutput
    kept_rows: list[int]
    new_tokens: list[int]


def param(default, help: str, *, label: str | None = None, minimum=None, maximum=None, choices=None,
          lossy: bool = False, kind: str | None = None, cli: str | None = None):
    """A method-configuration field with what forms and the command line need to show it.

    ``kind`` refines the type for forms (``"file"``: a path picker); ``cli`` overrides the
    command-line flag (default ``--field-name``); ``lossy`` marks an option that gives up
    the target's exact distribution.
    """
    meta = {"help": help, "label": label, "min": minimum, "max": maximum, "choices": choices, "lossy": lossy,
            "kind": kind, "cli": cli}
    return field(default=default, metadata=meta)


def field_type(cls: type, f: Field) -> tuple[type | None, bool]:
    """(base type, optional) of a config dataclass field, string annotations resolved.

    The one reading of a field's type that validation, the command line and the app's forms share.
    """
    try:
        hint = typing.get_type_hints(cls).get(f.name, f.type)
    except Exception:  # an annotation that does not evaluate: treat it as text
        hint = f.type
    if isinstance(hint, str):
        optional = "None" in hint or "Optional" in hint
        base = {"int": int, "float": float, "bool": bool, "str": str}
        name = hint.replace("Optional[", "").replace("]", "").replace("| None", "").replace("None |", "").strip()
        return base.get(name), optional
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        return (args[0] if len(args) == 1 else None), optional
    return hint, False


class MethodConfig:
    """Base for the typed, validated configuration dataclass of each method."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _check_ranges(self) -> None:
        """Each field must have its declared type, be finite, and lie within its bounds and choices."""
        import math

        from specplay.core.errors import ConfigError

        for f in fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            label = meta.get("label") or f.name
            kind, optional = field_type(type(self), f)
            if kind is None or (value is None and optional):
                continue  # a type this check does not know, or an optional field left empty
            ok = (isinstance(value, bool) if kind is bool else
                  isinstance(value, int) and not isinstance(value, bool) if kind is int else
                  isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
                  isinstance(value, kind))
            if not ok:
                raise ConfigError(f"{label} must be {'an integer' if kind is int else 'a number' if kind is float else kind.__name__}"
                                  f", got {value!r}")
            if kind is float and not math.isfinite(value):
                raise ConfigError(f"{label} must be a finite number, got {value}")
            lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
            if choices is not None and value not in choices:
                raise ConfigError(f"{label} must be one of {', '.join(map(str, choices))}, got {value!r}")
            if kind in (int, float):
                if lo is not None and value < lo:
                    raise ConfigError(f"{label} must be >= {lo}, got {value}")
                if hi is not None and value > hi:
                    raise ConfigError(f"{label} must be <= {hi}, got {value}")

    def __post_init__(self):
        self._check_ranges()


class Method(ABC):
    name: ClassVar[str]
    #: Who proposes the draft's nodes, for each token's provenance; ``{depth}`` is filled in per node.
    draft_source: ClassVar[str] = ""
    #: Ask the target for final hidden states in every step (feature-level drafters).
    needs_hidden: ClassVar[bool] = False
    #: Intermediate layer outputs the method reads from every target pass (an EAGLE-3 head's fused layers).
    feature_layers: tuple[int, ...] = ()
    #: Largest number of draft nodes a step may propose (sizes the KV cache).
    max_draft_nodes: int = 0
    #: (threshold, alpha) of Medusa's typical acceptance, or None for exact verification.
    typical: tuple[float, float] | None = None
    #: Which draft sizes follow measured times, or None. At temperature > 0 the seed then does not
    #: repeat the run: the same draws meet other accept/reject decisions (docs/seeds.md).
    timing_sized: str | None = None
    #: What the user should know before trusting this method's speed (heads learnt on another target's
    #: features, say): carried into every run's result and record, and shown with its figures.
    warnings: tuple[str, ...] = ()

    @property
    def max_draft_depth(self) -> int:
        """How deep a step's draft reaches at most: a chain's nodes (γ, a copy's length); a tree
        method says its own depth."""
        return self.max_draft_nodes

    @property
    def lossy(self) -> bool:
        """Whether the output may differ from the target's distribution (only typical acceptance)."""
        return self.typical is not None

    def __init__(self, config: MethodConfig):
        self.config = config

    def start(self, ctx: RunContext) -> None:
        """Called once after the target has prefilled the prompt (all tokens but the last)."""

    @abstractmethod
    def propose(self, ctx: RunContext, budget: int) -> Draft:
        """Propose at most ``budget`` draft tokens along any path (``budget`` may be 0)."""

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> dict[str, Any] | None:
        """Update drafting state after the verdict (the target has already committed).

        May return notes on the outcome for the step's internals (e.g. which candidate won);
        they are shown next to the draft's own ``shown``, which stays as proposed.
        """
        return None

    def describe(self) -> dict[str, Any]:
        """Method parameters for run logs."""
        return self.config.to_dict()
