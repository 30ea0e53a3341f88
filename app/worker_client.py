"""The GUI thread's side of the worker: requests out as queued signals, results back as futures.

All model work runs in one :class:`~specplay.app.worker.Worker` thread. A coroutine sends a
request and awaits its future; the worker's result signal (or its failure) resolves it. One
request is awaited at a time, and each carries a job number, so a Stop pressed while a job
is still queued reaches it (:meth:`Worker.cancel`). What the worker reports along the way
(steps, progress, the cost curve) comes out of the client's own signals, in the GUI thread.
"""

from __future__ import annotations

import asyncio
import logging

from PySide6.QtCore import QObject, QThread, Signal

from specplay.app.worker import (AuditRequest, Worker, LoadRequest, ModelsLoaded, RemoteRequest, RunDone,
                                 RunRequest, TuneRequest)

log = logging.getLogger(__name__)


class WorkerFailed(Exception):
    """The worker reported an error for the awaited request (the message is for the user)."""


class WorkerClient(QObject):
    """Owns the worker thread and its worker.

    Signals (emitted in the GUI thread):
        sig_error(str): a worker error while no request was awaited (still for the user).
        sig_step(object): a ``StepEvent`` of the job that runs (a generation or a remote completion).
        sig_progress(str, float): a loading, calibration or audit stage and its fraction (-1: unknown).
        sig_cost_curve(object): the target's verification ``CostCurve``, measured before its first run.
    """

    sig_load = Signal(object)
    sig_generate = Signal(object)
    sig_generate_remote = Signal(object)
    sig_audit = Signal(object)
    sig_tune = Signal(object)
    sig_error = Signal(str)
    sig_step = Signal(object)
    sig_progress = Signal(str, float)
    sig_cost_curve = Signal(object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.job = 0
        self._pending: asyncio.Future | None = None
        # While a loaded target's draft still loads beside the runs: resolved with its ModelsLoaded.
        self.draft_loaded: asyncio.Future | None = None
        self.thread = QThread(self)
        self.thread.setObjectName("worker")
        self.worker = Worker()
        self.worker.moveToThread(self.thread)
        self.sig_load.connect(self.worker.load)
        self.sig_generate.connect(self.worker.generate)
        self.sig_generate_remote.connect(self.worker.generate_remote)
        self.sig_audit.connect(self.worker.audit)
        self.sig_tune.connect(self.worker.tune)
        self.worker.sig_models_loaded.connect(self._on_models_loaded)
        self.worker.sig_draft_loaded.connect(self._on_draft_loaded)
        self.worker.sig_run_finished.connect(self._resolve)
        self.worker.sig_audit_finished.connect(self._resolve)
        self.worker.sig_tune_finished.connect(self._resolve)
        self.worker.sig_failed.connect(self._on_failed)
        self.worker.sig_step.connect(self.sig_step)
        self.worker.sig_progress.connect(self.sig_progress)
        self.worker.sig_cost_curve.connect(self.sig_cost_curve)
        self.thread.start()

    async def load(self, request: LoadRequest) -> ModelsLoaded:
        """Load the requested models (raises :class:`WorkerFailed` with the worker's message)."""
        return await self._submit(self.sig_load, request)

    async def generate(self, request: RunRequest, stop_first: bool = False) -> RunDone:
        """Run one generation (its ``RunResult`` and record); ``stop_first``: Stop was already pressed,
        so the job ends at once."""
        return await self._submit(self.sig_generate, request, stop_first)

    async def generate_remote(self, request: RemoteRequest, stop_first: bool = False) -> RunDone:
        """Stream one completion from a remote endpoint (its failures come back in the ``RemoteRun``)."""
        return await self._submit(self.sig_generate_remote, request, stop_first)

    async def audit(self, request: AuditRequest, stop_first: bool = False) -> RunDone:
        """Run one losslessness audit (stopped, it tests the samples drawn so far)."""
        return await self._submit(self.sig_audit, request, stop_first)

    async def tune(self, request: TuneRequest, stop_first: bool = False) -> RunDone:
        """Tune one method's draft size on one prompt (a Stop before its proof fails it with that reason)."""
        return await self._submit(self.sig_tune, request, stop_first)

    async def _submit(self, signal, request, stop_first: bool = False):
        self.job += 1
        request.job = self.job
        if stop_first:
            self.worker.cancel(self.job)
        fut = self._expect()
        signal.emit(request)
        return await fut

    def cancel(self) -> None:
        """Stop the current job (and any queued before it) within one step."""
        self.worker.cancel(self.job)

    def cancel_draft(self) -> None:
        """Stop the draft that loads beside the runs (``draft_loaded`` then says it was cancelled)."""
        self.worker.cancel_draft()

    def shutdown(self, wait_ms: int = 30_000) -> bool:
        """Cancel everything, fail the awaited request, and stop the thread; True once it has ended, False
        while a step that cannot be interrupted still runs after ``wait_ms`` (``thread.finished`` follows)."""
        self.worker.cancel(self.job)
        self.worker.cancel()
        self.worker.cancel_draft()
        for fut in (self._pending, self.draft_loaded):
            if fut is not None and not fut.done():
                fut.set_exception(WorkerFailed("the window was closed"))
        self._pending = self.draft_loaded = None
        self.thread.quit()
        if self.thread.wait(wait_ms):
            return True
        log.info("the worker thread ends once its current step does")
        return False

    def _expect(self) -> asyncio.Future:
        fut = asyncio.get_event_loop().create_future()
        self._pending = fut
        return fut

    def _on_models_loaded(self, loaded: ModelsLoaded) -> None:
        if loaded.draft_pending:  # before the load's future resolves: its awaiter awaits this next
            self.draft_loaded = asyncio.get_event_loop().create_future()
        self._resolve(loaded)

    def _on_draft_loaded(self, loaded: ModelsLoaded) -> None:
        # Kept, not cleared: a draft that fails at once can arrive before the load's awaiter awaits it.
        fut = self.draft_loaded
        if fut is not None and not fut.done():
            fut.set_result(loaded)

    def _resolve(self, value) -> None:
        fut, self._pending = self._pending, None
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _on_failed(self, message: str) -> None:
        fut, self._pending = self._pending, None
        if fut is not None and not fut.done():
            fut.set_exception(WorkerFailed(message))
        else:
            self.sig_error.emit(message)
