"""Speculative decoding with a small draft model (Leviathan et al. 2023; Chen et al. 2023).

The draft model proposes γ tokens autoregressively with its own KV cache; the target checks
them in one pass. At temperature > 0 the draft *samples* each token from its distribution
q, so the verifier can accept with min(1, p/q) and resample from the residual. With
adaptive γ, a fully accepted draft grows γ by 2 and a rejection shrinks it by 1 (the
schedule transformers calls "heuristic"); a confidence threshold stops a draft early when
the draft model's own probability of its next token drops below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import ConfigError
from core.methods.base import Method, MethodConfig, RunContext, StepOutcome, param
from core.models.base import CausalLM
from core.sampling import probabilities, sample
from core.types import Draft


@dataclass(frozen=True)
class SpeculativeConfig(MethodConfig):
    gamma: int = param(5, "Draft tokens per step (the starting value when adaptive)", label="γ", minimum=1, maximum=32)
    adaptive: bool = param(False, "Grow γ by 2 after a fully accepted draft, shrink it by 1 after a rejection",
                           label="adaptive γ", cli="--adaptive-gamma")
    max_gamma: int = param(16, "Upper bound for adaptive γ", label="max γ", minimum=1, maximum=64,
                          cli="--max-gamma")
    confidence: float = param(0.0, "Stop a draft when the draft model's probability of its next token is below this "
                              "(0 = never)", label="confidence threshold", minimum=0.0, maximum=1.0)

    def __post_init__(self):
        super().__post_init__()
        if self.adaptive and self.max_gamma < self.gamma:
            raise ConfigError(f"max γ ({self.max_gamma}) must be >= γ ({self.gamma})")


class Speculative(Method):
    name = "speculative"

    def __init__(self, config: SpeculativeConfig, draft_model: CausalLM):
        super().__init__(config)
        self.draft_model = draft_model
        self.gamma = config.gamma
        self.max_draft_nodes = config.max_gamma if config.adaptive else config.gamma

    def start(self, ctx: RunContext) -> None:
        self.gamma = self.config.gamma
        self.draft_model.reset()
        if len(ctx.tokens) > 1:
            self.draft_model.forward_chain(ctx.tokens[:-1])

    def propose(self, ctx: RunContext, budget: int) -> Draft:
        k = min(self.gamma, budget)
        if k <= 0:
            return Draft()
        dm = self.draft_model
        sampling = ctx.config.sampling
        # Feed what the draft cache lacks: the root, and any token the target added last step.
        logits = dm.forward_chain(ctx.tokens[dm.cache_len:]).logits[-1]
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        q_token: list[float] = []
        stopped_early = False
        for j in range(k):
            if sampling.greedy:
                probs = torch.softmax(logits.float(), -1)
                token = int(logits.argmax())
            else:
                probs = probabilities(logits.cpu(), sampling.temperature, sampling.top_p)
                token = sample(probs, ctx.draft_generator)
                q_rows.append(probs)
            confidence = float(probs[token])
            if j > 0 and confidence < self.config.confidence:
                if q_rows:
                    q_rows.pop()
                stopped_early = True
                break
            tokens.append(token)
            q_token.append(confidence)
            if j < k - 1:
                logits = dm.forward_chain([token]).logits[-1]
        return Draft.chain(tokens, sampled=not sampling.greedy, q=torch.stack(q_rows) if q_rows else None,
                           q_token=q_token, info={"gamma": self.gamma, "drafted": len(tokens),
                                                  "stopped_early": stopped_early})

    def observe(self, ctx: RunContext, outcome: StepOutcome) -> None:
        accepted = len(outcome.verdict.accepted)
        drafted = len(outcome.draft)
        # The draft cache holds the old context plus every drafted token but the last; keep
        # the old context plus the accepted ones. The next propose feeds what is missing.
        old_len = len(ctx.tokens) - len(outcome.new_tokens)
        self.draft_model.crop(min(self.draft_model.cache_len, old_len + accepted))
        if self.config.adaptive and drafted:
            if accepted == drafted:
                self.gamma = min(self.gamma + 2, self.config.max_gamma)
            else:
                self.gamma = max(self.gamma - 1, 1)
