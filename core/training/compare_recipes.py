"""The EAGLE-3 recipe against the classic EAGLE head, at equal data and at equal CPU time (issue 28).

Both heads learn from the same teacher shards, captured once (:mod:`specplay.core.training.teacher`)
in ``<cache>/training/<target>/teacher/``: ``train`` (the target's answers to learn from) and
``heldout`` (answers no head trains on; the shipped head's data does not hold them either).
The two sets are concatenated with the held-out answers last, and each trainer is told that
share as its evaluation fraction, so it trains on the train answers only and builds the draft
vocabulary from their labels (:func:`~specplay.core.training.pipeline.held_out_vocabulary`).

Training is each recipe's own, with ``specplay train eagle``'s defaults: batch 16 windows of
128, lr 3e-4, bfloat16 matmuls where the CPU has the units, the head started from the target's
last layer; :func:`~specplay.core.training.eagle3.train_eagle3` unrolled 3 levels deep,
:func:`~specplay.core.training.eagle.train_eagle` with unroll 1. Its cost is the process's
CPU seconds (:func:`time.process_time`, both torch threads), the trainer's final held-out
check included. With ``--seconds`` and no ``--steps``, the steps are what a few timed steps
say fit in that budget (the learning-rate schedule then ends in time), and the budget stops
training in any case.

Every head is judged the same way: top-1 of its draft at each of 5 drafting levels on 256
held-out windows (the trainers' own ``accuracy``), and τ_sim (:func:`~specplay.core.training.tau.eagle_tau`:
the inference tree replayed at 600 held-out answer roots).

    python -m specplay.core.training.compare_recipes capture   # once: the shards (about an hour on two cores)
    python -m specplay.core.training.compare_recipes shipped
    python -m specplay.core.training.compare_recipes eagle3 --steps N
    python -m specplay.core.training.compare_recipes classic --steps N [--name classic-steps]
    python -m specplay.core.training.compare_recipes classic --seconds S [--name classic-time]

Each writes ``<cache>/training/<target>/compare/<name or stage>.json`` and prints it.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from specplay.core.errors import Cancelled
from specplay.core.heads import EagleHead, head_config, load_heads, shipped_path
from specplay.core.heads.eagle import init_from_target_layer
from specplay.core.heads.eagle3 import Eagle3Head
from specplay.core.models.linear import has_bf16_units
from specplay.core.training.common import TrainSettings
from specplay.core.training.eagle import EagleObjective, train_eagle
from specplay.core.training.eagle3 import Eagle3Objective, train_eagle3
from specplay.core.training.pipeline import default_workdir, held_out_vocabulary
from specplay.core.training.tau import eagle_tau
from specplay.core.training.teacher import TeacherSet, capture_teacher, corpus_sequences, default_layers

TARGET = "qwen2.5-coder-1.5b-instruct"
#: Which answers of the committed corpus (assets/training/) each split holds: the first 200 to
#: learn from, and 48 from the shipped head's own held-out tail (its last 5%, answers 1966-2073).
SPLITS = {"train": range(0, 200), "heldout": range(1966, 2014)}
TRAINING = {"batch_size": 16, "lr": 3e-4}  # specplay train eagle's defaults
WINDOW, DEPTH, LEVELS, WINDOWS, ROOTS = 128, 3, 5, 256, 600


def load_split(folder: Path) -> TeacherSet:
    shards = sorted(Path(folder).glob("teacher-*.safetensors"))
    if not shards:
        raise SystemExit(f"no teacher shards in {folder}: run `python -m specplay.core.training.compare_recipes "
                         "capture` first")
    return TeacherSet.concat([TeacherSet.load(p) for p in shards])


def capture(target) -> None:
    """Read the target's layers, final features and top-K once for each split's answers, into
    resumable shards (a stopped capture goes on where it stopped)."""
    from specplay.core.progress import log_progress
    from specplay.core.training.data import chat_prompt_ids, instruction_prompts, load_corpus
    from specplay.core.training.pipeline import shipped_corpus, target_key

    key = target_key(target.path, log_progress)
    corpus = load_corpus(shipped_corpus(target.model_id), target.model_id, key)
    prompts = instruction_prompts(max(corpus) + 1)
    layers = default_layers(target.model.cfg.num_layers)
    for name, answers in SPLITS.items():
        keys = [k for k in answers if k in corpus]
        chats = {k: chat_prompt_ids(target.tokenizer, prompts[k]) for k in keys}
        sequences, prompt_lens = corpus_sequences(corpus, chats)
        capture_teacher(target.model, sequences, prompt_lens, default_workdir(target.model_id) / "teacher" / name,
                        target_key=key, layers=layers, progress=log_progress)


class Comparison:
    """The train and held-out answers of one target (``model``: its :class:`CausalLM`), as every stage sees them."""

    def __init__(self, model, train: TeacherSet, held: TeacherSet, draft_vocab: int = 32768, window: int = WINDOW,
                 windows: int = WINDOWS, roots: int = ROOTS):
        self.model, self.train_set, self.held = model, train, held
        self.data = TeacherSet.concat([train, held])
        self.cut = train.num_tokens  # the held-out answers' first position
        self.eval_fraction = (held.starts.numel() - 1) / (self.data.starts.numel() - 1)
        self.vocab_ids, _ = held_out_vocabulary(self.data.features(), draft_vocab, tuple(model.info.eos_token_ids),
                                                self.eval_fraction)
        self.window, self.windows, self.roots = window, windows, roots

    def objective(self, head, vocab_ids: torch.Tensor, noise: float = 0.0):
        m = self.model
        lm_rows = m.lm_head_weight()[vocab_ids].float()
        if isinstance(head, Eagle3Head):
            return Eagle3Objective(head, self.data, m.embed, lm_rows, vocab_ids, m.info.vocab_size, self.window, DEPTH)
        return EagleObjective(head, self.data.features(), m.embed, lm_rows, vocab_ids, m.info.vocab_size, self.window,
                              noise)

    def judge(self, head, vocab_ids: torch.Tensor) -> dict:
        """Top-1 by drafting level on held-out windows, and τ_sim at held-out answer roots."""
        c0 = time.process_time()
        objective = self.objective(head, vocab_ids)
        starts = objective.window_starts[objective.window_starts >= self.cut]
        starts = starts[torch.randperm(starts.numel(), generator=torch.Generator().manual_seed(1))[:self.windows]]
        head.eval()
        accuracy = objective.accuracy(starts, levels=LEVELS)
        tau = eagle_tau(head, self.held, self.model.embed, self.model.lm_head_weight()[vocab_ids], vocab_ids,
                        count=self.roots)
        return {"accuracy": accuracy, "top1_by_level": [round(a, 4) for a in accuracy["top1_by_level"]],
                "tau_sim": tau["tau_sim"], "tau_sim_roots": tau["tau_sim_roots"], "eval_windows": int(starts.numel()),
                "eval_cpu_s": round(time.process_time() - c0, 1), "draft_vocab": int(vocab_ids.numel()),
                "coverage": round(float(torch.isin(self.held.labels.long(), vocab_ids).float().mean()), 4)}

    def sizes(self) -> dict:
        return {"train_answers": self.train_set.starts.numel() - 1, "train_tokens": self.train_set.num_tokens,
                "heldout_answers": self.held.starts.numel() - 1, "heldout_tokens": self.held.num_tokens}

    def shipped(self, path: Path) -> dict:
        """The head in a heads file, as it is."""
        tensors, manifest = load_heads(path, "eagle", self.model)
        vocab_ids = tensors.pop("vocab_ids")
        cfg = head_config(self.model.cfg, manifest.get("intermediate_size"))
        head = Eagle3Head(cfg, len(manifest["layers"])) if manifest.get("recipe") == "eagle3" else EagleHead(cfg)
        head.load_state_dict(tensors)
        return {"recipe": manifest.get("recipe", "classic"), "head": str(path),
                "data_tokens": manifest["data"]["total_tokens"], "steps": manifest["steps"],
                "train_wall_s": manifest["train_seconds"], "train_cpu_s": None, **self.sizes(),
                **self.judge(head, vocab_ids)}

    def trained(self, recipe: str, steps: int | None = None, seconds: float | None = None, log=print,
                **training) -> dict:
        """A head of ``recipe`` ("eagle3" or "classic") trained from the target's init on the train
        answers for ``steps`` or until ``seconds`` CPU seconds (steps then from a short timing), then judged."""
        m = self.model
        if recipe == "eagle3":
            head = Eagle3Head(head_config(m.cfg), self.data.layers.shape[1])
            head.init_from_target(m)
        else:
            head = EagleHead(head_config(m.cfg))
            init_from_target_layer(head, m.layers[-1])
        bf16 = has_bf16_units()
        settings = {**TRAINING, **training}
        per_step = None
        if steps is None:
            per_step = cpu_per_step(self.objective(copy.deepcopy(head), self.vocab_ids, noise=0.1),
                                    self.cut - self.window, settings["batch_size"], settings["lr"], bf16)
            steps = max(1, int(seconds / per_step))
            log(f"{recipe}: {per_step:.2f} CPU s a step -> {steps} steps in {seconds:.0f} CPU s")
        settings = TrainSettings(steps=steps, eval_fraction=self.eval_fraction, eval_every=steps, bf16=bf16, **settings)
        losses: list[float] = []

        def progress(p) -> None:
            losses.append(p.metrics["loss"])
            if p.step % 10 == 0 or p.step == p.total:
                log(f"{recipe} step {p.step}/{p.total} loss {p.metrics['loss']:.4f} "
                    f"{time.process_time() - c0:.0f} CPU s {p.elapsed_s:.0f} s")

        c0, w0 = time.process_time(), time.perf_counter()
        over_budget = (lambda: time.process_time() - c0 > seconds) if seconds else (lambda: False)
        lm_rows = m.lm_head_weight()[self.vocab_ids]
        try:
            if recipe == "eagle3":
                train_eagle3(self.data, head, m.embed, lm_rows, self.vocab_ids, m.info.vocab_size, settings,
                             window=self.window, depth=DEPTH, progress=progress, should_cancel=over_budget)
            else:
                train_eagle(self.data.features(), head, m.embed, lm_rows, self.vocab_ids, m.info.vocab_size, settings,
                            window=self.window, progress=progress, should_cancel=over_budget)
        except Cancelled:
            log(f"{recipe}: CPU budget spent after {len(losses)} of {steps} steps")
        k = max(1, min(10, len(losses) // 4))
        return {"recipe": recipe, "data_tokens": self.train_set.num_tokens, "steps": len(losses),
                "planned_steps": steps, "budget_cpu_s": seconds, "cpu_s_per_step_timed": per_step,
                "train_cpu_s": round(time.process_time() - c0, 3), "train_wall_s": round(time.perf_counter() - w0, 3),
                "settings": settings.to_dict(), "window": self.window, "depth": DEPTH if recipe == "eagle3" else 1,
                "loss_start": sum(losses[:k]) / k, "loss_end": sum(losses[-k:]) / k, **self.sizes(),
                **self.judge(head, self.vocab_ids)}


def cpu_per_step(objective, end: int, batch: int, lr: float, bf16: bool, tries: int = 3) -> float:
    """CPU seconds of one training step (forward, backward, AdamW) of ``objective``'s head, which
    should be a copy: it is changed. Windows start before ``end``; the first step is not counted."""
    head = objective.head
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    pool = objective.window_starts[objective.window_starts < end]
    times = []
    for _ in range(tries):
        c0 = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = objective.loss(pool[torch.randint(0, pool.numel(), (batch,))])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        times.append(time.process_time() - c0)
    return sum(times[1:]) / max(1, len(times) - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specplay.core.training.compare_recipes",
                                description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("capture", "shipped", "eagle3", "classic"))
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seconds", type=float, help="training CPU seconds (steps from a short timing unless --steps)")
    p.add_argument("--name", help="result file name without .json (default: the stage)")
    args = p.parse_args(argv)
    if args.stage in ("eagle3", "classic") and not (args.steps or args.seconds):
        p.error("training stages need --steps or --seconds")
    torch.set_num_threads(2)
    from specplay.core.models.loader import load_model

    c0, w0 = time.process_time(), time.perf_counter()
    target = load_model(TARGET, "cpu", "auto")
    model = target.model
    root = default_workdir(TARGET)
    if args.stage == "capture":
        capture(target)
        return 0
    cmp = Comparison(model, load_split(root / "teacher" / "train"), load_split(root / "teacher" / "heldout"))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.stage == "shipped":
        record = cmp.shipped(shipped_path("eagle", TARGET))
    else:
        record = cmp.trained(args.stage, args.steps, args.seconds, log=log)
    record = {"stage": args.stage, "command": "python -m specplay.core.training.compare_recipes " + " ".join(
        sys.argv[1:] if argv is None else argv), **record, "wall_s": round(time.perf_counter() - w0, 1),
        "cpu_s": round(time.process_time() - c0, 1), "date": time.strftime("%Y-%m-%d %H:%M")}
    out = root / "compare" / f"{args.name or args.stage}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
