"""Run logs: one JSON object per run, a superset of the Spec-Bench answer record.

Spec-Bench's tools read ``question_id``, ``model_id`` and ``choices[i]`` with per-turn
``turns``, ``new_tokens``, ``wall_time`` and ``decoding_steps``, and one flat ``accept_lengths``
list over the turns (empty where the steps are unknown: an endpoint's); vLLM-style
readers find ``mean_acceptance_length`` and ``draft_acceptance_rate``. The flat fields carry
the rest: models, method and parameters, prompt, output, metrics and environment. With
``events`` the record also keeps every token's fate and numbers, so a run can be reopened
and shown exactly as it was.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from specplay.core.atomic import replacing
from specplay.core.records.environment import environment
from specplay.core.decoding.types import Fate, Rule, RunResult, StepEvent, StepTiming, TokenEvent


def _model_entry(loaded) -> dict | None:
    if loaded is None:
        return None
    info = loaded.model.info
    return {"id": loaded.model_id, "architecture": info.architecture, "backend": info.backend, "device": info.device,
            "dtype": info.dtype, "parameters": info.num_parameters, "notes": list(loaded.notes)}


def event_to_dict(e: StepEvent) -> dict:
    return {
        "step": e.step,
        "tokens": [[t.token_id, t.text, t.fate.value, t.depth, t.node, t.p, t.q, t.u, t.accept_prob,
                    None if t.rule is None else t.rule.value, t.source] for t in e.tokens],
        "committed": e.committed, "drafted": e.num_drafted, "accepted": e.num_accepted,
        "timing": [e.timing.draft_s, e.timing.verify_s, e.timing.other_s], "elapsed": e.elapsed_s,
        "tree": e.tree, "internals": e.internals, "stood_down": e.stood_down,
    }


def event_from_dict(d: dict, total_before: int = 0) -> StepEvent:
    # Logs written before the rule (and the source) were recorded have nine (ten) fields a token.
    tokens = [TokenEvent(token_id=t[0], text=t[1], fate=Fate(t[2]), depth=t[3], node=t[4], p=t[5], q=t[6], u=t[7],
                         accept_prob=t[8], rule=Rule(t[9]) if len(t) > 9 and t[9] else None,
                         source=t[10] if len(t) > 10 else None) for t in d["tokens"]]
    committed = list(d["committed"])
    return StepEvent(step=d["step"], tokens=tokens, committed=committed,
                     text="".join(t.text for t in tokens if t.fate is not Fate.REJECTED),
                     num_drafted=d["drafted"], num_accepted=d["accepted"], timing=StepTiming(*d["timing"]),
                     elapsed_s=d["elapsed"], total_new_tokens=total_before + len(committed), tree=d.get("tree", {}),
                     internals=d.get("internals", {}), stood_down=d.get("stood_down"))


@dataclass
class RunRecord:
    """One run as the run logs, the history and the exports keep it (a JSON object on disk).

    Every key the project writes is a field, in the order it is written. A local run
    (:meth:`of_run`) and an endpoint's (:func:`specplay.core.remote.runs.remote_record`) each leave out
    the keys the other has: the keys a record does not carry are listed in ``absent`` and left
    out of :meth:`to_dict` (they read as None here), so a record is written back as it was read,
    old files included. Keys this class does not know (an audit's, a newer version's, the app's
    ``chat_template``) stay in ``extra`` and are written after the rest.
    """

    question_id: Any = None
    answer_id: str | None = None
    model_id: str | None = None  # the target's id (a local run) or the served model's (an endpoint)
    tstamp: float | None = None
    method: str | None = None
    params: dict | None = None
    lossy: bool | None = None
    engine: dict | None = None  # an endpoint: where it is and the model it served
    target: dict | None = None  # a local run's models: id, architecture, backend, device, dtype, ...
    draft: dict | None = None
    prompt: str | None = None
    prompt_tokens: int | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    stop_reason: str | None = None
    cancelled: bool | None = None
    error: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    # Spec-Bench's answer fields (one turn)
    new_tokens: int | None = None
    wall_time: float | None = None
    accept_lengths: list[int] | None = None
    choices: list[dict] | None = None
    # metrics
    steps: int | None = None
    tokens_per_s: float | None = None
    prefill_time: float | None = None
    time_to_first_token: float | None = None
    inter_token_latency: float | None = None  # an endpoint's mean seconds between tokens
    mean_accepted: float | None = None
    # vLLM's: 1 + accepted draft tokens per draft (plain steps left out, unlike τ above).
    mean_acceptance_length: float | None = None
    acceptance_rate: float | None = None
    draft_acceptance_rate: float | None = None
    drafted: int | None = None
    accepted: int | None = None
    acceptance_by_position: list[float] | None = None
    acceptance_histogram: dict[str, int] | None = None
    spec_source: str | None = None  # an endpoint: where its speculation figures came from, None if not exposed
    # The names vLLM's speculative-decoding metrics use (llama.cpp's server reads the same):
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    acceptance_rate_per_position: list[float] | None = None
    stood_down_steps: int | None = None
    repeatable: bool | None = None
    unrepeatable_because: str | None = None
    tokens_by_source: dict[str, int] | None = None
    warnings: list[str] | None = None  # the method's (Method.warnings)
    time_split: dict[str, float] | None = None
    environment: dict | None = None
    events: list[dict] | None = None  # every step (event_to_dict), where the record keeps them
    # a comparison's (core/measure/compare.py, core/remote.py)
    speedup: float | None = None
    identical_to_baseline: bool | None = None
    absent: set[str] = field(default_factory=set, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in _KEYS and "absent" in self.__dict__:
            self.absent.discard(name)  # a key set after construction is carried from then on

    def to_dict(self) -> dict:
        """The record as it is written: the keys it carries, in order, then ``extra``."""
        out = {k: getattr(self, k) for k in _KEYS if k not in self.absent}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "RunRecord":
        """A record as read (from a log, the history or another version): missing keys read as None."""
        return cls(**{k: v for k, v in d.items() if k in _KEYS}, absent=set(_KEYS) - d.keys(),
                   extra={k: v for k, v in d.items() if k not in _KEYS})

    @classmethod
    def of_run(cls, result: RunResult, *, target, draft=None, prompt: str | None = None, question_id=None,
               include_events: bool = False, extra: dict | None = None) -> "RunRecord":
        """A local run's record; ``target`` and ``draft`` are the LoadedModels it ran, ``extra`` more keys."""
        m = result.metrics
        s = result.config.sampling
        record = cls(
            question_id=question_id, answer_id=uuid.uuid4().hex, model_id=target.model_id if target is not None else None,
            tstamp=time.time(), method=result.method, params=result.method_params, lossy=result.lossy,
            target=_model_entry(target), draft=_model_entry(draft), prompt=prompt,
            prompt_tokens=len(result.prompt_ids), text=result.text, token_ids=result.token_ids,
            stop_reason=result.stop_reason.value, cancelled=result.cancelled, error=result.error,
            temperature=s.temperature, top_p=s.top_p, seed=s.seed, max_new_tokens=result.config.max_new_tokens,
            new_tokens=m.new_tokens, wall_time=m.wall_time, accept_lengths=m.accept_lengths,
            choices=[{"index": 0, "turns": [result.text], "decoding_steps": [m.steps], "new_tokens": [m.new_tokens],
                      "wall_time": [m.wall_time], "accept_lengths": m.accept_lengths}],  # one turn: already flat
            steps=m.steps, tokens_per_s=m.tokens_per_s, prefill_time=m.prefill_time,
            time_to_first_token=m.time_to_first_token, mean_accepted=m.mean_accepted,
            mean_acceptance_length=1 + m.accepted / m.num_drafts if m.num_drafts else None,
            acceptance_rate=m.acceptance_rate, draft_acceptance_rate=m.acceptance_rate, drafted=m.drafted,
            accepted=m.accepted, acceptance_by_position=m.acceptance_by_position,
            acceptance_histogram={str(k): v for k, v in sorted(Counter(m.accept_lengths).items())},
            num_drafts=m.num_drafts, num_draft_tokens=m.drafted, num_accepted_tokens=m.accepted,
            acceptance_rate_per_position=[a / m.num_drafts for a in m.accepted_per_position] if m.num_drafts else [],
            stood_down_steps=m.stood_down_steps, repeatable=result.unrepeatable is None,
            unrepeatable_because=result.unrepeatable, tokens_by_source=tokens_by_source(result.events),
            warnings=list(result.warnings), time_split={"draft": m.draft_s, "verify": m.verify_s, "other": m.other_s},
            environment=environment(target, draft),
            events=[event_to_dict(e) for e in result.events] if include_events else None,
            absent=ENDPOINT_ONLY | COMPARISON_ONLY | (set() if include_events else {"events"}),
        )
        for key, value in (extra or {}).items():
            if key in _KEYS:
                setattr(record, key, value)
            else:
                record.extra[key] = value
        return record


_KEYS = tuple(f.name for f in fields(RunRecord) if f.name not in ("absent", "extra"))
#: Keys only an endpoint's record carries, and only a local run's.
ENDPOINT_ONLY = frozenset({"engine", "inter_token_latency", "spec_source"})
LOCAL_ONLY = frozenset({"num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate_per_position",
                        "stood_down_steps", "repeatable", "unrepeatable_because", "tokens_by_source",
                        "warnings"})
#: Keys a comparison adds to its records (:func:`specplay.core.measure.compare.annotate`).
COMPARISON_ONLY = frozenset({"speedup", "identical_to_baseline"})


def stats_line(record: RunRecord | dict) -> str:
    """One line that sums up a run record (the CLI prints it after a run; the app shows it under the text)."""
    r = record if isinstance(record, RunRecord) else RunRecord.from_dict(record)
    parts = [f"{r.new_tokens} tokens in {r.wall_time:.2f} s", f"{r.tokens_per_s:.1f} tok/s"]
    if r.time_to_first_token is not None:
        parts.append(f"first token {r.time_to_first_token:.2f} s")
    if r.mean_accepted is not None:
        parts.append(f"τ {r.mean_accepted:.2f}")
    if r.acceptance_rate is not None:
        parts.append(f"acceptance {r.acceptance_rate:.0%}")
    if r.stood_down_steps:
        parts.append(f"drafting stood down for {r.stood_down_steps} steps")
    if r.tokens_by_source:
        parts.append("offered by " + ", ".join(f"{k} {v}" for k, v in r.tokens_by_source.items()))
    parts.append(f"stop: {r.stop_reason}")
    if r.lossy:
        parts.append("LOSSY")
    parts += [f"warning: {w}" for w in r.warnings or ()]
    return " · ".join(parts)


def tokens_by_source(events) -> dict[str, int]:
    """How many output tokens each proposer offered (``draft model``, ``Medusa head 1``, ``bonus``, ...)."""
    counts = Counter(t.source for e in events for t in e.tokens if t.fate is not Fate.REJECTED and t.source)
    return dict(counts.most_common())


def run_record(result: RunResult, *, target, draft=None, prompt: str | None = None, question_id=None,
               include_events: bool = False, extra: dict | None = None) -> dict:
    """A local run's record as it is written (:meth:`RunRecord.of_run`)."""
    return RunRecord.of_run(result, target=target, draft=draft, prompt=prompt, question_id=question_id,
                            include_events=include_events, extra=extra).to_dict()


def dumps(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


def append_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Append records as JSON lines and flush them to disk before returning.

    If an earlier writer died mid-line, the torn line is closed first, so it stays the only
    unreadable line and the new records stay whole.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = False
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    with open(path, "a", encoding="utf-8") as f:
        if torn:
            f.write("\n")
        for r in records:
            f.write(dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_jsonl_atomic(path: Path, records: Iterable[dict]) -> None:
    """Write records to ``path`` through a temporary file, replacing it only when complete."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(dumps(r) + "\n")




