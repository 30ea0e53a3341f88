"""Hydra heads (Ankner et al. 2024): Medusa heads that read the tokens drafted before theirs.

A classic Medusa head k sees only the target's last hidden state h_t, so it must guess
x_{t+k+1} without knowing which x_{t+2..t+k} the heads before it drafted on its path. Here
head k carries a state along the path: s_0 = h_t, and

    s_k = s_{k-1} + SiLU(W_k [s_{k-1}; norm(e(x_{t+k}))] + b_k)

reads the state of the head before it and the embedding of the token drafted before its own
(head 1: the root token, which the target produced), then maps s_k to x_{t+k+1} through the
target's frozen LM head rows. Trained with the path's true tokens (teacher forcing) against
the target's distribution (Hydra++'s teacher loss, :mod:`specplay.core.training.medusa`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class HydraHeads(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2 * hidden, hidden) for _ in range(num_heads)])
        for block in self.blocks:  # each head starts as the LM head on h_t, as a classic head does
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)

    def step(self, k: int, state: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Head ``k`` (0-based) from the previous state and the embedding of the token before its own."""
        # The embeddings are a hundred times smaller than the final-norm states; normalised, both count.
        e = F.rms_norm(token_embeds.float(), (token_embeds.shape[-1],))
        block = self.blocks[k]  # in its own dtype (bfloat16 where the method runs it so), added back in the state's
        return state + F.silu(block(torch.cat([state, e], dim=-1).to(block.weight.dtype))).to(state.dtype)

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: ``hidden`` ``[B, h]`` and the embeddings of x_{t+1..t+K} ``[K, B, h]`` -> ``[K, B, h]``."""
        states, s = [], hidden
        for k in range(len(self.blocks)):
            s = self.step(k, s, token_embeds[k])
            states.append(s)
        return torch.stack(states)

    def draft_tree(self, hidden: torch.Tensor, root_embeds: torch.Tensor, parents: Sequence[int],
                   ranks: Sequence[int], depth_of: Sequence[int], logits: Callable[[torch.Tensor], torch.Tensor],
                   embed: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A static tree's candidates for ``B`` roots at once: ``hidden`` ``[B, h]``, ``root_embeds``
        ``[B, h]``; nodes ordered by depth, parents first (:class:`specplay.core.decoding.tree.TreeSpec`). ``logits``
        maps states to draft-vocabulary logits, ``embed`` draft-vocabulary indices to embeddings.
        Returns each node's draft-vocabulary index and draft probability, both ``[B, n]``."""
        n = len(parents)
        b = hidden.shape[0]
        index = torch.zeros(b, n, dtype=torch.long, device=hidden.device)
        prob = torch.zeros(b, n, device=hidden.device)
        has_child = {p for p in parents if p >= 0}
        states = {-1: self.step(0, hidden, root_embeds)}  # expansion point -> its state
        for depth in range(1, max(depth_of, default=0) + 1):
            nodes = [i for i in range(n) if depth_of[i] == depth]
            points = sorted({parents[i] for i in nodes})
            probs = torch.softmax(logits(torch.stack([states[p] for p in points], 1)).float(), dim=-1)  # [B, P, V']
            top = probs.topk(max(ranks[i] for i in nodes) + 1, dim=-1)
            row = {p: r for r, p in enumerate(points)}
            for i in nodes:
                index[:, i] = top.indices[:, row[parents[i]], ranks[i]]
                prob[:, i] = top.values[:, row[parents[i]], ranks[i]]
            grow = [i for i in nodes if i in has_child]
            if grow and depth < len(self.blocks):
                prev = torch.stack([states[parents[i]] for i in grow], 1)
                new = self.step(depth, prev, embed(index[:, grow]))
                states.update({i: new[:, j] for j, i in enumerate(grow)})
        return index, prob
