"""``specplay train eagle|medusa [--recipe R]``: one way to train draft heads, whichever the recipe.

A recipe (:data:`RECIPES`) says what its heads learn from, how they start, how they train and
what their manifest says of them. The classic EAGLE and Medusa recipes learn from the target's
final features and argmax (:func:`feature_data`); EAGLE-3 and Hydra from what it knows beyond
them, a low, a middle and a high layer and its top-K distribution (:func:`teacher_data`), both
over the same texts: standard-library source and the target's own answers (read from the corpus
where it holds them). :func:`train_heads` runs every recipe the same way: the data, the draft
vocabulary from the training answers' labels, the training (resumed from a checkpoint in the
work folder where it belongs to this training), τ_sim on the held-out answers at each evaluation
(:mod:`specplay.core.training.tau`), and a heads file with its manifest. The recipe comparison
(:mod:`specplay.core.training.compare_recipes`) starts, trains and describes heads through the
same recipes.

Everything is cached in a work folder (answers, feature shards, checkpoints), so an interrupted
run resumes where it stopped (``--resume`` for the training itself).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specplay.core.heads import EagleHead, MedusaHeads, head_config, heads_manifest, save_heads
from specplay.core.heads.eagle import init_from_target_layer
from specplay.core.heads.eagle3 import Eagle3Head
from specplay.core.heads.hydra import HydraHeads
from specplay.core.paths import cache_dir, data_dir, shipped_corpus
from specplay.core.progress import Progress
from specplay.core.training.common import ProgressFn, TrainProgress, TrainSettings, held_out_vocabulary
from specplay.core.training.data import (DataSettings, FeatureSet, answers_dir, chat_prompt_ids, code_sequences,
                                         extract_features, generate_answers, instruction_prompts, load_corpus,
                                         target_key, usable_answer)
from specplay.core.training.eagle import train_eagle, train_eagle3
from specplay.core.training.medusa import train_hydra, train_medusa
from specplay.core.training.tau import eagle_tau, medusa_tau
from specplay.core.training.teacher import TeacherSet, capture_teacher, default_layers

log = logging.getLogger(__name__)

TrainingData = FeatureSet | TeacherSet


def default_workdir(target_spec: str) -> Path:
    return cache_dir() / "training" / Path(target_spec).name


def default_output(kind: str, target_spec: str) -> Path:
    return data_dir() / "heads" / f"{kind}-{Path(target_spec).name}.safetensors"


def _features(data: TrainingData) -> FeatureSet:
    """The final features and argmax of ``data``, what the classic recipes read."""
    return data.features() if isinstance(data, TeacherSet) else data


def _rounded(values):
    return [_rounded(v) for v in values] if isinstance(values, list) else round(values, 4)


@dataclass(frozen=True)
class Recipe:
    """How one kind of heads (``kind``: the method that runs them) is trained by one recipe
    (``name``: what the manifest says)."""

    kind: str  # "eagle" or "medusa"
    name: str  # "classic", "eagle3" or "hydra"

    @property
    def teacher(self) -> bool:
        """Whether the heads learn from the target's layers and distribution (a :class:`TeacherSet`)."""
        return self.name != "classic"

    def layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers the recipe's data reads (EAGLE-3's fused feature), besides the final one."""
        return default_layers(num_layers) if self.name == "eagle3" else ()

    def start(self, model, *, num_heads: int = 4, intermediate: int | None = None, init: str = "target",
              layers: tuple[int, ...] = ()) -> torch.nn.Module:
        """New heads for ``model`` (the target's :class:`CausalLM`); an EAGLE head starts as the target's last
        layer where ``init`` is "target"."""
        if self.kind == "medusa":
            return (HydraHeads if self.name == "hydra" else MedusaHeads)(model.info.hidden_size, num_heads)
        cfg = head_config(model.cfg, intermediate)
        head = Eagle3Head(cfg, len(layers)) if self.name == "eagle3" else EagleHead(cfg)
        if init == "target":
            if self.name == "eagle3":
                head.init_from_target(model)
            else:
                init_from_target_layer(head, model.layers[-1])
        return head

    def train(self, head: torch.nn.Module, data: TrainingData, model, vocab_ids: torch.Tensor,
              settings: TrainSettings, *, window: int = 128, unroll: int = 1, teacher_weight: float = 1.0,
              held: TeacherSet | None = None, workdir: Path | None = None, identity: dict | None = None,
              progress: ProgressFn | None = None, should_cancel: Callable[[], bool] = lambda: False,
              resume: bool = False) -> tuple[dict, int]:
        """Train ``head`` in place on ``data``; return (its last held-out evaluation, steps). The evaluation
        holds ``accuracy`` (a Medusa table of top-R hits per head, or EAGLE's ``top1``/``top5``/
        ``top1_by_level``) and, where ``held`` answers are given, τ_sim at their roots."""
        lm_rows = model.lm_head_weight()[vocab_ids]
        table = (vocab_ids, model.info.vocab_size)
        run = dict(workdir=workdir, progress=progress, should_cancel=should_cancel, resume=resume, identity=identity)
        if self.kind == "medusa":
            tau = (lambda h, acc: medusa_tau(h, acc, held, model.embed, lm_rows, vocab_ids)) if held else None
            if self.name == "hydra":
                _, result, steps = train_hydra(data, model.embed, lm_rows, *table, len(head.blocks), settings,
                                               teacher_weight=teacher_weight, tau_sim=tau, heads=head, **run)
                return result, steps
            last: dict = {}
            keep = (lambda h, acc: last.update(tau(h, acc)) or last) if tau else None
            _, accuracy, steps = train_medusa(_features(data), lm_rows, *table, len(head.blocks), settings,
                                              tau_sim=keep, heads=head, **run)
            return {"accuracy": accuracy, **last}, steps
        tau = (lambda h: eagle_tau(h, held, model.embed, lm_rows, vocab_ids)) if held else None
        if self.name == "eagle3":
            result, steps = train_eagle3(data, head, model.embed, lm_rows, *table, settings, window=window,
                                         depth=unroll, teacher_weight=teacher_weight, tau_sim=tau, **run)
        else:
            result, steps = train_eagle(_features(data), head, model.embed, lm_rows, *table, settings, window=window,
                                        unroll=unroll, tau_sim=tau, **run)
        accuracy = {k: result[k] for k in ("top1", "top5", "top1_by_level") if k in result}
        return {**result, "accuracy": accuracy}, steps

    def fields(self, head: torch.nn.Module, accuracy, *, window: int, unroll: int, init,
               layers: tuple[int, ...]) -> dict:
        """What a manifest says of heads of this recipe: their shape and their held-out ``accuracy``."""
        if self.kind == "medusa":
            return {"num_heads": len(head.blocks), "accuracy": _rounded(accuracy),
                    "top1": [round(row[0], 4) for row in accuracy],
                    "top5": [round(sum(row[:5]), 4) for row in accuracy]}
        fields = {"intermediate_size": head.cfg.intermediate_size, "window": window, "unroll": unroll, "init": init,
                  "accuracy": {k: _rounded(v) for k, v in accuracy.items()}}
        return {**fields, "layers": list(layers)} if self.name == "eagle3" else fields


#: Every recipe, by (kind of heads, recipe name)
RECIPES = {(r.kind, r.name): r for r in (Recipe("eagle", "classic"), Recipe("eagle", "eagle3"),
                                         Recipe("medusa", "classic"), Recipe("medusa", "hydra"))}


def recipe_names(kind: str) -> tuple[str, ...]:
    return tuple(name for k, name in RECIPES if k == kind)


def feature_data(target, settings: DataSettings, workdir: Path, progress: Progress,
                 should_cancel: Callable[[], bool], corpus: Path | None = None) -> tuple[FeatureSet, dict]:
    """Standard-library source and the target's answers, with the target's final features: the
    classic recipes' data.

    Answers found in ``corpus`` (default: the project's, :func:`shipped_corpus`) are read
    instead of generated. What the work folder holds is used only where it was made by these
    weights (:func:`target_key`) and, for answers, for these instructions."""
    workdir.mkdir(parents=True, exist_ok=True)
    key = target_key(target.path, progress)
    sequences = code_sequences(target.tokenizer, settings.code_tokens, settings.seq_len, settings.seed)
    code = extract_features(target.model, sequences, workdir / f"features-{settings.key()}", target_key=key,
                            progress=progress, should_cancel=should_cancel)
    parts = [code]
    answers = None
    if settings.answers > 0:
        prompts = instruction_prompts(settings.answers, settings.seed)
        started = time.perf_counter()
        known = load_corpus(corpus or shipped_corpus(target.model_id), target.model_id, key)
        answers = generate_answers(target.model, target.tokenizer, prompts, settings.answer_tokens,
                                   answers_dir(workdir, settings), target_key=key, slots=settings.slots,
                                   corpus=known, progress=progress, should_cancel=should_cancel)
        parts.append(answers)
        log.info("answers ready in %.0f s", time.perf_counter() - started)
    features = FeatureSet.concat(parts)
    n_answers = 0 if answers is None else answers.starts.numel() - 1
    stats = {"code_tokens": code.num_tokens, "answer_tokens": features.num_tokens - code.num_tokens,
             "answers": n_answers, "sequences": features.starts.numel() - 1, "total_tokens": features.num_tokens,
             "sources": "Python standard library source; the target's greedy answers to instructions written "
                        "from the standard library (functions, classes, function bodies, modules, reference topics)"}
    return features, stats


def teacher_data(target, data: DataSettings, workdir: Path, progress: Progress, should_cancel: Callable[[], bool],
                 corpus: Path | None, layers: tuple[int, ...]) -> tuple[TeacherSet, dict]:
    """The texts of :func:`feature_data`, read by the target with its ``layers`` and top-K: the EAGLE-3
    and Hydra recipes' data.

    Answers come from the corpus where it holds them in full; where it does not, they are
    generated as the classic recipes' are (and then read once more, for their layers)."""
    key = target_key(target.path, progress)
    code = code_sequences(target.tokenizer, data.code_tokens, data.seq_len, data.seed)
    sequences, prompt_lens = list(code), [0] * len(code)
    if data.answers > 0:
        texts = instruction_prompts(data.answers, data.seed)
        prompts = [chat_prompt_ids(target.tokenizer, p) for p in texts]
        known = load_corpus(corpus or shipped_corpus(target.model_id), target.model_id, key)
        stop = set(target.model.info.eos_token_ids)
        answers = [usable_answer(known[k], ids, data.answer_tokens, stop) if k in known else None
                   for k, ids in enumerate(prompts)]
        if any(a is None for a in answers):
            made = generate_answers(target.model, target.tokenizer, texts, data.answer_tokens,
                                    answers_dir(workdir, data), target_key=key, slots=data.slots, corpus=known,
                                    progress=progress, should_cancel=should_cancel)
            bounds = made.starts.tolist()
            answers = [made.tokens[a:b].tolist() + [int(made.labels[b - 1])] for a, b in zip(bounds[:-1], bounds[1:])]
            prompt_of = {tuple(p): len(p) for p in prompts}
            prompt_lens += [next(n for p, n in prompt_of.items() if tuple(a[:n]) == p) for a in answers]
        else:
            prompt_lens += [len(p) for p in prompts]
        sequences += [a[:-1] for a in answers]  # the last token is the last position's label
    teacher = capture_teacher(target.model, sequences, prompt_lens, workdir / "teacher", target_key=key,
                              layers=layers, progress=progress, should_cancel=should_cancel)
    n_code = sum(len(s) for s in code)
    stats = {"code_tokens": n_code, "answer_tokens": teacher.num_tokens - n_code,
             "answers": len(sequences) - len(code), "sequences": len(sequences), "total_tokens": teacher.num_tokens,
             "sources": "Python standard library source; the target's greedy answers to instructions written "
                        "from the standard library, read once more by the target for its layers and top-K"}
    return teacher, stats


def prepare_data(recipe: Recipe, target, data: DataSettings, workdir: Path, progress: Progress,
                 should_cancel: Callable[[], bool], corpus: Path | None = None) -> tuple[TrainingData, dict]:
    """The data ``recipe`` learns from (``specplay train --data-only`` makes it and stops), and what it holds."""
    if recipe.teacher:
        return teacher_data(target, data, workdir, progress, should_cancel, corpus,
                            recipe.layers(target.model.cfg.num_layers))
    return feature_data(target, data, workdir, progress, should_cancel, corpus)


def held_out(data: TrainingData, eval_fraction: float, prompts: list[list[int]]) -> TeacherSet:
    """The held-out sequences (the last ``eval_fraction`` of them,
    :func:`specplay.core.training.common.split_sequences`) as τ_sim reads them: their final features and
    where each answer begins (from the data where it knows, else the chat prompt it starts with; none
    for source text)."""
    n_seq = data.starts.numel() - 1
    keep = list(range(n_seq - max(1, int(round(n_seq * eval_fraction))), n_seq))
    part = data.sequences(keep)
    if isinstance(part, TeacherSet):
        return part
    lens = []
    for i in range(len(keep)):
        a, b = int(part.starts[i]), int(part.starts[i + 1])
        seq = part.tokens[a:b].tolist()
        lens.append(next((len(p) for p in prompts if seq[:len(p)] == p), 0))
    n = part.num_tokens
    return TeacherSet(tokens=part.tokens, labels=part.labels, final=part.features,
                      layers=part.features.new_zeros(n, 0, part.features.shape[1]),
                      top_ids=torch.zeros(n, 0, dtype=torch.int32), top_logp=torch.zeros(n, 0, dtype=torch.float16),
                      starts=part.starts, prompt_lens=torch.tensor(lens, dtype=torch.long))


def tau_fields(result: dict) -> dict:
    """What the manifest keeps of an evaluation's τ_sim."""
    tau = result.get("tau_sim")
    se = result.get("tau_sim_se")
    return {"tau_sim": None if tau is None else round(tau, 3), "tau_sim_se": None if se is None else round(se, 3),
            "tau_sim_roots": result.get("tau_sim_roots", 0),
            "tau_sim_tree": result.get("tau_sim_tree")}


def train_heads(kind: str, target, data: DataSettings, settings: TrainSettings, *, recipe: str = "classic",
                num_heads: int = 4, draft_vocab: int = 32768, intermediate: int | None = None, window: int = 128,
                unroll: int = 1, init: str = "target", teacher_weight: float = 1.0, corpus: Path | None = None,
                workdir: Path | None = None, out: Path | None = None, resume: bool = False, command: str = "",
                progress: Progress = lambda s, f: None, on_step: ProgressFn | None = None,
                should_cancel: Callable[[], bool] = lambda: False) -> tuple[Path, dict]:
    """Build ``recipe``'s data, train ``kind`` ("medusa" or "eagle") heads for ``target``, save them;
    return (path, manifest)."""
    if (kind, recipe) not in RECIPES:
        raise ValueError(f"no {recipe} recipe for {kind} heads (recipes: {', '.join(recipe_names(kind))})")
    r = RECIPES[kind, recipe]
    trained = {"seconds": 0.0}  # the training loop's time, earlier sessions of a resumed run included

    def step_done(p: TrainProgress) -> None:
        trained["seconds"] = p.elapsed_s
        if on_step:
            on_step(p)

    workdir = workdir or default_workdir(target.model_id)
    out = out or default_output(kind, target.model_id)
    model = target.model
    layers = r.layers(model.cfg.num_layers)
    training, stats = prepare_data(r, target, data, workdir, progress, should_cancel, corpus)
    vocab_ids, coverage = held_out_vocabulary(_features(training), draft_vocab, tuple(model.info.eos_token_ids),
                                              settings.eval_fraction)
    prompts = [chat_prompt_ids(target.tokenizer, p) for p in instruction_prompts(data.answers, data.seed)] \
        if stats.get("answers") and not r.teacher else []  # where each held-out answer begins: drafting starts there
    held = held_out(training, settings.eval_fraction, prompts)
    # Which training a checkpoint in the work folder must belong to to be resumed: these weights, this
    # data and vocabulary, heads of this shape (the folder may hold another target's training). How long
    # and how fast to train may change between sessions.
    identity = {"kind": kind, "recipe": recipe, "target": target_key(target.path, progress),
                "code_tokens": data.code_tokens, "answers": data.answers, "answer_tokens": data.answer_tokens,
                "seq_len": data.seq_len, "data_seed": data.seed, "draft_vocab": draft_vocab,
                "eval_fraction": settings.eval_fraction, "layers": list(layers)}
    if r.teacher:
        identity["teacher_weight"] = teacher_weight
    head = r.start(model, num_heads=num_heads, intermediate=intermediate, init=init, layers=layers)
    if kind == "medusa":
        identity["num_heads"] = num_heads
    else:
        identity.update(intermediate_size=head.cfg.intermediate_size, window=window, unroll=unroll, init=init)
    progress(f"Training {kind} ({recipe}) on {training.num_tokens:,} tokens", None)
    result, steps = r.train(head, training, model, vocab_ids, settings, window=window, unroll=unroll,
                            teacher_weight=teacher_weight, held=held, workdir=workdir, identity=identity,
                            progress=step_done, should_cancel=should_cancel, resume=resume)
    manifest = heads_manifest(kind, recipe, target=target.model_id, model=model, vocab_ids=vocab_ids,
                              coverage=round(coverage, 4), command=command, data=stats, settings=settings.to_dict(),
                              **({"teacher_weight": teacher_weight} if r.teacher else {}))
    manifest.update(**r.fields(head, result["accuracy"], window=window, unroll=unroll, init=init, layers=layers),
                    **tau_fields(result), steps=steps, train_seconds=round(trained["seconds"], 1))
    save_heads(out, {**head.state_dict(), "vocab_ids": vocab_ids}, manifest)
    return out, manifest
