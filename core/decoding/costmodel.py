"""What verifying n tokens costs, relative to one, for this model on this machine.

This ratio decides whether and how far to speculate. On a GPU a step of 16 tokens costs
about what one costs; on a CPU each extra token adds a few percent, and past ~8 tokens the
int8 kernels become compute-bound and the cost climbs faster (docs/benchmarks.md). So the
methods that can choose how much to draft (prompt lookup's proposal length, Medusa's tree,
EAGLE's dynamic tree) measure the curve once per model and pick the size that maximises
expected tokens per unit of time.

The curve kept for a model is a prior: measured once, it may have been timed beside a compiler
or on a machine that has since slowed. :class:`CorrectedCurve` holds it with every verification
pass the runs have timed since, newer passes weighing more, and answers with the corrected ratio:
a curve kept 2x too steep sizes the drafts by the run's own timings within a few steps.
"""

from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

SIZES = (1, 2, 4, 8, 16, 32, 64)
#: Seconds after which the cost curve's timing starts no further round (a first launch waits for it;
#: the first round always runs): a round of all sizes is about 1.1 s for the 1.5B target on a 2-core
#: Xeon, so 3 rounds there; about 4 s where verifying 8 rows costs 3.4 steps, so one. The runs' own
#: passes then correct the curve (:class:`CorrectedCurve`).
CURVE_BUDGET_S = 2.5


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


class CorrectedCurve:
    """A kept :class:`CostCurve` corrected by the passes timed since (:meth:`observe`).

    Each block size seen keeps a decayed mean of its passes' seconds (the newest pass weighs
    :data:`NEWEST`, so a machine that slows, or a context that grows, moves it within a few
    passes). Where one-token passes were timed too, the ratio at a seen size is its time over
    theirs: what each row past the first costs beyond the kept ratio is read there, interpolated
    between seen sizes and held past them (a curve kept twice too steep is then right at every
    size). Without a timed one-token pass the passes say how fast the machine runs, not how the
    curve bends: the ratio stays the kept one.
    Called like a :class:`CostCurve`; ``sizes``/``relative`` give the corrected ratio at the kept sizes.
    """

    #: The newest pass's weight in its block size's mean.
    NEWEST = 0.4

    def __init__(self, kept: CostCurve):
        self.kept = kept
        self._seconds: dict[int, float] = {}  # block size -> decayed mean seconds of its passes
        self._newest: int | None = None  # the size timed last

    def observe(self, rows: int, seconds: float) -> None:
        """One verification (or plain) pass of ``rows`` rows took ``seconds``."""
        if rows < 1 or not seconds > 0:
            return
        before = self._seconds.get(rows)
        self._seconds[rows] = seconds if before is None else before + self.NEWEST * (seconds - before)
        self._newest = rows

    @property
    def observed(self) -> dict[int, float]:
        """Seconds of a pass by block size, as timed in the runs (decayed means)."""
        return dict(self._seconds)

    def _per_row(self, n: int) -> float:
        """What each row past the first costs more (or less) than the kept ratio says, at ``n`` rows."""
        timed = dict(self._seconds)  # one copy: the engine's thread may time a pass meanwhile
        one = timed.get(1)
        seen = sorted(k for k in timed if k > 1)
        if one is None or not seen:
            return 0.0
        slope = {k: (timed[k] / one - self.kept(k)) / (k - 1) for k in seen}
        below = [k for k in seen if k <= n]
        above = [k for k in seen if k >= n]
        if not below or not above:
            return slope[seen[0] if not below else seen[-1]]
        lo, hi = below[-1], above[0]
        if lo == hi:
            return slope[lo]
        return slope[lo] + (slope[hi] - slope[lo]) * (n - lo) / (hi - lo)

    def __call__(self, n: int) -> float:
        return max(1.0, self.kept(n) + (n - 1) * self._per_row(n))

    def step_seconds(self) -> float | None:
        """What a one-token pass takes now: timed, or implied by the newest pass and the ratio."""
        if 1 in self._seconds:
            return self._seconds[1]
        if self._newest is None:
            return None
        return self._seconds[self._newest] / self(self._newest)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.kept.sizes

    @property
    def relative(self) -> tuple[float, ...]:
        return tuple(self(n) for n in self.kept.sizes)

    def to_dict(self) -> dict:
        return {str(n): round(self(n), 3) for n in self.kept.sizes}


def timed_step(curve) -> float | None:
    """What a one-token pass of ``curve``'s model takes as its runs timed it; None for a curve that times
    nothing (a plain :class:`CostCurve`, as a test pins one) or before any pass was timed."""
    return curve.step_seconds() if isinstance(curve, CorrectedCurve) else None


_CURVES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def time_passes(model, sizes: Sequence[int], context: int = 64, repeats: int = 3, median: bool = False,
                check: Callable[[], None] = lambda: None, budget: float | None = None) -> list[float]:
    """Seconds of a forward pass of each block size after ``context`` cached tokens: the fastest of ``repeats``
    (the median with ``median``: what a run of many such passes meets on a shared machine); ``check``
    runs before each pass (it raises to stop). With a ``budget`` (seconds), no round starts once the
    rounds so far have taken it.

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
    started = time.perf_counter()
    for round_ in range(repeats):
        if round_ and budget is not None and time.perf_counter() - started >= budget:
            break
        for i, n in enumerate(sizes):
            block = torch.randint(0, vocab, (n,), generator=g)
            check()
            start = time.perf_counter()
            model.forward(block)  # left pending: the next pass overwrites it
            times[i].append(time.perf_counter() - start)
    model.reset()
    return [sorted(t)[len(t) // 2] if median else min(t) for t in times]


def measure(model, sizes: Sequence[int] = SIZES, context: int = 64, repeats: int = 3,
            budget: float | None = CURVE_BUDGET_S) -> CostCurve:
    """This model's curve on this machine (see :func:`time_passes`), within ``budget``."""
    medians = time_passes(model, sizes, context, repeats, budget=budget)
    # A bigger block never costs less (timing noise or an odd kernel choice aside).
    relative, peak = [], 0.0
    for t in medians:
        peak = max(peak, t / medians[0])
        relative.append(peak)
    return CostCurve(tuple(sizes), tuple(relative))


def is_measured(model) -> bool:
    """Whether :func:`cost_curve` already holds this model's curve (so asking for it is free)."""
    return model in _CURVES


def cost_curve(model) -> CorrectedCurve:
    """The model's cost curve: measured once per machine, model and storage (several seconds on a
    CPU: a later start of a one-shot command should not pay them again), kept with the machine's
    other measurements, and held per loaded model, corrected by every pass its runs time
    (:func:`observe`)."""
    curve = _CURVES.get(model)
    if curve is None:
        curve = _CURVES[model] = CorrectedCurve(_kept_curve(model))
    return curve


@contextmanager
def pinned(model, curve):
    """Within the block :func:`cost_curve` answers ``curve`` for ``model`` (a plain :class:`CostCurve`: the
    runs' timed passes correct nothing); after it, what was held before, or nothing."""
    before = _CURVES.get(model)
    _CURVES[model] = curve
    try:
        yield curve
    finally:
        if before is None:
            _CURVES.pop(model, None)
        else:
            _CURVES[model] = before


def observe(model, rows: int, seconds: float) -> None:
    """A timed pass of ``rows`` rows of ``model``, for its curve's correction. Nothing before the
    curve is held (timing a pass never triggers the measurement), nor where a plain
    :class:`CostCurve` is held (a curve pinned by a test stays as pinned)."""
    curve = _CURVES.get(model)
    if isinstance(curve, CorrectedCurve):
        curve.observe(rows, seconds)


def _kept_curve(model) -> CostCurve:
    from specplay.core import __version__
    from specplay.core.kernels import kernel_build
    from specplay.core.models.measurements import measured

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
