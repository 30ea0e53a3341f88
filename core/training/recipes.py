"""``specplay train eagle --recipe eagle3`` and ``specplay train medusa --recipe hydra``.

Both recipes learn from what the target knows at each position beyond its final feature and
argmax (:mod:`specplay.core.training.teacher`: a low, a middle and a high layer, and its top-K
distribution), so their data is one teacher-forced pass of the target over the same texts the
classic recipes use: standard-library source and the target's own answers (read from the
corpus where it holds them). Every evaluation also measures τ_sim (:mod:`specplay.core.training.tau`)
on the held-out answers, which goes into the heads' manifest with the per-level accuracy.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import torch

from specplay.core.heads import heads_manifest, save_heads
from specplay.core.paths import shipped_corpus
from specplay.core.progress import Progress
from specplay.core.training.common import ProgressFn, TrainProgress, TrainSettings
from specplay.core.training.data import FeatureSet
from specplay.core.training.teacher import TeacherSet, capture_teacher, default_layers

log = logging.getLogger(__name__)

RECIPES = {"eagle": ("classic", "eagle3"), "medusa": ("classic", "hydra")}


def teacher_data(target, data, workdir: Path, progress: Progress, should_cancel: Callable[[], bool],
                 corpus: Path | None, layers: tuple[int, ...]) -> tuple[TeacherSet, dict, str]:
    """The texts of :func:`specplay.core.training.pipeline.prepare_data`, read by the target with its layers.

    Answers come from the corpus where it holds them in full; where it does not, they are
    generated as the classic recipes' are (and then read once more, for their layers). Returns
    (the data, what it holds, the key of the target's weights)."""
    from specplay.core.training.data import (answers_dir, chat_prompt_ids, code_sequences, generate_answers,
                                             instruction_prompts, load_corpus, target_key, usable_answer)

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
    return teacher, stats, key


def classic_held_out(features: FeatureSet, prompts: list[list[int]], eval_fraction: float) -> TeacherSet:
    """The classic recipes' held-out sequences as τ_sim reads them: their final features, and
    where each answer begins (the chat prompt it starts with; none for source text)."""
    n_seq = features.starts.numel() - 1
    keep = list(range(n_seq - max(1, int(round(n_seq * eval_fraction))), n_seq))
    part = features.sequences(keep)
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
    return {"tau_sim": None if tau is None else round(tau, 3), "tau_sim_roots": result.get("tau_sim_roots", 0),
            "tau_sim_tree": result.get("tau_sim_tree")}


def held_out(data: TeacherSet, eval_fraction: float) -> TeacherSet:
    """The held-out sequences (:func:`specplay.core.training.common.split_sequences`), on which τ_sim is measured."""
    n_seq = data.starts.numel() - 1
    n_eval = max(1, int(round(n_seq * eval_fraction)))
    return data.sequences(list(range(n_seq - n_eval, n_seq)))


def train_recipe(kind: str, recipe: str, target, data, settings: TrainSettings, *, num_heads: int, draft_vocab: int,
                 window: int, unroll: int, init: str, teacher_weight: float, corpus: Path | None, workdir: Path,
                 out: Path, resume: bool, command: str, progress: Progress, on_step: ProgressFn | None,
                 should_cancel: Callable[[], bool]) -> tuple[Path, dict]:
    from specplay.core.training.common import held_out_vocabulary
    from specplay.core.training.tau import eagle_tau, medusa_tau

    model = target.model
    layers = default_layers(model.cfg.num_layers) if recipe == "eagle3" else ()
    teacher, stats, key = teacher_data(target, data, workdir, progress, should_cancel, corpus, layers)
    vocab_ids, coverage = held_out_vocabulary(teacher.features(), draft_vocab, tuple(model.info.eos_token_ids),
                                              settings.eval_fraction)
    lm_rows = model.lm_head_weight()[vocab_ids]
    evaluation_set = held_out(teacher, settings.eval_fraction)
    trained = {"seconds": 0.0}

    def step_done(p: TrainProgress) -> None:
        trained["seconds"] = p.elapsed_s
        if on_step:
            on_step(p)

    manifest = heads_manifest(kind, recipe, target=target.model_id, model=model, vocab_ids=vocab_ids,
                              coverage=round(coverage, 4), command=command, data=stats, settings=settings.to_dict(),
                              teacher_weight=teacher_weight)
    # Which training a checkpoint in the work folder must belong to to be resumed (as the classic recipes')
    identity = {"kind": kind, "recipe": recipe, "target": key, "code_tokens": data.code_tokens,
                "answers": data.answers, "answer_tokens": data.answer_tokens, "seq_len": data.seq_len,
                "data_seed": data.seed, "draft_vocab": draft_vocab, "eval_fraction": settings.eval_fraction,
                "layers": list(layers), "teacher_weight": teacher_weight}
    progress(f"Training {kind} ({recipe}) on {teacher.num_tokens:,} tokens", None)
    if recipe == "eagle3":
        from specplay.core.heads import head_config
        from specplay.core.heads.eagle3 import Eagle3Head
        from specplay.core.training.eagle3 import train_eagle3

        head = Eagle3Head(head_config(model.cfg), len(layers))
        if init == "target":
            head.init_from_target(model)
        result, steps = train_eagle3(
            teacher, head, model.embed, lm_rows, vocab_ids, model.info.vocab_size, settings, window=window,
            depth=unroll, teacher_weight=teacher_weight,
            tau_sim=lambda h: eagle_tau(h, evaluation_set, model.embed, lm_rows, vocab_ids),
            workdir=workdir, progress=step_done, should_cancel=should_cancel, resume=resume,
            identity={**identity, "window": window, "unroll": unroll, "init": init})
        tensors = dict(head.state_dict())
        manifest.update(intermediate_size=head.cfg.intermediate_size, layers=list(layers), window=window,
                        unroll=unroll, init=init, accuracy=_rounded(result))
    else:
        from specplay.core.training.hydra import train_hydra

        heads, result, steps = train_hydra(
            teacher, model.embed, lm_rows, vocab_ids, model.info.vocab_size, num_heads, settings,
            teacher_weight=teacher_weight,
            tau_sim=lambda h, acc: medusa_tau(h, acc, evaluation_set, model.embed, lm_rows, vocab_ids),
            workdir=workdir, progress=step_done, should_cancel=should_cancel, resume=resume,
            identity={**identity, "num_heads": num_heads})
        tensors = dict(heads.state_dict())
        accuracy = result["accuracy"]
        manifest.update(num_heads=num_heads, accuracy=[[round(a, 4) for a in row] for row in accuracy],
                        top1=[round(row[0], 4) for row in accuracy], top5=[round(sum(row[:5]), 4) for row in accuracy])
    manifest.update(**tau_fields(result), steps=steps, train_seconds=round(trained["seconds"], 1))
    tensors["vocab_ids"] = vocab_ids
    save_heads(out, tensors, manifest)
    return out, manifest


def _rounded(result: dict) -> dict:
    return {k: [round(a, 4) for a in v] if isinstance(v, list) else round(v, 4)
            for k, v in result.items() if k in ("top1", "top5", "top1_by_level")}
