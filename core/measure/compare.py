"""Run several methods on the same prompt, seed and settings, one after another, and compare.

Speedup is tokens/s over the ``autoregressive`` baseline's in the same run; at temperature
0 every output must equal the baseline's token for token. Each method first runs a short,
unrecorded warm-up (:func:`~specplay.core.decoding.engine.warm_up`), so the first one is not
timed cold (allocations, kernel first calls, a method's one-time calibration): the command line
and the app both compare this way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specplay.core.decoding.engine import WARMUP_TOKENS, run_to_end
from specplay.core.decoding.types import GenerationConfig, RunResult
from specplay.core.methods import build_method
from specplay.core.records.runlog import RunRecord, run_record


@dataclass
class Comparison:
    results: dict[str, RunResult] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    records_with_events: list[dict] = field(default_factory=list)


#: The method every other is measured against.
BASELINE = "autoregressive"


def annotate(records: list[dict], greedy: bool, baseline: str = BASELINE) -> None:
    """Add ``speedup`` and ``identical_to_baseline`` to each local run record, in place (remote
    runs are compared with each other: :func:`specplay.core.remote.runs.annotate_remote`)."""
    runs = [(r, RunRecord.from_dict(r)) for r in records]
    base = next((run for _, run in runs if run.method == baseline), None)
    for r, run in runs:
        if run.token_ids is None:
            continue
        if base is None:
            r["speedup"], r["identical_to_baseline"] = None, None
            continue
        r["speedup"] = run.tokens_per_s / base.tokens_per_s if base.tokens_per_s else None
        r["identical_to_baseline"] = (run.token_ids == base.token_ids) if greedy else None


def compare_methods(target, draft, names: list[str], configs: dict, prompt_ids: list[int], config: GenerationConfig,
                    *, prompt: str | None = None, warmup_tokens: int = WARMUP_TOKENS,
                    on_run: Callable[[str, RunResult], None] | None = None,
                    should_stop: Callable[[], bool] | None = None) -> Comparison:
    out = Comparison()
    for name in names:
        method = build_method(name, configs.get(name), target, draft)
        result = run_to_end(target.model, target.tokenizer, method, prompt_ids, config, warmup_tokens=warmup_tokens,
                            should_stop=should_stop)
        out.results[name] = result
        out.records.append(run_record(result, target=target, draft=draft, prompt=prompt))
        out.records_with_events.append(run_record(result, target=target, draft=draft, prompt=prompt,
                                                  include_events=True))
        if on_run:
            on_run(name, result)
        if result.cancelled:
            break
    annotate(out.records, config.sampling.greedy)
    annotate(out.records_with_events, config.sampling.greedy)
    return out


def format_table(records: list[dict]) -> str:
    head = f"{'method':16s} {'tok/s':>8s} {'speedup':>8s} {'τ':>6s} {'accept':>7s} {'tokens':>7s}  identical"
    lines = [head, "-" * len(head)]
    for r in map(RunRecord.from_dict, records):
        sp = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        acc = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.0%}"
        ident = {True: "✓", False: "✗ DIFFERENT", None: "-"}[r.identical_to_baseline]
        lossy = " (lossy)" if r.lossy else ""
        lines.append(f"{r.method + lossy:16s} {r.tokens_per_s:8.2f} {sp:>8s} {r.mean_accepted:6.2f} "
                     f"{acc:>7s} {r.new_tokens:7d}  {ident}")
    return "\n".join(lines)
