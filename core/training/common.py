"""What the Medusa and EAGLE trainers share: settings, progress, checkpoints, evaluation split."""

from __future__ import annotations

import logging
import math
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specplay.core.atomic import replacing
from specplay.core.errors import Cancelled, ConfigError, SpecPlayError
from specplay.core.training.data import FeatureSet, draft_vocabulary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2000
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 50
    eval_fraction: float = 0.05
    eval_every: int = 250
    checkpoint_every: int = 100
    seed: int = 0
    bf16: bool = False  # autocast matmuls to bfloat16 (fast on CPUs with bf16 units)

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError("steps and batch size must be >= 1")
        if not 0 < self.lr < 1:
            raise ConfigError(f"learning rate must be in (0, 1), got {self.lr}")
        if not 0 < self.eval_fraction < 0.5:
            raise ConfigError("the evaluation fraction must be in (0, 0.5)")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainProgress:
    """One progress report: ``metrics`` has ``loss`` and per-head ``top1``/``top5`` (lists) when evaluated."""

    step: int
    total: int
    elapsed_s: float  # training seconds so far, earlier sessions of a resumed run included
    metrics: dict = field(default_factory=dict)


ProgressFn = Callable[[TrainProgress], None]


def split_sequences(data: FeatureSet, eval_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(train positions, eval positions): whole sequences, the last ``eval_fraction`` of them for evaluation."""
    n_seq = data.starts.numel() - 1
    n_eval = max(1, int(round(n_seq * eval_fraction)))
    cut = int(data.starts[n_seq - n_eval])
    return torch.arange(0, cut), torch.arange(cut, data.num_tokens)


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    t = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


def vocab_lookup(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target id -> draft-vocabulary index, -100 (ignored by the loss) for ids outside it."""
    table = torch.full((vocab_size,), -100, dtype=torch.long)
    table[vocab_ids] = torch.arange(vocab_ids.numel())
    return table


class Checkpoint:
    """Resumable training state in one file, replaced atomically.

    The file holds only tensors, dicts, lists and numbers, so it loads with
    ``weights_only=True``: a checkpoint planted in the work folder cannot run code on resume.

    ``identity`` (strings and numbers) says which training it is: the target's weights, the data,
    the heads' shape. It is saved with the state, and a checkpoint of another training is not
    resumed, since a work folder may be shared by the trainings of several targets.
    """

    def __init__(self, path: Path, identity: dict | None = None):
        self.path = Path(path)
        self.identity = dict(identity or {})

    def save(self, module: torch.nn.Module, optimizer, step: int, extra: dict[str, float]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": int(step),
                 "rng": torch.get_rng_state(), "identity": self.identity, **{k: float(v) for k, v in extra.items()}}
        with replacing(self.path) as tmp:
            torch.save(state, tmp)

    def load(self, module: torch.nn.Module, optimizer) -> tuple[int, dict]:
        if not self.path.is_file():
            return 0, {}
        try:
            state = torch.load(self.path, weights_only=True)
        except pickle.UnpicklingError:
            raise SpecPlayError(f"{self.path} holds more than tensors and numbers, so it is not loaded; "
                              "delete it to train from the start") from None
        saved = state.pop("identity", None)
        if saved != self.identity:
            if saved is None:  # from before checkpoints recorded their training: whose it is cannot be told
                why = "it does not record which training it belongs to"
            else:
                why = "made with another " + ", ".join(sorted(k for k in saved.keys() | self.identity.keys()
                                                             if saved.get(k) != self.identity.get(k)))
            log.warning("%s is not resumed (%s): training starts from step 0 and will replace it", self.path, why)
            return 0, {}
        module.load_state_dict(state.pop("model"))
        optimizer.load_state_dict(state.pop("optimizer"))
        torch.set_rng_state(state.pop("rng"))
        return int(state.pop("step")), state


def run_loop(module: torch.nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor],
             evaluate: Callable[[], dict], train_positions: torch.Tensor, settings: TrainSettings,
             checkpoint: Checkpoint | None, progress: ProgressFn | None, should_cancel: Callable[[], bool],
             resume: bool) -> tuple[int, dict]:
    """The training loop both trainers use; returns (steps done, last evaluation)."""
    torch.manual_seed(settings.seed)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    step, before = 0, 0.0  # seconds spent by earlier sessions of a resumed training
    if resume and checkpoint is not None:
        step, extra = checkpoint.load(module, optimizer)
        before = float(extra.get("elapsed_s", 0.0))
    module.train()
    started = time.perf_counter()

    def elapsed() -> dict:
        return {"elapsed_s": before + time.perf_counter() - started}
    last_eval: dict = {}
    while step < settings.steps:
        if should_cancel():
            if checkpoint is not None:
                checkpoint.save(module, optimizer, step, elapsed())
            raise Cancelled(f"training cancelled at step {step} (resume with --resume)")
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step, settings)
        idx = train_positions[torch.randint(0, train_positions.numel(), (settings.batch_size,))]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            loss = loss_fn(idx)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        metrics = {"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]}
        if step % settings.eval_every == 0 or step == settings.steps:
            module.eval()
            last_eval = evaluate()
            module.train()
            metrics.update(last_eval)
        if checkpoint is not None and (step % settings.checkpoint_every == 0 or step == settings.steps):
            checkpoint.save(module, optimizer, step, elapsed())
        if progress:
            progress(TrainProgress(step=step, total=settings.steps, elapsed_s=elapsed()["elapsed_s"], metrics=metrics))
    module.eval()
    return step, last_eval


def held_out_vocabulary(features: FeatureSet, size: int, always: tuple[int, ...],
                        eval_fraction: float) -> tuple[torch.Tensor, float]:
    """(draft vocabulary, its coverage): built from the training sequences' labels, measured on the
    held-out sequences the heads' accuracy is measured on.

    On the labels it was built from, the coverage says nothing (any vocabulary as large as the
    tokens seen covers 100%); on unseen text it is the share of target predictions the heads
    can draft at all.
    """
    train_pos, eval_pos = split_sequences(features, eval_fraction)
    vocab_ids = draft_vocabulary(features.labels[train_pos], size, always)
    coverage = float(torch.isin(features.labels[eval_pos].long(), vocab_ids).float().mean())
    return vocab_ids, coverage
