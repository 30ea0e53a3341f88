"""Run charts (pyqtgraph): every plot item is created once and then only updated with new data.

* tokens/s over the run, one curve per method (the latest run of each);
* accepted length per step: tokens added per step, grouped bars per method;
* acceptance by draft position: the share of steps whose draft reached depth k and had it accepted;
* time split: draft / verify / other seconds per method, and the plain steps taken while drafting
  stood down (stacked bars).

While a run streams, only the tokens/s curve is redrawn, once a second (:data:`REDRAW_MS`); the
other three charts are drawn when the run ends (or a run is shown whole). Redrawing plots with
their axes is the window's largest cost during a run: all four at ten times a second took about
a tenth of a two-core machine from the model, and still a twentieth at twice a second.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QGridLayout, QLabel, QWidget

from specplay.app.palette import method_colour
from specplay.core.decoding.tree import depths
from specplay.core.decoding.types import StepEvent

REDRAW_MS = 1000
SPLIT_COLOURS = {"draft": "#E69F00", "verify": "#56B4E9", "other": "#BBBBBB", "stood down": "#F0E442"}


def configure_pyqtgraph() -> None:
    pg.setConfigOptions(background="w", foreground="#333333", antialias=True)


@dataclass
class Series:
    """What the charts know about the latest run of one method."""

    elapsed: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    pos_tried: list[int] = field(default_factory=list)
    pos_hit: list[int] = field(default_factory=list)
    split: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    stood: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # draft/verify/other of stood-down steps
    final_positions: list[float] | None = None  # from RunMetrics once the run ends

    def add(self, e: StepEvent) -> None:
        if e.elapsed_s > 0:
            self.elapsed.append(e.elapsed_s)
            self.rate.append(e.total_new_tokens / e.elapsed_s)
        if e.committed:  # a streamed endpoint's chunk commits no token ids: it is not a step of known length
            self.accept_lengths.append(len(e.committed))
        depth = _draft_depth(e)
        while len(self.pos_tried) < depth:
            self.pos_tried.append(0)
            self.pos_hit.append(0)
        for k in range(depth):
            self.pos_tried[k] += 1
            if k < e.num_accepted:
                self.pos_hit[k] += 1
        parts = (e.timing.draft_s, e.timing.verify_s, e.timing.other_s)
        # Step 0 is plain by design where the gate is on (its note says why), never stood down by it.
        if e.stood_down and e.step > 0:
            self.stood = [a + b for a, b in zip(self.stood, parts)]
            self.split[3] += sum(parts)
        else:
            self.split = [a + b for a, b in zip(self.split, parts)] + [self.split[3]]

    def positions(self) -> list[float]:
        if self.final_positions is not None:
            return self.final_positions
        return [h / t for h, t in zip(self.pos_hit, self.pos_tried) if t]


def _draft_depth(e: StepEvent) -> int:
    return max(depths((e.tree or {}).get("parents") or []), default=0)


class IntAxis(pg.AxisItem):
    """An axis of counts or positions: ticks only on whole numbers."""

    def tickSpacing(self, minVal, maxVal, size):  # noqa: N802 (pyqtgraph name)
        levels = super().tickSpacing(minVal, maxVal, size)
        out = []
        for spacing, offset in levels:
            if spacing >= 1:
                out.append((max(1.0, round(spacing)), offset))
        return out or [(1.0, 0.0)]


def _plot(title: str, x: str, y: str, int_x: bool = False) -> pg.PlotWidget:
    w = pg.PlotWidget(axisItems={"bottom": IntAxis("bottom")} if int_x else None)
    w.setTitle(title, size="10pt")
    w.setLabel("bottom", x)
    w.setLabel("left", y)
    w.showGrid(x=True, y=True, alpha=0.25)
    w.setMenuEnabled(False)
    w.setMinimumSize(200, 110)
    for side in ("left", "bottom"):
        w.getAxis(side).enableAutoSIPrefix(False)
    return w


class ChartsPanel(QWidget):
    def __init__(self, method_order: list[str], parent=None):
        super().__init__(parent)
        self.order = list(method_order)
        self.series: dict[str, Series] = {}
        self.rate_plot = _plot("Tokens/s over the run (cumulative)", "seconds", "tok/s")
        self.hist_plot = _plot("Tokens per step (accepted + 1)", "tokens added in a step", "steps", int_x=True)
        self.pos_plot = _plot("Acceptance by draft position", "draft position", "accepted share", int_x=True)
        self.pos_plot.setYRange(0, 1.05)
        chips = " ".join(f"<span style='color:{c}'>■</span>&nbsp;{p}" for p, c in SPLIT_COLOURS.items())
        self.split_plot = _plot(f"Time split &nbsp; {chips}", "seconds", "")
        self.split_plot.showGrid(x=True, y=False, alpha=0.25)
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.hist_bars: dict[str, pg.BarGraphItem] = {}
        self.pos_curves: dict[str, pg.PlotDataItem] = {}
        self.split_bars: dict[str, pg.BarGraphItem] = {}
        for part, colour in SPLIT_COLOURS.items():
            bar = pg.BarGraphItem(x0=np.zeros(0), width=np.zeros(0), y=np.zeros(0), height=0.6,
                                  brush=QColor(colour), pen=pg.mkPen("#ffffff", width=0.5))
            self.split_plot.addItem(bar)
            self.split_bars[part] = bar
        self.legend = QLabel("")  # one method legend for all four charts
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        grid = QGridLayout(self)
        grid.setContentsMargins(2, 2, 2, 2)
        grid.setSpacing(4)
        grid.addWidget(self.legend, 0, 0, 1, 2)
        grid.addWidget(self.rate_plot, 1, 0)
        grid.addWidget(self.hist_plot, 1, 1)
        grid.addWidget(self.pos_plot, 2, 0)
        grid.addWidget(self.split_plot, 2, 1)
        self._dirty = False
        self._shown: list[str] | None = None
        self._live: set[str] = set()  # methods whose tokens/s curve has new points
        self._timer = QTimer(self)
        self._timer.setInterval(REDRAW_MS)
        self._timer.timeout.connect(self._refresh_if_dirty)
        self._timer.start()
        self.refresh()

    # -- data in -------------------------------------------------------------------------------

    def begin_run(self, method: str) -> None:
        self.series[method] = Series()
        self._ensure_items(method)
        self._dirty = True

    def add_step(self, method: str, event: StepEvent) -> None:
        s = self.series.get(method)
        if s is None:
            self.begin_run(method)
            s = self.series[method]
        s.add(event)
        self._live.add(method)

    def finish_run(self, method: str, metrics: dict) -> None:
        """Replace the live estimates with the run's own metrics (``RunMetrics`` fields)."""
        s = self.series.setdefault(method, Series())
        if metrics.get("accept_lengths") is not None:
            s.accept_lengths = list(metrics["accept_lengths"])
        if metrics.get("acceptance_by_position") is not None:
            s.final_positions = list(metrics["acceptance_by_position"])
        if all(k in metrics for k in ("draft_s", "verify_s", "other_s")):
            # The run's totals hold its stood-down steps too: those are shown apart.
            s.split = [metrics[k] - t for k, t in zip(("draft_s", "verify_s", "other_s"), s.stood)] + [sum(s.stood)]
        self._dirty = True
        self.refresh()

    def show_run(self, method: str, events: list[StepEvent], metrics: dict) -> None:
        """Load a whole (reopened) run."""
        self.begin_run(method)
        for e in events:
            self.series[method].add(e)
        self.finish_run(method, metrics)

    def clear(self) -> None:
        self.series.clear()
        self._dirty = True
        self.refresh()

    # -- drawing -------------------------------------------------------------------------------

    def _ensure_items(self, method: str) -> None:
        if method in self.curves:
            return
        colour = method_colour(method, self.order)
        self.curves[method] = self.rate_plot.plot([], [], pen=pg.mkPen(colour, width=2), name=method)
        bar = pg.BarGraphItem(x=np.zeros(0), height=np.zeros(0), width=0.2, brush=QColor(colour), pen=None)
        self.hist_plot.addItem(bar)
        self.hist_bars[method] = bar
        self.pos_curves[method] = self.pos_plot.plot([], [], pen=pg.mkPen(colour, width=2), symbol="o",
                                                     symbolSize=6, symbolBrush=colour, symbolPen=None, name=method)

    def _refresh_if_dirty(self) -> None:
        if self._dirty:
            self.refresh()
        elif self._live:
            for method in self._live:  # the live curve only; the rest when the run ends
                s = self.series.get(method)
                if s is not None and method in self.curves:
                    self.curves[method].setData(s.elapsed, s.rate)
            self._live.clear()

    def refresh(self) -> None:
        self._dirty = False
        self._live.clear()
        shown = [m for m in self.order if m in self.series] + [m for m in self.series if m not in self.order]
        n = max(1, len(shown))
        width = 0.8 / n
        for method, curve in self.curves.items():
            s = self.series.get(method)
            if s is None:
                curve.setData([], [])
                self.hist_bars[method].setOpts(x=np.zeros(0), height=np.zeros(0))
                self.pos_curves[method].setData([], [])
                continue
            curve.setData(s.elapsed, s.rate)
            counts = Counter(s.accept_lengths)
            xs = np.array(sorted(counts), dtype=float)
            offset = (shown.index(method) - (n - 1) / 2) * width
            self.hist_bars[method].setOpts(x=xs + offset, height=np.array([counts[int(x)] for x in xs], dtype=float),
                                           width=width * 0.95)
            pos = s.positions()
            self.pos_curves[method].setData(np.arange(1, len(pos) + 1, dtype=float), pos)
        splits = np.array([self.series[m].split for m in shown], dtype=float).reshape(-1, len(SPLIT_COLOURS))
        ys = np.arange(len(shown), dtype=float)
        left = np.zeros(len(shown))
        for i, part in enumerate(SPLIT_COLOURS):
            self.split_bars[part].setOpts(x0=left.copy(), width=splits[:, i], y=ys, height=0.6)
            left = left + splits[:, i]
        # Seconds start at 0: bars of no width yet (a run that streams) would centre an automatic range on 0.
        longest = float(left.max()) if left.size else 0.0
        self.split_plot.setXRange(0, longest * 1.05 if longest > 0 else 1.0, padding=0)
        if shown != self._shown:  # the method rows and the legend change only with the methods shown
            self._shown = shown
            self.split_plot.getAxis("left").setTicks([[(float(i), m) for i, m in enumerate(shown)]])
            if shown:
                self.split_plot.setYRange(-0.5, len(shown) - 0.5, padding=0.02)
            self.legend.setText("Methods: " + " &nbsp; ".join(
                f"<span style='color:{method_colour(m, self.order)}'>■</span>&nbsp;{m}" for m in shown)
                if shown else "<span style='color:#777'>Charts fill in as runs stream.</span>")
