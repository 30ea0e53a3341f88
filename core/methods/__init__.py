"""The decoding methods, each an implementation of the step's contract
(:mod:`specplay.core.decoding.method`): autoregressive, speculative decoding with a draft model,
prompt lookup, lookahead, Medusa and EAGLE, and how to build one by name (:func:`build_method`).

May import: the helpers, :mod:`specplay.core.models`, :mod:`specplay.core.heads` and
:mod:`specplay.core.decoding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specplay.core.errors import ConfigError
from specplay.core.methods.autoregressive import Autoregressive, AutoregressiveConfig
from specplay.core.decoding.method import Method, MethodConfig
from specplay.core.methods.eagle import Eagle, EagleConfig
from specplay.core.methods.lookahead import Lookahead, LookaheadConfig
from specplay.core.methods.medusa import Medusa, MedusaConfig
from specplay.core.methods.prompt_lookup import PromptLookup, PromptLookupConfig
from specplay.core.methods.speculative import Speculative, SpeculativeConfig, ranked_vocabulary


@dataclass(frozen=True)
class MethodSpec:
    name: str
    title: str
    config_class: type
    needs_draft: bool
    build: Callable  # (config, target: LoadedModel, draft: LoadedModel | None) -> Method
    summary: str


METHODS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        MethodSpec("autoregressive", "Autoregressive", AutoregressiveConfig, False,
                   lambda c, t, d: Autoregressive(c), "Plain decoding, one target token per step (the baseline)."),
        MethodSpec("speculative", "Speculative (draft model)", SpeculativeConfig, True,
                   lambda c, t, d: Speculative(c, d.model, t.model,
                                               ranked_vocabulary(t.model_id)),
                   "A small draft model proposes γ tokens; the target verifies them in one pass."),
        MethodSpec("prompt_lookup", "Prompt lookup", PromptLookupConfig, False,
                   lambda c, t, d: PromptLookup(c, t.model),
                   "Copies what followed an earlier occurrence of the last n tokens; no extra model."),
        MethodSpec("lookahead", "Lookahead", LookaheadConfig, False, lambda c, t, d: Lookahead(c, t.model),
                   "Jacobi iteration over a window collects n-grams; matching ones are verified in the same pass."),
        MethodSpec("medusa", "Medusa", MedusaConfig, False, lambda c, t, d: Medusa(c, t.model, t.model_id),
                   "Extra heads on the target's last hidden state propose a tree of candidates (the shipped ones, "
                   "Hydra heads, each read the token drafted before theirs)."),
        MethodSpec("eagle", "EAGLE", EagleConfig, False, lambda c, t, d: Eagle(c, t.model, t.model_id),
                   "A one-layer head drafts from the target's features and grows a dynamic tree (EAGLE-2; the shipped "
                   "head is trained the EAGLE-3 way)."),
    )
}


def method_title(name: str, short: bool = False) -> str:
    """How a method is named to people: its title ("Speculative (draft model)"), without the
    parenthesis when ``short`` ("Speculative"); a name SpecPlay does not know (a peer, an
    endpoint, a record from another version) stands as it is."""
    if name not in METHODS:
        return name
    title = METHODS[name].title
    return title.split(" (")[0] if short else title


def get_spec(name: str) -> MethodSpec:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method '{name}' (choose from {', '.join(METHODS)})") from None


def build_method(name: str, config: MethodConfig | None, target, draft=None) -> Method:
    spec = get_spec(name)
    config = config if config is not None else spec.config_class()
    if spec.needs_draft and draft is None:
        raise ConfigError(f"method '{name}' needs a draft model")
    return spec.build(config, target, draft)


__all__ = ["METHODS", "Method", "MethodConfig", "MethodSpec", "build_method", "get_spec", "method_title"]
