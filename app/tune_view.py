"""Tune: which draft size is fastest for this prompt on this machine (:mod:`specplay.core.measure.tune`).

The method and its settings come from the Method panel, the prompt from the Prompt panel. One
click runs autoregressive, replays every setting of the method's size knobs along its answer,
predicts each one's tokens/s from this machine's timed step costs, then runs the default and
the predicted best. The chart shows the predicted speedup along the method's main knob (one
line for the default's other knobs, one for the best's) with the two measured runs on it; the
table puts each prediction beside what it measured, so a user sees when the model of the
machine is wrong. "Use these settings" puts the best into the Method panel's form. It draws
from a tune record, so a tune reopened from the history looks as it did.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QHBoxLayout, QLabel, QProgressBar, QPushButton, QTableWidgetItem, QWidget

from specplay.app.compare_view import page_layout, results_table, split_of
from specplay.core.measure.tune import KNOBS
from specplay.core.remote.llama_server import why_unavailable

TUNE_COLUMNS = ("Run", "Setting", "Predicted tok/s", "Measured tok/s", "Error", "τ predicted", "τ measured",
                "Same as autoregressive")
TUNE_TIPS = ("The method as configured in the Method panel, and the setting predicted fastest",
             "The knobs this tune changes; every other setting stays as the Method panel has it",
             "From the replayed acceptance and this machine's timed step costs, before the run",
             "The run itself (prefill included), the stand-down gate off",
             "(predicted − measured) / measured: how far the model of this machine was off",
             "Tokens per step, replayed along autoregressive's answer", "Tokens per step in the run",
             "Every token equal to autoregressive's (temperature 0)")
DEFAULT_COLOUR, BEST_COLOUR = "#777777", "#D55E00"
KNOB_LABELS = {"gamma": "γ (draft tokens a step)", "num_tokens": "tokens proposed after a match",
               "total_tokens": "tree budget (nodes)", "n_max": "tokens drafted a step (--spec-draft-n-max)"}



class TuneView(QWidget):
    """Signals:
        sig_run_requested(): tune the Method panel's method on the Prompt panel's prompt.
        sig_server_requested(): tune llama-server's own draft size on the Prompt panel's prompt.
        sig_apply_requested(str, dict): put this configuration (method, its fields) into the Method panel.
    """

    sig_run_requested = Signal()
    sig_server_requested = Signal()
    sig_apply_requested = Signal(str, dict)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.record: dict | None = None
        intro = QLabel("Predicts the tokens/s of every setting of the draft size of the method chosen under "
                       "<b>Method</b> (speculative: γ, adaptive, copies of earlier text; prompt lookup: length and "
                       "n-gram; EAGLE: tree budget, depth, auto size) on the prompt under <b>Prompt</b>, from one "
                       "autoregressive run and this machine's timed step costs, then runs the default and the "
                       "predicted best to check. Temperature 0 only.")
        intro.setWordWrap(True)
        self.run_button = QPushButton("Tune")
        self.run_button.setToolTip("Tune the Method panel's method on the prompt (Stop ends it before its proof)")
        self.run_button.clicked.connect(self.sig_run_requested)
        self.apply_button = QPushButton("Use these settings")
        self.apply_button.setToolTip("Put the tuned setting into the Method panel's form")
        self.apply_button.setEnabled(False)
        self.apply_button.clicked.connect(self._apply)
        why_not = why_unavailable()
        self.server_ready = why_not is None
        self.server_button = QPushButton("Tune llama-server's draft")
        self.server_button.setToolTip(why_not or (
            "The same for llama.cpp's own server with the loaded draft (llamacpp_speculative): predict its speed at "
            "every --spec-draft-n-max from llama.cpp's greedy answer and costs timed here, run its default and the "
            "best, and give the best as a llama-server command line"))
        self.server_button.setEnabled(self.server_ready)
        self.server_button.clicked.connect(self.sig_server_requested)
        self.copy_button = QPushButton("Copy command")
        self.copy_button.setToolTip("Copy the tuned llama-server command line for these two models")
        self.copy_button.setVisible(False)
        self.copy_button.clicked.connect(self._copy_command)
        self.command = QLabel("")
        self.command.setWordWrap(True)
        self.command.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.command.setStyleSheet("QLabel { font-family: monospace; }")
        self.command.setVisible(False)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        controls = QHBoxLayout()
        controls.addWidget(self.run_button)
        controls.addWidget(self.apply_button)
        controls.addWidget(self.server_button)
        controls.addWidget(self.copy_button)
        controls.addWidget(self.progress, 1)
        self.title = QLabel("No tune yet.")
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.title.setWordWrap(True)
        self.table = results_table(TUNE_COLUMNS, TUNE_TIPS)
        self.assumptions = QLabel("")
        self.assumptions.setWordWrap(True)
        self.assumptions.setStyleSheet("QLabel { color: #555555; }")
        split = split_of(Qt.Orientation.Vertical, [(self._build_chart(), 3), (self.table, 1)])
        page_layout(self, [intro, controls, self.title, self.command, (split, 1), self.assumptions])

    def _build_chart(self) -> pg.PlotWidget:
        self.plot = pg.PlotWidget()
        self.plot.setLabel("left", "× autoregressive")
        self.plot.showGrid(x=True, y=True, alpha=0.25)
        self.plot.setMenuEnabled(False)
        self.plot.addLegend(offset=(-8, 8))
        self.plot.addItem(pg.InfiniteLine(pos=1.0, angle=0, pen=pg.mkPen("#BBBBBB", style=Qt.PenStyle.DashLine)))
        self.default_line = self.plot.plot([], [], pen=pg.mkPen(DEFAULT_COLOUR, width=2),
                                           name="predicted, default's other knobs")
        self.best_line = self.plot.plot([], [], pen=pg.mkPen(BEST_COLOUR, width=2),
                                        name="predicted, best's other knobs")
        self.measured = pg.ScatterPlotItem(size=12, pen=pg.mkPen("#000000"), name="measured (default, best)")
        self.plot.addItem(self.measured)
        return self.plot

    def begin(self, title: str) -> None:
        """A tune starts: clear the last one."""
        self.record = None
        self.apply_button.setEnabled(False)
        self._show_command(None)
        self.title.setText(f"<b>{title}</b>: tuning…")
        self.table.setRowCount(0)
        self.assumptions.setText("")
        for line in (self.default_line, self.best_line):
            line.setData([], [])
        self.measured.setData([], [])
        self.set_progress("Starting", 0.0)

    def set_progress(self, stage: str, fraction: float) -> None:
        if fraction < 0:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
        self.progress.setFormat(stage if fraction < 0 else f"{stage} %p%")

    def series(self, which: str) -> list[tuple[float, float]]:
        """The chart's line for the default's or the best's other knobs: (main knob, predicted speedup)."""
        rec = self.record
        if rec is None:
            return []
        main, *others = rec["knobs"]
        fixed = {k: rec[which]["params"][k] for k in others}
        base = rec["autoregressive_tokens_per_s"]
        points = [(s["params"][main], s["predicted_tokens_per_s"] / base) for s in rec["settings"]
                  if all(s["params"][k] == v for k, v in fixed.items())]
        return sorted(points)

    def measured_points(self) -> list[tuple[float, float]]:
        rec = self.record
        if rec is None:
            return []
        main, base = rec["knobs"][0], rec["autoregressive_tokens_per_s"]
        return [(rec[w]["params"][main], rec[w]["measured_tokens_per_s"] / base) for w in ("default", "best")]

    def show_record(self, record: dict, title: str) -> None:
        """Show a tune record (:func:`specplay.core.measure.tune.tune_record`)."""
        self.record = record
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000)
        self.progress.setFormat(f"Done: {len(record['settings'])} settings predicted in {record['seconds']:.0f} s")
        base = record["autoregressive_tokens_per_s"]
        best, default = record["best"], record["default"]
        baseline = record.get("baseline", "autoregressive")
        self.title.setText(
            f"<b>{title}</b> on {record['prompt_tokens']} prompt tokens, {record['new_tokens']} new · {baseline} "
            f"{base:.2f} tok/s · <b>{_escape(record['verdict'])}</b> (measured {best['measured_tokens_per_s']:.2f} "
            f"against the default's {default['measured_tokens_per_s']:.2f} tok/s)")
        self._show_command(record.get("command"), record.get("notes", []))
        self.plot.setLabel("left", "× autoregressive" if baseline == "autoregressive" else "× baseline")
        self.table.horizontalHeaderItem(len(TUNE_COLUMNS) - 1).setText(f"Same as {record.get('same_as', baseline)}")
        rows = [("default", default)] + ([] if record["best_is_default"] else [("best", best)])
        self.table.setRowCount(len(rows))
        for row, (label, t) in enumerate(rows):
            values = (label, _params(t["params"]), f"{t['predicted_tokens_per_s']:.2f}",
                      f"{t['measured_tokens_per_s']:.2f}", f"{t['prediction_error']:+.1%}",
                      f"{t['predicted_tau']:.2f}", f"{t['measured_tau']:.2f}", "yes" if t["identical"] else "NO")
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                if 2 <= col <= 6:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)
        self.assumptions.setText("Assumes: " + "; ".join(record["assumptions"]) + ".")
        main = record["knobs"][0]
        self.plot.setLabel("bottom", KNOB_LABELS.get(main, main))
        for line, which in ((self.default_line, "default"), (self.best_line, "best")):
            pts = self.series(which)
            line.setData([p[0] for p in pts], [p[1] for p in pts])
        pts = self.measured_points()
        self.measured.setData([p[0] for p in pts], [p[1] for p in pts],
                              brush=[pg.mkBrush(DEFAULT_COLOUR), pg.mkBrush(BEST_COLOUR)])
        self.apply_button.setEnabled(record["method"] in KNOBS)

    def _show_command(self, command: str | None, notes: list[str] = ()) -> None:
        self.command.setText("\n".join(([f"Best as a command: {command}"] if command else []) + list(notes)))
        self.command.setVisible(bool(command))
        self.copy_button.setVisible(bool(command))

    def _copy_command(self) -> None:
        if self.record is not None and self.record.get("command"):
            QGuiApplication.clipboard().setText(self.record["command"])

    def _apply(self) -> None:
        if self.record is not None:
            self.sig_apply_requested.emit(self.record["method"], dict(self.record["best_config"]))


def _params(params: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in params.items())


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
