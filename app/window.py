"""The main window: docks for models, prompt, methods, X-ray, internals, charts and history
around a live token view and a compare view.

The window lays the views out, declares its actions and wires both to a
:class:`~specplay.app.session.RunSession`, which sequences every load, run, comparison and audit
in the worker thread. The window's coroutines read the panels into requests and await the
session; its slots draw what the session's signals report. Nothing here calls torch.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (QDockWidget, QFileDialog, QLabel, QMainWindow, QMessageBox, QSizePolicy, QStyle,
                               QTabWidget, QWidget)

from specplay.app.audit_view import AuditView
from specplay.app.charts import ChartsPanel, configure_pyqtgraph
from specplay.app.compare_view import CompareView
from specplay.app.history_panel import HistoryPanel
from specplay.app.internals import InternalsPanel
from specplay.app.live_view import LiveView
from specplay.app.panels import MethodsPanel, ModelsPanel, PromptPanel
from specplay.app.run_views import RunViews, explain_colours
from specplay.app.session import RunSession
from specplay.app.settings import AppSettings, open_settings
from specplay.app.tune_view import TuneView
from specplay.app.whyspeed_view import WhySpeedView
from specplay.app.window_settings import apply_to_window, collect_from_window
from specplay.app.worker import AuditRequest, ModelsLoaded, RemoteRequest, RunRequest, TuneRequest
from specplay.app.xray import XRayPanel
from specplay.core.decoding.engine import WARMUP_TOKENS
from specplay.core.decoding.types import RunResult
from specplay.core.errors import ConfigError
from specplay.core.measure.tune import KNOBS as TUNED
from specplay.core.measure.tune_server import NAME as SERVER_TUNE, tune_title
from specplay.core.memory import memory_text
from specplay.core.methods import METHODS, method_title
from specplay.core.records.history import Entry, History
from specplay.core.remote.endpoint import Endpoint

log = logging.getLogger(__name__)


class ActionRow(NamedTuple):
    """One menu or toolbar action, as :meth:`MainWindow._action_rows` declares them."""

    place: str  # "toolbar", or the menu it goes into
    text: str  # "-" is a separator
    handler: Callable | None = None
    shortcut: str | QKeySequence.StandardKey | None = None
    icon: QStyle.StandardPixmap | None = None
    tip: str = ""


MENUS = ("&File", "&View", "&Help")
#: How long closing the window waits, blocking, for the worker thread to stop (a Stop reaches a step in
#: this time); a step that takes longer is waited for with the window hidden.
CLOSE_WAIT_MS = 2_000
#: The save dialog of each kind of run export: (title, file name, filters).
EXPORT_DIALOGS = {"jsonl": ("Export runs as JSON lines", "specplay-runs.jsonl", "JSON lines (*.jsonl)"),
                  "csv": ("Export runs as CSV", "specplay-runs.csv", "CSV (*.csv)")}


class MainWindow(QMainWindow):
    def __init__(self, settings: AppSettings | None = None, history: History | None = None):
        super().__init__()
        configure_pyqtgraph()
        self.setWindowTitle("SpecPlay")
        self.settings = settings if settings is not None else AppSettings.load()
        self.session = RunSession(history, self)
        self._closed: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self.last_error = ""
        self._shown_once = False
        self._closing = False
        self._build_views()
        self._build_docks()
        self._build_actions()
        self._build_status_bar()
        self.run_views = RunViews(self.session, self.tabs, self.live, self.compare, self.audit_view, self.tune_view,
                                  self.charts, self.internals, self.xray, self)
        self._connect_views()
        self._connect_session()
        self._memory_timer = QTimer(self)
        self._memory_timer.setInterval(2000)
        self._memory_timer.timeout.connect(self._refresh_memory)
        self._memory_timer.start()
        self._refresh_memory()
        self.apply_settings(self.settings)
        self._on_busy_changed("")

    # ------------------------------------------------------------------------ construction
    def _build_views(self) -> None:
        """The central tabs: live, compare, why this speed, tune, audit."""
        self.live = LiveView()
        self.compare = CompareView()
        self.why = WhySpeedView()
        self.tune_view = TuneView()
        self.audit_view = AuditView()
        self.tabs = QTabWidget()
        for view, title in ((self.live, "Live"), (self.compare, "Compare"), (self.why, "Why this speed"),
                            (self.tune_view, "Tune"), (self.audit_view, "Audit")):
            self.tabs.addTab(view, title)
        self.setCentralWidget(self.tabs)
        # one "rejected drafts inline" setting for every token view
        self.live.rejected_inline.toggled.connect(self.compare.rejected_inline.setChecked)
        self.compare.rejected_inline.toggled.connect(self.live.rejected_inline.setChecked)

    def _build_docks(self) -> None:
        """The side and bottom panels, each in a dock the View menu shows and hides."""
        self.setDockNestingEnabled(True)
        # side panels run the full height; charts and history sit under the central view only
        self.setCorner(Qt.Corner.BottomLeftCorner, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.models_panel = ModelsPanel()
        self.prompt_panel = PromptPanel()
        self.methods_panel = MethodsPanel()
        self.xray = XRayPanel()
        self.internals = InternalsPanel(self.session.token_text)
        self.charts = ChartsPanel(list(METHODS))
        self.history_panel = HistoryPanel()
        area = Qt.DockWidgetArea
        self.docks: dict[str, QDockWidget] = {}
        for key, title, widget, where in (
                ("models", "Models", self.models_panel, area.LeftDockWidgetArea),
                ("prompt", "Prompt", self.prompt_panel, area.LeftDockWidgetArea),
                ("method", "Method", self.methods_panel, area.LeftDockWidgetArea),
                ("xray", "Token X-ray", self.xray, area.RightDockWidgetArea),
                ("internals", "Method internals", self.internals, area.RightDockWidgetArea),
                ("charts", "Charts", self.charts, area.BottomDockWidgetArea),
                ("history", "History", self.history_panel, area.BottomDockWidgetArea)):
            dock = QDockWidget(title, self)
            dock.setObjectName(f"dock_{key}")
            dock.setWidget(widget)
            dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                             | QDockWidget.DockWidgetFeature.DockWidgetFloatable
                             | QDockWidget.DockWidgetFeature.DockWidgetClosable)
            self.addDockWidget(where, dock)
            self.docks[key] = dock
        self.tabifyDockWidget(self.docks["charts"], self.docks["history"])
        self.docks["charts"].raise_()
        self._default_state = self.saveState()

    def _action_rows(self) -> list[ActionRow]:
        """Every action the window offers, in toolbar and menu order."""
        icon = QStyle.StandardPixmap
        selected = self.history_panel.selected_entries
        return [
            ActionRow("toolbar", "Run", lambda: self.spawn(self.run_single()), "Ctrl+Return", icon.SP_MediaPlay,
                      "Run the selected method on the prompt (Ctrl+Enter)"),
            ActionRow("toolbar", "Stop", self.session.stop, "Esc", icon.SP_MediaStop,
                      "Stop the run, comparison or loading within one step (Esc)"),
            ActionRow("toolbar", "-"),
            ActionRow("toolbar", "Compare", lambda: self.spawn(self.run_compare(self.compare.selected())),
                      "Ctrl+Shift+Return", icon.SP_FileDialogDetailedView,
                      "Run the methods checked in the Compare tab one after another (Ctrl+Shift+Enter)"),
            ActionRow("&File", "Export selected runs as JSONL…", lambda: self._export_dialog("jsonl", selected())),
            ActionRow("&File", "Export selected runs as CSV…", lambda: self._export_dialog("csv", selected())),
            ActionRow("&File", "Export charts as PNG…",
                      lambda: self._export_png_dialog(self.charts, "specplay-charts.png")),
            ActionRow("&File", "Export speedup chart as PNG…",
                      lambda: self._export_png_dialog(self.compare.speedup_plot, "specplay-speedup.png")),
            ActionRow("&File", "-"),
            ActionRow("&File", "Quit", self.close, QKeySequence.StandardKey.Quit),
            ActionRow("&View", "-"),  # after each dock's own show/hide action
            ActionRow("&View", "Reset layout", lambda: self.restoreState(self._default_state)),
            ActionRow("&Help", "Colours and marks", lambda: explain_colours(self)),
        ]

    def _build_actions(self) -> None:
        """The run toolbar and the menus, made from :meth:`_action_rows`."""
        bar = self.addToolBar("Run")
        bar.setObjectName("toolbar_run")
        bar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        places = {"toolbar": bar, **{title: self.menuBar().addMenu(title) for title in MENUS}}
        for dock in self.docks.values():
            places["&View"].addAction(dock.toggleViewAction())
        made: dict[str, QAction] = {}
        for row in self._action_rows():
            if row.text == "-":
                places[row.place].addSeparator()
                continue
            action = made[row.text] = QAction(row.text, self)
            if row.icon is not None:
                action.setIcon(self.style().standardIcon(row.icon))
            if row.shortcut is not None:
                action.setShortcut(QKeySequence(row.shortcut))
            if row.tip:
                action.setToolTip(row.tip)
            action.triggered.connect(row.handler)
            places[row.place].addAction(action)
        self.run_action, self.stop_action, self.compare_action = made["Run"], made["Stop"], made["Compare"]

    def _build_status_bar(self) -> None:
        self.status = QLabel("")
        self.status.setObjectName("status")
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.memory_label = QLabel("")
        self.statusBar().addWidget(self.status, 1)
        self.statusBar().addPermanentWidget(self.memory_label)

    def _connect_views(self) -> None:
        """What the panels ask for: loads, runs, comparisons, audits, history and exports."""
        self.models_panel.sig_load_requested.connect(lambda: self.spawn(self.load_models()))
        self.models_panel.sig_cancel_requested.connect(self.session.stop)
        self.compare.sig_run_requested.connect(lambda names: self.spawn(self.run_compare(names)))
        self.audit_view.sig_run_requested.connect(lambda n, k: self.spawn(self.run_audit(n, k)))
        self.tune_view.sig_run_requested.connect(lambda: self.spawn(self.run_tune()))
        self.tune_view.sig_server_requested.connect(lambda: self.spawn(self.run_tune(server=True)))
        self.tune_view.sig_apply_requested.connect(self.apply_tuned)
        self.history_panel.sig_open_requested.connect(lambda entry: self.spawn(self.open_saved(entry)))
        self.history_panel.sig_export_requested.connect(self._export_dialog)
        self.history_panel.sig_reload_requested.connect(lambda: self.spawn(self.session.reload_history()))
        self.history_panel.sig_keep_requested.connect(lambda n: self.spawn(self.session.keep_last_runs(n)))

    def _connect_session(self) -> None:
        """What the session reports, to the views that draw it (runs: :class:`RunViews`)."""
        s = self.session
        s.sig_busy_changed.connect(self._on_busy_changed)
        s.sig_status.connect(self.set_status)
        s.sig_error.connect(self.show_error)
        s.sig_progress.connect(self._on_progress)
        s.sig_models_changed.connect(self._on_models_changed)
        s.sig_load_failed.connect(self.models_panel.set_failed)
        s.sig_cost_curve.connect(self.why.set_curve)
        s.sig_record_saved.connect(self.history_panel.add_entry)
        s.sig_history_loaded.connect(self.history_panel.set_entries)
        s.sig_export_failed.connect(self._notify_export_error)
        self.run_views.sig_status.connect(self.set_status)
        self.run_views.sig_error.connect(self.show_error)

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
        self.spawn(self.session.reload_history())
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

    def closed_future(self) -> asyncio.Future:
        self._closed = asyncio.get_event_loop().create_future()
        return self._closed

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

    # ------------------------------------------------------------------------ what the session reports
    def _on_busy_changed(self, what: str) -> None:
        ready = not what and self.session.models is not None
        for control in (self.run_action, self.compare_action, self.compare.run_button, self.audit_view.run_button,
                        self.tune_view.run_button):
            control.setEnabled(ready)
        self.tune_view.server_button.setEnabled(ready and self.tune_view.server_ready)
        drafting = self.session.draft_loading  # the target runs; its draft loads beside it
        self.stop_action.setEnabled(bool(what) or drafting)
        self.models_panel.set_loading(what == "load" or drafting)

    def _on_progress(self, stage: str, fraction: float) -> None:
        if self.session.activity == "load" or self.session.draft_loading:  # the models panel's bar is for loading
            self.models_panel.set_progress(stage, fraction)
        elif self.session.activity == "audit":
            self.audit_view.set_progress(stage, fraction)
        elif self.session.activity == "tune":
            self.tune_view.set_progress(stage, fraction)
        if self.session.activity:  # a draft loading beside the runs keeps to its panel: the status line is theirs
            self.set_status(stage + ("" if fraction < 0 else f" {fraction:.0%}"))

    def _on_models_changed(self, loaded: ModelsLoaded | None) -> None:
        self.methods_panel.set_draft_available(loaded is not None and loaded.draft is not None,
                                               loading=loaded is not None and loaded.draft_pending)
        if loaded is None:  # loading starts
            return
        self.why.set_curve(loaded.cost_curve)
        self.why.set_records([])
        self.models_panel.set_loaded(loaded)
        self.setWindowTitle(f"SpecPlay — {loaded.target.model_id}" + (f" + {loaded.draft.model_id}" if loaded.draft else ""))
        self.live.clear_error()
        self._refresh_memory()

    # ------------------------------------------------------------------------ loading and running
    async def load_models(self, target: str | None = None, draft: str | None = None, device: str | None = None,
                          dtype: str | None = None) -> ModelsLoaded | None:
        """Load ``target`` and ``draft`` (by default the Models panel's choice) and remember them."""
        if self.session.busy:
            return None
        request = self.models_panel.load_request(target, draft, device, dtype)
        if request is None:
            self.show_error("Choose a target model first.")
            return None
        loaded = await self.session.load(request)
        if loaded is not None:
            self.settings.target, self.settings.draft = request.target, request.draft or ""
            for spec in (request.target, request.draft):
                if spec:
                    self.settings.remember_model(spec)
        return loaded

    def _ready_request(self, method: str) -> RunRequest | None:
        """A request to run ``method`` from the panels, or None when nothing can run now (the reason shown)."""
        if self.session.busy or self.session.models is None:
            return None
        try:
            return self.methods_panel.run_request(method, self.prompt_panel)
        except ConfigError as exc:
            self.show_error(str(exc))
            return None

    async def run_single(self) -> RunResult | None:
        """Run the Method panel's method on the Prompt panel's prompt, in the live view."""
        request = self._ready_request(self.methods_panel.method())
        if request is None:
            return None
        self.run_views.show_tab(self.live)
        return await self.session.run(request)

    async def run_compare(self, names: list[str], endpoints: list[str] | None = None) -> list[dict] | None:
        """Run ``names`` one after another on the same prompt, seed and settings, then the remote
        ``endpoints`` (specs as ``core.remote.endpoint.Endpoint.parse`` reads them); fill the table."""
        if self.session.busy or self.session.models is None:
            return None
        requests = self._compare_requests([n for n in names if n in METHODS],
                                          self.compare.endpoints() if endpoints is None else endpoints,
                                          self.compare.servers())
        if requests is None:
            return None
        local, remote = requests
        greedy = self.prompt_panel.generation_config().sampling.greedy
        self.run_views.show_tab(self.compare)
        self.compare.begin([r.method for r in local] + [f"remote:{r.endpoint.label}" for r in remote], greedy)
        self.charts.clear()
        records = await self.session.compare(local, remote, greedy)
        if records is not None:
            self.why.set_records(records)
        return records

    def _compare_requests(self, names: list[str], endpoints: list[str], servers: list[str]
                          ) -> tuple[list[RunRequest], list[RemoteRequest]] | None:
        """A comparison's local and remote requests from the panels (``servers``: llama-server peers, run
        after the endpoints), or None (the reason shown)."""
        try:
            remote = [Endpoint.parse(e) for e in endpoints]
        except ConfigError as exc:
            self.show_error(f"Endpoint: {exc}")
            return None
        if not names and not remote and not servers:
            self.show_error("Check at least one method (or name an endpoint) to compare.")
            return None
        try:
            # A server peer's endpoint only names it: the worker starts the server and streams from it.
            started = [replace(self.prompt_panel.remote_request(Endpoint("http://127.0.0.1:8080/v1", name=name)),
                               server=name) for name in servers]
            return ([self.methods_panel.run_request(n, self.prompt_panel, WARMUP_TOKENS) for n in names],
                    [self.prompt_panel.remote_request(ep) for ep in remote] + started)
        except ConfigError as exc:
            self.show_error(str(exc))
            return None

    async def run_audit(self, samples: int, depth: int) -> dict | None:
        """Audit the Method panel's method on the Prompt panel's prompt and sampling (:mod:`specplay.core.measure.audit`);
        the record goes into the history like a run's."""
        method = self.methods_panel.method()
        request = self._ready_request(method)
        if request is None:
            return None
        self.run_views.show_tab(self.audit_view)
        self.audit_view.begin(method_title(method))
        return await self.session.audit(AuditRequest(run=request, samples=samples, depth=depth))

    async def run_tune(self, server: bool = False) -> dict | None:
        """Tune the Method panel's method on the Prompt panel's prompt (:mod:`specplay.core.measure.tune`), or with
        ``server`` llama-server's own draft size (:mod:`specplay.core.measure.tune_server`); the record goes into
        the history like a run's."""
        method = "autoregressive" if server else self.methods_panel.method()  # a server tune runs no method of ours
        if not server and method not in TUNED:
            self.show_error(f"Tune predicts {', '.join(method_title(m) for m in TUNED)}: choose one under Method.")
            return None
        request = self._ready_request(method)
        if request is None:
            return None
        if not request.config.sampling.greedy:
            self.show_error("Tune predicts greedy runs: set the temperature to 0 under Prompt.")
            return None
        self.run_views.show_tab(self.tune_view)
        self.tune_view.begin(tune_title(SERVER_TUNE if server else method))
        return await self.session.tune(TuneRequest(run=request, server=server))

    def apply_tuned(self, method: str, config: dict) -> None:
        """The Tune view's "Use these settings": the method and its tuned configuration into the Method panel."""
        self.methods_panel.set_method(method)
        self.methods_panel.current_form().set_values(config)
        self.set_status(f"{method_title(method)} set to the tuned settings.")

    # ------------------------------------------------------------------------ export
    def _ask_path(self, title: str, name: str, filters: str) -> str | None:
        start = Path(self.settings.export_dir or Path.home()) / name
        path, _ = QFileDialog.getSaveFileName(self, title, str(start), filters)
        if path:
            self.settings.export_dir = str(Path(path).parent)
        return path or None

    async def open_saved(self, entry: Entry) -> None:
        """Show a run of the history again, its whole record read off the GUI thread."""
        records = await self.session.history_records([entry])
        if records:
            self.run_views.show_saved(records[0])

    def _export_dialog(self, kind: str, entries: list[Entry]) -> None:
        if not entries:
            self.show_error("Select one or more runs in the History panel to export.")
            return
        path = self._ask_path(*EXPORT_DIALOGS[kind])
        if path:
            self.spawn(self.export_entries(path, entries, kind))

    async def export_entries(self, path: str, entries: list[Entry], kind: str) -> bool:
        """Export the whole records of history ``entries`` (read off the GUI thread)."""
        records = await self.session.history_records(entries)
        return records is not None and await self.session.export_runs(path, records, kind)

    def _export_png_dialog(self, widget: QWidget, name: str) -> None:
        path = self._ask_path("Export chart as PNG", name, "PNG images (*.png)")
        if path:  # grabbing must happen on the GUI thread
            self.spawn(self.session.export_png(path, widget.grab().toImage()))

    def closeEvent(self, event):  # noqa: N802 (Qt name)
        """Stop what runs and end the worker thread. A step that cannot be interrupted (llama.cpp quantizing
        a file, a probe child) is waited for with the window hidden; the window closes once it ends."""
        thread = self.session.client.thread
        if not self._closing:
            self._closing = True
            self.save_settings()
            self._memory_timer.stop()
            if not self.session.shutdown(wait_ms=CLOSE_WAIT_MS):
                thread.finished.connect(self.close)
        if not thread.isFinished():
            self.hide()
            event.ignore()
            return
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(0)
        super().closeEvent(event)

