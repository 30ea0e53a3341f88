"""The "why this speed" step-cost model: arithmetic, break-even, and the command line."""

import pytest

from specplay.core.decoding.costmodel import CostCurve
from specplay.core.measure.whyspeed import break_even_cost, chain_speedup, explain, format_explanation
from specplay.core.records.runlog import RunRecord

CURVE = CostCurve((1, 2, 4, 8), (1.0, 1.05, 1.1, 1.3))


def record(method, steps, new_tokens, drafted, draft, verify, other=0.0):
    return RunRecord(method=method, steps=steps, new_tokens=new_tokens, drafted=drafted,
                     mean_accepted=new_tokens / steps, time_split={"draft": draft, "verify": verify, "other": other})


def test_the_prediction_from_tau_and_step_costs_matches_hand_computation():
    # Plain decoding: 100 steps of 0.05 s, so T(1) = 0.05 s.
    base = record("autoregressive", 100, 100, 0, 0.0, 5.0)
    # 25 steps of 3 drafted tokens at 0.01 s each (c = 0.2) and a 4-row verification (T(4)/T(1) = 1.1).
    spec = record("speculative", 25, 100, 75, 0.75, 25 * 0.055)
    plain, fast = explain([base, spec], CURVE)
    assert plain.predicted_speedup == pytest.approx(1.0) and plain.measured_speedup == pytest.approx(1.0)
    assert fast.nodes_per_step == pytest.approx(3.0) and fast.draft_cost == pytest.approx(0.6)
    assert fast.verify_cost == pytest.approx(1.1) and fast.draft_cost_per_token == pytest.approx(0.2)
    assert fast.predicted_speedup == pytest.approx(4.0 / 1.7)
    assert fast.measured_speedup == pytest.approx((100 / 2.125) / (100 / 5.0))
    text = format_explanation([plain, fast], CURVE)
    assert "speculative" in text and "break-even" in text


@pytest.mark.parametrize("alpha", [0.5, 0.7, 0.9])
def test_at_the_break_even_draft_cost_speculation_neither_wins_nor_loses(alpha):
    c = break_even_cost(alpha, 5, CURVE)
    assert chain_speedup(alpha, 5, c, CURVE) == pytest.approx(1.0)
    assert chain_speedup(alpha, 5, c * 0.5, CURVE) > 1.0 > chain_speedup(alpha, 5, c * 1.5, CURVE)
