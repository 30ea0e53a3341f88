"""``specplay train medusa|eagle``: data from the target, training, and a heads file with its manifest.

Everything is cached in a work folder (answers, feature shards, checkpoints), so an
interrupted run resumes where it stopped (``--resume`` for the training itself).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from specplay.core.heads import heads_manifest, save_heads
from specplay.core.paths import cache_dir, data_dir, shipped_corpus
from specplay.core.progress import Progress
from specplay.core.training.common import ProgressFn, TrainProgress, TrainSettings, held_out_vocabulary
from specplay.core.training.data import (DataSettings, FeatureSet, answers_dir, chat_prompt_ids, code_sequences,
                                         extract_features, generate_answers, instruction_prompts, load_corpus,
                                         target_key)

log = logging.getLogger(__name__)


def default_workdir(target_spec: str) -> Path:
    return cache_dir() / "training" / Path(target_spec).name


def default_output(kind: str, target_spec: str) -> Path:
    return data_dir() / "heads" / f"{kind}-{Path(target_spec).name}.safetensors"


def prepare_data(target, settings: DataSettings, workdir: Path, progress: Progress,
                 should_cancel: Callable[[], bool], corpus: Path | None = None) -> tuple[FeatureSet, dict]:
    """Standard-library source and the target's answers, with the target's features.

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


def train_heads(kind: str, target, data: DataSettings, settings: TrainSettings, *, num_heads: int = 4,
                draft_vocab: int = 32768, intermediate: int | None = None, window: int = 128, unroll: int = 1,
                init: str = "target", head_recipe: str = "classic", teacher_weight: float = 1.0,
                corpus: Path | None = None,
                workdir: Path | None = None, out: Path | None = None, resume: bool = False, command: str = "",
                progress: Progress = lambda s, f: None, on_step: ProgressFn | None = None,
                should_cancel: Callable[[], bool] = lambda: False) -> tuple[Path, dict]:
    """Build data, train ``kind`` ("medusa" or "eagle") heads for ``target``, save them; return (path, manifest)."""
    trained = {"seconds": 0.0}  # the training loop's time, earlier sessions of a resumed run included

    def step_done(p: TrainProgress) -> None:
        trained["seconds"] = p.elapsed_s
        if on_step:
            on_step(p)

    workdir = workdir or default_workdir(target.model_id)
    out = out or default_output(kind, target.model_id)
    if head_recipe != "classic":  # EAGLE-3 and Hydra learn from the target's layers and distribution
        from specplay.core.training.recipes import train_recipe

        return train_recipe(kind, head_recipe, target, data, settings, num_heads=num_heads, draft_vocab=draft_vocab,
                            window=window, unroll=unroll, init=init, teacher_weight=teacher_weight, corpus=corpus,
                            workdir=workdir, out=out, resume=resume, command=command, progress=progress,
                            on_step=on_step, should_cancel=should_cancel)
    features, stats = prepare_data(target, data, workdir, progress, should_cancel, corpus)
    model = target.model
    vocab_ids, coverage = held_out_vocabulary(features, draft_vocab, tuple(model.info.eos_token_ids),
                                              settings.eval_fraction)
    lm_rows = model.lm_head_weight()[vocab_ids]
    manifest = heads_manifest(kind, "classic", target=target.model_id, model=model, vocab_ids=vocab_ids,
                              coverage=round(coverage, 4), command=command, data=stats, settings=settings.to_dict())
    # Which training a checkpoint in the work folder must belong to to be resumed: these weights,
    # this data and vocabulary, heads of this shape (the folder may hold another target's training).
    # How long and how fast to train may change between sessions.
    identity = {"kind": kind, "target": target_key(target.path, progress), "code_tokens": data.code_tokens,
              "answers": data.answers, "answer_tokens": data.answer_tokens, "seq_len": data.seq_len,
              "data_seed": data.seed, "draft_vocab": draft_vocab, "eval_fraction": settings.eval_fraction}
    # τ_sim on the held-out answers at each evaluation (core.training.tau); the last goes into the manifest
    from specplay.core.training.recipes import classic_held_out, tau_fields
    from specplay.core.training.tau import eagle_tau, medusa_tau

    prompts = [chat_prompt_ids(target.tokenizer, p) for p in instruction_prompts(data.answers, data.seed)] \
        if stats.get("answers") else []  # where each held-out answer begins: drafting starts there
    held = classic_held_out(features, prompts, settings.eval_fraction)
    last_tau: dict = {}

    def tau(result: dict) -> dict:
        last_tau.update(result)
        return result

    progress(f"Training {kind} on {features.num_tokens:,} tokens", None)
    if kind == "medusa":
        from specplay.core.training.medusa import train_medusa

        heads, accuracy, steps = train_medusa(features, lm_rows, vocab_ids, model.info.vocab_size, num_heads, settings,
                                              workdir, step_done, should_cancel, resume,
                                              identity={**identity, "num_heads": num_heads},
                                              tau_sim=lambda h, acc: tau(medusa_tau(h, acc, held, model.embed,
                                                                                    lm_rows, vocab_ids)))
        tensors = dict(heads.state_dict())
        manifest.update(num_heads=num_heads, accuracy=[[round(a, 4) for a in row] for row in accuracy],
                        top1=[round(row[0], 4) for row in accuracy], top5=[round(sum(row[:5]), 4) for row in accuracy])
    elif kind == "eagle":
        from specplay.core.heads import EagleHead, head_config
        from specplay.core.heads.eagle import init_from_target_layer
        from specplay.core.training.eagle import train_eagle

        cfg = head_config(model.cfg, intermediate)
        head = EagleHead(cfg)
        if init == "target":
            init_from_target_layer(head, model.layers[-1])
        accuracy, steps = train_eagle(features, head, model.embed, lm_rows, vocab_ids, model.info.vocab_size, settings,
                                      window=window, unroll=unroll, workdir=workdir, progress=step_done,
                                      should_cancel=should_cancel, resume=resume,
                                      identity={**identity, "intermediate_size": cfg.intermediate_size,
                                                "window": window, "unroll": unroll},
                                      tau_sim=lambda h: tau(eagle_tau(h, held, model.embed, lm_rows, vocab_ids)))
        accuracy = {k: v for k, v in accuracy.items() if k in ("top1", "top5", "top1_by_level")}
        tensors = dict(head.state_dict())
        manifest.update(intermediate_size=cfg.intermediate_size, window=window, unroll=unroll, init=init,
                        accuracy={k: [round(a, 4) for a in v] if isinstance(v, list) else round(v, 4)
                                  for k, v in accuracy.items()})
    else:
        raise ValueError(f"unknown head kind {kind}")
    tensors["vocab_ids"] = vocab_ids
    manifest.update(**tau_fields(last_tau), steps=steps, train_seconds=round(trained["seconds"], 1))
    save_heads(out, tensors, manifest)
    return out, manifest
