"""The progress and cancel callbacks that long work (conversion, loading, training data) takes."""

from __future__ import annotations

import logging
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
