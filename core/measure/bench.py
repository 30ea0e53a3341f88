"""Benchmarks the way the field measures them (Spec-Bench), with in-process peers.

Greedy by default, batch size 1, wall time including prefill. For each method and
question, per-question speed = tokens over all turns / wall time over all turns; a
category's tokens/s is the mean of per-question speeds, and its speedup is that mean over
the ``autoregressive`` baseline's mean (a ratio of means, as Spec-Bench computes it). τ
(#MAT) pools all decoding steps. Every output is compared token for token with the
baseline's. Multi-turn questions feed each method's own earlier answer back.

A run that fails (out of memory, an error of the method, a peer that cannot load) is recorded
as a failure with its message and left out of every speed and acceptance figure; speedups
compare only questions both sides answered. An endpoint's answer is compared by text (its
token ids are only the target tokenizer's reading of that text).

Each answer is appended to its method's file as soon as it is finished, so an interrupted run
keeps what it did: run again with the same ``out_dir`` and answers already there under the
same settings are read back instead of run again (the same models on the same device, dtype and
backend, the same method parameters, sampling and token limit, machine and SpecPlay version:
:func:`_settings`); a file made otherwise is moved aside and its method measured afresh.

Peers run the same weights and storage through ``transformers``: ``hf_generate`` (greedy
``generate``), ``hf_assisted`` (assisted generation with the draft model) and
``hf_prompt_lookup`` (prompt-lookup decoding), with SpecPlay's sampling settings and nothing
from the model folder's ``generation_config.json``. With the ``peers`` extra, llama.cpp runs
the target's GGUF file: ``llamacpp_generate`` (plain decoding) and ``llamacpp_prompt_lookup``;
once ``specplay peers build-server`` has built it, llama.cpp's own server runs as a child for the
bench: ``llamacpp_speculative`` (with the draft's GGUF file) and ``llamacpp_ngram`` (draftless).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from specplay.core.atomic import write_text_atomic
from specplay.core.errors import SpecPlayError
from specplay.core.measure.peers import (HF_PEERS, LLAMACPP_PEERS, PEERS, SERVER_PEERS, HFPeer, LlamaCppPeer,
                                         LlamaServerPeer, OurMethod, RemotePeer, TurnResult)
from specplay.core.measure.prompts import MT_BENCH, Question
from specplay.core.records.runlog import dumps, write_jsonl_atomic


# ----------------------------------------------------------------------------- metrics
def summarize(answers: dict[str, list[dict]], questions: list[Question], baseline: str = "autoregressive",
              by_text: frozenset[str] | set[str] = frozenset()) -> dict:
    """Per category and overall: tokens/s, speedup, τ, acceptance rate, identical outputs, failures.

    ``answers[method]`` holds one record per (repeat, question) with ``category``,
    ``question_id``, ``repeat`` and per-turn ``new_tokens``, ``wall_time``, ``accept_lengths``,
    ``token_ids``, ``turns`` (texts), ``drafted``, ``accepted``, and ``error`` (a message) if the
    question failed. Failed records count only in ``failures`` and ``errors``. Methods in
    ``by_text`` are identical when their texts equal the baseline's, not their token ids.
    """
    cats = sorted({q.category for q in questions})
    groups = {c: {c} for c in cats}
    if MT_BENCH & set(cats) and len(cats) > 1:
        groups["mt_bench"] = MT_BENCH & set(cats)
    groups["overall"] = set(cats)
    base = [r for r in answers[baseline] if not r.get("error")] if baseline in answers else None

    summary: dict = {}
    for method, recs in answers.items():
        summary[method] = {}
        for group, members in groups.items():
            sel = [r for r in recs if r["category"] in members]
            if not sel:
                continue
            failed = [r for r in sel if r.get("error")]
            ok = [r for r in sel if not r.get("error")]
            entry = {"questions": len({r["question_id"] for r in sel}), "failures": len(failed),
                     "errors": sorted({r["error"] for r in failed}), **_speed_figures(ok)}
            if base is not None:
                entry.update(_against_baseline(ok, [r for r in base if r["category"] in members],
                                               "turns" if method in by_text else "token_ids"))
            summary[method][group] = entry
    return summary


def _speed(rec: dict) -> float:
    return sum(rec["new_tokens"]) / sum(rec["wall_time"]) if sum(rec["wall_time"]) > 0 else 0.0


def _speed_figures(ok: list[dict]) -> dict:
    """tokens/s (mean over repeats of the mean per-question speed), new tokens per repeat, τ, acceptance."""
    if not ok:
        return {"tokens_per_s": None, "new_tokens": None, "mean_accepted": None, "acceptance_rate": None,
                "time_to_first_token": None}
    repeats = sorted({r["repeat"] for r in ok})
    speeds = [statistics.fmean(_speed(r) for r in ok if r["repeat"] == k) for k in repeats]
    steps = [a for r in ok for turn in (r["accept_lengths"] or []) for a in (turn or [])]
    drafted = sum(r.get("drafted", 0) for r in ok)
    first = [r["time_to_first_token"][0] for r in ok if (r.get("time_to_first_token") or [None])[0] is not None]
    tau = statistics.fmean(steps) if steps and ok[0]["accept_lengths"] else None
    if tau is None and all(r.get("steps") for r in ok):  # a peer that counts its steps, not each one's length
        tau = sum(sum(r["new_tokens"]) for r in ok) / sum(sum(r["steps"]) for r in ok)
    return {"tokens_per_s": statistics.fmean(speeds),
            "time_to_first_token": statistics.fmean(first) if first else None,
            "new_tokens": sum(sum(r["new_tokens"]) for r in ok) / len(repeats),
            "mean_accepted": tau,
            "acceptance_rate": sum(r.get("accepted", 0) for r in ok) / drafted if drafted else None}


def _against_baseline(ok: list[dict], base_ok: list[dict], same_by: str) -> dict:
    """Speedup (per repeat, a ratio of mean speeds) and equality of ``same_by`` (token ids, or texts), on the
    questions both answered."""
    by_key = {(r["repeat"], r["question_id"]): r for r in base_ok}
    pairs = [(r, by_key[(r["repeat"], r["question_id"])]) for r in ok if (r["repeat"], r["question_id"]) in by_key]
    by_question: dict = {}
    for r, b in pairs:
        by_question.setdefault(r["question_id"], []).append((r["repeat"], _speed(r), _speed(b)))
    ratios = _repeat_ratios([s for speeds in by_question.values() for s in speeds])
    return {"speedup": statistics.fmean(ratios) if ratios else None,
            "speedup_std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
            "speedup_interval": _speedup_interval(by_question),
            "identical": all(r[same_by] == b[same_by] for r, b in pairs) if pairs else None}


def _repeat_ratios(speeds: list[tuple[int, float, float]]) -> list[float]:
    """Per repeat, in order, the method's mean speed over the baseline's, from (repeat, the method's speed,
    the baseline's speed) a question; a repeat whose baseline made nothing is left out."""
    ratios = []
    for k in sorted({rep for rep, _, _ in speeds}):
        mine = [m for rep, m, _ in speeds if rep == k]
        theirs = [b for rep, _, b in speeds if rep == k]
        if statistics.fmean(theirs) > 0:
            ratios.append(statistics.fmean(mine) / statistics.fmean(theirs))
    return ratios


#: Resamplings of the questions behind a speedup's interval, and the interval's coverage.
INTERVAL_DRAWS, INTERVAL_LEVEL = 2000, 0.95


def _speedup_interval(by_question: dict[int, list[tuple[int, float, float]]]) -> list[float] | None:
    """A percentile bootstrap interval of the speedup (:data:`INTERVAL_LEVEL`): the questions drawn again
    with replacement :data:`INTERVAL_DRAWS` times (a fixed seed), each draw's speedup computed as the
    speedup itself is (per repeat, a ratio of mean speeds; then their mean). A method and its baseline
    answer each question within the same minute, so a question's ratio carries both what the question
    asks of the method and what the shared machine was doing then: how far another set of questions,
    or another minute, could move the figure. ``by_question``: each question's (repeat, the method's
    speed, the baseline's speed). None with fewer than two questions."""
    questions = sorted(by_question)
    if len(questions) < 2:
        return None
    rng = random.Random(0)
    draws = []
    for _ in range(INTERVAL_DRAWS):
        ratios = _repeat_ratios([s for _ in questions for s in by_question[rng.choice(questions)]])
        if ratios:
            draws.append(statistics.fmean(ratios))
    if not draws:
        return None
    draws.sort()
    tail = (1 - INTERVAL_LEVEL) / 2
    return [draws[int(tail * len(draws))], draws[min(len(draws) - 1, int((1 - tail) * len(draws)))]]


def format_summary(summary: dict, verify_cost: dict | None = None, temperature: float = 0.0) -> str:
    """The table of one temperature's summary. "same" (the output equals the baseline's token for
    token) is shown at temperature 0 only: above it, outputs differ run to run by design and what a
    lossless method preserves is the distribution (``specplay audit`` tests that)."""
    groups = [g for g in next(iter(summary.values())) if g != "overall"] + ["overall"]
    width = max(18, *(len(m) + 1 for m in summary))
    head = (f"{'method':{width}s}" + "".join(f"{g[:12]:>13s}" for g in groups)
            + f"{'95% range':>12s}{'tok/s':>9s}{'TTFT s':>8s}{'τ':>7s}{'accept':>8s}  same")
    lines = [head, "-" * len(head)]
    for method, per in summary.items():
        cells = "".join(f"{per[g]['speedup']:12.2f}x" if per.get(g, {}).get("speedup") is not None else f"{'-':>13s}"
                        for g in groups)
        o = per["overall"]
        interval = o.get("speedup_interval")
        spread = f"{interval[0]:.2f}-{interval[1]:.2f}" if interval else "-"
        speed = f"{o['tokens_per_s']:9.2f}" if o["tokens_per_s"] is not None else f"{'-':>9s}"
        ttft = f"{o['time_to_first_token']:8.2f}" if o.get("time_to_first_token") is not None else f"{'-':>8s}"
        tau = f"{o['mean_accepted']:7.2f}" if o.get("mean_accepted") is not None else f"{'-':>7s}"
        acc = f"{o['acceptance_rate']:8.0%}" if o.get("acceptance_rate") is not None else f"{'-':>8s}"
        same = {True: "✓", False: "✗", None: "-"}[o.get("identical") if temperature == 0 else None]
        lines.append(f"{method:{width}s}{cells}{spread:>12s}{speed}{ttft}{tau}{acc}  {same}")
    if any(per["overall"].get("speedup_interval") for per in summary.values()):
        lines.append(f"95% range: the overall speedup's {INTERVAL_LEVEL:.0%} bootstrap interval, the questions drawn "
                     f"again {INTERVAL_DRAWS:,} times (how far other questions, or another minute, could move it)")
    for method, per in summary.items():
        o = per["overall"]
        if o["failures"]:
            lines.append(f"{method}: {o['failures']} failed (not counted above): {'; '.join(o['errors'])}")
    if verify_cost:
        lines.append(f"target verify cost T(8)/T(1) = {verify_cost['ratio']:.2f} "
                     f"({verify_cost['t1_ms']:.1f} ms -> {verify_cost['t8_ms']:.1f} ms at {verify_cost['context']} tokens of context)")
    return "\n".join(lines)


def format_sweep(by_temperature: dict[float, dict]) -> str:
    """Speedup, τ and acceptance rate per method and category (rows) at each temperature (columns)."""
    temps = list(by_temperature)
    head = f"{'method':18s}{'category':14s}" + "".join(f"{'T=' + format(t, 'g') + ': speedup':>18s}{'τ':>7s}{'accept':>8s}"
                                                      for t in temps)
    lines = ["by temperature:", head, "-" * len(head)]
    first = by_temperature[temps[0]]
    for method, per in first.items():
        for k, group in enumerate(per):
            cells = ""
            for t in temps:
                e = by_temperature[t].get(method, {}).get(group, {})
                speedup, tau, acc = e.get("speedup"), e.get("mean_accepted"), e.get("acceptance_rate")
                cells += (f"{speedup:17.2f}x" if speedup is not None else f"{'-':>18s}") + \
                         (f"{tau:7.2f}" if tau is not None else f"{'-':>7s}") + \
                         (f"{acc:8.0%}" if acc is not None else f"{'-':>8s}")
            lines.append(f"{method if k == 0 else '':18s}{group[:13]:14s}{cells}")
    return "\n".join(lines)


def measure_verify_cost(model, context: int = 200, repeats: int = 7) -> dict:
    """The fastest of ``repeats`` forward passes of 1 and of 8 new tokens after ``context`` cached
    tokens, taking turns (see :func:`specplay.core.decoding.costmodel.time_passes`)."""
    from specplay.core.decoding.costmodel import time_passes

    t1, t8 = time_passes(model, (1, 8), context, repeats)
    return {"t1_ms": t1 * 1e3, "t8_ms": t8 * 1e3, "ratio": t8 / t1, "context": context}


# ----------------------------------------------------------------------------- driver
@dataclass
class BenchSpec:
    methods: list[str]
    configs: dict = field(default_factory=dict)
    max_new_tokens: int = 256
    endpoints: dict = field(default_factory=dict)  # "remote:<label>" -> core.remote.endpoint.Endpoint
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    warmup: int = 1
    repeats: int = 1
    chat_template: bool = True
    #: Methods take plain steps where drafting does not pay (core/decoding/standdown.py).
    stand_down: bool = True
    #: A sweep: every method runs at each of these temperatures in turn (empty: ``temperature`` alone).
    temperatures: tuple[float, ...] = ()

    def sweep(self) -> tuple[float, ...]:
        return tuple(self.temperatures) or (self.temperature,)


def run_bench(target, draft, questions: list[Question], bench_spec: BenchSpec, out_dir: Path,
              log: Callable[[str], None] = print) -> dict:
    """Run every method on every question, appending each answer to its method's file in ``out_dir``
    as it finishes, then write ``summary.json``. Answers already there under the same settings are
    read back, not run again (see :func:`_resume`).

    A temperature sweep (``bench_spec.temperatures``) runs every question at each temperature in turn;
    each method's answers at temperature T go to ``<method>-T<T>.jsonl``. The result's and
    ``summary.json``'s ``summary`` is then the first temperature's, and ``by_temperature`` has
    every temperature's (keyed ``"0"``, ``"1"``, ...): a single temperature writes what it always did.
    """
    if "autoregressive" not in bench_spec.methods:
        bench_spec.methods.insert(0, "autoregressive")
    out_dir.mkdir(parents=True, exist_ok=True)
    runners, load_errors = _load_runners(bench_spec, target, draft, log)
    try:
        return _run_loaded(runners, load_errors, target, draft, questions, bench_spec, out_dir, log)
    finally:  # a server child is stopped however the bench ends: finished, failed, or Ctrl-C
        for runner in runners.values():
            close = getattr(runner, "close", None)
            if close is not None:
                close()


def _run_loaded(runners: dict, load_errors: dict, target, draft, questions: list[Question], bench_spec: BenchSpec,
                out_dir: Path, log: Callable[[str], None]) -> dict:
    from specplay.core.text import encode_messages, encode_prompt

    verify_cost = measure_verify_cost(target.model)
    log(f"target verify cost T(8)/T(1) = {verify_cost['ratio']:.2f}")
    tok = target.tokenizer

    def prompt_ids(history: list[dict]) -> list[int]:
        if bench_spec.chat_template and getattr(tok, "chat_template", None):
            return encode_messages(tok, history)
        return encode_prompt(tok, history[-1]["content"], chat_template=False)

    temperatures = bench_spec.sweep()
    params = {name: _plain(runner.params()) for name, runner in runners.items()}
    warm: set[str] = set()
    by_temperature, files = {}, {}
    for temperature in temperatures:
        at = replace(bench_spec, temperature=temperature, temperatures=())
        suffix = f"-T{temperature:g}" if len(temperatures) > 1 else ""
        files[temperature] = {name: out_dir / f"{stem}{suffix}.jsonl"
                              for name, stem in file_stems(bench_spec.methods).items()}
        where = f" at temperature {temperature:g}" if len(temperatures) > 1 else ""
        answers = _run_questions(runners, questions, at, target, draft, files[temperature], params, prompt_ids, warm,
                                 lambda m: log(m + where))
        for name, error in load_errors.items():
            answers[name] = [_record(q, rep, [TurnResult([], "", 0.0, None, error=error)])
                             for rep in range(bench_spec.repeats) for q in questions]
        by_temperature[temperature] = summarize(answers, questions, by_text=set(bench_spec.endpoints) | set(SERVER_PEERS))
    env = _write_summary(out_dir, by_temperature, verify_cost, target, draft, bench_spec, params, files)
    return {"summary": by_temperature[temperatures[0]], "verify_cost": verify_cost, "environment": env,
            "by_temperature": by_temperature}


def _run_questions(runners: dict, questions: list[Question], bench_spec: BenchSpec, target, draft,
                   files: dict[str, Path], params: dict, prompt_ids: Callable, warm: set[str],
                   log: Callable[[str], None]) -> dict:
    """Every runner's answer to every question at ``bench_spec.temperature``: read back, or run and appended."""
    from specplay.core.decoding.types import GenerationConfig, SamplingConfig

    gen = GenerationConfig(max_new_tokens=bench_spec.max_new_tokens, stand_down=bench_spec.stand_down,
                           sampling=SamplingConfig(temperature=bench_spec.temperature, top_p=bench_spec.top_p,
                                                   seed=bench_spec.seed))
    settings = _settings(bench_spec, target, draft)
    wanted = {(rep, q.question_id): list(q.turns) for rep in range(bench_spec.repeats) for q in questions}
    done = {name: _resume(files[name], name, settings, params[name], wanted, log) for name in runners}
    answers: dict[str, list[dict]] = {name: [] for name in bench_spec.methods}
    started = time.perf_counter()
    # Methods interleave per question, so slow drifts of a shared machine hit all of them alike.
    for rep in range(bench_spec.repeats):
        for qi, q in enumerate(questions):
            for name, runner in runners.items():
                rec = done[name].get((rep, q.question_id))
                if rec is None:
                    if name not in warm:  # before its first timed run; a method read back in full needs none
                        for _ in range(bench_spec.warmup):
                            _run_turn(runner, prompt_ids([{"role": "user", "content": q.turns[0]}]), gen)
                        warm.add(name)
                    rec = _record(q, rep, _answer(runner, q, prompt_ids, gen))
                    if rec["error"]:
                        log(f"{name} failed on question {q.question_id}: {rec['error']}")
                    _append_line(files[name], _answer_line(rec, name, target.model_id, settings, params[name]))
                answers[name].append(rec)
            done_count = rep * len(questions) + qi + 1
            log(f"[{done_count}/{bench_spec.repeats * len(questions)}] question {q.question_id} "
                f"({time.perf_counter() - started:.0f}s)")
    return answers


def _load_runners(bench_spec: BenchSpec, target, draft, log: Callable[[str], None]) -> tuple[dict, dict[str, str]]:
    """Each method's runner, and the reason of each that could not load (the others still run)."""
    hf_models: dict = {}
    runners, errors = {}, {}
    for name in bench_spec.methods:
        try:
            if name in HF_PEERS:
                runners[name] = HFPeer(name, target, draft, hf_models)
            elif name in LLAMACPP_PEERS:
                runners[name] = LlamaCppPeer(name, target)
            elif name in SERVER_PEERS:
                runners[name] = LlamaServerPeer(name, target, draft)
            elif name in bench_spec.endpoints:
                runners[name] = RemotePeer(bench_spec.endpoints[name], target)
            else:
                runners[name] = OurMethod(name, bench_spec.configs.get(name), target, draft)
                for warning in runners[name].method.warnings:  # its records carry them too
                    log(f"{name}: warning: {warning}")
        except Exception as exc:
            errors[name] = f"could not load: {_reason(exc)}"
            log(f"{name} {errors[name]}")
    return runners, errors


def _reason(exc: Exception) -> str:
    """A failure's message for the table: SpecPlay's own errors are written for users, others keep their type."""
    return str(exc) if isinstance(exc, SpecPlayError) else f"{type(exc).__name__}: {exc}"


def _run_turn(runner, prompt_ids: list[int], gen) -> TurnResult:
    """One turn; an exception of the method or peer is this turn's failure, not the end of the bench."""
    try:
        return runner.run(prompt_ids, gen)
    except Exception as exc:
        return TurnResult([], "", 0.0, None, error=_reason(exc))


def _answer(runner, q: Question, prompt_ids: Callable[[list[dict]], list[int]], gen) -> list[TurnResult]:
    """All turns of ``q``, each fed the runner's own earlier answers; a failed turn is the last."""
    history: list[dict] = []
    turns = []
    for turn in q.turns:
        history.append({"role": "user", "content": turn})
        res = _run_turn(runner, prompt_ids(history), gen)
        turns.append(res)
        if res.error:  # later turns would build on an unfinished answer
            break
        history.append({"role": "assistant", "content": res.text})
    return turns


def _record(q: Question, rep: int, turns: list[TurnResult]) -> dict:
    """The record :func:`summarize` reads, for one question's turns (the last one's error is the question's)."""
    return {"question_id": q.question_id, "category": q.category, "repeat": rep, "question_turns": list(q.turns),
            "turns": [t.text for t in turns], "token_ids": [t.token_ids for t in turns],
            "new_tokens": [len(t.token_ids) for t in turns], "wall_time": [t.wall_time for t in turns],
            "accept_lengths": None if turns[0].accept_lengths is None else [t.accept_lengths for t in turns],
            "drafted": sum(t.drafted for t in turns), "accepted": sum(t.accepted for t in turns),
            "steps": None if any(t.steps is None for t in turns) else [t.steps for t in turns],
            "time_to_first_token": [t.time_to_first_token for t in turns], "error": turns[-1].error}


# ----------------------------------------------------------------------------- answer files
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_STEM = 100  # well under the 255 bytes a file name may have, with room for a hash and suffixes


def file_stems(names: list[str]) -> dict[str, str]:
    """A file name stem for each method, safe in any folder and distinct from the others' stems.

    An endpoint's name carries its label (``remote:host:8000/Org/Name``, or whatever ``name=``
    says), so every character but letters, digits, ``.``, ``_`` and ``-`` becomes ``-`` and leading
    dots go: no folders, no ``..``, no hidden files. Stems that would then coincide (also up to
    case, for case-insensitive file systems) or that are cut to length end with a short hash of
    the full name, which tells them apart and stays the same from one run to the next.
    """
    plain = {n: _UNSAFE.sub("-", n).lstrip(".") or "method" for n in names}
    taken = Counter(s.lower() for s in plain.values())
    return {n: s if taken[s.lower()] == 1 and len(s) <= _MAX_STEM
            else f"{s[:_MAX_STEM]}-{hashlib.sha256(n.encode()).hexdigest()[:8]}" for n, s in plain.items()}


def _settings(bench_spec: BenchSpec, target, draft) -> dict:
    """What shapes an answer's tokens or timings besides the method's own parameters: answers are
    reused only under the same. Each model is named with its resolved device, dtype and backend
    (``--dtype``, ``--device`` and ``--draft-backend`` resolve to them), beside the machine, its
    int8 kernel and threads, and the SpecPlay version that made the answer."""
    from specplay.core import __version__
    from specplay.core.models.measurements import cpu_name

    models = {}
    for role, loaded in (("target", target), ("draft", draft)):
        info = loaded.model.info if loaded is not None else None
        models[role] = loaded.model_id if loaded is not None else None
        for key in ("device", "dtype", "backend"):
            models[f"{role}_{key}"] = getattr(info, key) if info is not None else None
    return {**models, "max_new_tokens": bench_spec.max_new_tokens,
            "temperature": bench_spec.temperature, "top_p": bench_spec.top_p, "seed": bench_spec.seed,
            "chat_template": bench_spec.chat_template, "stand_down": bench_spec.stand_down,
            "specplay": __version__, "machine": cpu_name(), "int8_kernel": torch.backends.quantized.engine,
            "threads": torch.get_num_threads()}


def _plain(value):
    """``value`` as it reads back from JSON (tuples become lists), so that read-back settings compare equal."""
    return json.loads(json.dumps(value, default=str))


_CHOICE_FIELDS = ("turns", "new_tokens", "wall_time", "token_ids", "drafted", "accepted", "time_to_first_token")


def _answer_line(rec: dict, name: str, target_id: str, settings: dict, params: dict) -> dict:
    """A Spec-Bench answer record, with what it takes to read it back and to check it was made the same way.

    Its choice has Spec-Bench's keys in Spec-Bench's shapes: ``accept_lengths`` one flat list over
    the turns, ``decoding_steps`` each turn's number of steps (both empty where the runner does
    not say its steps: a peer, an endpoint; a server that counts its steps gives only the latter);
    each turn's own list is ``accept_lengths_per_turn`` (None where the steps are not known).
    """
    per_turn = rec["accept_lengths"]
    known = [] if per_turn is None else [turn or [] for turn in per_turn]
    steps = [len(t) for t in known] if per_turn is not None else (rec.get("steps") or [])
    choice = {"index": 0, **{k: rec[k] for k in _CHOICE_FIELDS},
              "accept_lengths": [a for turn in known for a in turn], "decoding_steps": steps,
              "accept_lengths_per_turn": per_turn}
    return {"question_id": rec["question_id"], "category": rec["category"], "answer_id": uuid.uuid4().hex,
            "model_id": f"{target_id}/{name}", "repeat": rec["repeat"], "method": name, "params": params,
            "settings": settings, "question_turns": rec["question_turns"], "choices": [choice],
            "error": rec["error"], "tstamp": time.time()}


def _record_from_line(line: dict) -> dict:
    """The record that :func:`_answer_line` wrote, as :func:`summarize` reads it."""
    c = line["choices"][0]
    counted = c["accept_lengths_per_turn"] is None and c.get("decoding_steps")  # a peer's own count of its steps
    return {"question_id": line["question_id"], "category": line["category"], "repeat": line["repeat"],
            "question_turns": line["question_turns"], **{k: c[k] for k in _CHOICE_FIELDS},
            "accept_lengths": c["accept_lengths_per_turn"], "steps": c["decoding_steps"] if counted else None,
            "error": line["error"]}


def _append_line(path: Path, line: dict) -> None:
    """Append one JSON line and sync it to disk; if that fails the file is left as it was, not with half a line."""
    data = memoryview((dumps(line) + "\n").encode("utf-8"))
    existed = path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    size = os.lseek(fd, 0, os.SEEK_END)
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, size)
        os.close(fd)
        if not existed:
            path.unlink(missing_ok=True)
        raise
    os.close(fd)


def _json_object(text: str) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _mismatch(line: dict | None, name: str, settings: dict, params: dict, wanted: dict) -> str | None:
    """Why a line already in the file may not stand beside this run's answers; None if it may."""
    if line is None:
        return "a line is not an answer"
    if line.get("method") != name:
        return f"it holds answers of {line.get('method')!r}"
    old = line.get("settings")
    if not isinstance(old, dict):
        return "its answers do not record their settings"
    changed = [f"{k} {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v]
    if changed:
        return "the settings changed: " + ", ".join(changed)
    old = line.get("params") or {}
    if old != params:
        return f"{name}'s parameters changed: " + ", ".join(sorted(k for k in {**old, **params}
                                                                   if old.get(k) != params.get(k)))
    key = (line.get("repeat"), line.get("question_id"))
    if key in wanted and line.get("question_turns") != wanted[key]:
        return f"question {key[1]!r} is not the same question any more"
    return None


def _resume(path: Path, name: str, settings: dict, params: dict, wanted: dict, log: Callable[[str], None]) -> dict:
    """The answers of ``name`` in ``path`` that this run can use, by (repeat, question id).

    A file whose answers were made otherwise (settings, parameters, questions), or that holds
    something else, is moved aside, not mixed with new answers, and the method starts afresh.
    Failed runs are dropped from the file, to be run again (a failure is not an answer), and so
    is an unfinished last line: :func:`_append_line` leaves none, but a killed process can.
    """
    if not path.is_file():
        return {}
    texts = [t for t in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True) if t.strip()]
    torn = bool(texts) and (not texts[-1].endswith("\n") or _json_object(texts[-1]) is None)
    lines = [_json_object(t) for t in (texts[:-1] if torn else texts)]
    for line in lines:
        why = _mismatch(line, name, settings, params, wanted)
        if why:
            aside = path.with_name(f"{path.name}.superseded-{uuid.uuid4().hex[:8]}")  # never ends in .jsonl
            path.rename(aside)
            log(f"{name}: {path.name} was made otherwise ({why}); moved to {aside.name}, {name} starts afresh")
            return {}
    kept = [line for line in lines if not line["error"]]
    if torn or len(kept) < len(lines):
        log(f"{name}: {path.name}: {len(lines) - len(kept)} failed and {int(torn)} unfinished answers "
            "dropped, to be run again")
        write_jsonl_atomic(path, kept)
    reused: dict = {}
    for line in kept:
        reused.setdefault((line["repeat"], line["question_id"]), _record_from_line(line))
    reused = {key: rec for key, rec in reused.items() if key in wanted}
    if reused:
        log(f"{name}: {len(reused)} answers read back from {path.name}")
    return reused


def _write_summary(out_dir: Path, by_temperature: dict[float, dict], verify_cost: dict, target, draft,
                   bench_spec: BenchSpec, params: dict, files: dict[float, dict[str, Path]]) -> dict:
    """Write ``summary.json`` (a sweep adds every temperature's summary and files); return its environment card."""
    from specplay.core.records.environment import environment

    first = bench_spec.sweep()[0]
    doc = {"summary": by_temperature[first], "verify_cost": verify_cost, "baseline": "autoregressive",
           "target": target.model_id, "draft": draft.model_id if draft else None,
           "settings": {"methods": bench_spec.methods, "max_new_tokens": bench_spec.max_new_tokens,
                        "temperature": first, "top_p": bench_spec.top_p, "seed": bench_spec.seed,
                        "warmup": bench_spec.warmup, "repeats": bench_spec.repeats,
                        "chat_template": bench_spec.chat_template},
           "params": params, "answer_files": {name: files[first][name].name for name in params},
           "environment": environment(target, draft, measure=True)}
    if len(by_temperature) > 1:
        doc["settings"]["temperatures"] = list(by_temperature)
        doc["by_temperature"] = {f"{t:g}": s for t, s in by_temperature.items()}
        doc["answer_files_by_temperature"] = {f"{t:g}": {name: files[t][name].name for name in params}
                                              for t in by_temperature}
    write_text_atomic(out_dir / "summary.json", json.dumps(doc, indent=2, default=str) + "\n")
    return doc["environment"]


def check_methods(names: list[str]) -> None:
    from specplay.core.methods import METHODS

    for n in names:
        if n not in METHODS and n not in PEERS:
            raise SpecPlayError(f"unknown method '{n}' (methods: {', '.join(METHODS)}; peers: {', '.join(PEERS)})")
