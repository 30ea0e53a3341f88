"""The run history: every finished or cancelled run, newest first; reopen or export a selection."""

from __future__ import annotations

import time

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QLabel, QPushButton, QTableWidget,
                               QTableWidgetItem, QVBoxLayout, QWidget)

from specplay.core.methods import method_title
from specplay.core.runlog import RunRecord

COLUMNS = ("When", "Method", "Target", "Tokens", "tok/s", "τ", "Temp.", "Stop", "Prompt")


def _when(ts) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))
    except (TypeError, ValueError, OverflowError):
        return "?"


class HistoryPanel(QWidget):
    """Signals:
        sig_open_requested(dict): reopen a run record.
        sig_export_requested(str, list): ("jsonl" | "csv", the selected records).
        sig_reload_requested()
    """

    sig_open_requested = Signal(dict)
    sig_export_requested = Signal(str, list)
    sig_reload_requested = Signal()

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []  # oldest first, as the history file keeps them
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
        jsonl.clicked.connect(lambda: self.sig_export_requested.emit("jsonl", self.selected_records()))
        csv = QPushButton("Export CSV…")
        csv.setToolTip("One row of metrics per selected run")
        csv.clicked.connect(lambda: self.sig_export_requested.emit("csv", self.selected_records()))
        reload = QPushButton("Reload")
        reload.clicked.connect(self.sig_reload_requested)
        buttons = QHBoxLayout()
        buttons.addWidget(self.count, 1)
        for b in (open_button, jsonl, csv, reload):
            buttons.addWidget(b)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)

    def set_records(self, records: list[dict]) -> None:
        self.records = list(records)
        self.table.setRowCount(0)
        for r in self.records:
            self._insert_row(r)
        self._update_count()

    def add_record(self, record: dict) -> None:
        self.records.append(record)
        self._insert_row(record)
        self._update_count()

    def _update_count(self) -> None:
        self.count.setText(f"{len(self.records)} run(s) · double-click to reopen · select several to export")

    def _insert_row(self, record: dict) -> None:
        self.table.insertRow(0)  # newest first
        r = RunRecord.from_dict(record)
        title = method_title(r.method or "?")
        if r.lossy:
            title += " (LOSSY)"
        prompt = (r.prompt or "").replace("\n", " ")
        stop = str(r.stop_reason or "")
        if r.extra.get("kind") == "audit":  # a losslessness audit (core/audit.py): its verdict stands for a stop reason
            p_value = r.extra.get("p_value")
            title = f"Audit: {title}"
            stop = str(r.extra.get("verdict", "")) + ("" if p_value is None else f" (p = {p_value:.2g})")
        values = (_when(r.tstamp), title, str(r.model_id or ""), "" if r.new_tokens is None else str(r.new_tokens),
                  _num(r.tokens_per_s), _num(r.mean_accepted), _num(r.temperature), stop, prompt[:80])
        for col, v in enumerate(values):
            item = QTableWidgetItem(v)
            if col in (3, 4, 5, 6):
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            item.setData(Qt.ItemDataRole.UserRole, len(self.records) - 1)
            if col == 8:
                item.setToolTip(r.prompt or "")
            self.table.setItem(0, col, item)

    def selected_records(self) -> list[dict]:
        rows = {i.row() for i in self.table.selectedIndexes()}
        indices = sorted(self.table.item(row, 0).data(Qt.ItemDataRole.UserRole) for row in rows)
        return [self.records[i] for i in indices]  # oldest first, as they ran

    def select_indices(self, indices: list[int]) -> None:
        """Select runs by their index in ``records`` (oldest = 0)."""
        self.table.clearSelection()
        mode = self.table.selectionMode()
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.MultiSelection)
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(Qt.ItemDataRole.UserRole) in indices:
                self.table.selectRow(row)
        self.table.setSelectionMode(mode)

    def _open(self) -> None:
        sel = self.selected_records()
        if sel:
            self.sig_open_requested.emit(sel[-1])


def _num(v) -> str:
    return "" if v is None else f"{float(v):.2f}"
