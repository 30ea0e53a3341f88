"""The main window: docks for models, prompt, methods, X-ray, internals, charts and history
around a live token view and a compare view.

Orchestration (load, run, compare sequences, exports) is written as coroutines on the qasync
loop; every model call happens in the engine thread, reached through
:class:`~specplay.app.engine_client.EngineClient`. Nothing here calls torch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QDockWidget, QFileDialog, QLabel, QMainWindow, QMessageBox, QSizePolicy, QStyle,
                               QTabWidget, QWidget)

from specplay.app.audit_view import AuditView
from specplay.app.charts import ChartsPanel, configure_pyqtgraph
from specplay.app.compare_view import CompareView
from specplay.app.export import ExportError, write_png, write_runs_csv, write_runs_jsonl
from specplay.app.history_panel import HistoryPanel
from specplay.app.internals import InternalsPanel
from specplay.app.panels import MethodsPanel, ModelsPanel, PromptPanel
from specplay.app.settings import AppSettings, open_settings
from specplay.app.window_settings import apply_to_window, collect_from_window
from specplay.app.tokenview import TokenView
from specplay.app.whyspeed_view import WhySpeedView
from specplay.app.engine_client import EngineClient, EngineFailed
from specplay.app.live_view import LiveView
from specplay.app.worker import AuditRequest, LoadRequest, ModelsLoaded, RemoteRequest, RunRequest
from specplay.app.xray import XRayPanel
from specplay.core.compare import WARMUP_TOKENS, annotate
from specplay.core.remote import annotate_remote
from specplay.core.errors import ConfigError
from specplay.core.history import History
from specplay.core.memory import memory_text
from specplay.core.methods import METHODS, method_title
from specplay.core.runlog import stats_line
from specplay.core.types import RunResult, StepEvent

log = logging.getLogger(__name__)

FRAME_MS = 33  # how often arriving step events are drawn (about 30 frames a second)


class MainWindow(QMainWindow):
    def __init__(self, settings: AppSettings | None = None, history: History | None = None):
        super().__init__()
        configure_pyqtgraph()
        self.setWindowTitle("SpecPlay")
        self.setDockNestingEnabled(True)
        # side panels run the full height; charts and history sit under the central view only
        self.setCorner(Qt.Corner.BottomLeftCorner, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.settings = settings if settings is not None else AppSettings.load()
        self.history = history if history is not None else History()
        self.models: ModelsLoaded | None = None
        self._closed: asyncio.Future | None = None
        self._busy: str | None = None
        self._stop_requested = False
        self._step_sinks: list = []
        # Step events are drawn once per frame, not as each arrives: with one token a step, drawing
        # per event would take CPU from the model on a small machine (FRAME_MS below).
        self._step_queue: list[StepEvent] = []
        self.frames_drawn = 0  # frames that drew step events (a run of n tokens draws far fewer than n)
        self._frame = QTimer(self)
        self._frame.setInterval(FRAME_MS)
        self._frame.timeout.connect(self._flush_steps)
        self._tasks: set[asyncio.Task] = set()
        self._token_texts: dict[int, str] = {}
        self.last_error = ""
        self.last_export: Path | None = None
        self._shown_once = False
        self._internals_view: TokenView | None = None  # whose run the internals panel shows
        # File work (history reading, exports) runs here, off the GUI thread; never model work.
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specplay-io")

        # views
        self.live = LiveView()
        self.compare = CompareView()
        self.tabs = QTabWidget()
        self.tabs.addTab(self.live, "Live")
        self.tabs.addTab(self.compare, "Compare")
        # one "rejected drafts inline" setting for every token view
        self.live.rejected_inline.toggled.connect(self.compare.rejected_inline.setChecked)
        self.compare.rejected_inline.toggled.connect(self.live.rejected_inline.setChecked)
        self.why = WhySpeedView()
        self.tabs.addTab(self.why, "Why this speed")
        self.audit_view = AuditView()
        self.tabs.addTab(self.audit_view, "Audit")
        self.setCentralWidget(self.tabs)
        self.models_panel = ModelsPanel()
        self.prompt_panel = PromptPanel()
        self.methods_panel = MethodsPanel()
        self.xray = XRayPanel()
        self.internals = InternalsPanel(self._token_text)
        self.charts = ChartsPanel(list(METHODS))
        self.history_panel = HistoryPanel()
        self.docks: dict[str, QDockWidget] = {}
        left = Qt.DockWidgetArea.LeftDockWidgetArea
        right = Qt.DockWidgetArea.RightDockWidgetArea
        bottom = Qt.DockWidgetArea.BottomDockWidgetArea
        self._dock("models", "Models", self.models_panel, left)
        self._dock("prompt", "Prompt", self.prompt_panel, left)
        self._dock("method", "Method", self.methods_panel, left)
        self._dock("xray", "Token X-ray", self.xray, right)
        self._dock("internals", "Method internals", self.internals, right)
        self._dock("charts", "Charts", self.charts, bottom)
        self._dock("history", "History", self.history_panel, bottom)
        self.tabifyDockWidget(self.docks["charts"], self.docks["history"])
        self.docks["charts"].raise_()
        self._default_state = self.saveState()

        self._build_actions()
        self.status = QLabel("")
        self.status.setObjectName("status")
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.memory_label = QLabel("")
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.memory_label)

        # the worker thread
        self.engine = EngineClient(self)
        self.worker = self.engine.worker
        self.worker.sig_progress.connect(self._on_progress)
        self.worker.sig_step.connect(self._on_step)
        self.worker.sig_cost_curve.connect(self.why.set_curve)
        self.engine.sig_error.connect(self.show_error)

        # wiring
        self.models_panel.sig_load_requested.connect(lambda: self.spawn(self.load_models()))
        self.models_panel.sig_cancel_requested.connect(self.stop)
        self.compare.sig_run_requested.connect(lambda names: self.spawn(self.run_compare(names)))
        self.audit_view.sig_run_requested.connect(lambda n, k: self.spawn(self.run_audit(n, k)))
        self.history_panel.sig_open_requested.connect(self.open_record)
        self.history_panel.sig_export_requested.connect(self._export_dialog)
        self.history_panel.sig_reload_requested.connect(lambda: self.spawn(self.reload_history()))
        for view in (self.live.view,):
            self._connect_token_view(view)

        self._memory_timer = QTimer(self)
        self._memory_timer.setInterval(2000)
        self._memory_timer.timeout.connect(self._refresh_memory)
        self._memory_timer.start()
        self._refresh_memory()
        self.apply_settings(self.settings)
        self._set_busy(None)

    # ------------------------------------------------------------------------ construction
    def _dock(self, key: str, title: str, widget: QWidget, area) -> None:
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock_{key}")
        dock.setWidget(widget)
        dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                         | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                         | QDockWidget.DockWidgetFeature.DockWidgetClosable)
        self.addDockWidget(area, dock)
        self.docks[key] = dock

    def _build_actions(self) -> None:
        style = self.style()
        self.run_action = QAction(style.standardIcon(QStyle.StandardPixmap.SP_MediaPlay), "Run", self)
        self.run_action.setShortcut(QKeySequence("Ctrl+Return"))
        self.run_action.setToolTip("Run the selected method on the prompt (Ctrl+Enter)")
        self.run_action.triggered.connect(lambda: self.spawn(self.run_single()))
        self.stop_action = QAction(style.standardIcon(QStyle.StandardPixmap.SP_MediaStop), "Stop", self)
        self.stop_action.setShortcut(QKeySequence("Esc"))
        self.stop_action.setToolTip("Stop the run, comparison or loading within one step (Esc)")
        self.stop_action.triggered.connect(self.stop)
        self.compare_action = QAction(style.standardIcon(QStyle.StandardPixmap.SP_FileDialogDetailedView), "Compare",
                                      self)
        self.compare_action.setShortcut(QKeySequence("Ctrl+Shift+Return"))
        self.compare_action.setToolTip("Run the methods checked in the Compare tab one after another (Ctrl+Shift+Enter)")
        self.compare_action.triggered.connect(lambda: self.spawn(self.run_compare(self.compare.selected())))
        bar = self.addToolBar("Run")
        bar.setObjectName("toolbar_run")
        bar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        bar.addAction(self.run_action)
        bar.addAction(self.stop_action)
        bar.addSeparator()
        bar.addAction(self.compare_action)
        self.run_button = bar.widgetForAction(self.run_action)
        self.stop_button = bar.widgetForAction(self.stop_action)

        file_menu = self.menuBar().addMenu("&File")
        a = file_menu.addAction("Export selected runs as JSONL…")
        a.triggered.connect(lambda: self._export_dialog("jsonl", self.history_panel.selected_records()))
        a = file_menu.addAction("Export selected runs as CSV…")
        a.triggered.connect(lambda: self._export_dialog("csv", self.history_panel.selected_records()))
        a = file_menu.addAction("Export charts as PNG…")
        a.triggered.connect(lambda: self._export_png_dialog(self.charts, "specplay-charts.png"))
        a = file_menu.addAction("Export speedup chart as PNG…")
        a.triggered.connect(lambda: self._export_png_dialog(self.compare.speedup_plot, "specplay-speedup.png"))
        file_menu.addSeparator()
        a = file_menu.addAction("Quit")
        a.setShortcut(QKeySequence.StandardKey.Quit)
        a.triggered.connect(self.close)
        view_menu = self.menuBar().addMenu("&View")
        for dock in self.docks.values():
            view_menu.addAction(dock.toggleViewAction())
        view_menu.addSeparator()
        a = view_menu.addAction("Reset layout")
        a.triggered.connect(lambda: self.restoreState(self._default_state))
        help_menu = self.menuBar().addMenu("&Help")
        a = help_menu.addAction("Colours and marks")
        a.triggered.connect(self._explain_colours)

    def _connect_token_view(self, view: TokenView) -> None:
        view.sig_token_hovered.connect(self.xray.show_token)
        view.sig_token_clicked.connect(lambda token, step, v=view: self._on_token_clicked(token, step, v))

    # ------------------------------------------------------------------------ settings
    def apply_settings(self, s: AppSettings) -> None:
        apply_to_window(self, s)
        if s.geometry is None or not self.restoreGeometry(s.geometry):
            self._default_size()
        if s.window_state is not None:
            self.restoreState(s.window_state)

    def showEvent(self, event):  # noqa: N802 (Qt name)
        super().showEvent(event)
        if not self._shown_once:
            self._shown_once = True
            if self.settings.window_state is None:
                QTimer.singleShot(150, self._default_dock_sizes)

    def _default_dock_sizes(self) -> None:
        d = self.docks
        h = max(600, self.height() - 90)
        self.resizeDocks([d["models"], d["xray"]], [360, 320], Qt.Orientation.Horizontal)
        self.resizeDocks([d["models"], d["prompt"], d["method"]], [int(h * 0.38), int(h * 0.27), int(h * 0.35)],
                         Qt.Orientation.Vertical)
        self.resizeDocks([d["xray"], d["internals"]], [int(h * 0.42), int(h * 0.58)], Qt.Orientation.Vertical)
        self.resizeDocks([d["charts"]], [int(h * 0.36)], Qt.Orientation.Vertical)

    def _default_size(self) -> None:
        """1560×980, or less on a smaller screen."""
        screen = self.screen().availableGeometry() if self.screen() is not None else None
        w, h = 1560, 980
        if screen is not None and screen.width() > 0:
            w, h = min(w, int(screen.width() * 0.96)), min(h, int(screen.height() * 0.92))
        self.resize(w, h)

    def save_settings(self) -> None:
        try:
            collect_from_window(self).save(open_settings())
        except Exception as exc:  # never lose the close because settings could not be written
            log.warning("could not save settings: %s", exc)

    # ------------------------------------------------------------------------ async plumbing
    def start(self) -> None:
        """Called once the event loop runs: load the history and the last (or default) models."""
        self.spawn(self.reload_history())
        self.spawn(self.load_models())

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("unexpected error in the window", exc_info=exc)
            self.show_error(f"Unexpected error: {exc!r}")
            self._set_busy(None)

    def closed_future(self) -> asyncio.Future:
        self._closed = asyncio.get_event_loop().create_future()
        return self._closed

    def _set_busy(self, what: str | None) -> None:
        self._busy = what
        loaded = self.models is not None
        self.run_action.setEnabled(what is None and loaded)
        self.compare_action.setEnabled(what is None and loaded)
        self.compare.run_button.setEnabled(what is None and loaded)
        self.audit_view.run_button.setEnabled(what is None and loaded)
        self.stop_action.setEnabled(what is not None)
        self.models_panel.set_loading(what == "load")
        if what is None and self.models_panel.progress.maximum() == 0:
            self.models_panel.progress.setRange(0, 1000)

    @property
    def busy(self) -> bool:
        return self._busy is not None

    def stop(self) -> None:
        """Stop whatever runs (a compare sequence stops after the current method's step)."""
        if self._busy is None:
            return
        self._stop_requested = True
        self.engine.cancel()
        self.set_status("Stopping…")

    # ------------------------------------------------------------------------ status and errors
    def set_status(self, text: str) -> None:
        self.status.setStyleSheet("")
        self.status.setText(text)

    def show_error(self, message: str) -> None:
        """An error the user must see: the status bar and a banner over the token view."""
        self.last_error = message
        self.status.setStyleSheet("QLabel { color: #b00020; }")
        self.status.setText(message)
        self.live.show_error(message)

    def _notify_export_error(self, message: str) -> None:
        self.show_error(message)
        box = QMessageBox(QMessageBox.Icon.Critical, "Export failed", message, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()  # not modal for the loop: runs keep streaming
        self._export_box = box

    def _refresh_memory(self) -> None:
        self.models_panel.refresh_memory()
        self.memory_label.setText(memory_text(short=True))

    # ------------------------------------------------------------------------ models
    async def load_models(self, target: str | None = None, draft: str | None = None, device: str | None = None,
                          dtype: str | None = None) -> ModelsLoaded | None:
        if self.busy:
            return None
        mp = self.models_panel
        target = target if target is not None else mp.target.spec()
        draft = draft if draft is not None else mp.draft.spec()
        device = device or mp.device.currentText()
        dtype = dtype or mp.dtype.currentText()
        if not target:
            self.show_error("Choose a target model first.")
            return None
        mp.target.set_spec(target)
        mp.draft.set_spec(draft)
        if mp.device.findText(device) >= 0:
            mp.device.setCurrentText(device)
        if mp.dtype.findText(dtype) >= 0:
            mp.dtype.setCurrentText(dtype)
        self._set_busy("load")
        self.models = None
        self.methods_panel.set_draft_available(False)
        self.set_status(f"Loading {target}" + (f" and {draft}" if draft else "") + "…")
        try:
            loaded: ModelsLoaded = await self.engine.load(LoadRequest(
                target=target, draft=draft or None, device=device, dtype=dtype,
                draft_backend=mp.draft_engine.currentText()))
        except EngineFailed as exc:
            mp.set_failed(str(exc))
            self.show_error(f"Loading failed: {exc}")
            self._set_busy(None)
            return None
        finally:
            self._stop_requested = False
        self.models = loaded
        self._token_texts.clear()
        self.why.set_curve(loaded.cost_curve)
        self.why.set_records([])
        mp.set_loaded(loaded)
        self.methods_panel.set_draft_available(loaded.draft is not None)
        self.settings.target, self.settings.draft = target, draft
        self.settings.remember_model(target)
        if draft:
            self.settings.remember_model(draft)
        self.setWindowTitle(f"SpecPlay — {loaded.target.spec}" + (f" + {loaded.draft.spec}" if loaded.draft else ""))
        self.set_status("Models ready." + (f" Draft: {loaded.draft_error}" if loaded.draft_error else ""))
        self.live.clear_error()
        self._set_busy(None)
        self._refresh_memory()
        return loaded

    def _on_progress(self, stage: str, fraction: float) -> None:
        if self._busy == "load":  # the models panel's bar is for loading; other stages go to the status bar
            self.models_panel.set_progress(stage, fraction)
        elif self._busy == "audit":
            self.audit_view.set_progress(stage, fraction)
        self.set_status(stage + ("" if fraction < 0 else f" {fraction:.0%}"))

    def _token_text(self, token_id: int) -> str:
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
    def _request(self, method: str, warmup_tokens: int = 0) -> RunRequest:
        """A run request from the panels; raises ConfigError with a message for the user."""
        config = self.methods_panel.config_for(method)
        gen = self.prompt_panel.generation_config()
        prompt = self.prompt_panel.prompt()
        if not prompt.strip():
            raise ConfigError("The prompt is empty.")
        if METHODS[method].needs_draft and (self.models is None or self.models.draft is None):
            raise ConfigError(f"{method_title(method)} needs a draft model: choose one in Models and load it.")
        return RunRequest(prompt=prompt, method=method, config=gen, method_config=config,
                          chat_template=self.prompt_panel.chat_template.isChecked(), warmup_tokens=warmup_tokens)

    async def _run(self, request: RunRequest, sinks: list) -> RunResult | None:
        """Send one run to the worker and wait for its result; errors are shown, and give None."""
        self._step_sinks = sinks
        try:
            return await self.engine.generate(request, stop_first=self._stop_requested)
        except EngineFailed as exc:
            self.show_error(f"{method_title(request.method)}: {exc}")
            return None
        finally:
            self._flush_steps()
            self._step_sinks = []

    def _on_step(self, event: StepEvent) -> None:
        self._step_queue.append(event)
        if not self._frame.isActive():
            self._frame.start()

    def _flush_steps(self) -> None:
        """Hand the steps that arrived since the last frame to the current run's views."""
        events, self._step_queue = self._step_queue, []
        if not events:
            self._frame.stop()
            return
        self.frames_drawn += 1
        for event in events:
            for sink in self._step_sinks:
                sink(event)
            self._remember_texts(event)

    def _remember_texts(self, event: StepEvent) -> None:
        # tokens seen in events feed the internals' token texts
        for t in event.tokens:
            if t.token_id not in self._token_texts and t.text:
                self._token_texts[t.token_id] = t.text

    def _record(self, result: RunResult, prompt: str, chat_template: bool) -> dict:
        from specplay.core.runlog import run_record

        draft = self.models.draft if METHODS.get(result.method) and METHODS[result.method].needs_draft else None
        return run_record(result, target=self.models.target, draft=draft, prompt=prompt, include_events=True,
                          extra={"chat_template": chat_template})

    def _save_to_history(self, record: dict) -> None:
        try:
            self.history.append(record)
        except OSError as exc:
            self.show_error(f"Could not save the run to the history ({self.history.path}): {exc.strerror or exc}")
        self.history_panel.add_record(record)

    async def run_single(self) -> RunResult | None:
        if self.busy or self.models is None:
            return None
        method = self.methods_panel.method()
        try:
            request = self._request(method)
        except ConfigError as exc:
            self.show_error(str(exc))
            return None
        self._set_busy("run")
        self._stop_requested = False
        self.live.clear_error()
        self.tabs.setCurrentWidget(self.live)
        self._begin_live(method)
        started = time.perf_counter()

        def live_stats(e: StepEvent) -> None:
            rate = e.total_new_tokens / e.elapsed_s if e.elapsed_s > 0 else 0.0
            self.live.stats.setText(f"{e.total_new_tokens} tokens · step {e.step + 1} · {rate:.1f} tok/s so far")

        sinks = [self.live.view.append_step, lambda e: self.charts.add_step(method, e),
                 self._internals_sink(self.live.view), live_stats]
        self.set_status(f"Running {method_title(method)}…")
        result = await self._run(request, sinks)
        self._set_busy(None)
        if result is None:
            return None
        record = self._record(result, request.prompt, request.chat_template)
        self._save_to_history(record)
        self.charts.finish_run(method, result.metrics.to_dict())
        if self._internals_view is self.live.view:
            self.internals.set_steps(result.events)
        self.live.stats.setText(stats_line(record))
        state = "Cancelled" if result.cancelled else "Done"
        self.set_status(f"{state}: {stats_line(record)} ({time.perf_counter() - started:.1f} s)")
        self._report_run_error(result)
        return result

    def _report_run_error(self, result: RunResult) -> None:
        """A run the engine ended early (out of memory): what it made is kept, and the reason shown."""
        if getattr(result.stop_reason, "value", None) == "error":
            title = method_title(result.method)
            self.show_error(f"{title} stopped early: {getattr(result, 'error', None) or 'an error in the engine'}. "
                            f"The {len(result.token_ids)} token(s) it made are kept.")

    def _begin_live(self, method: str, title: str | None = None) -> None:
        self.live.title.setText(f"<b>{title or method_title(method)}</b>")
        self.live.stats.setText("")
        self.live.view.clear_run()
        self._internals_view = self.live.view
        self.internals.clear()
        self.charts.begin_run(method)
        self.xray.show_token(None, None)

    async def run_compare(self, names: list[str], endpoints: list[str] | None = None) -> list[dict] | None:
        """Run ``names`` one after another on the same prompt, seed and settings, then the remote
        ``endpoints`` (specs as ``core.remote.Endpoint.parse`` reads them); fill the table."""
        from specplay.core.remote import Endpoint

        if self.busy or self.models is None:
            return None
        names = [n for n in names if n in METHODS]
        try:
            remote = [Endpoint.parse(e) for e in (self.compare.endpoints() if endpoints is None else endpoints)]
        except ConfigError as exc:
            self.show_error(f"Endpoint: {exc}")
            return None
        if not names and not remote:
            self.show_error("Check at least one method (or name an endpoint) to compare.")
            return None
        try:
            requests = {n: self._request(n, warmup_tokens=WARMUP_TOKENS) for n in names}
            remote_requests = [self._remote_request(ep) for ep in remote]
        except ConfigError as exc:
            self.show_error(str(exc))
            return None
        self._set_busy("compare")
        self._stop_requested = False
        self.live.clear_error()
        self.tabs.setCurrentWidget(self.compare)
        self.compare.begin(names + [f"remote:{ep.label}" for ep in remote])
        self.charts.clear()
        greedy = self.prompt_panel.generation_config().sampling.greedy
        self.compare.note.setText(
            "Same prompt, seed and settings for every method, each after a short warm-up"
            + (" (endpoints are compared with the first endpoint). " if remote else ". ")
            + ("Temperature 0: every lossless method must match autoregressive token for token."
               if greedy else "Temperature > 0: outputs differ run to run; the distribution is what is preserved."))
        await asyncio.sleep(0.05)  # let the new columns lay out before the first timed run starts
        records: list[dict] = []
        aborted = False
        for i, name in enumerate(names):
            if self._stop_requested:
                break
            col = self.compare.column(name)
            self._connect_token_view(col.view)
            self.charts.begin_run(name)
            self._internals_view = col.view
            self.internals.clear()

            def col_stats(e: StepEvent, col=col) -> None:
                rate = e.total_new_tokens / e.elapsed_s if e.elapsed_s > 0 else 0.0
                col.stats.setText(f"{e.total_new_tokens} tokens · {rate:.1f} tok/s so far")

            sinks = [col.view.append_step, lambda e, n=name: self.charts.add_step(n, e),
                     self._internals_sink(col.view), col_stats]
            col.stats.setText("warming up…")
            self.set_status(f"Comparing: {method_title(name)} ({i + 1}/{len(names)})…")
            result = await self._run(requests[name], sinks)
            if result is None:
                col.stats.setText("failed (see the message above)")
                aborted = True
                break
            record = self._record(result, requests[name].prompt, requests[name].chat_template)
            self._save_to_history(record)
            records.append(record)
            self.charts.finish_run(name, result.metrics.to_dict())
            col.stats.setText(stats_line(record))
            self._report_run_error(result)
            annotate(records, greedy)
            self.compare.set_records(records)
            if result.cancelled or getattr(result.stop_reason, "value", None) == "error":
                aborted = True
                break
        for j, req in enumerate(remote_requests):
            if self._stop_requested or aborted:
                break
            aborted = not await self._compare_remote(req, f"remote:{req.endpoint.label}", records, greedy,
                                                     f"endpoint {j + 1}/{len(remote_requests)}")
        annotate(records, greedy)
        annotate_remote(records, greedy)
        self.compare.set_records(records)
        self.why.set_records(records)
        self._set_busy(None)
        stopped = self._stop_requested
        self._stop_requested = False
        self.set_status(("Comparison stopped" if stopped else "Comparison done") + f": {len(records)} run(s).")
        return records

    def _remote_request(self, endpoint) -> RemoteRequest:
        gen = self.prompt_panel.generation_config()
        prompt = self.prompt_panel.prompt()
        if not prompt.strip():
            raise ConfigError("The prompt is empty.")
        s = gen.sampling
        return RemoteRequest(endpoint=endpoint, prompt=prompt, max_tokens=gen.max_new_tokens, temperature=s.temperature,
                             top_p=s.top_p, seed=s.seed, chat=self.prompt_panel.chat_template.isChecked(),
                             warmup_tokens=8)

    async def _compare_remote(self, request: RemoteRequest, name: str, records: list[dict], greedy: bool,
                              where: str) -> bool:
        """One endpoint's run in a comparison: streamed into its column, recorded, annotated.
        Returns False when the comparison should stop (cancelled, or the engine thread failed)."""
        from specplay.core.remote import remote_record

        col = self.compare.column(name)
        self.charts.begin_run(name)

        def col_stats(e: StepEvent) -> None:
            rate = e.total_new_tokens / e.elapsed_s if e.elapsed_s > 0 else 0.0
            col.stats.setText(f"{e.total_new_tokens} chunks · {rate:.1f}/s so far")

        col.stats.setText(f"connecting to {request.endpoint.url}…")
        self.set_status(f"Comparing: {request.endpoint.label} ({where})…")
        self._step_sinks = [col.view.append_step, lambda e: self.charts.add_step(name, e), col_stats]
        try:
            run = await self.engine.generate_remote(request, stop_first=self._stop_requested)
        except EngineFailed as exc:
            self.show_error(f"{request.endpoint.label}: {exc}")
            return False
        finally:
            self._flush_steps()
            self._step_sinks = []
        record = remote_record(run, max_new_tokens=request.max_tokens, temperature=request.temperature,
                               top_p=request.top_p, seed=request.seed)
        self._save_to_history(record)
        records.append(record)
        col.stats.setText(stats_line(record) if not run.error else f"error: {run.error}")
        if run.error:
            kept = f" The {len(run.text)} characters received are kept." if run.text else ""
            self.show_error(f"{request.endpoint.label}: {run.error}.{kept}")
        annotate_remote(records, greedy)
        self.compare.set_records(records)
        return not run.cancelled

    async def run_audit(self, samples: int, depth: int) -> dict | None:
        """Audit the Method panel's method on the Prompt panel's prompt and sampling (:mod:`specplay.core.audit`);
        the record goes into the history like a run's."""
        from specplay.core.audit import audit_record

        if self.busy or self.models is None:
            return None
        method = self.methods_panel.method()
        try:
            request = AuditRequest(run=self._request(method), samples=samples, depth=depth)
        except ConfigError as exc:
            self.show_error(str(exc))
            return None
        self._set_busy("audit")
        self._stop_requested = False
        self.live.clear_error()
        self.tabs.setCurrentWidget(self.audit_view)
        self.audit_view.begin(method_title(method))
        self.set_status(f"Auditing {method_title(method)}: {samples} samples of {depth} tokens…")
        try:
            result = await self.engine.audit(request, stop_first=self._stop_requested)
        except EngineFailed as exc:
            self.show_error(f"Audit of {method_title(method)}: {exc}")
            return None
        finally:
            self._set_busy(None)
        draft = self.models.draft if METHODS[method].needs_draft else None
        record = audit_record(result, target=self.models.target, draft=draft, prompt=request.run.prompt,
                              extra={"chat_template": request.run.chat_template})
        self._save_to_history(record)
        self.audit_view.show_record(record, method_title(method))
        self.set_status(("Audit stopped: " if result.cancelled else "Audit: ") + record["text"])
        if result.error:
            self.show_error(f"The audit of {method_title(method)} stopped early: {result.error}")
        return record

    # ------------------------------------------------------------------------ history
    async def reload_history(self) -> list[dict]:
        loop = asyncio.get_event_loop()
        try:
            records = await loop.run_in_executor(self._io, self.history.load)
        except OSError as exc:
            self.show_error(f"Could not read the run history {self.history.path}: {exc.strerror or exc}")
            return []
        self.history_panel.set_records(records)
        return records

    def open_record(self, record: dict) -> None:
        """Show a saved run again: tokens, X-ray, internals and charts."""
        from specplay.core.runlog import event_from_dict

        method = record.get("method", "?")
        if record.get("kind") == "audit":
            self.tabs.setCurrentWidget(self.audit_view)
            self.audit_view.show_record(record, f"{method_title(method)} "
                                                "(from the history)")
            self.set_status(f"Showing a saved audit: {method}, {record.get('samples')} samples.")
            return
        events: list[StepEvent] = []
        total = 0
        try:
            for d in record.get("events") or []:
                e = event_from_dict(d, total)
                total = e.total_new_tokens
                events.append(e)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self.show_error(f"This history entry cannot be shown token by token ({exc!r}); its text is shown instead.")
            events = []
        self.tabs.setCurrentWidget(self.live)
        self._begin_live(method, f"{method_title(method)} (from the history)")
        self.live.clear_error()
        if events:
            self.live.view.set_steps(events)
        else:
            self.live.view.setPlainText(record.get("text") or "")
        self.internals.set_steps(events)
        split = record.get("time_split") or {}
        self.charts.show_run(method, events, {"accept_lengths": record.get("accept_lengths"),
                                              "acceptance_by_position": record.get("acceptance_by_position"),
                                              "draft_s": split.get("draft", 0.0), "verify_s": split.get("verify", 0.0),
                                              "other_s": split.get("other", 0.0)})
        self.live.stats.setText(stats_line(record) if "wall_time" in record else "")
        self.set_status(f"Showing a saved run: {method}, {record.get('new_tokens', '?')} tokens.")

    # ------------------------------------------------------------------------ export
    def _ask_path(self, title: str, name: str, filters: str) -> str | None:
        start = Path(self.settings.export_dir or Path.home()) / name
        path, _ = QFileDialog.getSaveFileName(self, title, str(start), filters)
        if path:
            self.settings.export_dir = str(Path(path).parent)
        return path or None

    def _export_dialog(self, kind: str, records: list[dict]) -> None:
        if not records:
            self.show_error("Select one or more runs in the History panel to export.")
            return
        if kind == "jsonl":
            path = self._ask_path("Export runs as JSON lines", "specplay-runs.jsonl", "JSON lines (*.jsonl)")
        else:
            path = self._ask_path("Export runs as CSV", "specplay-runs.csv", "CSV (*.csv)")
        if path:
            self.spawn(self.export_runs(path, records, kind))

    def _export_png_dialog(self, widget: QWidget, name: str) -> None:
        path = self._ask_path("Export chart as PNG", name, "PNG images (*.png)")
        if path:
            self.spawn(self.export_png(path, widget))

    async def export_runs(self, path: str | Path, records: list[dict], kind: str = "jsonl") -> bool:
        """Write ``records`` (JSON lines or CSV) atomically; a failure is shown and changes nothing."""
        write = write_runs_jsonl if kind == "jsonl" else write_runs_csv
        try:
            await asyncio.get_event_loop().run_in_executor(self._io, write, Path(path), list(records))
        except ExportError as exc:
            self._notify_export_error(str(exc))
            return False
        self.last_export = Path(path)
        self.set_status(f"Exported {len(records)} run(s) to {path}.")
        return True

    async def export_png(self, path: str | Path, widget: QWidget) -> bool:
        image = widget.grab().toImage()  # grabbing must happen on the GUI thread
        try:
            await asyncio.get_event_loop().run_in_executor(self._io, write_png, Path(path), image)
        except ExportError as exc:
            self._notify_export_error(str(exc))
            return False
        self.last_export = Path(path)
        self.set_status(f"Saved {path}.")
        return True

    # ------------------------------------------------------------------------ misc
    def _internals_sink(self, view: TokenView):
        """Steps of the run shown in ``view`` feed the internals panel while it shows that view's run."""
        def sink(event: StepEvent) -> None:
            if self._internals_view is view:
                self.internals.add_step(event)
        return sink

    def _on_token_clicked(self, token, step, view: TokenView) -> None:
        self.xray.show_token(token, step)
        if self._internals_view is not view:  # a token of another run (a compare column): show that run
            self._internals_view = view
            self.internals.set_steps(view.steps)
        self.internals.select_step(step)

    def _explain_colours(self) -> None:
        from specplay.app.palette import FATE_STYLES

        lines = [f"<p><b style='color:{s.colour}'>{s.label}</b>: {s.description}</p>" for s in FATE_STYLES.values()]
        box = QMessageBox(QMessageBox.Icon.Information, "Colours and marks",
                          "".join(lines) + "<p>Rejected drafts leave a raised ✕ (with their count) where they were tried, "
                          "or show struck through with “rejected drafts inline”; resampled tokens are underlined, "
                          "bonus ones overlined, so the fates read without colour too.</p>", QMessageBox.StandardButton.Ok,
                          self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()

    def closeEvent(self, event):  # noqa: N802 (Qt name)
        self.save_settings()
        self._stop_requested = True
        self.engine.shutdown()
        self._memory_timer.stop()
        self._io.shutdown(wait=False)
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(0)
        super().closeEvent(event)
