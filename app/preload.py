"""The remembered models' loads, started before the window is built, taken over by the worker's first load.

A later launch spends about 0.5 s importing the window's modules and building it, and 0.75 s loading
the target (its tokenizer, its GGUF header, its head's blocks) after that; begun first, the loads run
beside them, one after the other (target, then draft). The worker's load of the same model takes a
load over (:func:`take`): from then on it reports the load's progress and its Stop cancels it, as if
it had begun the load itself; a load that asks for other models drops the rest (:func:`keep_only`).
Nothing is kept from a load that failed: the worker loads again and says why.
"""

from __future__ import annotations

import threading
from typing import Callable

from specplay.core.errors import Cancelled

_pending: "dict[tuple, Preload]" = {}
_lock = threading.Lock()


class Preload:
    """``load(progress, should_cancel)`` run in a thread of its own for the model ``key`` names, once
    ``after`` (an earlier preload) has ended."""

    def __init__(self, key: tuple, load: Callable, after: "Preload | None" = None):
        self.key = key
        self._report: Callable | None = None
        self._cancelled: Callable[[], bool] = lambda: False
        self._dropped = False
        self._last: tuple | None = None  # the stage said before anyone listened
        self._handoff = threading.Lock()  # between the load saying a stage and a taker starting to listen
        self._done = threading.Event()
        self.result = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load, after), name="specplay-preload", daemon=True)
        self._thread.start()

    def _progress(self, stage: str, fraction) -> None:
        if self._should_cancel():
            raise Cancelled("loading cancelled")
        with self._handoff:
            report = self._report
            if report is None:
                self._last = (stage, fraction)
                return
        report(stage, fraction)

    def _should_cancel(self) -> bool:
        return self._dropped or self._cancelled()

    def _run(self, load: Callable, after: "Preload | None") -> None:
        if after is not None:
            after._done.wait()
        try:
            if self._should_cancel():
                raise Cancelled("loading cancelled")
            self.result = load(self._progress, self._should_cancel)
        except BaseException as exc:  # kept for the taker: it loads again and says why
            self.error = exc
        finally:
            self._done.set()

    def take_over(self, progress: Callable, should_cancel: Callable[[], bool]):
        """Wait for the load, now reporting to ``progress`` and stopped by ``should_cancel``: the model,
        or None where it failed (``Cancelled`` where it was cancelled)."""
        self._cancelled = should_cancel
        with self._handoff:
            self._report, last = progress, self._last
        if last is not None:
            progress(*last)
        self._done.wait()
        if isinstance(self.error, Cancelled):
            raise self.error
        return None if self.error is not None else self.result

    def drop(self) -> None:
        """Cancel the load and let it go (another model is wanted)."""
        self._dropped = True


def start(key: tuple, load: Callable) -> None:
    """Begin loading the model ``key`` names, after the loads begun before: ``load(progress,
    should_cancel)`` returns it."""
    with _lock:
        earlier = list(_pending.values())
        _pending[key] = Preload(key, load, earlier[-1] if earlier else None)


def take(key: tuple, progress: Callable, should_cancel: Callable[[], bool]):
    """The model begun by :func:`start` for ``key`` (waiting for it; see :meth:`Preload.take_over`),
    else None; it is no longer pending either way."""
    with _lock:
        pending = _pending.pop(key, None)
    return None if pending is None else pending.take_over(progress, should_cancel)


def keep_only(keys) -> None:
    """Drop the pending loads of models other than ``keys`` (a load asked for others)."""
    with _lock:
        for key in [k for k in _pending if k not in keys]:
            _pending.pop(key).drop()
