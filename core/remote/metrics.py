"""Speculation as each engine reports it: Prometheus text parsed, vLLM's counters differenced over a
run, SGLang's gauges, llama.cpp server's timings."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from specplay.core.remote.endpoint import Endpoint, RemoteError
from specplay.core.remote.transport import deadline_of, http_get

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of Prometheus' text format: (name, sorted labels) -> value."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if not math.isfinite(value):  # NaN and ±Inf are allowed in the format but say nothing of a run
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    return out


def _total(samples: dict, name: str) -> float | None:
    """The sum of a metric over its label sets (engines, ranks), or None if absent."""
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


@dataclass
class SpecStats:
    """Speculative decoding as an engine reports it; any field may be unknown (None)."""

    source: str  # "vllm-metrics", "sglang-metrics", "llamacpp-timings"
    mean_accepted: float | None = None  # tokens per step, the bonus token included (τ)
    acceptance_rate: float | None = None  # accepted / drafted
    drafted: int | None = None
    accepted: int | None = None
    by_position: list[float] | None = None  # acceptance at draft position 1, 2, ...
    steps: int | None = None  # the target's decoding steps (passes that yielded tokens), where known


def vllm_spec_stats(before: dict, after: dict) -> SpecStats | None:
    """This run's speculation from vLLM's counters read before and after it."""
    def delta(name: str) -> float | None:
        a, b = _total(after, name), _total(before, name)
        return None if a is None else a - (b or 0.0)

    drafts = delta("vllm:spec_decode_num_drafts_total")
    drafted = delta("vllm:spec_decode_num_draft_tokens_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    if drafts is None or drafted is None or accepted is None:
        return None
    per_pos: dict[int, float] = {}
    for (name, labels), value in after.items():
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = dict(labels).get("position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + value - before.get((name, labels), 0.0)
    return SpecStats(source="vllm-metrics", drafted=int(drafted), accepted=int(accepted),
                     mean_accepted=1 + accepted / drafts if drafts else None,
                     acceptance_rate=accepted / drafted if drafted else None,
                     by_position=[per_pos[k] / drafts for k in sorted(per_pos)] if per_pos and drafts else None)


def sglang_spec_stats(after: dict) -> SpecStats | None:
    length = _total(after, "sglang:spec_accept_length")
    if length is None:
        return None
    rates = [v for (n, _), v in after.items() if n == "sglang:spec_accept_rate"]
    return SpecStats(source="sglang-metrics", mean_accepted=length,
                     acceptance_rate=sum(rates) / len(rates) if rates else None)


def llamacpp_spec_stats(timings: dict | None) -> SpecStats | None:
    if not timings or not timings.get("draft_n"):
        return None
    drafted, accepted = int(timings["draft_n"]), int(timings.get("draft_n_accepted") or 0)
    generated = timings.get("predicted_n")
    steps = (generated - accepted) if generated else None
    return SpecStats(source="llamacpp-timings", drafted=drafted, accepted=accepted, acceptance_rate=accepted / drafted,
                     mean_accepted=generated / steps if steps else None, steps=steps or None)


def read_metrics(endpoint: Endpoint, deadline: float | None = None) -> dict:
    """The server's ``/metrics`` samples, or {} where it has none (not every engine does)."""
    try:
        status, body = http_get(endpoint, "/metrics", deadline_of(endpoint, deadline), absolute=True)
    except RemoteError:
        return {}
    return parse_prometheus(body) if status == 200 else {}
