"""Audit: does the selected method sample the target's exact distribution? (:mod:`specplay.core.measure.audit`)

The method and its settings come from the Method panel, the prompt, temperature, top-p and
seed from the Prompt panel; here only the number of samples N and of tokens K are chosen. The
view shows the verdict, what the test could see (the power statement), each test's p-value,
and the histogram of observed against expected counts with a band of two standard
deviations of the count around each expected value. It draws from an audit record, so an
audit reopened from the history looks exactly as it did.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QProgressBar, QPushButton, QSpinBox,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from specplay.app.compare_view import page_layout, results_table, split_of
from specplay.core.measure.audit import DEFAULT_DEPTH, DEFAULT_SAMPLES, largest_bins, verified_text

TEST_COLUMNS = ("Test", "p-value", "χ²", "df", "Bins", "Outside support")
TEST_TIPS = ("The joint distribution of the K tokens, or one position given the sample's own earlier tokens",
             "Chi-square goodness of fit: the chance of a difference this large if the method samples the target",
             "Pearson's statistic over the bins", "Degrees of freedom (bins after merging, minus one)",
             "Sequences (or tokens) with an expected count of at least 5, plus one bin for all others",
             "Samples the target gives probability 0: any one decides the test")
MAX_BARS = 30  # the largest bins, then the pooled one: more would not read
OBSERVED_COLOUR = "#0072B2"
EXPECTED_COLOUR = "#BBBBBB"


class AuditView(QWidget):
    """Signals:
        sig_run_requested(int, int): (samples N, tokens K) for an audit of the Method panel's method.
    """

    sig_run_requested = Signal(int, int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.record: dict | None = None
        intro = QLabel("Draws N independent samples of the first K new tokens with the method chosen under "
                       "<b>Method</b> (its settings, LOSSY options included), on the prompt, temperature, top-p and "
                       "seed under <b>Prompt</b> (sample i uses seed + 2i), then has the target score them and "
                       "tests them against its exact distribution (chi-square: the K tokens jointly, and each "
                       "position given the earlier ones). Use a temperature above 0: at 0 there is one answer.")
        intro.setWordWrap(True)
        controls = self._build_controls()
        self.title = QLabel("")
        self.title.setTextFormat(Qt.TextFormat.RichText)
        self.verdict = QLabel("No audit yet.")
        self.verdict.setWordWrap(True)
        self.verdict.setTextFormat(Qt.TextFormat.RichText)
        self.power = QLabel("")
        self.power.setWordWrap(True)
        self.power.setStyleSheet("QLabel { color: #555555; }")
        self.table = results_table(TEST_COLUMNS, TEST_TIPS)
        split = split_of(Qt.Orientation.Vertical, [(self._build_chart(), 3), (self.table, 1)])
        page_layout(self, [intro, controls, self.title, self.verdict, self.power, (split, 1)])

    def _build_controls(self) -> QHBoxLayout:
        """N and K, the Audit button and the progress bar."""
        self.samples = QSpinBox()
        self.samples.setRange(10, 1_000_000)
        self.samples.setValue(DEFAULT_SAMPLES)
        self.samples.setToolTip("Independent samples N: more samples see smaller differences (see the power line)")
        self.depth = QSpinBox()
        self.depth.setRange(1, 8)
        self.depth.setValue(DEFAULT_DEPTH)
        self.depth.setToolTip("New tokens per sample K: deeper samples test deeper draft positions but spread the "
                              "distribution over more sequences")
        self.run_button = QPushButton("Audit")
        self.run_button.setToolTip("Run the audit (Stop ends it; the samples drawn so far are tested)")
        self.run_button.clicked.connect(lambda: self.sig_run_requested.emit(self.samples.value(), self.depth.value()))
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(True)
        controls = QHBoxLayout()
        for label, box in (("Samples N", self.samples), ("Tokens K", self.depth)):
            controls.addWidget(QLabel(label))
            controls.addWidget(box)
        controls.addWidget(self.run_button)
        controls.addWidget(self.progress, 1)
        return controls

    def _build_chart(self) -> QWidget:
        """The histogram of observed against expected counts, and the choice of test it shows."""
        self.test_choice = QComboBox()
        self.test_choice.setToolTip("Which test's bins the chart shows")
        self.test_choice.currentIndexChanged.connect(self._draw_chart)
        self.plot = pg.PlotWidget()
        self.plot.setLabel("left", "samples")
        self.plot.showGrid(x=False, y=True, alpha=0.25)
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=False, y=False)
        self.plot.addLegend(offset=(-8, 8))
        self.expected_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=EXPECTED_COLOUR, pen=None,
                                             name="expected (the target)")
        self.observed_bars = pg.BarGraphItem(x=[], height=[], width=0.45, brush=OBSERVED_COLOUR, pen=None,
                                             name="observed (the method)")
        self.band = pg.ErrorBarItem(x=np.zeros(0), y=np.zeros(0), height=np.zeros(0), beam=0.3,
                                    pen=pg.mkPen("#333333", width=1))
        for item in (self.expected_bars, self.observed_bars, self.band):
            self.plot.addItem(item)
        chart_box = QWidget()
        chart_layout = QVBoxLayout(chart_box)
        chart_layout.setContentsMargins(0, 0, 0, 0)
        pick = QHBoxLayout()
        pick.addWidget(QLabel("Observed against expected counts:"))
        pick.addWidget(self.test_choice)
        pick.addStretch(1)
        chart_layout.addLayout(pick)
        chart_layout.addWidget(self.plot, 1)
        return chart_box

    def begin(self, title: str) -> None:
        """An audit starts: clear the last one's results."""
        self.record = None
        self.title.setText(f"<b>{title}</b>: sampling…")
        self.verdict.setText("")
        self.power.setText("")
        self.table.setRowCount(0)
        self.test_choice.clear()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setFormat("%p%")
        self._draw_chart()

    def set_progress(self, stage: str, fraction: float) -> None:
        """The worker's progress: a fraction of the samples drawn, or -1 while the target scores them."""
        if fraction < 0:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))
        self.progress.setFormat(stage if fraction < 0 else f"{stage} %p%")

    def show_record(self, record: dict, title: str) -> None:
        """Show an audit record (:func:`specplay.core.measure.audit.audit_record`)."""
        self.record = record
        self.progress.setRange(0, 1000)
        asked = record.get("samples_requested") or record["samples"]
        self.progress.setValue(round(1000 * record["samples"] / asked) if asked else 1000)
        self.progress.setFormat(f"{'Stopped' if record.get('cancelled') else 'Done'}: {record['samples']} samples tested")
        lossy = " <span style='color:#b00020'>(LOSSY options on)</span>" if record.get("lossy") else ""
        stopped = " · stopped early" if record.get("cancelled") else ""
        self.title.setText(
            f"<b>{title}</b>{lossy}: temperature {record['temperature']:g}, top-p {record['top_p']:g}, seeds "
            f"{record['seed']} + 2i · {record['samples']} samples of {record['depth']} tokens · "
            f"{record['wall_time']:.0f} s{stopped}")
        colour = {"differs": "#b00020", "consistent": "#00734d"}.get(record.get("verdict"), "#333333")
        self.verdict.setText(f"<span style='color:{colour}; font-size:12pt'><b>{_escape(record['text'])}</b></span>")
        notes = []
        if record.get("detectable_tv"):
            notes.append(f"Power: at N = {record['samples']} the joint test (level {record['level']:.3g}) sees a "
                         f"total-variation difference of {record['detectable_tv']:.3f} or more with "
                         f"{record['power']:.0%} probability.")
            needed = [f"{tv} needs N = {n:,}" for tv, n in record["samples_needed"].items() if n]
            notes.append("A difference of " + ", ".join(needed) + ".")
        if "deepest_verified" in record:  # records of older versions do not say
            notes.append(verified_text(record))
        if record.get("mean_accepted"):
            notes.append(f"τ over the samples: {record['mean_accepted']:.2f}.")
        self.power.setText(" ".join(notes))
        tests = self._tests()
        self.table.setRowCount(len(tests))
        for row, (name, t) in enumerate(tests):
            bins = len(t["bins"])
            values = (name, f"{t['p_value']:.3g}", f"{t['statistic']:.2f}", str(t["df"]), str(bins),
                      str(t["outside_support"]))
            for col, value in enumerate(values):
                item = QTableWidgetItem(value)
                if col:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)
        self.test_choice.blockSignals(True)
        self.test_choice.clear()
        self.test_choice.addItems([name for name, _ in tests])
        self.test_choice.blockSignals(False)
        self._draw_chart()

    def _tests(self) -> list[tuple[str, dict]]:
        if self.record is None or not self.record["tests"]["joint"]:
            return []
        tests = self.record["tests"]
        return [("joint", tests["joint"])] + [(f"position {k + 1}", t) for k, t in enumerate(tests["positions"])]

    def shown_bins(self) -> list[list]:
        """The chart's bins, [label, observed, expected]: the largest, then the pooled one."""
        tests = self._tests()
        index = self.test_choice.currentIndex()
        if not tests or index < 0:
            return []
        return largest_bins(tests[index][1]["bins"], MAX_BARS)

    def _draw_chart(self) -> None:
        bins = self.shown_bins()
        xs = np.arange(len(bins), dtype=float)
        expected = np.array([b[2] for b in bins], dtype=float)
        self.expected_bars.setOpts(x=xs, height=expected)
        self.observed_bars.setOpts(x=xs, height=np.array([b[1] for b in bins], dtype=float))
        # Two standard deviations of a count with this expectation (binomial): where a count may fall by chance.
        n = self.record["samples"] if self.record else 0
        spread = 4 * np.sqrt(expected * np.clip(1 - expected / n, 0.0, None)) if n else np.zeros(0)
        self.band.setData(x=xs, y=expected, height=spread)
        self.plot.getAxis("bottom").setTicks([[(i, _short(b[0])) for i, b in enumerate(bins)]])
        if bins:
            self.plot.setXRange(-0.6, len(bins) - 0.4, padding=0)


def _short(label: str, width: int = 14) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
