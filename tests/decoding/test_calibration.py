"""The tree methods' chances of acceptance, calibrated by the run's verdicts."""

import pytest

from specplay.core.decoding.calibration import PRIOR_FACTOR, Calibration


def test_a_head_never_borne_out_loses_its_word_within_a_few_steps():
    cal = Calibration()
    assert cal.factor == PRIOR_FACTOR == 0.5  # before any evidence: half the head's own word
    for _ in range(4):
        cal.observe([-1, 0, 1], [0.8, 0.8, 0.8], [])  # a chain of three, the first node rejected
    assert cal.factor < 0.3
    # Every chance is then scaled down, a deeper node's the more.
    values = cal.values([-1, 0, 1], [0.8, 0.8, 0.8])
    f = cal.factor
    assert values == pytest.approx([0.8 * f, (0.8 * f) ** 2, (0.8 * f) ** 3])


def test_a_modest_head_that_is_always_right_gains_trust_but_no_chance_passes_one():
    cal = Calibration()
    for _ in range(6):
        cal.observe([-1, 0, 1], [0.5, 0.5, 0.5], [0, 1, 2])  # all accepted
    assert cal.factor > 1.5
    values = cal.values([-1, 0, 1, -1], [0.6, 0.9, 0.5, 0.3])
    assert all(0.0 < v <= 1.0 for v in values)
    assert values[1] == values[0] == 1.0  # capped at 1, and never above its parent's
    assert values[2] <= values[1] and values[3] < values[0]


def test_each_level_counts_the_reached_nodes_children_and_nothing_past_a_leaf():
    """A tree: root children 0 (0.5) and 1 (0.3); 0's children 2 (0.4) and 3 (0.2); 2 a leaf.
    The path 0 -> 2 accepted: level 1 offered 0.8 and went on, level 2 offered 0.6 and went on,
    node 2 offered nothing (a leaf): 1.4 predicted against 2 realized."""
    cal = Calibration()
    cal.observe([-1, -1, 0, 0], [0.5, 0.3, 0.4, 0.2], [0, 2])
    assert cal.factor == pytest.approx((2 + 0.5) / (1.4 + 1))
    # The path stopping after node 0 (its children both rejected): 1.4 predicted, 1 realized.
    cal = Calibration()
    cal.observe([-1, -1, 0, 0], [0.5, 0.3, 0.4, 0.2], [0])
    assert cal.factor == pytest.approx((1 + 0.5) / (1.4 + 1))


def test_newer_steps_weigh_more():
    """A head wrong for a while, then right again: trust comes back within about ten steps."""
    cal = Calibration()
    for _ in range(10):
        cal.observe([-1], [0.9], [])
    low = cal.factor
    for _ in range(12):
        cal.observe([-1], [0.9], [0])
    assert low < 0.2 and cal.factor > 0.8


def test_one_step_borne_out_restores_the_heads_word():
    """Half the head's word before any evidence; a three-node chain accepted whole brings it back."""
    cal = Calibration()
    cal.observe([-1, 0, 1], [0.8, 0.8, 0.8], [0, 1, 2])
    assert cal.factor == pytest.approx((3 + 0.5) / (2.4 + 1))
    assert cal.factor > 1.0


def test_a_first_tree_from_a_confident_head_is_sized_small():
    """Before any verdict a confident head's chain (0.9 a level) is sized by half its word: on a curve
    where each verified node costs 8% of a step, 2 nodes are kept instead of its 5."""
    from specplay.core.decoding.costmodel import CostCurve, best_size

    parents, chances = [-1, 0, 1, 2, 3], [0.9] * 5
    curve = CostCurve.linear(0.08)
    trusted = [0.9 ** (d + 1) for d in range(5)]
    assert best_size(trusted, curve) == 5
    assert best_size(Calibration().values(parents, chances), curve) == 2
