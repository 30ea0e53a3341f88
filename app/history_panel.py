"""The run history: every finished or cancelled run, newest first; reopen or export a selection, keep the newest.

The panel lists the history's entries (:class:`specplay.core.records.history.Entry`: what the index keeps of
each run); the window reads a run's whole record only to reopen or export it."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QPushButton, QSpinBox,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from specplay.core.records.history import Entry
from specplay.core.measure.tune_server import tune_title
from specplay.core.methods import method_title
from specplay.core.records.runlog import RunRecord

COLUMNS = ("When", "Method", "Target", "Tokens", "tok/s", "τ", "Temp.", "Stop", "Prompt")


def _when(ts) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))
    except (TypeError, ValueError, OverflowError):
        return "?"


class HistoryPanel(QWidget):
    """Signals:
        sig_open_requested(object): reopen the run of an :class:`Entry`.
        sig_export_requested(str, list): ("jsonl" | "csv", the selected entries).
        sig_reload_requested()
        sig_keep_requested(int): keep only this many of the newest runs in the history.
    """

    sig_open_requested = Signal(object)
    sig_export_requested = Signal(str, list)
    sig_reload_requested = Signal()
    sig_keep_requested = Signal(int)

    def __init__(self):
        super().__init__()
        self.entries: list[Entry] = []  # oldest first, as the history file keeps them
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.doubleClicked.connect(lambda _: self._open())
        self.count = QLabel("")
        self.count.setStyleSheet("QLabel { color: #555555; }")
        open_button = QPushButton("Open")
        open_button.setToolTip("Show the selected run again: its tokens, X-ray, internals and charts")
        open_button.clicked.connect(self._open)
        jsonl = QPushButton("Export JSONL…")
        jsonl.setToolTip("The selected runs as JSON lines, every token's fate included (Spec-Bench compatible)")
        jsonl.clicked.connect(lambda: self.sig_export_requested.emit("jsonl", self.selected_entries()))
        csv = QPushButton("Export CSV…")
        csv.setToolTip("One row of metrics per selected run")
        csv.clicked.connect(lambda: self.sig_export_requested.emit("csv", self.selected_entries()))
        reload = QPushButton("Reload")
        reload.clicked.connect(self.sig_reload_requested)
        self.keep = QSpinBox()
        self.keep.setRange(1, 1_000_000)
        self.keep.setValue(500)
        self.keep.setToolTip("How many of the newest runs “Keep newest” leaves in the history file")
        self.keep_button = QPushButton("Keep newest")
        self.keep_button.setToolTip("Remove the older runs from the history file, for good: each run with its "
                                    "steps takes about 0.4 KB a token")
        self.keep_button.clicked.connect(lambda: self.sig_keep_requested.emit(self.keep.value()))
        buttons = QHBoxLayout()
        buttons.addWidget(self.count, 1)
        for b in (open_button, jsonl, csv, reload, self.keep_button, self.keep):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)

    def set_entries(self, entries: list[Entry]) -> None:
        self.entries = list(entries)
        self.table.setRowCount(0)
        for e in self.entries:
            self._insert_row(e.summary)
        self._update_count()

    def add_entry(self, entry: Entry) -> None:
        self.entries.append(entry)
        self._insert_row(entry.summary)
        self._update_count()

    def _update_count(self) -> None:
        self.count.setText(f"{len(self.entries)} run(s) · double-click to reopen · select several to export")

    def _insert_row(self, summary: dict) -> None:
        self.table.insertRow(0)  # newest first
        r = RunRecord.from_dict(summary)
        title = method_title(r.method or "?")
        if r.lossy:
            title += " (LOSSY)"
        prompt = (r.prompt or "").replace("\n", " ")
        stop = str(r.stop_reason or "")
        if r.extra.get("kind") == "audit":  # a losslessness audit (core/measure/audit.py): its verdict stands for a stop reason
            p_value = r.extra.get("p_value")
            title = f"Audit: {title}"
            stop = str(r.extra.get("verdict", "")) + ("" if p_value is None else f" (p = {p_value:.2g})")
        elif r.extra.get("kind") == "tune":  # a tune (core/measure/tune.py): its verdict stands for a stop reason
            title = f"Tune: {tune_title(r.method or '?')}"
            stop = str(r.extra.get("verdict", ""))
        values = (_when(r.tstamp), title, str(r.model_id or ""), "" if r.new_tokens is None else str(r.new_tokens),
                  _num(r.tokens_per_s), _num(r.mean_accepted), _num(r.temperature), stop, prompt[:80])
        for col, v in enumerate(values):
            item = QTableWidgetItem(v)
            if col in (3, 4, 5, 6):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            item.setData(Qt.ItemDataRole.UserRole, len(self.entries) - 1)
            if col == 8:
                item.setToolTip(r.prompt or "")
            self.table.setItem(0, col, item)

    def selected_entries(self) -> list[Entry]:
        rows = {i.row() for i in self.table.selectedIndexes()}
        indices = sorted(self.table.item(row, 0).data(Qt.ItemDataRole.UserRole) for row in rows)
        return [self.entries[i] for i in indices]  # oldest first, as they ran

    def select_indices(self, indices: list[int]) -> None:
        """Select runs by their index in ``entries`` (oldest = 0)."""
        self.table.clearSelection()
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(Qt.ItemDataRole.UserRole) in indices:
                self.table.selectRow(row)
        self.table.setSelectionMode(mode)

    def _open(self) -> None:
        sel = self.selected_entries()
        if sel:
            self.sig_open_requested.emit(sel[-1])


def _num(v) -> str:
    return "" if v is None else f"{float(v):.2f}"
