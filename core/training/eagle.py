"""Training an EAGLE head on the target's features (the target stays frozen).

A batch is a set of windows cut from the training sequences. At position t of a window the
head reads (embedding of x_{t+1}, f_t + noise) and predicts f_{t+1}; the loss is a smooth
L1 regression to the target's feature plus 0.1 x the cross-entropy of the mapped tokens
(the frozen LM head over the draft vocabulary) against the target's own prediction at
t + 1, EAGLE's recipe. Uniform noise on the input features teaches the head to cope with
its own imperfect predictions, which it reads back when drafting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from core.methods.eagle import EagleHead
from core.training.common import Checkpoint, ProgressFn, TrainSettings, run_loop, split_sequences, vocab_lookup
from core.training.data import FeatureSet

CE_WEIGHT = 0.1


class EagleObjective:
    def __init__(self, head: EagleHead, data: FeatureSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, window: int, noise: float):
        self.head, self.data, self.embed, self.lm_rows = head, data, embed, lm_rows
        self.window = window
        self.labels = vocab_lookup(vocab_ids, vocab_size)[data.labels.long()]
        self.noise = noise * float(data.features[:4096].float().pow(2).mean().sqrt())
        # Windows start anywhere a full window (plus its target) fits inside one sequence.
        starts, ends = data.starts[:-1], data.starts[1:]
        ok = []
        for s, e in zip(starts.tolist(), ends.tolist()):
            length = min(window, e - s - 1)
            if length >= 2:
                ok.append(torch.arange(s, e - length))
        self.window_starts = torch.cat(ok)

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
        feats, embeds, target, labels = self._batch(starts, noisy=True)
        pred = self.head(embeds, feats)
        regression = F.smooth_l1_loss(pred.float(), target)
        logits = pred @ self.lm_rows.T
        ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return regression + CE_WEIGHT * ce

    @torch.no_grad()
    def accuracy(self, starts: torch.Tensor) -> dict:
        """Teacher-forced next-token accuracy of the head's draft (top-1, top-5) on held-out windows."""
        hit1 = hit5 = total = 0
        for chunk in starts.split(16):
            feats, embeds, _, labels = self._batch(chunk, noisy=False)
            top = (self.head(embeds, feats) @ self.lm_rows.T).topk(5, dim=-1).indices
            valid = labels >= 0
            hit1 += int((top[..., 0] == labels)[valid].sum())
            hit5 += int((top == labels[..., None]).any(-1)[valid].sum())
            total += int(valid.sum())
        return {"top1": hit1 / max(total, 1), "top5": hit5 / max(total, 1)}


def train_eagle(data: FeatureSet, head: EagleHead, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                vocab_size: int, settings: TrainSettings, window: int = 128, noise: float = 0.1,
                workdir: Path | None = None, progress: ProgressFn | None = None,
                should_cancel: Callable[[], bool] = lambda: False, resume: bool = False):
    """Train ``head`` in place; return (held-out accuracy, steps)."""
    objective = EagleObjective(head, data, embed, lm_rows.float(), vocab_ids, vocab_size, window, noise)
    train_pos, eval_pos = split_sequences(data, settings.eval_fraction)
    cut = int(eval_pos[0])
    train_starts = objective.window_starts[objective.window_starts < cut - window]
    eval_starts = objective.window_starts[objective.window_starts >= cut]
    eval_starts = eval_starts[torch.randperm(eval_starts.numel(), generator=torch.Generator().manual_seed(0))[:64]]
    checkpoint = Checkpoint(workdir / "eagle-checkpoint.pt") if workdir else None
    steps, last = run_loop(head, objective.loss, lambda: objective.accuracy(eval_starts), train_starts, settings,
                           checkpoint, progress, should_cancel, resume)
    return last or objective.accuracy(eval_starts), steps
