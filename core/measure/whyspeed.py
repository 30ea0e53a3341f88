"""Why a method is as fast as it is, on this machine: a step-cost model checked against the run.

A decoding step of a speculative method costs its drafting plus one verification pass over
the root and its draft nodes, and yields τ tokens on average. In units of one plain decoding
step T(1) (the target's one-token forward pass, measured as ``autoregressive``'s time per
step in the same comparison)::

    step cost  =  draft / T(1)  +  T(1 + k) / T(1)  +  other / T(1)
    speedup    ≈  τ / step cost                    (decoding only, prefill aside)

with k the mean number of draft nodes verified per step and T(n)/T(1) this machine's measured
verification cost curve (:mod:`specplay.core.decoding.costmodel`). Comparing this prediction with the measured
decoding speedup shows where time goes; a gap means time the model does not see.

The break-even picture (Leviathan et al.'s analysis with a measured cost curve): a chain of γ
draft tokens, each accepted with probability α, yields (1 − α^(γ+1)) / (1 − α) tokens per step;
with a draft that costs c·T(1) per token, speculation pays when that exceeds γ·c + T(1+γ)/T(1).
"""

from __future__ import annotations

from dataclasses import dataclass

from specplay.core.decoding.costmodel import CostCurve
from specplay.core.records.runlog import RunRecord


@dataclass(frozen=True)
class SpeedExplanation:
    method: str
    tau: float
    nodes_per_step: float  # draft nodes verified per step (k)
    draft_cost: float  # drafting per step, in T(1)
    verify_cost: float  # T(1 + k) / T(1) from the curve
    other_cost: float  # bookkeeping per step, in T(1)
    predicted_speedup: float
    measured_speedup: float
    draft_cost_per_token: float | None  # drafting per drafted token, in T(1) (c)

    def to_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def _decode_time(record: RunRecord) -> float:
    split = record.time_split
    return split["draft"] + split["verify"] + split["other"]


def explain(records: list[RunRecord], curve: CostCurve, baseline: str = "autoregressive") -> list[SpeedExplanation]:
    """One explanation per run record of one comparison (each with its steps, drafted tokens and time split)."""
    base = next(r for r in records if r.method == baseline)
    t1 = _decode_time(base) / base.steps  # one plain step, as this comparison measured it
    base_rate = base.new_tokens / _decode_time(base)
    out = []
    for r in records:
        steps = max(r.steps, 1)
        split = r.time_split
        k = r.drafted / steps
        draft, other = split["draft"] / steps / t1, split["other"] / steps / t1
        verify = curve(1 + round(k))
        tau = r.mean_accepted
        measured = r.new_tokens / _decode_time(r) / base_rate if _decode_time(r) > 0 else 0.0
        out.append(SpeedExplanation(
            method=r.method, tau=tau, nodes_per_step=k, draft_cost=draft, verify_cost=verify, other_cost=other,
            predicted_speedup=tau / (draft + verify + other), measured_speedup=measured,
            draft_cost_per_token=split["draft"] / r.drafted / t1 if r.drafted else None))
    return out


def chain_speedup(alpha: float, gamma: int, draft_cost: float, curve: CostCurve) -> float:
    """Expected speedup of a γ-token chain draft accepted per token with probability α, drafts costing c·T(1)."""
    expected = float(gamma + 1) if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return expected / (gamma * draft_cost + curve(1 + gamma))


def break_even_cost(alpha: float, gamma: int, curve: CostCurve) -> float:
    """The draft cost per token (in T(1)) at which a γ-chain accepted with probability α stops paying."""
    expected = float(gamma + 1) if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return max(0.0, (expected - curve(1 + gamma)) / gamma)


def format_explanation(rows: list[SpeedExplanation], curve: CostCurve) -> str:
    lines = ["Why this speed (costs in units of one plain decoding step T(1)):",
             "verify cost T(n)/T(1): " + "  ".join(f"{n}: {r:.2f}" for n, r in zip(curve.sizes, curve.relative)),
             f"{'method':16s} {'τ':>6s} {'nodes':>6s} {'draft':>6s} {'verify':>7s} {'other':>6s} "
             f"{'predicted':>10s} {'measured':>9s}  draft/token"]
    for e in rows:
        c = "-" if e.draft_cost_per_token is None else f"{e.draft_cost_per_token:.2f}"
        lines.append(f"{e.method:16s} {e.tau:6.2f} {e.nodes_per_step:6.1f} {e.draft_cost:6.2f} {e.verify_cost:7.2f} "
                     f"{e.other_cost:6.2f} {e.predicted_speedup:9.2f}x {e.measured_speedup:8.2f}x  {c}")
    lines.append("break-even draft cost per token c for a γ = 5 chain (speculation pays below it):")
    lines.append("  " + "  ".join(f"α {a:.1f}: c < {break_even_cost(a, 5, curve):.2f}" for a in (0.5, 0.6, 0.7, 0.8, 0.9)))
    return "\n".join(lines)
