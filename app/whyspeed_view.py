"""Why this speed: this machine's verification cost curve, each method's step cost, and where
speculation pays (the break-even draft cost against acceptance).

Everything shown is measured here: the curve T(n)/T(1) by :mod:`specplay.core.decoding.costmodel` on the loaded
target, the methods' step costs and acceptance from the last comparison's run records, read
through :func:`specplay.core.measure.whyspeed.explain` (the same numbers ``specplay compare --why`` prints).
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QLabel, QTableWidgetItem, QWidget

from specplay.app.compare_view import page_layout, place_labels, results_table, split_of
from specplay.app.palette import method_colour
from specplay.core.decoding.costmodel import SIZES, CorrectedCurve, CostCurve
from specplay.core.methods import METHODS, method_title
from specplay.core.measure.whyspeed import SpeedExplanation, break_even_cost, explain
from specplay.core.records.runlog import RunRecord

WHY_COLUMNS = ("Method", "τ", "Nodes/step", "Draft", "Verify", "Other", "Predicted", "Measured (steps)",
               "Draft/token")
WHY_TIPS = ("", "Mean tokens added per step", "Draft nodes the target verifies per step",
            "Drafting per step, in plain steps T(1)", "Verification pass T(1 + nodes)/T(1), from this machine's curve",
            "Bookkeeping per step, in T(1)", "τ / (draft + verify + other): the speedup these costs predict",
            "The speedup of the decoding steps' own time (draft + verify + other) over autoregressive's: the "
            "prompt's prefill and the time between steps aside. The Compare tab's Speedup (wall) counts them, "
            "so it reads lower",
            "Drafting per drafted token, in T(1): the draft cost ratio c")
GAMMAS = (3, 5, 8)
GAMMA_PENS = {3: "#999999", 5: "#333333", 8: "#777777"}


class WhySpeedView(QWidget):
    """The cost curve, the break-even picture and the per-method cost table."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.order = list(METHODS)
        self.curve: CorrectedCurve | CostCurve | None = None
        self.records: list[RunRecord] = []
        self.rows: list[SpeedExplanation] = []
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)

        self.cost_plot = pg.PlotWidget()
        self.cost_plot.setTitle("Verification cost on this machine: T(n) / T(1)", size="10pt")
        self.cost_plot.setLabel("bottom", "tokens verified in one pass, n")
        self.cost_plot.setLabel("left", "cost in plain steps")
        self.cost_plot.setLogMode(x=True, y=False)
        self.cost_plot.showGrid(x=True, y=True, alpha=0.25)
        self.cost_plot.setMenuEnabled(False)
        self.cost_plot.setMouseEnabled(x=False, y=False)
        self.cost_line = self.cost_plot.plot([], [], pen=pg.mkPen("#0072B2", width=2), symbol="o", symbolSize=6,
                                             symbolBrush="#0072B2")
        self.cost_plot.addItem(pg.InfiniteLine(pos=1.0, angle=0, pen=pg.mkPen("#888888", style=Qt.PenStyle.DashLine)))
        # The curve kept from its one measurement, beside the one the runs' own passes corrected.
        self.cost_plot.addLegend(offset=(8, 8))
        self.kept_line = self.cost_plot.plot([], [], pen=pg.mkPen("#999999", width=1, style=Qt.PenStyle.DashLine),
                                             name="kept (measured once)")
        self.cost_line.opts["name"] = "corrected by the runs' passes"
        self.cost_plot.plotItem.legend.addItem(self.cost_line, self.cost_line.opts["name"])

        self.even_plot = pg.PlotWidget()
        self.even_plot.setTitle("Where a γ-token draft pays: below the line", size="10pt")
        self.even_plot.setLabel("bottom", "acceptance per drafted token, α")
        self.even_plot.setLabel("left", "draft cost per token, c (in T(1))")
        self.even_plot.showGrid(x=True, y=True, alpha=0.25)
        self.even_plot.setMenuEnabled(False)
        self.even_plot.setMouseEnabled(x=False, y=False)
        self.even_plot.addLegend(offset=(8, 8))
        self.even_lines = {g: self.even_plot.plot([], [], pen=pg.mkPen(GAMMA_PENS[g], width=2), name=f"γ = {g}")
                           for g in GAMMAS}
        self.points = pg.ScatterPlotItem(size=11)
        self.even_plot.addItem(self.points)
        self.point_labels: list[pg.TextItem] = []

        self.table = results_table(WHY_COLUMNS, WHY_TIPS)

        plots = split_of(Qt.Orientation.Horizontal, [(self.cost_plot, 0), (self.even_plot, 0)])
        split = split_of(Qt.Orientation.Vertical, [(plots, 3), (self.table, 2)])
        page_layout(self, [self.summary, (split, 1)])
        self._refresh()

    def set_curve(self, curve: CorrectedCurve | CostCurve | None) -> None:
        self.curve = curve
        self._refresh()

    def set_records(self, records: list[dict]) -> None:
        """The run records of one comparison (finished runs only)."""
        self.records = [r for r in map(RunRecord.from_dict, records) if not r.cancelled and r.steps and r.time_split]
        self._refresh()

    def _refresh(self) -> None:
        curve = self.curve
        if curve is None:
            self.summary.setText("Load a target and run a method: the first run measures this machine's verification "
                                 "cost once, and the curve appears here.")
        self.cost_line.setData(list(curve.sizes) if curve else [], list(curve.relative) if curve else [])
        kept = getattr(curve, "kept", None)
        self.kept_line.setData(list(kept.sizes) if kept else [], list(kept.relative) if kept else [])
        self._size_ticks(curve.sizes if curve else SIZES)
        alphas = np.linspace(0.0, 0.99, 100)
        for g, line in self.even_lines.items():
            ys = [break_even_cost(float(a), g, curve) for a in alphas] if curve else []
            line.setData(alphas if curve else [], ys)
        self.rows = []
        if curve is not None:
            if any(r.method == "autoregressive" for r in self.records):
                self.rows = explain(self.records, curve)
                t1 = next(r for r in self.records if r.method == "autoregressive")
                split = t1.time_split
                step_ms = 1000 * (split["draft"] + split["verify"] + split["other"]) / max(t1.steps, 1)
                self.summary.setText(
                    f"One plain decoding step T(1) took <b>{step_ms:.0f} ms</b> in the last comparison. A method's "
                    "speedup is τ divided by its step cost in those units; <b>Predicted</b> is that quotient, "
                    "<b>Measured (steps)</b> what the run's steps gave, prefill aside (the Compare tab's Speedup counts the "
                    "whole wall time). Verifying 8 tokens costs "
                    f"<b>{curve(8):.2f}</b> plain steps here, 16 tokens <b>{curve(16):.2f}</b>.")
            else:
                self.summary.setText(
                    f"Verifying 8 tokens costs <b>{curve(8):.2f}</b> plain steps on this machine, 16 tokens "
                    f"<b>{curve(16):.2f}</b>. Run a comparison that includes Autoregressive to see each method's "
                    "step cost against its τ.")
        self._fill_table()
        self._place_points()

    def _size_ticks(self, sizes) -> None:
        """One label per measured block size (1, 2, 4, …, 64) on the logarithmic axis: pyqtgraph's own ticks
        there print every integer's label, on top of each other."""
        axis = self.cost_plot.getAxis("bottom")
        axis.setTicks([[(math.log10(n), str(n)) for n in sizes], []])
        self.cost_plot.setXRange(0, math.log10(max(sizes)), padding=0.05)

    def _fill_table(self) -> None:
        self.table.setRowCount(len(self.rows))
        for row, e in enumerate(self.rows):
            values = (method_title(e.method, short=True), f"{e.tau:.2f}", f"{e.nodes_per_step:.1f}", f"{e.draft_cost:.2f}",
                      f"{e.verify_cost:.2f}", f"{e.other_cost:.2f}", f"{e.predicted_speedup:.2f}×",
                      f"{e.measured_speedup:.2f}×",
                      "–" if e.draft_cost_per_token is None else f"{e.draft_cost_per_token:.2f}")
            for col, v in enumerate(values):
                item = QTableWidgetItem(v)
                if col:
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, col, item)

    def _place_points(self) -> None:
        """Each method with a drafted-token cost, at its measured (α, c)."""
        accept = {r.method: r.acceptance_rate for r in self.records}
        spots = []
        for e in self.rows:
            alpha = accept.get(e.method)
            if e.draft_cost_per_token is None or alpha is None:
                continue
            spots.append({"pos": (float(alpha), float(e.draft_cost_per_token)), "data": e.method,
                          "brush": QColor(method_colour(e.method, self.order)), "pen": pg.mkPen("#222222")})
        self.points.setData(spots)
        place_labels(self.even_plot, self.point_labels, [(method_title(s["data"], short=True), *s["pos"]) for s in spots],
                     anchor=(0.0, 1.0))
        top = max([1.0] + [s["pos"][1] * 1.2 for s in spots])
        self.even_plot.setXRange(0, 1, padding=0.02)
        self.even_plot.setYRange(0, top, padding=0.02)
