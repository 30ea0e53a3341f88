"""The run session: the app's sequences of the worker's jobs, and what they tell the views.

A :class:`RunSession` holds everything about running that is not a widget: the worker thread
(through :class:`~specplay.app.worker_client.WorkerClient`), the loaded models, what runs now and
whether Stop was pressed, the step events that arrive while a run streams (handed on once a
frame), and the run history that every run, remote run and audit is saved into as it ends.

The window builds requests from its panels and awaits the session's coroutines (:meth:`~RunSession.load`,
:meth:`~RunSession.run`, :meth:`~RunSession.compare`, :meth:`~RunSession.audit`); what the views
draw reaches them only through the session's signals, so a session runs, and is tested, without
a widget.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal

from specplay.app.worker_client import WorkerClient, WorkerFailed
from specplay.app.export import ExportError, write_png, write_runs_csv, write_runs_jsonl
from specplay.app.worker import AuditRequest, LoadRequest, ModelsLoaded, RemoteRequest, RunDone, RunRequest, TuneRequest
from specplay.core.measure.compare import BASELINE, annotate
from specplay.core.records.history import Entry, History, summary_of
from specplay.core.measure.tune_server import NAME as SERVER_TUNE, tune_title
from specplay.core.methods import method_title
from specplay.core.remote.runs import annotate_remote
from specplay.core.records.runlog import stats_line
from specplay.core.decoding.types import RunResult, StepEvent, StopReason

log = logging.getLogger(__name__)

FRAME_MS = 33  # how often arriving step events are handed to the views (about 30 frames a second)


class RunSession(QObject):
    """Loads models and runs methods, comparisons and audits, one at a time.

    Signals (all in the GUI thread):
        sig_busy_changed(str): what runs now, "load", "run", "compare", "audit" or "tune"; "" when nothing does
            (also emitted when ``draft_loading`` changes).
        sig_status(str): a line for the status bar.
        sig_error(str): a message the user must see (what a run made is kept and saved all the same).
        sig_progress(str, float): a loading, calibration or audit stage and its fraction (-1: unknown).
        sig_models_changed(object): the :class:`ModelsLoaded` just loaded, or None while models load.
        sig_load_failed(str): loading ended with this message.
        sig_cost_curve(object): the target's verification ``CostCurve``, measured before its first run.
        sig_run_started(str, str): a run starts streaming: its name (a method, or ``remote:LABEL`` for an
            endpoint) and what its view shows until the first step arrives.
        sig_steps(str, object): that run's step events (a list) that arrived since the last frame.
        sig_run_finished(str, object, object): the run's result (``RunResult`` or ``RemoteRun``) and its saved
            record (a dict).
        sig_run_failed(str): the named run ended without a result (the message went to ``sig_error``).
        sig_compare_updated(object): the comparison's annotated records so far (a list).
        sig_audit_finished(object): an audit's saved record (a dict).
        sig_tune_finished(object): a tune's saved record (a dict, :func:`specplay.core.measure.tune.tune_record`).
        sig_record_saved(object): a run's :class:`~specplay.core.records.history.Entry` went into the history (one that
            could not be saved holds its record).
        sig_history_loaded(object): the history's entries (a list), oldest first; a run's whole record is read
            only when it is reopened or exported (:meth:`~RunSession.history_records`).
        sig_export_failed(str): an export wrote nothing, for this reason (the old file is kept).

    Records travel as ``object``: a ``dict`` signal would copy each through a QVariantMap, and empty
    one that has a key other than a string.
    """

    sig_busy_changed = Signal(str)
    sig_status = Signal(str)
    sig_error = Signal(str)
    sig_progress = Signal(str, float)
    sig_models_changed = Signal(object)
    sig_load_failed = Signal(str)
    sig_cost_curve = Signal(object)
    sig_run_started = Signal(str, str)
    sig_steps = Signal(str, object)
    sig_run_finished = Signal(str, object, object)
    sig_run_failed = Signal(str)
    sig_compare_updated = Signal(object)
    sig_audit_finished = Signal(object)
    sig_tune_finished = Signal(object)
    sig_record_saved = Signal(object)
    sig_history_loaded = Signal(object)
    sig_export_failed = Signal(str)

    def __init__(self, history: History | None = None, parent=None):
        super().__init__(parent)
        self.history = history if history is not None else History()
        self.models: ModelsLoaded | None = None
        self.activity = ""  # see sig_busy_changed
        self.draft_loading = False  # the target is loaded and its draft loads beside the runs
        self._stop_requested = False
        self._token_texts: dict[int, str] = {}
        # Step events are handed on once per frame, not as each arrives: with one token a step,
        # drawing per event would take CPU from the model on a small machine.
        self._streaming: str | None = None  # the run whose steps arrive now
        self._step_queue: list[StepEvent] = []
        self.frames = 0  # batches of step events handed on (a run of n steps makes far fewer than n)
        self._frame = QTimer(self)
        self._frame.setInterval(FRAME_MS)
        self._frame.timeout.connect(self._flush_steps)
        # File work (reading the history, exports) runs here, off the GUI thread; never model work.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specplay-io")
        self.client = WorkerClient(self)
        self.client.sig_step.connect(self._on_step)
        self.client.sig_progress.connect(self.sig_progress)
        self.client.sig_cost_curve.connect(self.sig_cost_curve)
        self.client.sig_error.connect(self.sig_error)

    # ------------------------------------------------------------------------ busy and stop
    @property
    def busy(self) -> bool:
        return bool(self.activity)

    @contextmanager
    def _doing(self, what: str):
        """Busy with ``what`` until the block ends, however it ends; Stop reaches this activity only."""
        self._stop_requested = False
        self._set_activity(what)
        try:
            yield
        finally:
            self._stop_requested = False
            self._set_activity("")

    def _set_activity(self, what: str) -> None:
        self.activity = what
        self.sig_busy_changed.emit(what)

    def stop(self) -> None:
        """Stop whatever runs within one step; a comparison starts nothing after it. With nothing
        running, a draft loading beside the runs is stopped (the target stays)."""
        if not self.busy:
            if self.draft_loading:
                self.client.cancel_draft()
                self.sig_status.emit("Stopping the draft's load…")
            return
        self._stop_requested = True
        self.client.cancel()
        self.sig_status.emit("Stopping…")

    def shutdown(self, wait_ms: int = 30_000) -> bool:
        """Stop everything and end the worker and file threads (the window closes); True once the worker
        thread has ended, False while a step that cannot be interrupted still runs after ``wait_ms``
        (it ends at that step's end: its ``thread.finished`` says when). History writes under way finish."""
        self._stop_requested = True
        ended = self.client.shutdown(wait_ms)
        self._io.shutdown(wait=True)
        return ended

    # ------------------------------------------------------------------------ models
    async def load(self, request: LoadRequest) -> ModelsLoaded | None:
        """Load the requested models in place of the current ones; None if that failed (said in ``sig_error``).

        The session is busy until the target is ready; the draft then loads beside the runs that
        need none (``draft_loading``), and this returns once it is there too (or said why not)."""
        if self.busy:
            return None
        with self._doing("load"):
            self.models = None
            self.sig_models_changed.emit(None)
            draft = f" and {request.draft}" if request.draft else ""
            self.sig_status.emit(f"Loading {request.target}{draft}…")
            try:
                loaded = await self.client.load(request)
            except WorkerFailed as exc:
                self.sig_load_failed.emit(str(exc))
                self.sig_error.emit(f"Loading failed: {exc}")
                return None
            self._take(loaded)
        if loaded.draft_pending:
            self.draft_loading = True
            self.sig_busy_changed.emit(self.activity)
            self.sig_status.emit(f"{request.target} is ready: methods without a draft run now; "
                                 f"loading the draft {request.draft}…")
            try:
                with_draft = await self.client.draft_loaded
            except WorkerFailed:
                return None
            finally:
                self.draft_loading = False
                self.sig_busy_changed.emit(self.activity)
            if self.models is not loaded:  # another load replaced these meanwhile
                return None
            loaded = with_draft
            self._take(loaded)
        self.sig_status.emit("Models ready." + (f" Draft: {loaded.draft_error}" if loaded.draft_error else ""))
        return loaded

    def _take(self, loaded: ModelsLoaded) -> None:
        self.models = loaded
        self._token_texts.clear()
        self.sig_models_changed.emit(loaded)

    def token_text(self, token_id: int) -> str:
        """Text of a token id for the internals views (cached; decoding is cheap and thread-safe)."""
        text = self._token_texts.get(token_id)
        if text is None:
            if self.models is None:
                return f"#{token_id}"
            text = self.models.target.tokenizer.decode([token_id])
            if len(self._token_texts) < 100_000:
                self._token_texts[token_id] = text
        return text

    # ------------------------------------------------------------------------ runs
    async def run(self, request: RunRequest) -> RunResult | None:
        """One run: its steps stream, its record is saved; None if it failed (said in ``sig_error``)."""
        if self.busy or self.models is None:
            return None
        started = time.perf_counter()
        with self._doing("run"):
            self.sig_status.emit(f"Running {method_title(request.method)}…")
            done = await self._generate(request, "")
            if done is not None:
                await self._save(done.record)
        if done is None:
            return None
        state = "Cancelled" if done.result.cancelled else "Done"
        self.sig_status.emit(f"{state}: {stats_line(done.record)} ({time.perf_counter() - started:.1f} s)")
        self._report_early_stop(done.result)
        return done.result

    async def compare(self, requests: list[RunRequest], remote: list[RemoteRequest], greedy: bool
                      ) -> list[dict] | None:
        """Run ``requests`` one after another, then the ``remote`` endpoints; the records, annotated for
        comparison (``greedy``: outputs must be identical), or None when something else runs."""
        if self.busy or self.models is None:
            return None
        records: list[dict] = []
        # The baseline runs first, so that each record is saved with its final speedup and identity.
        requests = sorted(requests, key=lambda r: r.method != BASELINE)
        with self._doing("compare"):
            await asyncio.sleep(0.05)  # let the views lay out their new columns before the first timed run
            going = True
            for i, request in enumerate(requests):
                if not going or self._stop_requested:
                    break
                self.sig_status.emit(f"Comparing: {method_title(request.method)} ({i + 1}/{len(requests)})…")
                going = await self._compare_local(request, records, greedy)
            for j, request in enumerate(remote):
                if not going or self._stop_requested:
                    break
                self.sig_status.emit(f"Comparing: {request.endpoint.label} (endpoint {j + 1}/{len(remote)})…")
                going = await self._compare_remote(request, records, greedy)
            annotate(records, greedy)
            annotate_remote(records, greedy)
            self.sig_compare_updated.emit(records)
            stopped = self._stop_requested
        self.sig_status.emit(("Comparison stopped" if stopped else "Comparison done") + f": {len(records)} run(s).")
        return records

    async def _compare_local(self, request: RunRequest, records: list[dict], greedy: bool) -> bool:
        """One method's run in a comparison; False when the comparison should stop."""
        done = await self._generate(request, "warming up…")
        if done is None:
            return False
        records.append(done.record)
        self._report_early_stop(done.result)
        annotate(records, greedy)
        await self._save(done.record)
        self.sig_compare_updated.emit(records)
        return not (done.result.cancelled or _ended_by_error(done.result))

    async def _compare_remote(self, request: RemoteRequest, records: list[dict], greedy: bool) -> bool:
        """One endpoint's run in a comparison; False when the comparison should stop."""
        label = request.endpoint.label
        name = f"remote:{label}"
        job = self.client.generate_remote(request, stop_first=self._stop_requested)
        waiting = "starting llama-server…" if request.server else f"connecting to {request.endpoint.url}…"
        done = await self._stream(name, waiting, label, job)
        if done is None:
            return False
        self.sig_run_finished.emit(name, done.result, done.record)
        records.append(done.record)
        run = done.result
        if run.error:
            kept = f" The {len(run.text)} characters received are kept." if run.text else ""
            self.sig_error.emit(f"{label}: {run.error}.{kept}")
        annotate_remote(records, greedy)
        await self._save(done.record)
        self.sig_compare_updated.emit(records)
        return not run.cancelled

    async def audit(self, request: AuditRequest) -> dict | None:
        """Audit the request's method (:mod:`specplay.core.measure.audit`); its record, saved like a run's, or None
        if the audit failed (said in ``sig_error``)."""
        if self.busy or self.models is None:
            return None
        title = method_title(request.run.method)
        status = f"Auditing {title}: {request.samples} samples of {request.depth} tokens…"
        done = await self._saved_job("audit", status, f"Audit of {title}",
                                     lambda stop: self.client.audit(request, stop_first=stop))
        if done is None:
            return None
        self.sig_audit_finished.emit(done.record)
        self.sig_status.emit(("Audit stopped: " if done.result.cancelled else "Audit: ") + done.record["text"])
        if done.result.error:
            self.sig_error.emit(f"The audit of {title} stopped early: {done.result.error}")
        return done.record

    async def tune(self, request: TuneRequest) -> dict | None:
        """Tune the request's method on its prompt (:mod:`specplay.core.measure.tune`); its record, saved like a run's, or
        None if the tune failed or was stopped (said in ``sig_error``)."""
        if self.busy or self.models is None:
            return None
        title = tune_title(SERVER_TUNE if request.server else request.run.method)
        done = await self._saved_job("tune", f"Tuning {title}: predicting every setting, then running the best…",
                                     f"Tune of {title}", lambda stop: self.client.tune(request, stop_first=stop))
        if done is None:
            return None
        self.sig_tune_finished.emit(done.record)
        self.sig_status.emit(done.record["text"])
        return done.record

    async def _saved_job(self, activity: str, status: str, failure: str, submit) -> RunDone | None:
        """One worker job (``submit(stop_first)``) whose record goes into the history like a run's; None if it
        failed (said in ``sig_error`` after ``failure``)."""
        with self._doing(activity):
            self.sig_status.emit(status)
            try:
                done = await submit(self._stop_requested)
            except WorkerFailed as exc:
                self.sig_error.emit(f"{failure}: {exc}")
                return None
        await self._save(done.record)
        return done

    async def _generate(self, request: RunRequest, waiting: str) -> RunDone | None:
        """One local run streamed as ``request.method`` (its caller saves it); None if the worker failed."""
        job = self.client.generate(request, stop_first=self._stop_requested)
        done = await self._stream(request.method, waiting, method_title(request.method), job)
        if done is not None:
            self.sig_run_finished.emit(request.method, done.result, done.record)
        return done

    async def _stream(self, name: str, waiting: str, label: str, job) -> RunDone | None:
        """Await the worker's ``job`` while its steps go to the views as run ``name``; None if it failed."""
        self._streaming = name
        self.sig_run_started.emit(name, waiting)
        failure = None
        try:
            done = await job
        except WorkerFailed as exc:
            done, failure = None, str(exc)
        finally:
            self._flush_steps()
            self._streaming = None
        if failure is not None:
            self.sig_error.emit(f"{label}: {failure}")
            self.sig_run_failed.emit(name)
        return done

    def _report_early_stop(self, result: RunResult) -> None:
        """A run the engine ended early (out of memory): what it made is kept, and the reason shown."""
        if _ended_by_error(result):
            self.sig_error.emit(f"{method_title(result.method)} stopped early: "
                                f"{result.error or 'an error in the engine'}. "
                                f"The {len(result.token_ids)} token(s) it made are kept.")

    # ------------------------------------------------------------------------ steps
    def _on_step(self, event: StepEvent) -> None:
        self._step_queue.append(event)
        if not self._frame.isActive():
            self._frame.start()

    def _flush_steps(self) -> None:
        """Hand the steps that arrived since the last frame to the views of the run that streams."""
        events, self._step_queue = self._step_queue, []
        if not events:
            self._frame.stop()
            return
        for event in events:  # tokens seen in events feed the internals' token texts
            for t in event.tokens:
                if t.token_id not in self._token_texts and t.text:
                    self._token_texts[t.token_id] = t.text
        if self._streaming is not None:
            self.frames += 1
            self.sig_steps.emit(self._streaming, events)

    # ------------------------------------------------------------------------ history and exports
    async def _save(self, record: dict) -> Entry:
        """Write ``record`` into the history in the file thread (a copy: a comparison annotates its records
        again meanwhile); its entry, which goes to the views even when it could not be written."""
        try:
            entry = await self._file_work(self.history.append, dict(record))
        except OSError as exc:
            self.sig_error.emit(f"Could not save the run to the history ({self.history.path}): {exc.strerror or exc}")
            entry = Entry(summary_of(record), record=record)
        self.sig_record_saved.emit(entry)
        return entry

    async def reload_history(self) -> list[Entry]:
        """Read the history's index again (off the GUI thread); its entries, or [] if it cannot be read."""
        try:
            entries = await self._file_work(self.history.entries)
        except OSError as exc:
            self.sig_error.emit(f"Could not read the run history {self.history.path}: {exc.strerror or exc}")
            return []
        self.sig_history_loaded.emit(entries)
        return entries

    async def history_records(self, entries: list[Entry]) -> list[dict] | None:
        """The whole records of ``entries``, read in the file thread; None if the history cannot be read (said)."""
        try:
            return await self._file_work(lambda: [self.history.read(e) for e in entries])
        except OSError as exc:
            self.sig_error.emit(f"Could not read the run history {self.history.path}: {exc.strerror or exc}")
            return None

    async def keep_last_runs(self, n: int) -> list[Entry]:
        """Drop all but the newest ``n`` runs from the history (in the file thread), then list it again."""
        try:
            dropped = await self._file_work(self.history.keep_last, n)
        except OSError as exc:
            self.sig_error.emit(f"Could not compact the run history {self.history.path}: {exc.strerror or exc}")
            return []
        self.sig_status.emit(f"History: {dropped} older run(s) removed, the newest {n} kept.")
        return await self.reload_history()

    async def export_runs(self, path: str | Path, records: list[dict], kind: str = "jsonl") -> bool:
        """Write ``records`` as JSON lines or CSV (``kind``), atomically: a failure changes nothing."""
        write = write_runs_jsonl if kind == "jsonl" else write_runs_csv
        return await self._export(write, Path(path), list(records), f"Exported {len(records)} run(s) to {path}.")

    async def export_png(self, path: str | Path, image) -> bool:
        """Write ``image`` (a ``QImage`` grabbed from a chart in the GUI thread) as a PNG, atomically."""
        return await self._export(write_png, Path(path), image, f"Saved {path}.")

    async def _export(self, write, path: Path, content, done: str) -> bool:
        try:
            await self._file_work(write, path, content)
        except ExportError as exc:
            self.sig_export_failed.emit(str(exc))
            return False
        self.sig_status.emit(done)
        return True

    async def _file_work(self, fn, *args):
        """``fn(*args)`` in the file thread: reading and writing files never holds up the window."""
        return await asyncio.get_event_loop().run_in_executor(self._io, fn, *args)


def _ended_by_error(result: RunResult) -> bool:
    return result.stop_reason is StopReason.ERROR
