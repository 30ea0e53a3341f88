"""Training EAGLE heads with the target frozen: the classic head on the target's final features,
and the EAGLE-3 head on its fused layers and distribution.

Classic: a batch is a set of windows cut from the training sequences. At position t of a window
the head reads (embedding of x_{t+1}, f_t + noise) and predicts f_{t+1}; the loss is a smooth
L1 regression to the target's feature plus 0.1 x the cross-entropy of the mapped tokens
(the frozen LM head over the draft vocabulary) against the target's own prediction at
t + 1, EAGLE's recipe. Uniform noise on the input features teaches the head to cope with
its own imperfect predictions, which it reads back when drafting; with ``unroll`` > 1 the
head is also trained on those predictions themselves, level by level as drafting reads
them (:meth:`EagleHead.unrolled`), the training-time test of EAGLE-3.

EAGLE-3 (:class:`specplay.core.heads.eagle3.Eagle3Head`): at position t the head reads
(embedding of x_{t+1}, fused target layers at t) and predicts x_{t+2}; that is level 1. At
level j it reads its own level j-1 state from position t-1 instead of the target's layers,
exactly as drafting does, so the head is trained on what it will read when it drafts (the
training-time test), for ``depth`` levels. The loss at each level is the cross-entropy against
the target's distribution over its top-K tokens (the teacher's soft labels; with
``teacher_weight`` < 1 partly its argmax), weighted 0.8^(j-1) as later levels are harder and
count less.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specplay.core.heads import EagleHead
from specplay.core.heads.eagle3 import Eagle3Head
from specplay.core.training.common import Checkpoint, ProgressFn, TrainSettings, run_loop, split_sequences, vocab_lookup
from specplay.core.training.data import FeatureSet
from specplay.core.training.teacher import TeacherSet


CE_WEIGHT = 0.1


class EagleObjective:
    def __init__(self, head: EagleHead, data: FeatureSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, window: int, noise: float, unroll: int = 1):
        self.head, self.data, self.embed, self.lm_rows = head, data, embed, lm_rows
        self.window, self.unroll = window, unroll
        self.labels = vocab_lookup(vocab_ids, vocab_size)[data.labels.long()]
        self.noise = noise * float(data.features[:4096].float().pow(2).mean().sqrt())
        self.window_starts = window_starts(data, window)

    def _batch(self, starts: torch.Tensor, noisy: bool):
        d = self.data
        lengths = torch.clamp(torch.bucketize(starts, d.starts, right=True), max=d.starts.numel() - 1)
        seq_end = d.starts[lengths]
        length = int(min(self.window, int((seq_end - starts).min()) - 1))
        idx = starts[:, None] + torch.arange(length)[None]  # [B, L] positions t
        feats = d.features[idx].float()
        if noisy and self.noise > 0:
            feats = feats + (torch.rand_like(feats) * 2 - 1) * self.noise
        embeds = self.embed(d.tokens[idx + 1].long()).float()
        return feats, embeds, d.features[idx + 1].float(), self.labels[idx + 1]

    def loss(self, starts: torch.Tensor) -> torch.Tensor:
        """Feature regression plus a little cross-entropy, averaged over the unrolled levels."""
        feats, embeds, target, labels = self._batch(starts, noisy=True)
        total = 0.0
        for level, pred in enumerate(self.head.unrolled(embeds, feats, self.unroll)):
            pred, want, lab = pred[:, level:], target[:, level:], labels[:, level:]
            regression = F.smooth_l1_loss(pred.float(), want)
            logits = pred @ self.lm_rows.T
            ce = F.cross_entropy(logits.float().flatten(0, 1), lab.flatten(), ignore_index=-100)
            total = total + regression + CE_WEIGHT * ce
        return total / self.unroll

    @torch.no_grad()
    def accuracy(self, starts: torch.Tensor, levels: int = 3) -> dict:
        """Next-token accuracy of the head's draft on held-out windows: top-1 and top-5 with the
        target's features (teacher forced), and top-1 at each drafting level, where the head
        reads its own predicted features (``top1_by_level``)."""
        hit1, hit5, total = 0, 0, 0
        by_level = [[0, 0] for _ in range(levels)]
        for chunk in starts.split(16):
            feats, embeds, _, labels = self._batch(chunk, noisy=False)
            for level, pred in enumerate(self.head.unrolled(embeds, feats, levels)):
                top = (pred[:, level:] @ self.lm_rows.T).topk(5, dim=-1).indices
                lab = labels[:, level:]
                valid = lab >= 0
                hits = (top[..., 0] == lab)[valid]
                by_level[level][0] += int(hits.sum())
                by_level[level][1] += int(valid.sum())
                if level == 0:
                    hit1 += int(hits.sum())
                    hit5 += int((top == lab[..., None]).any(-1)[valid].sum())
                    total += int(valid.sum())
        return {"top1": hit1 / max(total, 1), "top5": hit5 / max(total, 1),
                "top1_by_level": [h / max(n, 1) for h, n in by_level]}


def train_eagle(data: FeatureSet, head: EagleHead, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                vocab_size: int, settings: TrainSettings, window: int = 128, noise: float = 0.1, unroll: int = 1,
                workdir: Path | None = None, progress: ProgressFn | None = None,
                should_cancel: Callable[[], bool] = lambda: False, resume: bool = False, identity: dict | None = None,
                tau_sim: Callable[[EagleHead], dict] | None = None):
    """Train ``head`` in place; return (held-out accuracy, steps).

    ``identity``: which training a checkpoint must belong to to be resumed (:class:`Checkpoint`);
    ``tau_sim(head)`` (:func:`specplay.core.training.tau.eagle_tau`) adds to each evaluation."""
    objective = EagleObjective(head, data, embed, lm_rows.float(), vocab_ids, vocab_size, window, noise, unroll)
    train_pos, eval_pos = split_sequences(data, settings.eval_fraction)
    cut = int(eval_pos[0])
    train_starts = objective.window_starts[objective.window_starts < cut - window]
    eval_starts = objective.window_starts[objective.window_starts >= cut]
    eval_starts = eval_starts[torch.randperm(eval_starts.numel(), generator=torch.Generator().manual_seed(0))[:64]]
    checkpoint = Checkpoint(workdir / "eagle-checkpoint.pt", identity) if workdir else None
    def evaluate() -> dict:
        return {**objective.accuracy(eval_starts), **(tau_sim(head) if tau_sim else {})}

    steps, last = run_loop(head, objective.loss, evaluate, train_starts, settings, checkpoint, progress,
                           should_cancel, resume)
    return last or objective.accuracy(eval_starts), steps


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
