"""Training Medusa heads with the backbone frozen: the classic heads on the target's final
features and predictions, and Hydra heads on its distribution.

Classic: head k at position t learns the target's prediction at position t + k (its token for
t + k + 1), through the target's frozen LM head restricted to the draft vocabulary.
The loss weights decay with depth (0.8^k), as later heads are harder and matter less.

Hydra (:class:`specplay.core.heads.hydra.HydraHeads`): at position t, head k (0-based) reads
the head before it (h_t for the first) and the true token x_{t+k+1} (teacher forcing: a tree
node counts only when its path was right), and learns the target's distribution at position
t + k + 1, the one that decides x_{t+k+2}: the cross-entropy against its top-K tokens (Hydra++'s
teacher loss; with ``teacher_weight`` < 1 partly its argmax). Later heads weigh 0.8^k, as for
the classic heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specplay.core.heads import MedusaHeads
from specplay.core.heads.hydra import HydraHeads
from specplay.core.training.common import Checkpoint, ProgressFn, TrainSettings, run_loop, split_sequences, vocab_lookup
from specplay.core.training.data import FeatureSet
from specplay.core.training.eagle import soft_targets
from specplay.core.training.teacher import TeacherSet

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


class HydraObjective:
    def __init__(self, heads: HydraHeads, data: TeacherSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, teacher_weight: float = 1.0):
        self.heads, self.data, self.embed, self.lm_rows = heads, data, embed, lm_rows
        self.k, self.teacher_weight = len(heads.blocks), teacher_weight
        self.table = vocab_lookup(vocab_ids, vocab_size)
        self.labels = self.table[data.labels.long()]
        # valid[k][t]: head k at t has its input token and target inside t's sequence
        self.valid = [data.same_sequence_shift(k + 1) for k in range(self.k)]
        self.weights = [0.8 ** k for k in range(self.k)]

    def _shifted(self, positions: torch.Tensor) -> torch.Tensor:
        """``[K, B]`` positions t + k + 1, clamped to the data (invalid ones are masked)."""
        last = self.data.num_tokens - 1
        return (positions[None] + torch.arange(1, self.k + 1)[:, None]).clamp(max=last)

    def logits(self, positions: torch.Tensor) -> torch.Tensor:
        ahead = self._shifted(positions)
        states = self.heads(self.data.final[positions].float(), self.embed(self.data.tokens[ahead].long()).float())
        return states @ self.lm_rows.T  # [K, B, V']

    def loss(self, positions: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(self.logits(positions).float(), dim=-1)
        ahead = self._shifted(positions)
        total = logp.new_zeros(())
        for k in range(self.k):
            ok = self.valid[k][positions]
            if not ok.any():
                continue
            loss = 0.0
            if self.teacher_weight > 0:
                ids, p = soft_targets(self.data.top_ids[ahead[k]], self.data.top_logp[ahead[k]], self.table)
                loss = self.teacher_weight * -((p * logp[k].gather(-1, ids)).sum(-1))[ok].mean()
            if self.teacher_weight < 1:
                y = torch.where(ok, self.labels[ahead[k]], torch.full_like(ok, -100, dtype=torch.long))
                loss = loss + (1 - self.teacher_weight) * F.nll_loss(logp[k], y, ignore_index=-100)
            total = total + self.weights[k] * loss
        return total

    @torch.no_grad()
    def accuracy(self, positions: torch.Tensor, chunk: int = 512) -> list[list[float]]:
        """acc[k][r]: share of valid positions where head k+1's rank-r candidate is the label, its
        path's earlier tokens right (what a tree node needs to be accepted)."""
        hits = torch.zeros(self.k, TOP_RANKS)
        counts = torch.zeros(self.k)
        for s in range(0, positions.numel(), chunk):
            pos = positions[s:s + chunk]
            top = self.logits(pos).topk(TOP_RANKS, dim=-1).indices
            ahead = self._shifted(pos)
            for k in range(self.k):
                y = self.labels[ahead[k]]
                ok = self.valid[k][pos] & (y >= 0)
                hits[k] += (top[k][ok] == y[ok, None]).float().sum(0)
                counts[k] += ok.sum()
        return (hits / counts.clamp_min(1)[:, None]).tolist()


def train_hydra(data: TeacherSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int,
                num_heads: int, settings: TrainSettings, teacher_weight: float = 1.0,
                tau_sim: Callable[[HydraHeads, list[list[float]]], dict] | None = None,
                workdir: Path | None = None, progress: ProgressFn | None = None,
                should_cancel: Callable[[], bool] = lambda: False, resume: bool = False, identity: dict | None = None,
                heads: HydraHeads | None = None):
    """Train ``num_heads`` Hydra heads (``heads`` from where they are, else new ones); return (heads, held-out
    evaluation, steps). The evaluation
    has ``accuracy`` (as :meth:`HydraObjective.accuracy`), ``top1`` and what ``tau_sim(heads,
    accuracy)`` (:func:`specplay.core.training.tau.medusa_tau`) adds. ``identity``: which training a
    checkpoint must belong to to be resumed (:class:`Checkpoint`)."""
    heads = heads if heads is not None else HydraHeads(data.final.shape[1], num_heads)
    objective = HydraObjective(heads, data, embed, lm_rows.float(), vocab_ids, vocab_size, teacher_weight)
    train_pos, eval_pos = split_sequences(data, settings.eval_fraction)
    eval_pos = eval_pos[torch.randperm(eval_pos.numel(), generator=torch.Generator().manual_seed(0))[:4096]]

    def evaluate() -> dict:
        acc = objective.accuracy(eval_pos)
        result = {"top1": [a[0] for a in acc], "top5": [sum(a[:5]) for a in acc], "accuracy": acc}
        if tau_sim is not None:
            result.update(tau_sim(heads, acc))
        return result

    checkpoint = Checkpoint(workdir / "hydra-checkpoint.pt", identity) if workdir else None
    steps, last = run_loop(heads, objective.loss, evaluate, train_pos, settings, checkpoint, progress, should_cancel,
                           resume)
    return heads, last or evaluate(), steps
