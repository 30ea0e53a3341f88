"""Medusa heads: K residual blocks on the target's last hidden state, one per future position.

Shared by the method (:mod:`specplay.core.methods.medusa`) and the trainer (:mod:`specplay.core.training.medusa`);
logits come from the target's frozen LM head rows of the draft vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: each head begins as the LM head
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        # In the block's dtype (bfloat16 where the method runs it so), added back in the input's.
        return x + nn.functional.silu(self.linear(x.to(self.linear.weight.dtype))).to(x.dtype)


class MedusaHeads(nn.Module):
    """K residual blocks; logits come from the frozen LM head rows of the draft vocabulary."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(hidden) for _ in range(num_heads)])  # K distinct modules

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` -> ``[K, B, hidden]``."""
        return torch.stack([b(h) for b in self.blocks])
