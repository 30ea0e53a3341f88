"""Where runs are drawn: the session's run signals, and saved runs, in the central views.

A run streams into the live view or, in a comparison, into its own column of the compare view;
its steps also go to the charts, and to the internals panel while that panel follows this run's
token view (clicking a token of another run switches the panel to that run, and the X-ray shows
the token). A run or audit reopened from the history is drawn by the same views.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QLabel, QMessageBox, QTabWidget, QWidget

from specplay.app.audit_view import AuditView
from specplay.app.tune_view import TuneView
from specplay.app.charts import ChartsPanel
from specplay.app.compare_view import CompareView
from specplay.app.internals import InternalsPanel
from specplay.app.live_view import LiveView
from specplay.app.palette import FATE_STYLES
from specplay.app.session import RunSession
from specplay.app.tokenview import TokenView
from specplay.app.xray import XRayPanel
from specplay.core.measure.tune_server import tune_title
from specplay.core.methods import METHODS, method_title
from specplay.core.records.runlog import event_from_dict, stats_line
from specplay.core.decoding.types import StepEvent


class RunViews(QObject):
    """Draws runs, streaming or saved, in the token views, the charts, the internals panel and the X-ray.

    Signals:
        sig_status(str): a line for the status bar.
        sig_error(str): a message the user must see.
    """

    sig_status = Signal(str)
    sig_error = Signal(str)

    def __init__(self, session: RunSession, tabs: QTabWidget, live: LiveView, compare: CompareView,
                 audit_view: AuditView, tune_view: TuneView, charts: ChartsPanel, internals: InternalsPanel,
                 xray: XRayPanel, parent=None):
        super().__init__(parent)
        self.session = session
        self.tabs, self.live, self.compare, self.audit_view, self.tune_view = tabs, live, compare, audit_view, tune_view
        self.charts, self.internals, self.xray = charts, internals, xray
        self._internals_view: TokenView | None = None  # the token view whose run the internals panel shows
        self._stream_to: tuple[TokenView, QLabel] | None = None  # the streaming run's token view and stats line
        self._connect_token_view(live.view)
        session.sig_run_started.connect(self._on_run_started)
        session.sig_steps.connect(self._on_steps)
        session.sig_run_finished.connect(self._on_run_finished)
        session.sig_run_failed.connect(self._on_run_failed)
        session.sig_compare_updated.connect(compare.set_records)
        session.sig_audit_finished.connect(lambda rec: audit_view.show_record(rec, method_title(rec["method"])))
        session.sig_tune_finished.connect(lambda rec: tune_view.show_record(rec, tune_title(rec["method"])))

    def _connect_token_view(self, view: TokenView) -> None:
        """A hovered token of ``view`` shows in the X-ray; a clicked one also selects its step in the internals."""
        view.sig_token_hovered.connect(self.xray.show_token)
        view.sig_token_clicked.connect(lambda token, step, v=view: self._on_token_clicked(token, step, v))

    def _on_token_clicked(self, token, step, view: TokenView) -> None:
        self.xray.show_token(token, step)
        if self._internals_view is not view:  # a token of another run (a compare column): show that run
            self._internals_view = view
            self.internals.set_steps(view.steps)
        self.internals.select_step(step)

    def show_tab(self, view) -> None:
        """Bring ``view`` (the live, compare or audit view) to the front for a new run; the last error banner goes."""
        self.live.clear_error()
        self.tabs.setCurrentWidget(view)

    def _begin_live(self, method: str, title: str | None = None) -> None:
        """The live view, charts and internals start afresh for a run of ``method``."""
        self.live.title.setText(f"<b>{title or method_title(method)}</b>")
        self.live.stats.setText("")
        self.live.view.clear_run()
        self._internals_view = self.live.view
        self.internals.clear()
        self.charts.begin_run(method)
        self.xray.show_token(None, None)

    # ------------------------------------------------------------------------ a streaming run
    def _on_run_started(self, name: str, waiting: str) -> None:
        """A run streams into the live view, or in a comparison into its own column."""
        if self.session.activity != "compare":
            self._begin_live(name)
            self._stream_to = (self.live.view, self.live.stats)
            return
        col = self.compare.column(name)
        self._stream_to = (col.view, col.stats)
        col.stats.setText(waiting)
        self.charts.begin_run(name)
        if name in METHODS:  # not an endpoint: its tokens open in the X-ray and the internals
            self._connect_token_view(col.view)
            self._internals_view = col.view
            self.internals.clear()

    def _on_steps(self, name: str, events: list[StepEvent]) -> None:
        view, stats = self._stream_to
        for event in events:
            view.append_step(event)
            self.charts.add_step(name, event)
            if self._internals_view is view:
                self.internals.add_step(event)
        e = events[-1]
        rate = e.total_new_tokens / e.elapsed_s if e.elapsed_s > 0 else 0.0
        if name not in METHODS:
            stats.setText(f"{e.total_new_tokens} chunks · {rate:.1f}/s so far")
        elif view is self.live.view:
            stats.setText(f"{e.total_new_tokens} tokens · step {e.step + 1} · {rate:.1f} tok/s so far")
        else:
            stats.setText(f"{e.total_new_tokens} tokens · {rate:.1f} tok/s so far")

    def _on_run_finished(self, name: str, result, record: dict) -> None:
        view, stats = self._stream_to
        if name not in METHODS:  # an endpoint's RemoteRun
            stats.setText(stats_line(record) if not result.error else f"error: {result.error}")
            return
        self.charts.finish_run(name, result.metrics.to_dict())
        if view is self.live.view and self._internals_view is view:
            self.internals.set_steps(result.events)
        stats.setText(stats_line(record))

    def _on_run_failed(self, name: str) -> None:
        view, stats = self._stream_to
        if view is not self.live.view:  # a comparison's column
            stats.setText("failed (see the message above)")

    # ------------------------------------------------------------------------ a saved run
    def show_saved(self, record: dict) -> None:
        """Show a run or audit from the history again: tokens, X-ray, internals and charts."""
        method = record.get("method", "?")
        title = f"{tune_title(method)} (from the history)"
        if record.get("kind") == "audit":
            self.tabs.setCurrentWidget(self.audit_view)
            self.audit_view.show_record(record, title)
            self.sig_status.emit(f"Showing a saved audit: {method}, {record.get('samples')} samples.")
            return
        if record.get("kind") == "tune":
            self.tabs.setCurrentWidget(self.tune_view)
            self.tune_view.show_record(record, title)
            self.sig_status.emit(f"Showing a saved tune: {method}, {record.get('verdict')}.")
            return
        try:
            events = saved_events(record)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            self.sig_error.emit(f"This history entry cannot be shown token by token ({exc!r}); its text is shown "
                                "instead.")
            events = []
        self.tabs.setCurrentWidget(self.live)
        self._begin_live(method, title)
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
        self.sig_status.emit(f"Showing a saved run: {method}, {record.get('new_tokens', '?')} tokens.")


def explain_colours(parent: QWidget) -> None:
    """Open (not modal) a note on what the token views' colours and marks mean."""
    lines = [f"<p><b style='color:{s.colour}'>{s.label}</b>: {s.description}</p>" for s in FATE_STYLES.values()]
    box = QMessageBox(QMessageBox.Icon.Information, "Colours and marks",
                      "".join(lines) + "<p>Rejected drafts leave a raised ✕ (with their count) where they were "
                      "tried, or show struck through with “rejected drafts inline”; resampled tokens are "
                      "underlined, bonus ones overlined, so the fates read without colour too.</p>",
                      QMessageBox.StandardButton.Ok, parent)
    box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
    box.open()


def saved_events(record: dict) -> list[StepEvent]:
    """A saved run's step events (raises KeyError, TypeError, ValueError or IndexError on a malformed record)."""
    events: list[StepEvent] = []
    total = 0
    for d in record.get("events") or []:
        events.append(event_from_dict(d, total))
        total = events[-1].total_new_tokens
    return events
