"""Benchmarks the way the field measures them (Spec-Bench), with in-process peers.

Greedy by default, batch size 1, wall time including prefill. For each method and
question, per-question speed = tokens over all turns / wall time over all turns; a
category's tokens/s is the mean of per-question speeds, and its speedup is that mean over
the ``autoregressive`` baseline's mean (a ratio of means, as Spec-Bench computes it). τ
(#MAT) pools all decoding steps. Every output is compared token for token with the
baseline's. Multi-turn questions feed each method's own earlier answer back.

Peers run the same weights and storage through ``transformers``: ``hf_generate`` (greedy
``generate``), ``hf_assisted`` (assisted generation with the draft model) and
``hf_prompt_lookup`` (prompt-lookup decoding), each with transformers' defaults.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from core.errors import ConfigError, SpecPlayError
from core.paths import assets_dir

PEERS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
BUILTIN_SETS = {"code": "code_prompts_dev.jsonl", "spec_bench": "spec_bench_dev.jsonl"}
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


# ----------------------------------------------------------------------------- prompt files
@dataclass(frozen=True)
class Question:
    question_id: object
    category: str
    turns: tuple[str, ...]


def load_questions(source: str, categories: list[str] | None = None, limit: int | None = None,
                   per_category: int | None = None) -> list[Question]:
    """Read a Spec-Bench question file (or a built-in set name); bad lines are errors that name the line.

    ``per_category`` keeps the first N questions of each category; ``limit`` the first N overall.
    """
    path = Path(source)
    if source in BUILTIN_SETS:
        path = assets_dir() / "prompts" / BUILTIN_SETS[source]
    if not path.is_file():
        raise ConfigError(f"prompt file not found: {source} (built-in sets: {', '.join(BUILTIN_SETS)})")
    questions = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not valid UTF-8 (byte {exc.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}, line {n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}, line {n}: expected a JSON object")
        turns = obj.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ConfigError(f"{path}, line {n}: 'turns' must be a non-empty list of non-empty strings")
        if "question_id" not in obj:
            raise ConfigError(f"{path}, line {n}: missing 'question_id'")
        questions.append(Question(obj["question_id"], str(obj.get("category", "default")), tuple(turns)))
    if categories:
        wanted = set(categories)
        if "mt_bench" in wanted:
            wanted |= MT_BENCH
        questions = [q for q in questions if q.category in wanted]
    if per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            seen[q.category] = seen.get(q.category, 0) + 1
            if seen[q.category] <= per_category:
                kept.append(q)
        questions = kept
    if limit is not None:
        questions = questions[:limit]
    if not questions:
        raise ConfigError(f"no questions selected from {path}")
    return questions


# ----------------------------------------------------------------------------- runners
@dataclass
class TurnResult:
    token_ids: list[int]
    text: str
    wall_time: float
    accept_lengths: list[int] | None
    drafted: int = 0
    accepted: int = 0


class OurMethod:
    """One of SpecPlay's methods, through the engine."""

    def __init__(self, name: str, config, target, draft):
        from core.methods import build_method

        self.name = name
        self.target = target
        self.method = build_method(name, config, target, draft)

    def params(self) -> dict:
        return self.method.describe()

    def run(self, prompt_ids: list[int], gen) -> TurnResult:
        from core.engine import drain, generate

        r = drain(generate(self.target.model, self.target.tokenizer, self.method, prompt_ids, gen))
        m = r.metrics
        return TurnResult(r.token_ids, r.text, m.wall_time, m.accept_lengths, m.drafted, m.accepted)


class HFPeer:
    """A transformers decoding strategy on the same weights and storage."""

    def __init__(self, name: str, target, draft, hf_models: dict):
        self.name = name
        self.target = target
        self.model = _hf_model(target, hf_models)
        self.kwargs: dict = {}
        if name == "hf_assisted":
            if draft is None:
                raise ConfigError("hf_assisted needs a draft model")
            self.kwargs["assistant_model"] = _hf_model(draft, hf_models)
        elif name == "hf_prompt_lookup":
            self.kwargs["prompt_lookup_num_tokens"] = 10

    def params(self) -> dict:
        return {k: v for k, v in self.kwargs.items() if k != "assistant_model"}

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], gen) -> TurnResult:
        s = gen.sampling
        sampling = {"do_sample": False} if s.greedy else {"do_sample": True, "temperature": s.temperature,
                                                             "top_p": s.top_p}
        if not s.greedy:
            torch.manual_seed(s.seed)
        ids = torch.tensor([prompt_ids])
        eos = list(self.target.model.info.eos_token_ids)
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen.max_new_tokens,
                                  eos_token_id=eos or None, pad_token_id=(eos or [0])[0], **sampling, **self.kwargs)
        wall = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        for k, t in enumerate(new):  # tokens after an end-of-sequence token are not output
            if t in eos:
                new = new[: k + 1]
                break
        text = self.target.tokenizer.decode(new, skip_special_tokens=True)
        return TurnResult(new, text, wall, None)


def _hf_model(loaded, cache: dict):
    """The transformers model for a LoadedModel, with the same weights and storage."""
    from transformers import AutoModelForCausalLM

    from core.models.loader import quantize_hf_linears

    key = str(loaded.path)
    if key not in cache:
        info = loaded.model.info
        dtype = torch.float32 if info.dtype in ("int8", "float32") else getattr(torch, info.dtype)
        hf = AutoModelForCausalLM.from_pretrained(key, dtype=dtype).eval().to(info.device)
        if info.dtype == "int8":
            quantize_hf_linears(hf)
        cache[key] = hf
    return cache[key]


# ----------------------------------------------------------------------------- metrics
def summarize(answers: dict[str, list[dict]], questions: list[Question], baseline: str = "autoregressive") -> dict:
    """Per category and overall: tokens/s, speedup, τ, acceptance rate, identical outputs.

    ``answers[method]`` holds one record per (repeat, question) with ``category``,
    ``question_id``, ``repeat`` and per-turn ``new_tokens``, ``wall_time``, ``accept_lengths``,
    ``token_ids``, ``drafted``, ``accepted``.
    """
    cats = sorted({q.category for q in questions})
    groups = {c: {c} for c in cats}
    if MT_BENCH & set(cats) and len(cats) > 1:
        groups["mt_bench"] = MT_BENCH & set(cats)
    groups["overall"] = set(cats)
    base = answers.get(baseline)

    def speed(rec):
        return sum(rec["new_tokens"]) / sum(rec["wall_time"]) if sum(rec["wall_time"]) > 0 else 0.0

    summary: dict = {}
    for method, recs in answers.items():
        summary[method] = {}
        for group, members in groups.items():
            sel = [r for r in recs if r["category"] in members]
            if not sel:
                continue
            repeats = sorted({r["repeat"] for r in sel})
            speeds = [statistics.fmean(speed(r) for r in sel if r["repeat"] == k) for k in repeats]
            entry = {"questions": len({r["question_id"] for r in sel}), "tokens_per_s": statistics.fmean(speeds),
                     "new_tokens": sum(sum(r["new_tokens"]) for r in sel) / len(repeats)}
            steps = [a for r in sel for turn in (r["accept_lengths"] or []) for a in (turn or [])]
            entry["mean_accepted"] = statistics.fmean(steps) if steps and sel[0]["accept_lengths"] else None
            drafted = sum(r.get("drafted", 0) for r in sel)
            entry["acceptance_rate"] = sum(r.get("accepted", 0) for r in sel) / drafted if drafted else None
            if base is not None:
                bsel = [r for r in base if r["category"] in members]
                bspeeds = [statistics.fmean(speed(r) for r in bsel if r["repeat"] == k) for k in repeats
                           if any(r["repeat"] == k for r in bsel)]
                ratios = [s / b for s, b in zip(speeds, bspeeds) if b > 0]
                entry["speedup"] = statistics.fmean(ratios) if ratios else None
                entry["speedup_std"] = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
                ref = {(r["repeat"], r["question_id"]): r["token_ids"] for r in bsel}
                entry["identical"] = all(ref.get((r["repeat"], r["question_id"])) == r["token_ids"] for r in sel)
            summary[method][group] = entry
    return summary


def format_summary(summary: dict, verify_cost: dict | None = None) -> str:
    groups = [g for g in next(iter(summary.values())) if g != "overall"] + ["overall"]
    head = f"{'method':18s}" + "".join(f"{g[:12]:>13s}" for g in groups) + f"{'tok/s':>9s}{'τ':>7s}{'accept':>8s}  same"
    lines = [head, "-" * len(head)]
    for method, per in summary.items():
        cells = "".join(f"{per[g]['speedup']:12.2f}x" if per.get(g, {}).get("speedup") is not None else f"{'-':>13s}"
                        for g in groups)
        o = per["overall"]
        tau = f"{o['mean_accepted']:7.2f}" if o.get("mean_accepted") is not None else f"{'-':>7s}"
        acc = f"{o['acceptance_rate']:8.0%}" if o.get("acceptance_rate") is not None else f"{'-':>8s}"
        same = {True: "✓", False: "✗", None: "-"}[o.get("identical")]
        lines.append(f"{method:18s}{cells}{o['tokens_per_s']:9.2f}{tau}{acc}  {same}")
    if verify_cost:
        lines.append(f"target verify cost T(8)/T(1) = {verify_cost['ratio']:.2f} "
                     f"({verify_cost['t1_ms']:.1f} ms -> {verify_cost['t8_ms']:.1f} ms at {verify_cost['context']} tokens of context)")
    return "\n".join(lines)


def measure_verify_cost(model, context: int = 200, repeats: int = 7) -> dict:
    """Median time of a forward pass of 1 and of 8 new tokens after ``context`` cached tokens."""
    g = torch.Generator().manual_seed(0)
    vocab = model.info.vocab_size
    ctx = torch.randint(0, vocab, (context,), generator=g).tolist()
    model.reset()
    model.forward_chain(ctx)
    times = {}
    for n in (1, 8, 1, 8):
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            model.forward(torch.randint(0, vocab, (n,), generator=g))
            samples.append(time.perf_counter() - t)
        times[n] = statistics.median(samples)
    model.reset()
    return {"t1_ms": times[1] * 1e3, "t8_ms": times[8] * 1e3, "ratio": times[8] / times[1], "context": context}


# ----------------------------------------------------------------------------- driver
@dataclass
class BenchSpec:
    methods: list[str]
    configs: dict = field(default_factory=dict)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    warmup: int = 1
    repeats: int = 1
    chat_template: bool = True


def run_bench(target, draft, questions: list[Question], spec: BenchSpec, out_dir: Path,
              log: Callable[[str], None] = print) -> dict:
    from core.text import encode_messages, encode_prompt
    from core.types import GenerationConfig, SamplingConfig

    if "autoregressive" not in spec.methods:
        spec.methods.insert(0, "autoregressive")
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = GenerationConfig(max_new_tokens=spec.max_new_tokens,
                           sampling=SamplingConfig(temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed))
    hf_models: dict = {}
    runners = {}
    for name in spec.methods:
        runners[name] = HFPeer(name, target, draft, hf_models) if name in PEERS else \
            OurMethod(name, spec.configs.get(name), target, draft)
    verify_cost = measure_verify_cost(target.model)
    log(f"target verify cost T(8)/T(1) = {verify_cost['ratio']:.2f}")
    tok = target.tokenizer

    def prompt_ids(history: list[dict]) -> list[int]:
        if spec.chat_template and getattr(tok, "chat_template", None):
            return encode_messages(tok, history)
        return encode_prompt(tok, history[-1]["content"], chat_template=False)

    answers: dict[str, list[dict]] = {name: [] for name in spec.methods}
    started = time.perf_counter()
    # Methods interleave per question, so slow drifts of a shared machine hit all of them alike.
    for rep in range(spec.repeats):
        for qi, q in enumerate(questions):
            for name, runner in runners.items():
                if rep == 0 and qi == 0:
                    for _ in range(spec.warmup):
                        runner.run(prompt_ids([{"role": "user", "content": q.turns[0]}]), gen)
                history: list[dict] = []
                turns = []
                for turn in q.turns:
                    history.append({"role": "user", "content": turn})
                    res = runner.run(prompt_ids(history), gen)
                    history.append({"role": "assistant", "content": res.text})
                    turns.append(res)
                answers[name].append({
                    "question_id": q.question_id, "category": q.category, "repeat": rep,
                    "turns": [t.text for t in turns], "token_ids": [t.token_ids for t in turns],
                    "new_tokens": [len(t.token_ids) for t in turns], "wall_time": [t.wall_time for t in turns],
                    "accept_lengths": None if turns[0].accept_lengths is None else [t.accept_lengths for t in turns],
                    "drafted": sum(t.drafted for t in turns), "accepted": sum(t.accepted for t in turns),
                })
            done = rep * len(questions) + qi + 1
            log(f"[{done}/{spec.repeats * len(questions)}] question {q.question_id} "
                f"({time.perf_counter() - started:.0f}s)")
    summary = summarize(answers, questions)
    _write_outputs(out_dir, answers, summary, verify_cost, target, draft, spec, runners)
    return {"summary": summary, "verify_cost": verify_cost}


def _write_outputs(out_dir, answers, summary, verify_cost, target, draft, spec, runners) -> None:
    from core.runlog import environment

    for name, recs in answers.items():
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps({
                    "question_id": r["question_id"], "category": r["category"], "answer_id": uuid.uuid4().hex,
                    "model_id": f"{target.spec}/{name}", "repeat": r["repeat"], "method": name,
                    "params": runners[name].params(),
                    "choices": [{"index": 0, "turns": r["turns"], "new_tokens": r["new_tokens"],
                                 "wall_time": r["wall_time"], "accept_lengths": r["accept_lengths"],
                                 "decoding_steps": None if r["accept_lengths"] is None else
                                 [len(a) for a in r["accept_lengths"]], "token_ids": r["token_ids"]}],
                    "tstamp": time.time(),
                }, ensure_ascii=False) + "\n")
    doc = {"summary": summary, "verify_cost": verify_cost, "baseline": "autoregressive",
           "target": target.spec, "draft": draft.spec if draft else None,
           "settings": {"methods": spec.methods, "max_new_tokens": spec.max_new_tokens,
                        "temperature": spec.temperature, "top_p": spec.top_p, "seed": spec.seed,
                        "warmup": spec.warmup, "repeats": spec.repeats},
           "params": {name: r.params() for name, r in runners.items()},
           "environment": environment(target.model)}
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")


def check_methods(names: list[str]) -> None:
    from core.methods import METHODS

    for n in names:
        if n not in METHODS and n not in PEERS:
            raise SpecPlayError(f"unknown method '{n}' (methods: {', '.join(METHODS)}; peers: {', '.join(PEERS)})")
