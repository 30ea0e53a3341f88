"""Training an EAGLE-3 head (:class:`specplay.core.heads.eagle3.Eagle3Head`) with the target frozen.

A batch is a set of windows cut from the training sequences. At position t the head reads
(embedding of x_{t+1}, fused target layers at t) and predicts x_{t+2}; that is level 1. At
level j it reads its own level j-1 state from position t-1 instead of the target's layers,
exactly as drafting does (:meth:`EagleHead.unrolled`), so the head is trained on what it
will read when it drafts (the training-time test), for ``depth`` levels. The loss at each
level is the cross-entropy against the target's distribution over its top-K tokens (the
teacher's soft labels; with ``teacher_weight`` < 1 partly its argmax), weighted 0.8^(j-1)
as later levels are harder and count less.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specplay.core.heads.eagle3 import Eagle3Head
from specplay.core.training.common import Checkpoint, ProgressFn, TrainSettings, run_loop, split_sequences, vocab_lookup
from specplay.core.training.teacher import TeacherSet

LEVEL_DECAY = 0.8


def soft_targets(top_ids: torch.Tensor, top_logp: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-K as (draft-vocabulary indices, probabilities renormalised over those the
    draft vocabulary holds); an id outside it gets index 0 and probability 0."""
    idx = table[top_ids.long()]
    inside = idx >= 0
    p = top_logp.float().exp() * inside
    return idx.clamp_min(0), p / p.sum(-1, keepdim=True).clamp_min(1e-9)


def window_starts(data, window: int) -> torch.Tensor:
    """Positions where a window (up to ``window`` long, at least 2) and the token after it fit in one sequence."""
    ok = []
    for s, e in zip(data.starts[:-1].tolist(), data.starts[1:].tolist()):
        length = min(window, e - s - 1)
        if length >= 2:
            ok.append(torch.arange(s, e - length))
    return torch.cat(ok) if ok else torch.zeros(0, dtype=torch.long)


class Eagle3Objective:
    def __init__(self, head: Eagle3Head, data: TeacherSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, window: int, depth: int, teacher_weight: float = 1.0):
        self.head, self.data, self.embed, self.lm_rows = head, data, embed, lm_rows
        self.window, self.depth, self.teacher_weight = window, depth, teacher_weight
        self.table = vocab_lookup(vocab_ids, vocab_size)
        self.labels = self.table[data.labels.long()]
        self.window_starts = window_starts(data, window)

    def _batch(self, starts: torch.Tensor):
        d = self.data
        seq = torch.clamp(torch.bucketize(starts, d.starts, right=True), max=d.starts.numel() - 1)
        length = int(min(self.window, int((d.starts[seq] - starts).min()) - 1))
        idx = starts[:, None] + torch.arange(length)[None]  # [B, L] positions t
        embeds = self.embed(d.tokens[idx + 1].long()).float()
        return idx, d.layers[idx].float(), embeds

    def states(self, starts: torch.Tensor, depth: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(positions ``[B, L]``, the head's states level by level, each ``[B, L, h]``)."""
        idx, layers, embeds = self._batch(starts)
        return idx, self.head.unrolled(embeds, self.head.fused(layers), depth)

    def loss(self, starts: torch.Tensor) -> torch.Tensor:
        idx, levels = self.states(starts, self.depth)
        total, weights = 0.0, 0.0
        for j, state in enumerate(levels):  # level j + 1: meaningful from position j of the window on
            target = idx[:, j:] + 1  # the position whose prediction (x_{t+2}) the head makes
            logp = torch.log_softmax(self.head.logits(state[:, j:], self.lm_rows).float(), dim=-1)
            loss = 0.0
            if self.teacher_weight > 0:
                ids, p = soft_targets(self.data.top_ids[target], self.data.top_logp[target], self.table)
                loss = self.teacher_weight * -(p * logp.gather(-1, ids)).sum(-1).mean()
            if self.teacher_weight < 1:
                hard = F.nll_loss(logp.flatten(0, 1), self.labels[target].flatten(), ignore_index=-100)
                loss = loss + (1 - self.teacher_weight) * hard
            total = total + LEVEL_DECAY ** j * loss
            weights += LEVEL_DECAY ** j
        return total / weights

    @torch.no_grad()
    def accuracy(self, starts: torch.Tensor, levels: int = 3) -> dict:
        """Top-1 of the head's draft on held-out windows at each drafting level (``top1_by_level``;
        level 1 reads the target's layers, later levels the head's own states) and top-5 at level 1."""
        by_level = [[0, 0] for _ in range(levels)]
        hit5 = 0
        for chunk in starts.split(16):
            idx, states = self.states(chunk, levels)
            for j, state in enumerate(states):
                top = self.head.logits(state[:, j:], self.lm_rows).topk(5, dim=-1).indices
                lab = self.labels[idx[:, j:] + 1]
                valid = lab >= 0
                by_level[j][0] += int((top[..., 0] == lab)[valid].sum())
                by_level[j][1] += int(valid.sum())
                if j == 0:
                    hit5 += int((top == lab[..., None]).any(-1)[valid].sum())
        top1 = [h / max(n, 1) for h, n in by_level]
        return {"top1": top1[0], "top5": hit5 / max(by_level[0][1], 1), "top1_by_level": top1}


def held_out_windows(objective, data, eval_fraction: float, window: int, count: int = 64):
    """(training window starts, ``count`` held-out ones): whole sequences, the last ``eval_fraction`` held out."""
    _, eval_pos = split_sequences(data, eval_fraction)
    cut = int(eval_pos[0])
    starts = objective.window_starts
    train = starts[starts < cut - window]
    held = starts[starts >= cut]
    return train, held[torch.randperm(held.numel(), generator=torch.Generator().manual_seed(0))[:count]]


def train_eagle3(data: TeacherSet, head: Eagle3Head, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, settings: TrainSettings, window: int = 128, depth: int = 3,
                 teacher_weight: float = 1.0, tau_sim: Callable[[Eagle3Head], dict] | None = None,
                 workdir: Path | None = None, progress: ProgressFn | None = None,
                 should_cancel: Callable[[], bool] = lambda: False, resume: bool = False, identity: dict | None = None):
    """Train ``head`` in place; return (held-out accuracy, with ``tau_sim`` where given, and steps).

    ``tau_sim(head)`` (:func:`specplay.core.training.tau.eagle_tau`) runs at each evaluation; ``identity``:
    which training a checkpoint must belong to to be resumed (:class:`Checkpoint`)."""
    objective = Eagle3Objective(head, data, embed, lm_rows.float(), vocab_ids, vocab_size, window, depth,
                                teacher_weight)
    train_starts, eval_starts = held_out_windows(objective, data, settings.eval_fraction, window)

    def evaluate() -> dict:
        result = objective.accuracy(eval_starts)
        if tau_sim is not None:
            result.update(tau_sim(head))
        return result

    checkpoint = Checkpoint(workdir / "eagle3-checkpoint.pt", identity) if workdir else None
    steps, last = run_loop(head, objective.loss, evaluate, train_starts, settings, checkpoint, progress,
                           should_cancel, resume)
    return last or evaluate(), steps
