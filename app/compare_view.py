"""Compare: several methods on the same prompt, seed and settings, side by side, with a results table."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (QAbstractItemView, QCheckBox, QFrame, QGridLayout, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QPushButton,
                               QSplitter, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from specplay.app.palette import method_colour
from specplay.app.tokenview import REJECTED_INLINE_TIP, TokenView
from specplay.core.methods import METHODS, method_title
from specplay.core.records.runlog import RunRecord
from specplay.core.remote.llama_server import why_unavailable

TABLE_COLUMNS = ("Method", "Same", "tok/s", "TTFT", "Speedup (wall)", "τ", "Accept", "Tokens", "Steps", "Notes")
COLUMN_TIPS = ("", "Identical: token for token the same output as autoregressive (checked at temperature 0; "
                   "endpoints: the same text as the first endpoint)",
               "New tokens per second, prefill included", "Time to first token (the prompt's prefill included)",
               "tok/s over autoregressive's in this comparison, each over its run's whole wall time: the prompt's "
               "prefill (in the time to first token) and the time between steps included, as Spec-Bench counts. "
               "“Why this speed” measures the decoding steps' own time, so its Measured (steps) reads higher",
               "Mean tokens added per step (accepted draft tokens + 1)", "Accepted draft tokens / drafted tokens",
               "New tokens", "Decoding steps (target forward passes)", "")
IDENTICAL_COL = 1
#: llama.cpp's own server, started on the loaded models for its run (``core.measure.peers.SERVER_PEERS``).
SERVER_PEER_TITLES = {
    "llamacpp_speculative": ("with the draft", "llama.cpp's speculative decoding with the loaded draft model "
                                               "(-md, its own default draft sizes)"),
    "llamacpp_ngram": ("n-gram", "llama.cpp's draftless n-gram speculation, the type that measured fastest on this "
                                 "machine (chosen once, on two of the prompt presets)"),
}
SERVER_TIP = ("Started as a child on a free loopback port on the loaded target's GGUF file, given the prompt as "
              "SpecPlay's tokens, and stopped after its run; compared like an endpoint")


def results_table(columns: tuple[str, ...], tips: tuple[str, ...]) -> QTableWidget:
    """A read-only table of runs: one row each, headers with tooltips, columns sized to their contents."""
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    for i, tip in enumerate(tips):
        table.horizontalHeaderItem(i).setToolTip(tip)
    table.verticalHeader().setVisible(False)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    table.horizontalHeader().setStretchLastSection(True)
    return table


def split_of(orientation: Qt.Orientation, parts: list[tuple[QWidget, int]]) -> QSplitter:
    """A splitter of ``parts``, each (widget, stretch factor): a chart over its table, say."""
    split = QSplitter(orientation)
    for i, (widget, stretch) in enumerate(parts):
        split.addWidget(widget)
        split.setStretchFactor(i, stretch)
    return split


def page_layout(view: QWidget, rows: list, margin: int = 6) -> QVBoxLayout:
    """A view's rows top to bottom: widgets and layouts, a (widget, 1) row taking the height left."""
    layout = QVBoxLayout(view)
    layout.setContentsMargins(margin, margin, margin, margin)
    for row in rows:
        widget, stretch = row if isinstance(row, tuple) else (row, 0)
        if isinstance(widget, QWidget):
            layout.addWidget(widget, stretch)
        else:
            layout.addLayout(widget)
    return layout


def place_labels(plot: pg.PlotWidget, pool: list, labels: list[tuple[str, float, float]],
                 anchor: tuple[float, float]) -> None:
    """Show ``(text, x, y)`` labels on ``plot`` from a pool of text items that only grows."""
    while len(pool) < len(labels):
        item = pg.TextItem("", color="#222222", anchor=anchor)
        plot.addItem(item)
        pool.append(item)
    for i, item in enumerate(pool):
        item.setVisible(i < len(labels))
        if i < len(labels):
            text, x, y = labels[i]
            item.setText(text)
            item.setPos(x, y)


def columns_per_row(n: int) -> int:
    """Side-by-side columns stay readable at the default window size: at most three a row
    (four methods make two rows of two)."""
    return 2 if n == 4 else min(3, max(1, n))


def identical_text(value) -> str:
    return {True: "✓", False: "✗ differs", None: "–"}[value]


class CompareColumn(QFrame):
    def __init__(self, name: str, colour: str):
        super().__init__()
        self.name = name
        self.setFrameShape(QFrame.Shape.StyledPanel)
        title = method_title(name)
        self.header = QLabel(f"<span style='color:{colour}'>■</span> <b>{title}</b>")
        self.stats = QLabel("waiting…")
        self.stats.setWordWrap(True)
        self.stats.setStyleSheet("QLabel { color: #555555; }")
        self.view = TokenView()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.setSpacing(2)
        layout.addWidget(self.header)
        layout.addWidget(self.stats)
        layout.addWidget(self.view, 1)


class CompareView(QWidget):
    """Method choice, side-by-side token views, the results table and the speedup chart.

    Signals:
        sig_run_requested(list): the methods to compare, in order.
    """

    sig_run_requested = Signal(list)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.order = list(METHODS)
        self.records: list[RunRecord] = []
        self.columns: dict[str, CompareColumn] = {}
        choose = self._build_choice()
        endpoints_row = self._build_endpoints()
        note_row = self._build_note()
        self._build_columns()
        self.table = results_table(TABLE_COLUMNS, COLUMN_TIPS)
        self._build_speedup_plot()
        bottom = QSplitter(Qt.Orientation.Horizontal)
        bottom.addWidget(self.table)
        bottom.addWidget(self.speedup_plot)
        bottom.setStretchFactor(0, 5)
        bottom.setStretchFactor(1, 2)
        bottom.setSizes([760, 240])
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.columns_box)
        split.addWidget(bottom)
        split.setStretchFactor(0, 3)
        split.setStretchFactor(1, 2)
        split.setSizes([600, 320])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(choose)
        layout.addLayout(endpoints_row)
        layout.addLayout(note_row)
        layout.addWidget(split, 1)

    def _build_choice(self) -> QHBoxLayout:
        """A check box per method, and the button that compares the checked ones."""
        choose = QHBoxLayout()
        choose.addWidget(QLabel("Compare:"), 0, Qt.AlignmentFlag.AlignTop)
        boxes = QGridLayout()  # a grid, so many methods do not force a wide window
        boxes.setHorizontalSpacing(14)
        boxes.setVerticalSpacing(2)
        per_row = 4
        self.checks: dict[str, QCheckBox] = {}
        for i, (name, spec) in enumerate(METHODS.items()):
            box = QCheckBox(spec.title)
            box.setToolTip(spec.summary)
            self.checks[name] = box
            boxes.addWidget(box, i // per_row, i % per_row)
        choose.addLayout(boxes)
        choose.addStretch(1)
        self.run_button = QPushButton("Run comparison")
        self.run_button.setObjectName("compare_button")
        self.run_button.setToolTip("Run the checked methods one after another on the same prompt, seed and settings "
                                   "(each after a short warm-up)")
        self.run_button.clicked.connect(lambda: self.sig_run_requested.emit(self.selected()))
        choose.addWidget(self.run_button, 0, Qt.AlignmentFlag.AlignTop)
        return choose

    def _build_endpoints(self) -> QHBoxLayout:
        self.endpoints_edit = QLineEdit()
        self.endpoints_edit.setPlaceholderText("optional: OpenAI-compatible endpoints, e.g. "
                                               "http://127.0.0.1:8000/v1,name=plain; http://127.0.0.1:8001/v1,name=eagle")
        self.endpoints_edit.setToolTip(
            "Remote engines (vLLM, SGLang, llama.cpp's server, …) to run on the same prompt after the checked methods, "
            "separated by ';'. Options after a comma: model=NAME, name=LABEL, key-env=VAR, timeout=SECONDS, "
            "deadline=SECONDS. An API key is sent only to an endpoint with one of its own: the variable its key-env= "
            "names, else the OS keyring entry for its exact URL; never over plain http:// to another machine (use "
            "https:// or a loopback address), and never saved. Endpoints are compared with the first endpoint; "
            "speculation metrics appear where the engine exposes them.")
        endpoints_row = QHBoxLayout()
        endpoints_row.addWidget(QLabel("Endpoints:"))
        endpoints_row.addWidget(self.endpoints_edit, 1)
        endpoints_row.addSpacing(12)
        endpoints_row.addWidget(QLabel("llama-server:"))
        why_not = why_unavailable()
        self.server_checks: dict[str, QCheckBox] = {}
        for name, (title, tip) in SERVER_PEER_TITLES.items():
            box = QCheckBox(title)
            box.setObjectName(f"server_{name}")
            box.setEnabled(why_not is None)
            box.setToolTip(f"{tip}. {SERVER_TIP}" if why_not is None else why_not)
            self.server_checks[name] = box
            endpoints_row.addWidget(box)
        return endpoints_row

    def _build_note(self) -> QHBoxLayout:
        """What the comparison holds equal, and the "rejected drafts inline" switch."""
        self.note = QLabel("")
        self.note.setWordWrap(True)
        self.note.setStyleSheet("QLabel { color: #555555; }")
        self.rejected_inline = QCheckBox("rejected drafts inline")
        self.rejected_inline.setChecked(False)
        self.rejected_inline.setToolTip(REJECTED_INLINE_TIP)
        self.rejected_inline.toggled.connect(self._set_rejected_inline)
        note_row = QHBoxLayout()
        note_row.addWidget(self.note, 1)
        note_row.addWidget(self.rejected_inline)
        return note_row

    def _build_columns(self) -> None:
        """The grid the side-by-side columns go into; until the first comparison, a hint."""
        self.columns_box = QWidget()
        self.columns_layout = QGridLayout(self.columns_box)
        self.columns_layout.setContentsMargins(0, 0, 0, 0)
        self.columns_layout.setSpacing(4)
        placeholder = QLabel("Check two or more methods and press “Run comparison”. Include Autoregressive: it is the "
                             "baseline for speedups and for the identical-output check at temperature 0.")
        placeholder.setWordWrap(True)
        placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        placeholder.setStyleSheet("QLabel { color: #777777; }")
        self.placeholder = placeholder
        self.columns_layout.addWidget(placeholder, 0, 0)

    def _build_speedup_plot(self) -> None:
        self.speedup_plot = pg.PlotWidget()
        self.speedup_plot.setTitle("Speedup", size="10pt")
        self.speedup_plot.setMenuEnabled(False)
        self.speedup_plot.setMouseEnabled(x=False, y=False)
        self.speedup_plot.showGrid(x=True, alpha=0.25)
        self.speedup_plot.setLabel("bottom", "× baseline (wall)")
        self.speedup_plot.getAxis("bottom").enableAutoSIPrefix(False)
        self.speedup_plot.setMinimumWidth(180)
        # horizontal bars: method names read along the left axis, however many methods there are
        self.speedup_bars = pg.BarGraphItem(x0=np.zeros(0), width=np.zeros(0), y=np.zeros(0), height=0.6,
                                            brushes=[])
        self.speedup_plot.addItem(self.speedup_bars)
        self.speedup_plot.addItem(pg.InfiniteLine(pos=1.0, angle=90, pen=pg.mkPen("#555555", style=Qt.PenStyle.DashLine)))
        self.speedup_labels: list[pg.TextItem] = []

    def endpoints(self) -> list[str]:
        """The endpoint specs typed in (``URL[,option=value...]``), in order."""
        return [e.strip() for e in self.endpoints_edit.text().split(";") if e.strip()]

    def servers(self) -> list[str]:
        """The llama-server peers checked (``core.measure.peers.SERVER_PEERS``), in order."""
        return [n for n, box in self.server_checks.items() if box.isChecked() and box.isEnabled()]

    def selected(self) -> list[str]:
        return [n for n, box in self.checks.items() if box.isChecked()]

    def set_selected(self, names: list[str]) -> None:
        for n, box in self.checks.items():
            box.setChecked(n in names)

    def begin(self, names: list[str], greedy: bool) -> None:
        """New comparison: one column per method or endpoint (``remote:LABEL``), and the note on what
        to expect at this temperature (``greedy``: temperature 0)."""
        endpoints = any(name.startswith("remote:") for name in names)
        self.note.setText(
            "Same prompt, seed and settings for every method, each after a short warm-up"
            + (" (endpoints are compared with the first endpoint). " if endpoints else ". ")
            + ("Temperature 0: every lossless method must match autoregressive token for token."
               if greedy else "Temperature > 0: outputs differ run to run; the distribution is what is preserved."))
        for col in self.columns.values():
            col.setParent(None)
            col.deleteLater()
        self.columns.clear()
        self.placeholder.setVisible(False)
        per_row = columns_per_row(len(names))
        for i, name in enumerate(names):
            col = CompareColumn(name, method_colour(name, self.order))
            col.view.set_rejected_inline(self.rejected_inline.isChecked())
            self.columns[name] = col
            self.columns_layout.addWidget(col, i // per_row, i % per_row)
        for c in range(self.columns_layout.columnCount()):
            self.columns_layout.setColumnStretch(c, 1 if c < per_row else 0)
        self.set_records([])

    def _set_rejected_inline(self, show: bool) -> None:
        for col in self.columns.values():
            col.view.set_rejected_inline(show)

    def column(self, name: str) -> CompareColumn | None:
        return self.columns.get(name)

    def set_records(self, records: list[dict]) -> None:
        """Fill the table and the chart from annotated run records (see ``core.measure.compare.annotate``)."""
        self.records = [RunRecord.from_dict(r) for r in records]
        self.table.setRowCount(len(self.records))
        for row, r in enumerate(self.records):
            acc, sp, ttft, tau = r.acceptance_rate, r.speedup, r.time_to_first_token, r.mean_accepted
            notes = []
            if r.lossy:
                notes.append("LOSSY")
            if r.cancelled:
                notes.append("cancelled")
            if r.stop_reason and r.stop_reason not in ("max_tokens", "cancelled"):
                notes.append(f"stopped: {r.stop_reason}")
            title = method_title(r.method, short=True)
            if r.method.startswith("remote:") and r.spec_source is None and not r.error:
                notes.append("speculation not exposed")
            values = (title, identical_text(r.identical_to_baseline), f"{r.tokens_per_s:.2f}",
                      "–" if ttft is None else f"{ttft:.2f} s", "–" if sp is None else f"{sp:.2f}×",
                      "–" if tau is None else f"{tau:.2f}",
                      "–" if acc is None else f"{acc:.0%}", str(r.new_tokens),
                      "–" if r.steps is None else str(r.steps),
                      ", ".join(notes))
            for col, v in enumerate(values):
                item = QTableWidgetItem(v)
                if 2 <= col <= 8:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if col == IDENTICAL_COL:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignCenter)
                    ident = r.identical_to_baseline
                    if ident is not None:
                        item.setForeground(QColor("#007a55" if ident else "#b00020"))
                        item.setToolTip("Token for token the same output as autoregressive (temperature 0)"
                                        if ident else "The output differs from autoregressive at temperature 0")
                    else:
                        item.setToolTip("Only checked at temperature 0 with autoregressive in the comparison")
                self.table.setItem(row, col, item)
        self._update_chart()

    def _update_chart(self) -> None:
        rows = [r for r in self.records if r.speedup is not None]
        ys = np.arange(len(rows), dtype=float)[::-1]  # the first method on top
        widths = np.array([r.speedup for r in rows], dtype=float)
        brushes = [QColor(method_colour(r.method, self.order)) for r in rows]
        self.speedup_bars.setOpts(x0=np.zeros(len(rows)), width=widths, y=ys, height=0.6, brushes=brushes)
        self.speedup_plot.getAxis("left").setTicks(
            [[(float(y), method_title(r.method, short=True)) for y, r in zip(ys, rows)]])
        place_labels(self.speedup_plot, self.speedup_labels,
                     [(f" {w:.2f}×", float(w), float(y)) for w, y in zip(widths, ys)], anchor=(0.0, 0.5))
        if len(rows):
            self.speedup_plot.setYRange(-0.6, len(rows) - 0.4, padding=0)
            self.speedup_plot.setXRange(0, max(1.3, float(widths.max()) * 1.25), padding=0)
