"""What verifying n tokens costs, relative to one, for this model on this machine.

This ratio decides whether and how far to speculate. On a GPU a step of 16 tokens costs
about what one costs; on a CPU each extra token adds a few percent, and past ~8 tokens the
int8 kernels become compute-bound and the cost climbs faster (docs/benchmarks.md). So the
methods that can choose how much to draft (prompt lookup's proposal length, Medusa's tree,
EAGLE's dynamic tree) measure the curve once per model and pick the size that maximises
expected tokens per unit of time.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostCurve:
    """T(n) / T(1) at measured block sizes, interpolated linearly (extrapolated past the last)."""

    sizes: tuple[int, ...]
    relative: tuple[float, ...]

    def __call__(self, n: int) -> float:
        s, r = self.sizes, self.relative
        if n <= s[0]:
            return r[0]
        for i in range(1, len(s)):
            if n <= s[i]:
                return r[i - 1] + (r[i] - r[i - 1]) * (n - s[i - 1]) / (s[i] - s[i - 1])
        slope = (r[-1] - r[-2]) / (s[-1] - s[-2])
        return r[-1] + slope * (n - s[-1])

    @staticmethod
    def linear(per_token: float) -> "CostCurve":
        """A curve where each extra token costs ``per_token`` of a one-token step."""
        return CostCurve((1, 2), (1.0, 1.0 + per_token))

    def to_dict(self) -> dict:
        return {str(n): round(r, 3) for n, r in zip(self.sizes, self.relative)}


_CURVES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def time_passes(model, sizes: Sequence[int], context: int = 64, repeats: int = 3, median: bool = False,
                check: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of a forward pass of each block size after ``context`` cached tokens: the fastest of ``repeats``
    (the median with ``median``: what a run of many such passes meets on a shared machine); ``check``
    runs before each pass (it raises to stop).

    The sizes take turns (``repeats`` rounds of all of them) and each keeps its fastest pass:
    on a shared machine noise only ever adds time, and a slow spell then touches every size
    instead of inflating the one it fell on (a median of back-to-back passes once put T(8) at
    1.9 T(1) where the session's other measurements said 1.2-1.6). The one timing harness: the
    cost curve and the benchmark's verify-cost line both use it. The cache is reset afterwards.
    """
    vocab = model.info.vocab_size
    g = torch.Generator().manual_seed(0)
    model.reset()
    model.forward_chain(torch.randint(0, vocab, (context,), generator=g))
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for i, n in enumerate(sizes):
            block = torch.randint(0, vocab, (n,), generator=g)
            check()
            start = time.perf_counter()
            model.forward(block)  # left pending: the next pass overwrites it
            times[i].append(time.perf_counter() - start)
    model.reset()
    return [sorted(t)[len(t) // 2] if median else min(t) for t in times]


def measure(model, sizes: Sequence[int] = SIZES, context: int = 64, repeats: int = 3) -> CostCurve:
    """This model's curve on this machine (see :func:`time_passes`)."""
    medians = time_passes(model, sizes, context, repeats)
    # A bigger block never costs less (timing noise or an odd kernel choice aside).
    relative, peak = [], 0.0
    for t in medians:
        peak = max(peak, t / medians[0])
        relative.append(peak)
    return CostCurve(tuple(sizes), tuple(relative))


def is_measured(model) -> bool:
    """Whether :func:`cost_curve` already holds this model's curve (so asking for it is free)."""
    return model in _CURVES


def cost_curve(model) -> CostCurve:
    """The model's cost curve: measured once per machine, model and storage (several seconds on a
    CPU: a later start of a one-shot command should not pay them again), kept with the machine's
    other measurements, and held per loaded model."""
    curve = _CURVES.get(model)
    if curve is None:
        curve = _CURVES[model] = _kept_curve(model)
    return curve


def _kept_curve(model) -> CostCurve:
    from specplay.core import __version__
    from specplay.core.models import kernel_build
    from specplay.core.models.engines import measured

    info = model.info
    # What the curve depends on besides the machine (in the measurements' key already): the model,
    # how it is stored and run, and the code that runs it.
    key = (f"cost curve {info.name} {info.num_parameters} {info.backend} {info.dtype} {info.device} "
           f"specplay {__version__} kquant {kernel_build.library_digest()}")
    kept = measured(key, lambda: measure(model).to_dict(),
                    valid=lambda d: all(isinstance(d.get(str(n)), (int, float)) for n in SIZES))
    return CostCurve(SIZES, tuple(float(kept[str(n)]) for n in SIZES))


def best_size(values: Sequence[float], curve: CostCurve, fixed: int = 1, cap: int | None = None) -> int:
    """How many candidates (taken in the given order) maximise expected tokens per unit of time.

    ``values[i]`` is candidate i's probability of being accepted (in descending order, each
    candidate's ancestors before it); a step yields 1 + their sum and costs
    ``curve(fixed + k)``, ``fixed`` being the tokens the forward pass always holds (the root).
    """
    limit = len(values) if cap is None else min(cap, len(values))
    best_k, best_rate, expected = 0, 1.0 / curve(fixed), 1.0
    for k in range(1, limit + 1):
        expected += values[k - 1]
        rate = expected / curve(fixed + k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
