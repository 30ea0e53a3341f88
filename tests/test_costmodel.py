"""The verification cost curve and the size choice built on it."""

import pytest
import torch

from specplay.core.decoding.costmodel import CostCurve, best_size, cost_curve, measure
from tiny import native_from_hf, tiny_hf_model


def test_curve_interpolates_and_extrapolates():
    c = CostCurve((1, 2, 4, 8), (1.0, 1.1, 1.2, 1.6))
    assert c(1) == 1.0 and c(3) == pytest.approx(1.15) and c(6) == pytest.approx(1.4)
    assert c(12) == pytest.approx(2.0)  # the last slope, 0.1 per token
    assert CostCurve.linear(0.05)(11) == pytest.approx(1.5)


def test_best_size_weighs_acceptance_against_cost():
    free = CostCurve.linear(0.0)
    cpu = CostCurve.linear(0.05)
    chain = lambda a, k: [a ** i for i in range(1, k + 1)]  # noqa: E731
    assert best_size(chain(0.9, 10), free) == 10  # free verification: propose everything
    assert best_size(chain(0.9, 10), cpu) == 10
    assert best_size(chain(0.2, 10), cpu) == 1  # weak guesses: one token
    assert best_size(chain(0.02, 10), cpu) == 0  # hopeless guesses: plain decoding
    assert 1 < best_size(chain(0.6, 10), CostCurve.linear(0.1)) < 10
    assert best_size(chain(0.9, 10), cpu, cap=3) == 3
    # Fading candidates: a curve that turns steep past 8 tokens stops at the bend (7 + the root).
    fading = [0.6 * 0.8 ** i for i in range(16)]
    assert best_size(fading, CostCurve((1, 8, 16), (1.0, 1.2, 2.0))) == 7
    assert best_size(fading, CostCurve.linear(0.02)) == 11
    assert best_size(fading, CostCurve.linear(0.0)) == 16


def test_block_sizes_take_turns_and_each_keeps_its_fastest_pass(monkeypatch):
    """A slow spell of the machine touches every size once instead of inflating the one it fell on."""
    from specplay.core.decoding import costmodel

    clock = [0.0]
    order = []

    class Fake:
        info = type("Info", (), {"vocab_size": 50})()

        def reset(self):
            pass

        def forward_chain(self, tokens):
            pass

        def forward(self, block):
            n = len(block)
            order.append(n)
            slow = 100.0 if len(order) in (2, 3) else 0.0  # a spell over two consecutive passes
            clock[0] += n + slow

    monkeypatch.setattr(costmodel.time, "perf_counter", lambda: clock[0])
    assert costmodel.time_passes(Fake(), (1, 8, 16), repeats=3) == [1.0, 8.0, 16.0]
    assert order == [1, 8, 16] * 3


def test_measured_curve_is_nondecreasing_cached_and_leaves_the_cache_empty():
    model = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32))
    curve = measure(model, sizes=(1, 2, 4, 8), context=8, repeats=2)
    assert curve.relative[0] == 1.0
    assert all(b >= a for a, b in zip(curve.relative, curve.relative[1:]))
    assert model.cache_len == 0
    assert cost_curve(model) is cost_curve(model)


def test_a_curve_is_measured_once_per_machine_and_model_and_read_back_in_a_later_start(monkeypatch, tmp_path):
    """A later start of a one-shot command does not time the model again: the curve is kept with
    the machine's measurements, keyed by the model, its storage and the code that runs it."""
    from specplay.core.decoding import costmodel

    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    first = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32))
    measured = cost_curve(first)
    monkeypatch.setattr(costmodel, "measure", lambda *a, **k: pytest.fail("measured again"))
    again = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32))  # another process's load, as it were
    assert cost_curve(again) == measured
    other = native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32, hidden=64))
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        cost_curve(other)
