"""The EAGLE-3 recipe against the classic EAGLE head, and Hydra heads against classic Medusa heads,
at equal data and at equal CPU time (issue 28).

Both heads learn from the same teacher shards, captured once (:mod:`specplay.core.training.teacher`)
in ``<cache>/training/<target>/teacher/``: ``train`` (the target's answers to learn from) and
``heldout`` (answers no head trains on; the shipped head's data does not hold them either).
The two sets are concatenated with the held-out answers last, and each trainer is told that
share as its evaluation fraction, so it trains on the train answers only and builds the draft
vocabulary from their labels (:func:`~specplay.core.training.common.held_out_vocabulary`).

Training is each recipe's own, with ``specplay train eagle``'s defaults: batch 16 windows of
128, lr 3e-4, bfloat16 matmuls where the CPU has the units, the head started from the target's
last layer; :func:`~specplay.core.training.eagle.train_eagle3` unrolled 3 levels deep,
:func:`~specplay.core.training.eagle.train_eagle` with unroll 1. Its cost is the process's
CPU seconds (:func:`time.process_time`, both torch threads), the trainer's final held-out
check included. With ``--seconds`` and no ``--steps``, the steps are what a few timed steps
say fit in that budget (the learning-rate schedule then ends in time), and the budget stops
training in any case.

Medusa and Hydra heads train with ``specplay train medusa``'s defaults (4 heads, batch 128
positions, lr 1e-3) for a number of steps; equal CPU time is a number of steps in proportion
to each recipe's measured CPU seconds a step.

Every EAGLE head is judged the same way: top-1 of its draft at each of 5 drafting levels on 256
held-out windows (the trainers' own ``accuracy``), and τ_sim (:func:`~specplay.core.training.tau.eagle_tau`:
the inference tree replayed at 600 held-out answer roots). Medusa and Hydra heads: each head's
top-1 on 4,096 held-out positions, and τ_sim (:func:`~specplay.core.training.tau.medusa_tau`) with
the static tree those accuracies choose, at the same 600 roots.

    python -m specplay.core.training.compare_recipes answers [--to N] [--minutes M]   # more answers in the corpus
    python -m specplay.core.training.compare_recipes agreement [--splits heldout]   # the corpus against the target
    python -m specplay.core.training.compare_recipes capture [--splits train,heldout,more,rest,late,unseen]   # the shards, once
    python -m specplay.core.training.compare_recipes own --splits heldout,probe   # the target's own answers, read too
    python -m specplay.core.training.compare_recipes shipped | shipped-medusa
    python -m specplay.core.training.compare_recipes judge --heads FILE [--held heldout-own] --splits SPLIT
    python -m specplay.core.training.compare_recipes eagle3 --steps N [--more] [--rest] [--late] [--out FILE]
    python -m specplay.core.training.compare_recipes eagle3 --steps N --splits unseen --init FILE --out FILE
    python -m specplay.core.training.compare_recipes classic --seconds S [--name classic-time]
    python -m specplay.core.training.compare_recipes medusa | hydra --steps N [--more] [--rest] [--late] [--out FILE]

A training stage with ``--init FILE`` starts from that heads file's head and draft vocabulary (a
head learnt on one storage's features, trained on for a while on another's); ``--lr`` sets the peak
learning rate (the recipe's own warms a trained head up to a rate that makes it forget first).

``answers`` adds to the committed corpus the target's greedy answers (up to :data:`ANSWER_TOKENS`
tokens, as the corpus's others) to the instruction prompts it does not answer yet, up to ``--to``
(default: the whole pool), in resumable shards in ``<cache>/training/<target>/answers-384-s0/``;
``--minutes`` ends it on time, keeping every answer finished by then. ``agreement`` reads the corpus's
answers of ``--splits`` once (teacher forcing) and counts where the target's argmax is not the
answer's next token: how far answers made on another storage are from this target's own.

``own`` answers the prompts of ``--splits`` afresh with the target itself (greedy, on this storage, up to the
same length), as the committed answers were made on another storage (the int8 target's, up to answer 2073),
in resumable shards in ``<cache>/training/<target>/own-384/``, kept as a corpus of their own beside the
committed one (``own-corpus.safetensors``), then captures each as the split ``<split>-own``: what training
stages take in ``--splits`` and ``--held`` (the split a head is judged on; default ``heldout``) like any other;
``judge`` judges a heads file (``--heads``) on ``--held`` as ``shipped`` judges the shipped ones.

Each writes ``<cache>/training/<target>/compare/<name or stage>.json`` and prints it; ``--out``
saves the trained head as a heads file (what ``--heads`` and ``assets/heads/`` take) and judges
it once more as saved (int8 rows), its manifest keeping those figures as ``as_saved``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from specplay.core.errors import Cancelled, ModelError
from specplay.core.heads import heads_manifest, load_heads, read_manifest, save_heads, shipped_path
from specplay.core.heads.eagle3 import Eagle3Head
from specplay.core.heads.hydra import HydraHeads
from specplay.core.kernels.linear import has_bf16_units
from specplay.core.training.common import TrainSettings, held_out_vocabulary
from specplay.core.training.eagle import Eagle3Objective, EagleObjective
from specplay.core.training.medusa import HydraObjective, MedusaObjective
from specplay.core.training.recipes import RECIPES, default_workdir
from specplay.core.training.tau import eagle_tau, medusa_tau
from specplay.core.training.teacher import TeacherSet, capture_teacher, corpus_sequences, default_layers

TARGET = "qwen2.5-coder-1.5b-instruct"
#: Which answers of the committed corpus (assets/training/) each split holds: the first 200 to
#: learn from, 48 from the shipped head's own held-out tail (its last 5%, answers 1966-2073), and
#: 800 more to learn from for the comparison at more data (``--more``), the 966 after them up to the
#: held-out tail (``--rest``), and every answer after the 48 (``--late``: the shipped heads' unused
#: held-out answers 2014-2073, then the GGUF target's own answers that ``answers`` added from 2074).
#: With all three, every answer of the corpus the held-out ones do not hold. ``unseen``: the late
#: answers past the 688 the heads shipped on 2026-12-06 learnt from (2014-2701), to train those on.
SPLITS = {"train": range(0, 200), "heldout": range(1966, 2014), "more": range(200, 1000), "rest": range(1000, 1966),
          "late": range(2014, 1 << 20), "unseen": range(2702, 1 << 20), "probe": range(1000, 1100)}
#: A split's name with this suffix names the target's own greedy answers to that split's prompts, made afresh on
#: its storage by the ``own`` stage (``probe``: the first 100 of ``rest``, which the EAGLE-3 head shipped on
#: 2026-12-01 never learnt from, small enough to regenerate, read and train on within an hour).
OWN = "-own"
ANSWER_TOKENS = 384  # the longest answer of the committed corpus
TRAINING = {"batch_size": 16, "lr": 3e-4}  # specplay train eagle's defaults
MEDUSA_TRAINING = {"batch_size": 128, "lr": 1e-3}  # specplay train medusa's
MEDUSA_HEADS = 4
#: The recipe (:data:`specplay.core.training.recipes.RECIPES`) each training stage runs: the classic EAGLE
#: head, EAGLE-3, classic Medusa heads, Hydra heads
STAGES = {"classic": RECIPES["eagle", "classic"], "eagle3": RECIPES["eagle", "eagle3"],
          "medusa": RECIPES["medusa", "classic"], "hydra": RECIPES["medusa", "hydra"]}
WINDOW, DEPTH, LEVELS, WINDOWS, ROOTS, POSITIONS = 128, 3, 5, 256, 600, 4096


def stage_of(kind: str, recipe: str) -> str:
    """The training stage that makes ``kind`` heads by ``recipe`` (a manifest's fields)."""
    return next(name for name, r in STAGES.items() if (r.kind, r.name) == (kind, recipe))


def load_split(*folders: Path) -> TeacherSet:
    """The shards of one split, or of several read as one (concatenated once: they may be gigabytes)."""
    shards = []
    for folder in folders:
        found = sorted(Path(folder).glob("teacher-*.safetensors"))
        if not found:
            raise SystemExit(f"no teacher shards in {folder}: run `python -m specplay.core.training.compare_recipes "
                             f"capture --splits {Path(folder).name}` first")
        shards += found
    return TeacherSet.concat([TeacherSet.load(p) for p in shards])


def committed_corpus(target) -> tuple[Path, str, dict[int, list[int]]]:
    """(the committed corpus's path, the key of the target's weights, its answers by prompt index)."""
    from specplay.core.paths import shipped_corpus
    from specplay.core.progress import log_progress
    from specplay.core.training.data import load_corpus, target_key

    key = target_key(target.path, log_progress)
    path = shipped_corpus(target.model_id)
    return path, key, load_corpus(path, target.model_id, key)


def split_keys(name: str) -> range:
    """The prompt indices of a split (``<split>-own`` answers the same prompts as ``<split>``)."""
    return SPLITS[name.removesuffix(OWN)]


def capture(target, splits: list[str]) -> None:
    """Read the target's layers, final features and top-K once for each of ``splits``' answers (the committed
    corpus's, or for a ``-own`` split the target's own, :func:`own_answers`), into resumable shards (a stopped
    capture goes on where it stopped)."""
    from specplay.core.training.data import instruction_prompts, load_corpus

    _, key, committed = committed_corpus(target)
    own = load_corpus(own_corpus_path(target), target.model_id, key)
    _capture(target, splits, key, committed, own, instruction_prompts(max(committed) + 1))


def _capture(target, splits: list[str], key: str, committed: dict[int, list[int]], own: dict[int, list[int]],
             prompts: list[str]) -> None:
    """:func:`capture` on the corpora and prompts its caller has read."""
    from specplay.core.progress import log_progress
    from specplay.core.training.data import chat_prompt_ids

    layers = default_layers(target.model.cfg.num_layers)
    for name in splits:
        corpus = own if name.endswith(OWN) else committed
        keys = [k for k in split_keys(name) if k in corpus]
        chats = {k: chat_prompt_ids(target.tokenizer, prompts[k]) for k in keys}
        sequences, prompt_lens = corpus_sequences(corpus, chats)
        capture_teacher(target.model, sequences, prompt_lens, default_workdir(target.model_id) / "teacher" / name,
                        target_key=key, layers=layers, progress=log_progress)


def own_corpus_path(target) -> Path:
    return default_workdir(target.model_id) / "own-corpus.safetensors"


def own_answers(target, splits: list[str], log=print) -> dict:
    """The target's own greedy answers to the prompts the committed corpus answers in ``splits``, made afresh
    (resumable shards in ``<cache>/training/<target>/own-384/``) and kept in :func:`own_corpus_path`; then
    captured as the splits ``<split>-own``. How far they are from the committed ones: how many answers are the
    same throughout, and where the others first part from them (answer tokens in; the texts differ from there)."""
    from specplay.core.progress import log_progress
    from specplay.core.training.data import (chat_prompt_ids, generate_answers, instruction_prompts, load_corpus,
                                             save_corpus)

    _, key, committed = committed_corpus(target)
    keys = sorted({k for name in splits for k in split_keys(name) if k in committed})
    prompts = instruction_prompts(max(committed) + 1)
    shards = default_workdir(target.model_id) / f"own-{ANSWER_TOKENS}"
    log(f"answering {len(keys)} prompts of {', '.join(splits)} afresh with the target")
    generate_answers(target.model, target.tokenizer, prompts, ANSWER_TOKENS, shards, target_key=key, only=keys,
                     progress=log_progress)
    path = own_corpus_path(target)
    save_corpus(shards, path, target.model_id, key)
    own = load_corpus(path, target.model_id, key)
    _capture(target, [name + OWN for name in splits], key, committed, own, prompts)
    parted = []
    for k in keys:
        a, b = committed[k], own[k]
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            parted.append(at - len(chat_prompt_ids(target.tokenizer, prompts[k])))
    parted.sort()
    return {"corpus": str(path), "answers": len(keys), "same_answers": len(keys) - len(parted),
            "first_difference": parted, "first_difference_median": parted[len(parted) // 2] if parted else None}


def extend_corpus(target, to: int | None = None, minutes: float | None = None, log=print) -> dict:
    """Generate the target's greedy answers to the instruction prompts below ``to`` (default: all of them) that
    its committed corpus does not hold, and add them to it; stop after ``minutes`` with what is finished.
    The shards are those of ``specplay train``'s answers of the same length (:func:`answers_dir`)."""
    from specplay.core.progress import log_progress
    from specplay.core.training.data import (DataSettings, answers_dir, generate_answers, instruction_prompts,
                                             save_corpus)

    path, key, before = committed_corpus(target)
    shards = answers_dir(default_workdir(target.model_id), DataSettings(answer_tokens=ANSWER_TOKENS))
    prompts = instruction_prompts(to if to is not None else 1 << 30)
    missing = [k for k in range(len(prompts)) if k not in before]
    deadline = time.monotonic() + minutes * 60 if minutes else None
    log(f"{len(before)} answers in {path}; answering {len(missing)} more of the pool's {len(prompts)} prompts")
    try:
        generate_answers(target.model, target.tokenizer, prompts, ANSWER_TOKENS, shards, target_key=key,
                         only=missing, progress=log_progress,
                         should_cancel=lambda: deadline is not None and time.monotonic() > deadline)
    except Cancelled:
        log(f"{minutes:g} minutes spent: the answers finished so far are kept")
    held = save_corpus(shards, path, target.model_id, key)
    return {"corpus": str(path), "answers_before": len(before), "answers": held, "added": held - len(before),
            "pool": len(prompts)}


def greedy_agreement(target, corpus: dict[int, list[int]], keys) -> dict:
    """Where the target's greedy choice leaves the corpus's answers to the prompts at ``keys``: the share of
    answer positions whose argmax is not the answer's next token, how many answers never leave it, and
    where the others first do (answer tokens in)."""
    from specplay.core.training.data import chat_prompt_ids, instruction_prompts, read_once

    keys = [k for k in keys if k in corpus]
    prompts = instruction_prompts(max(keys) + 1) if keys else []
    positions = differ = 0
    first = []
    for k in keys:
        seq = corpus[k]
        start = len(chat_prompt_ids(target.tokenizer, prompts[k]))
        _, labels = read_once(target.model, seq[:-1])
        wrong = [i for i, (got, want) in enumerate(zip(labels[start - 1:].tolist(), seq[start:])) if got != want]
        positions += len(seq) - start
        differ += len(wrong)
        if wrong:
            first.append(wrong[0])
    first.sort()
    return {"answers": len(keys), "answer_tokens": positions, "differing_share": round(differ / max(positions, 1), 4),
            "whole_answers": len(keys) - len(first), "first_difference": first,
            "first_difference_median": first[len(first) // 2] if first else None}


class Comparison:
    """The train and held-out answers of one target (``model``: its :class:`CausalLM`), as every stage sees them."""

    def __init__(self, model, train: TeacherSet, held: TeacherSet, draft_vocab: int = 32768, window: int = WINDOW,
                 windows: int = WINDOWS, roots: int = ROOTS):
        self.model, self.held = model, held
        self.data = TeacherSet.concat([train, held])  # the train set itself is not kept: it may be gigabytes
        self.train_answers = train.starts.numel() - 1
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
                "tau_sim": tau["tau_sim"], "tau_sim_se": tau["tau_sim_se"], "tau_sim_roots": tau["tau_sim_roots"],
                "eval_windows": int(starts.numel()),
                "eval_cpu_s": round(time.process_time() - c0, 1), **self.vocab_fields(vocab_ids)}

    def vocab_fields(self, vocab_ids: torch.Tensor) -> dict:
        """The draft vocabulary's size and the share of held-out labels it holds."""
        return {"draft_vocab": int(vocab_ids.numel()),
                "coverage": round(float(torch.isin(self.held.labels.long(), vocab_ids).float().mean()), 4)}

    def sizes(self) -> dict:
        return {"train_answers": self.train_answers, "train_tokens": self.cut,
                "heldout_answers": self.held.starts.numel() - 1, "heldout_tokens": self.held.num_tokens}

    def _read(self, path: Path, kind: str):
        """(the head or heads in a heads file of ``kind``, its draft vocabulary, its manifest)."""
        tensors, manifest = load_heads(path, kind, self.model)
        vocab_ids = tensors.pop("vocab_ids")
        recipe = RECIPES[kind, manifest.get("recipe", "classic")]
        head = recipe.start(self.model, num_heads=manifest.get("num_heads", MEDUSA_HEADS),
                            intermediate=manifest.get("intermediate_size"), init="none",
                            layers=tuple(manifest.get("layers", ())))
        head.load_state_dict(tensors)
        return head, vocab_ids, manifest

    def start_from(self, path: Path, recipe: str) -> tuple[torch.nn.Module, dict]:
        """(the head or heads of a heads file of ``recipe``, what they had learnt as its manifest says), to
        train on from there (:meth:`trained`'s ``start``): the comparison then trains and judges on that
        file's draft vocabulary. A head learnt on another storage's features adapts to this target's in a
        fraction of its first training."""
        kind = STAGES[recipe].kind
        head, vocab_ids, manifest = self._read(path, kind)
        made_by = stage_of(kind, manifest.get("recipe", "classic"))
        if made_by != recipe:
            raise ValueError(f"{path} holds {made_by} heads, not {recipe} heads")
        self.vocab_ids = vocab_ids
        return head, {"file": Path(path).name, "feature_dtype": manifest.get("feature_dtype"),
                      "answers": (manifest.get("data") or {}).get("answers"), "steps": manifest.get("steps")}

    def shipped(self, path: Path, kind: str = "eagle") -> dict:
        """The head (``kind`` "eagle") or heads ("medusa") in a heads file, as they are."""
        head, vocab_ids, manifest = self._read(path, kind)
        recipe = stage_of(kind, manifest.get("recipe", "classic"))
        judged = self.judge(head, vocab_ids) if kind == "eagle" else self.judge_medusa(head, vocab_ids)
        return {"recipe": recipe, "head": str(path), "data_tokens": manifest["data"]["total_tokens"],
                "steps": manifest["steps"], "train_wall_s": manifest["train_seconds"], "train_cpu_s": None,
                **self.sizes(), **judged}

    def trained(self, recipe: str, steps: int | None = None, seconds: float | None = None, log=print,
                start=None, **training) -> tuple[torch.nn.Module, dict]:
        """(head, record): a head of ``recipe`` (:data:`STAGES`) trained on the train answers for ``steps``
        or until ``seconds`` CPU seconds (steps then from a short timing; EAGLE recipes only), and its judging.
        Heads start from ``start`` (:meth:`start_from`; trained in place), else EAGLE heads from the
        target's last layer, Medusa and Hydra heads as their trainers start them."""
        r = STAGES[recipe]
        kind = r.kind
        bf16 = has_bf16_units()
        settings = {**(TRAINING if kind == "eagle" else MEDUSA_TRAINING), **training}
        head = start if start is not None else r.start(self.model, num_heads=MEDUSA_HEADS,
                                                       layers=default_layers(self.model.cfg.num_layers))
        per_step = None
        if steps is None:
            if kind != "eagle":
                raise ValueError(f"{recipe} heads train for a number of steps, not a CPU budget")
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
        try:
            r.train(head, self.data, self.model, self.vocab_ids, settings, window=self.window,
                    unroll=DEPTH if recipe == "eagle3" else 1, progress=progress, should_cancel=over_budget)
        except Cancelled:
            log(f"{recipe}: CPU budget spent after {len(losses)} of {steps} steps")
        k = max(1, min(10, len(losses) // 4))
        judged = self.judge(head, self.vocab_ids) if kind == "eagle" else self.judge_medusa(head, self.vocab_ids)
        return head, {"recipe": recipe, "data_tokens": self.cut, "steps": len(losses),
                "planned_steps": steps, "budget_cpu_s": seconds, "cpu_s_per_step_timed": per_step,
                "train_cpu_s": round(time.process_time() - c0, 3), "train_wall_s": round(time.perf_counter() - w0, 3),
                "settings": settings.to_dict(), "window": self.window if kind == "eagle" else None,
                "depth": DEPTH if recipe == "eagle3" else 1,
                "loss_start": sum(losses[:k]) / k, "loss_end": sum(losses[-k:]) / k, **self.sizes(), **judged}

    def judge_medusa(self, heads, vocab_ids: torch.Tensor) -> dict:
        """Each head's top-1 (its token right, the path before it right) on held-out positions, and
        τ_sim with the static tree those accuracies choose, at held-out answer roots."""
        c0 = time.process_time()
        m = self.model
        lm_rows = m.lm_head_weight()[vocab_ids].float()
        if isinstance(heads, HydraHeads):
            objective = HydraObjective(heads, self.data, m.embed, lm_rows, vocab_ids, m.info.vocab_size)
        else:
            objective = MedusaObjective(heads, self.data.features(), lm_rows, vocab_ids, m.info.vocab_size)
        positions = torch.arange(self.cut, self.data.num_tokens)
        positions = positions[torch.randperm(positions.numel(), generator=torch.Generator().manual_seed(1))[:POSITIONS]]
        heads.eval()
        accuracy = objective.accuracy(positions)
        tau = medusa_tau(heads, accuracy, self.held, m.embed, lm_rows, vocab_ids, count=self.roots)
        return {"top1_by_head": [round(a[0], 4) for a in accuracy], "top5_by_head": [round(sum(a[:5]), 4) for a in accuracy],
                "accuracy": [[round(a, 4) for a in row] for row in accuracy],
                "tau_sim": tau["tau_sim"], "tau_sim_se": tau["tau_sim_se"], "tau_sim_roots": tau["tau_sim_roots"],
                "tau_sim_tree": tau["tau_sim_tree"],
                "eval_positions": int(positions.numel()), "eval_cpu_s": round(time.process_time() - c0, 1),
                **self.vocab_fields(vocab_ids)}


def save_trained(path: Path, head, record: dict, model, vocab_ids: torch.Tensor, model_id: str,
                 layers: tuple[int, ...] = ()) -> None:
    """A heads file the eagle or medusa method reads, its manifest saying how it was made and how it
    judged; ``layers``: the target layers an EAGLE-3 head's data was read from."""
    r = STAGES[record["recipe"]]
    data = {"total_tokens": record["data_tokens"], "answers": record["train_answers"],
            "sources": "the target's greedy answers in the committed corpus (assets/training/), "
                       "read once for its layers, final features and top-K"}
    manifest = heads_manifest(r.kind, r.name, target=model_id, model=model, vocab_ids=vocab_ids,
                              coverage=record["coverage"], command=record["command"], data=data,
                              settings=record["settings"], steps=record["steps"], train_seconds=record["train_wall_s"],
                              train_cpu_s=record["train_cpu_s"], tau_sim=round(record["tau_sim"], 4),
                              tau_sim_se=None if record["tau_sim_se"] is None else round(record["tau_sim_se"], 4),
                              tau_sim_roots=record["tau_sim_roots"],
                              heldout={"answers": record["heldout_answers"], "tokens": record["heldout_tokens"]})
    manifest.update(r.fields(head, record["accuracy"], window=record["window"], unroll=record["depth"], init="target",
                             layers=layers))
    if r.kind == "medusa":
        manifest["tau_sim_tree"] = record["tau_sim_tree"]
    if "init" in record:  # the heads file it started from (--init)
        manifest["init"] = record["init"]
    if "as_saved" in record:  # how the file itself judges, its int8 rows included
        manifest["as_saved"] = record["as_saved"]
    save_heads(path, {**head.state_dict(), "vocab_ids": vocab_ids}, manifest)


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
    p.add_argument("stage", choices=("answers", "agreement", "capture", "own", "shipped", "shipped-medusa", "judge",
                                     *STAGES))
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seconds", type=float, help="training CPU seconds (steps from a short timing unless --steps; "
                   "EAGLE recipes)")
    p.add_argument("--name", help="result file name without .json (default: the stage)")
    p.add_argument("--to", type=int, help="answers: answer the pool's prompts below this index (default: all)")
    p.add_argument("--minutes", type=float, help="answers: stop after this long, keeping the finished answers")
    p.add_argument("--splits", help="capture: the splits to read (default train,heldout); agreement: the splits to "
                   "judge (default heldout); training stages: the splits to train on, instead of train and the "
                   "flags' (a head trained on from --init needs no answers it learnt from); own: the splits to "
                   "answer afresh; of %s, each also as <split>%s (the target's own answers, made by own)"
                   % (", ".join(SPLITS), OWN))
    p.add_argument("--heads", type=Path, help="judge: the heads file to judge (its manifest names its kind)")
    p.add_argument("--held", default="heldout", choices=("heldout", "heldout" + OWN),
                   help="training stages, shipped and judge: the held-out answers to judge on (default heldout)")
    p.add_argument("--more", action="store_true", help="train on the 'more' split too (capture it first)")
    p.add_argument("--rest", action="store_true", help="train on the 'rest' split too (capture it first)")
    p.add_argument("--late", action="store_true", help="train on the 'late' split too (capture it first)")
    p.add_argument("--out", type=Path, help="training stages: save the head there as a heads file (int8 rows, as "
                   "shipped) and judge it once more as saved")
    p.add_argument("--lr", type=float, help="training stages: the peak learning rate (default: the recipe's; a "
                   "head trained on from --init keeps more of what it learnt at a lower one)")
    p.add_argument("--init", type=Path, help="training stages: start from this heads file's head (of the stage's "
                   "recipe) and its draft vocabulary, instead of afresh")
    args = p.parse_args(argv)
    if args.stage in STAGES and not (args.steps or args.seconds):
        p.error("training stages need --steps or --seconds")
    if args.stage in STAGES and STAGES[args.stage].kind == "medusa" and not args.steps:
        p.error(f"{args.stage} trains for --steps")
    named = (args.splits or ("heldout" if args.stage == "agreement" else "train,heldout")).split(",")
    plain = args.stage in ("own", "agreement")  # stages that read the committed answers' splits only
    unknown = {name for name in named if name.removesuffix(OWN) not in SPLITS or (plain and name.endswith(OWN))}
    if unknown:
        p.error(f"unknown split {', '.join(sorted(unknown))}: the splits are {', '.join(SPLITS)}"
                + ("" if plain else f", each also as <split>{OWN}"))
    if args.stage == "own" and not args.splits:
        p.error("own answers the prompts of --splits")
    if args.stage == "judge":
        if not args.heads:
            p.error("judge needs --heads FILE")
        try:
            judged = read_manifest(args.heads)["kind"]
        except ModelError as exc:
            p.error(str(exc))
    if args.stage in STAGES and args.splits and any(name.removesuffix(OWN) == "heldout" for name in named):
        p.error("the held-out answers judge the heads: train on other splits")
    torch.set_num_threads(2)
    from specplay.core.models.loader import load_model

    c0, w0 = time.process_time(), time.perf_counter()
    target = load_model(TARGET, "cpu", "auto")
    model = target.model
    root = default_workdir(TARGET)
    if args.stage == "answers":
        record = {"stage": "answers", **extend_corpus(target, args.to, args.minutes, log=print),
                  "wall_s": round(time.perf_counter() - w0, 1)}
        print(json.dumps(record))
        return 0
    if args.stage == "agreement":
        _, _, corpus = committed_corpus(target)
        record = {"stage": "agreement", "splits": named, "storage": target.model.storage,
                  **greedy_agreement(target, corpus, [k for name in named for k in SPLITS[name]]),
                  "wall_s": round(time.perf_counter() - w0, 1)}
        print(json.dumps(record))
        return 0
    if args.stage == "capture":
        capture(target, named)
        return 0
    if args.stage == "own":
        record = {"stage": "own", "splits": named, "storage": target.model.storage,
                  **own_answers(target, named, log=print), "wall_s": round(time.perf_counter() - w0, 1)}
        print(json.dumps(record))
        return 0
    splits = (tuple(named) if (args.stage in STAGES or args.stage == "judge") and args.splits else
              ("train",) + tuple(name for name in ("more", "rest", "late") if getattr(args, name)))
    cmp = Comparison(model, load_split(*(root / "teacher" / name for name in splits)),
                     load_split(root / "teacher" / args.held))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    command = "python -m specplay.core.training.compare_recipes " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.stage.startswith("shipped"):
        kind = "medusa" if args.stage == "shipped-medusa" else "eagle"
        record = cmp.shipped(shipped_path(kind, TARGET), kind)
    elif args.stage == "judge":
        record = cmp.shipped(args.heads, judged)
    else:
        start, origin = cmp.start_from(args.init, args.stage) if args.init else (None, None)
        head, record = cmp.trained(args.stage, args.steps, args.seconds, log=log, start=start,
                                   **({"lr": args.lr} if args.lr else {}))
        if origin:  # what the head started from: the file, and what it had learnt
            record["init"] = origin
        if args.out:
            save_trained(args.out, head, {**record, "command": command}, model, cmp.vocab_ids, TARGET,
                         default_layers(model.cfg.num_layers))  # the layers capture() read
            saved = cmp.shipped(args.out, STAGES[args.stage].kind)
            record["as_saved"] = {k: saved[k] for k in ("tau_sim", "tau_sim_se", "top1_by_level", "top1_by_head")
                                  if k in saved}
            # Saved again with those figures in its manifest: the same rows, since rounding them is deterministic.
            save_trained(args.out, head, {**record, "command": command}, model, cmp.vocab_ids, TARGET,
                         default_layers(model.cfg.num_layers))
    record = {"stage": args.stage, "command": command, **record, "wall_s": round(time.perf_counter() - w0, 1),
        "cpu_s": round(time.process_time() - c0, 1), "date": time.strftime("%Y-%m-%d %H:%M")}
    out = root / "compare" / f"{args.name or args.stage}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
