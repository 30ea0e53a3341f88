"""Training an EAGLE head on the target's features (the target stays frozen).

A batch is a set of windows cut from the training sequences. At position t of a window the
head reads (embedding of x_{t+1}, f_t + noise) and predicts f_{t+1}; the loss is a smooth
L1 regression to the target's feature plus 0.1 x the cross-entropy of the mapped tokens
(the frozen LM head over the draft vocabulary) against the target's own prediction at
t + 1, EAGLE's recipe. Uniform noise on the input features teaches the head to cope with
its own imperfect predictions, which it reads back when drafting; with ``unroll`` > 1 the
head is also trained on those predictions themselves, level by level as drafting reads
them (:meth:`EagleHead.unrolled`), the training-time test of EAGLE-3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specplay.core.heads import EagleHead
from specplay.core.training.common import Checkpoint, ProgressFn, TrainSettings, run_loop, split_sequences, vocab_lookup
from specplay.core.training.data import FeatureSet

CE_WEIGHT = 0.1


class EagleObjective:
    def __init__(self, head: EagleHead, data: FeatureSet, embed, lm_rows: torch.Tensor, vocab_ids: torch.Tensor,
                 vocab_size: int, window: int, noise: float, unroll: int = 1):
        self.head, self.data, self.embed, self.lm_rows = head, data, embed, lm_rows
        self.window, self.unroll = window, unroll
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
