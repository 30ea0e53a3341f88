"""Training Medusa heads with the backbone frozen, on the target's own features and predictions.

Head k at position t learns the target's prediction at position t + k (its token for
t + k + 1), through the target's frozen LM head restricted to the draft vocabulary.
The loss weights decay with depth (0.8^k), as later heads are harder and matter less.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specplay.core.heads import MedusaHeads
from specplay.core.training.common import (Checkpoint, ProgressFn, TrainSettings, run_loop, split_sequences,
                                  vocab_lookup)
from specplay.core.training.data import FeatureSet

TOP_RANKS = 10


class MedusaObjective:
    def __init__(self, heads: MedusaHeads, data: FeatureSet, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int):
        self.heads, self.data, self.lm_rows = heads, data, lm_rows
        self.k = len(heads.blocks)
        table = vocab_lookup(vocab_ids, vocab_size)
        n = data.num_tokens
        labels = table[data.labels.long()]
        # target[k][t]: draft-vocabulary index of the label of head k+1 at position t (or -100).
        self.targets = []
        for k in range(1, self.k + 1):
            t = torch.full((n,), -100, dtype=torch.long)
            ok = data.same_sequence_shift(k)
            t[: n - k] = labels[k:]
            self.targets.append(torch.where(ok, t, torch.full_like(t, -100)))
        self.weights = [0.8 ** k for k in range(self.k)]

    def logits(self, positions: torch.Tensor) -> torch.Tensor:
        h = self.data.features[positions].float()
        return self.heads(h) @ self.lm_rows.T  # [K, B, V']

    def loss(self, positions: torch.Tensor) -> torch.Tensor:
        logits = self.logits(positions)
        total = logits.new_zeros(())
        for k in range(self.k):
            y = self.targets[k][positions]
            if (y >= 0).any():
                total = total + self.weights[k] * F.cross_entropy(logits[k].float(), y, ignore_index=-100)
        return total

    @torch.no_grad()
    def accuracy(self, positions: torch.Tensor, chunk: int = 512) -> list[list[float]]:
        """acc[k][r]: share of valid positions where head k+1's rank-r candidate is the label."""
        hits = torch.zeros(self.k, TOP_RANKS)
        counts = torch.zeros(self.k)
        for s in range(0, positions.numel(), chunk):
            pos = positions[s:s + chunk]
            top = self.logits(pos).topk(TOP_RANKS, dim=-1).indices  # [K, B, R]
            for k in range(self.k):
                y = self.targets[k][pos]
                valid = y >= 0
                hits[k] += (top[k][valid] == y[valid, None]).float().sum(0)
                counts[k] += valid.sum()
        return (hits / counts.clamp_min(1)[:, None]).tolist()


def train_medusa(data: FeatureSet, lm_rows: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int, num_heads: int,
                 settings: TrainSettings, workdir: Path | None = None, progress: ProgressFn | None = None,
                 should_cancel: Callable[[], bool] = lambda: False, resume: bool = False, identity: dict | None = None,
                 tau_sim: Callable[[MedusaHeads, list[list[float]]], dict] | None = None,
                 heads: MedusaHeads | None = None):
    """Train ``num_heads`` heads (``heads`` from where they are, else new ones); return (heads, accuracy table
    on held-out sequences, steps).

    ``identity``: which training a checkpoint must belong to to be resumed (:class:`Checkpoint`);
    ``tau_sim(heads, accuracy)`` (:func:`specplay.core.training.tau.medusa_tau`) adds to each evaluation."""
    heads = heads if heads is not None else MedusaHeads(data.features.shape[1], num_heads)
    objective = MedusaObjective(heads, data, lm_rows.float(), vocab_ids, vocab_size)
    train_pos, eval_pos = split_sequences(data, settings.eval_fraction)
    eval_pos = eval_pos[torch.randperm(eval_pos.numel(), generator=torch.Generator().manual_seed(0))[:4096]]

    def evaluate() -> dict:
        acc = objective.accuracy(eval_pos)
        result = {"top1": [a[0] for a in acc], "top5": [sum(a[:5]) for a in acc], "accuracy": acc}
        return {**result, **(tau_sim(heads, acc) if tau_sim else {})}

    checkpoint = Checkpoint(workdir / "medusa-checkpoint.pt", identity) if workdir else None
    steps, last = run_loop(heads, objective.loss, evaluate, train_pos, settings, checkpoint, progress, should_cancel,
                           resume)
    return heads, last.get("accuracy") or objective.accuracy(eval_pos), steps
