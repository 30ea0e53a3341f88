"""Run logs: one JSON object per run, a superset of the Spec-Bench answer record.

Spec-Bench's tools read ``question_id``, ``model_id`` and ``choices[i]`` with per-turn
``turns``, ``new_tokens``, ``wall_time``, ``accept_lengths`` and ``decoding_steps``; vLLM-style
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
from pathlib import Path
from typing import Iterable

from specplay.core.atomic import replacing
from specplay.core.environment import environment
from specplay.core.types import Fate, Rule, RunResult, StepEvent, StepTiming, TokenEvent


def _model_entry(loaded) -> dict | None:
    if loaded is None:
        return None
    info = loaded.model.info
    return {"id": loaded.spec, "architecture": info.architecture, "backend": info.backend, "device": info.device,
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


def stats_line(record: dict) -> str:
    """One line that sums up a run record (the CLI prints it after a run; the app shows it under the text)."""
    acc = record.get("acceptance_rate")
    parts = [f"{record['new_tokens']} tokens in {record['wall_time']:.2f} s", f"{record['tokens_per_s']:.1f} tok/s"]
    if record.get("time_to_first_token") is not None:
        parts.append(f"first token {record['time_to_first_token']:.2f} s")
    if record.get("mean_accepted") is not None:
        parts.append(f"τ {record['mean_accepted']:.2f}")
    if acc is not None:
        parts.append(f"acceptance {acc:.0%}")
    if record.get("stood_down_steps"):
        parts.append(f"drafting stood down for {record['stood_down_steps']} steps")
    if record.get("tokens_by_source"):
        parts.append("offered by " + ", ".join(f"{k} {v}" for k, v in record["tokens_by_source"].items()))
    parts.append(f"stop: {record['stop_reason']}")
    if record.get("lossy"):
        parts.append("LOSSY")
    return " · ".join(parts)


def tokens_by_source(events) -> dict[str, int]:
    """How many output tokens each proposer offered (``draft model``, ``Medusa head 1``, ``bonus``, ...)."""
    counts = Counter(t.source for e in events for t in e.tokens if t.fate is not Fate.REJECTED and t.source)
    return dict(counts.most_common())


def run_record(result: RunResult, *, target, draft=None, prompt: str | None = None, question_id=None,
               include_events: bool = False, extra: dict | None = None) -> dict:
    m = result.metrics
    s = result.config.sampling
    record = {
        "question_id": question_id,
        "answer_id": uuid.uuid4().hex,
        "model_id": target.spec if target is not None else None,
        "tstamp": time.time(),
        "method": result.method,
        "params": result.method_params,
        "lossy": result.lossy,
        "target": _model_entry(target),
        "draft": _model_entry(draft),
        "prompt": prompt,
        "prompt_tokens": len(result.prompt_ids),
        "text": result.text,
        "token_ids": result.token_ids,
        "stop_reason": result.stop_reason.value,
        "cancelled": result.cancelled,
        "error": result.error,
        "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed,
        "max_new_tokens": result.config.max_new_tokens,
        # Spec-Bench answer fields (one turn)
        "new_tokens": m.new_tokens,
        "wall_time": m.wall_time,
        "accept_lengths": m.accept_lengths,
        "choices": [{"index": 0, "turns": [result.text], "decoding_steps": [m.steps], "new_tokens": [m.new_tokens],
                     "wall_time": [m.wall_time], "accept_lengths": [m.accept_lengths]}],
        # metrics
        "steps": m.steps,
        "tokens_per_s": m.tokens_per_s,
        "prefill_time": m.prefill_time,
        "time_to_first_token": m.time_to_first_token,
        "mean_accepted": m.mean_accepted,
        # vLLM's: 1 + accepted draft tokens per draft (plain steps left out, unlike τ above).
        "mean_acceptance_length": 1 + m.accepted / m.num_drafts if m.num_drafts else None,
        "acceptance_rate": m.acceptance_rate,
        "draft_acceptance_rate": m.acceptance_rate,
        "drafted": m.drafted,
        "accepted": m.accepted,
        "acceptance_by_position": m.acceptance_by_position,
        "acceptance_histogram": {str(k): v for k, v in sorted(Counter(m.accept_lengths).items())},
        # The names vLLM's speculative-decoding metrics use (llama.cpp's server reads the same):
        "num_drafts": m.num_drafts,
        "num_draft_tokens": m.drafted,
        "num_accepted_tokens": m.accepted,
        "acceptance_rate_per_position": [a / m.num_drafts for a in m.accepted_per_position] if m.num_drafts else [],
        "stood_down_steps": m.stood_down_steps,
        "repeatable": result.unrepeatable is None,
        "unrepeatable_because": result.unrepeatable,
        "tokens_by_source": tokens_by_source(result.events),
        "time_split": {"draft": m.draft_s, "verify": m.verify_s, "other": m.other_s},
        "environment": environment(target, draft),
    }
    if include_events:
        record["events"] = [event_to_dict(e) for e in result.events]
    if extra:
        record.update(extra)
    return record


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




