"""The EAGLE-3 head (Li et al. 2025): fused target layers in, tokens out.

Differences from the classic head (:class:`specplay.core.heads.eagle.EagleHead`, whose decoder layer
and drafting structure it keeps):

- its first input feature is not the target's final hidden state but a linear fusion of a
  low, a middle and a high layer of the target (``fuse``: 3h -> h), which carry more about the
  tokens after the next one than the last layer, specialised in the next token, does;
- it is trained to predict tokens (cross-entropy through a trainable norm and the target's
  frozen LM head rows), not to regress the target's features, so its output is its own state
  rather than an imitation of the target's; drafting feeds that state back as the next feature;
- it is trained on its own states several levels deep (the training-time test), as drafting
  uses it (:meth:`EagleHead.unrolled`).
"""

from __future__ import annotations

import torch
from torch import nn

from specplay.core.heads.eagle import EagleHead, init_from_target_layer
from specplay.core.models.layers import DecoderConfig, rms_norm


class Eagle3Head(EagleHead):
    def __init__(self, cfg: DecoderConfig, fused_layers: int = 3):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.fuse = nn.Linear(fused_layers * h, h, bias=False)
        self.out_norm = nn.Parameter(torch.ones(h))
        with torch.no_grad():  # start by passing the highest layer through (see core.training.teacher.default_layers)
            self.fuse.weight.zero_()
            self.fuse.weight[:, -h:].copy_(torch.eye(h))

    def fused(self, layers: torch.Tensor) -> torch.Tensor:
        """``[..., L, h]`` target layer outputs -> ``[..., h]``: the first-level input feature."""
        return self.fuse(layers.flatten(-2))

    @torch.no_grad()
    def init_from_target(self, target) -> None:
        """Start as the target's top: its last layer (:func:`init_from_target_layer`) and its final
        norm, so that at first the head reads the high layer and predicts as the target does."""
        init_from_target_layer(self, target.layers[-1])
        self.out_norm.copy_(target.norm_weight.float())

    def logits(self, states: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """The head's states -> logits over the draft vocabulary (``lm_rows``: ``[V', h]``, frozen)."""
        return rms_norm(states, self.out_norm, self.cfg.rms_norm_eps) @ lm_rows.T
