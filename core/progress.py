"""The progress and cancel callbacks that long work (conversion, loading, training data) takes."""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger(__name__)

#: ``progress(stage, fraction)``: a stage's description and its completed fraction (None: unknown).
Progress = Callable[[str, "float | None"], None]
#: ``should_cancel()``: polled between units of work; True stops the work with :class:`~specplay.core.errors.Cancelled`.
ShouldCancel = Callable[[], bool]


def log_progress(stage: str, fraction: float | None) -> None:
    """The default progress callback: a log line."""
    log.info("%s%s", stage, "" if fraction is None else f" {fraction:.0%}")


def never() -> bool:
    """The default cancel callback: never cancel."""
    return False


def counting_down(progress: Progress, stage: str, clock: Callable[[], float] = time.monotonic
                  ) -> Callable[[float], None]:
    """``report(fraction)`` for one stage: its fraction, and from the pace so far the time left
    (said once 5% is done and two seconds have passed, when the pace means something)."""
    start = clock()

    def report(fraction: float) -> None:
        elapsed = clock() - start
        if 0.05 <= fraction < 1.0 and elapsed >= 2.0:
            left = elapsed * (1.0 - fraction) / fraction
            progress(f"{stage}: about {_duration(left)} left", fraction)
        else:
            progress(stage, fraction)

    return report


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))} s" if seconds < 90 else f"{round(seconds / 60)} min"
