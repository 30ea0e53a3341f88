"""A minimal main window: load the default target, type a prompt, watch plain decoding stream."""

from __future__ import annotations

import asyncio

from PySide6.QtCore import QThread, Signal
from PySide6.QtWidgets import (QHBoxLayout, QLabel, QMainWindow, QPlainTextEdit, QProgressBar, QPushButton,
                               QSpinBox, QVBoxLayout, QWidget)

from app.worker import EngineWorker
from core.models.catalog import DEFAULT_TARGET
from core.types import GenerationConfig


class MainWindow(QMainWindow):
    sig_load = Signal(str, str, str)
    sig_generate = Signal(object)

    def __init__(self):
        super().__init__()
        self.setWindowTitle("SpecPlay")
        self.resize(900, 640)
        self._closed: asyncio.Future | None = None
        self.prompt = QPlainTextEdit("Write a Python function that merges two sorted lists.")
        self.output = QPlainTextEdit(readOnly=True)
        self.max_tokens = QSpinBox(minimum=1, maximum=4096, value=128)
        self.run_button = QPushButton("Run", enabled=False)
        self.stop_button = QPushButton("Stop", enabled=False)
        self.status = QLabel("")
        self.progress = QProgressBar(maximum=1000)
        row = QHBoxLayout()
        row.addWidget(QLabel("Max new tokens"))
        row.addWidget(self.max_tokens)
        row.addStretch(1)
        row.addWidget(self.run_button)
        row.addWidget(self.stop_button)
        layout = QVBoxLayout()
        layout.addWidget(self.prompt, 1)
        layout.addLayout(row)
        layout.addWidget(self.output, 3)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        central = QWidget()
        central.setLayout(layout)
        self.setCentralWidget(central)

        self.thread = QThread(self)
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self.sig_load.connect(self.worker.load)
        self.sig_generate.connect(self.worker.generate)
        self.worker.sig_progress.connect(self._on_progress)
        self.worker.sig_models_loaded.connect(self._on_loaded)
        self.worker.sig_step.connect(lambda e: self.output.insertPlainText(e.text))
        self.worker.sig_run_finished.connect(self._on_finished)
        self.worker.sig_failed.connect(self._on_failed)
        self.run_button.clicked.connect(self._run)
        self.stop_button.clicked.connect(self.worker.cancel)
        self.thread.start()

    def start(self) -> None:
        self.status.setText(f"Loading {DEFAULT_TARGET}…")
        self.sig_load.emit(DEFAULT_TARGET, "auto", "auto")

    def closed_future(self) -> asyncio.Future:
        self._closed = asyncio.get_event_loop().create_future()
        return self._closed

    def _on_progress(self, stage: str, fraction: float) -> None:
        self.status.setText(stage)
        self.progress.setRange(0, 0 if fraction < 0 else 1000)
        if fraction >= 0:
            self.progress.setValue(int(fraction * 1000))

    def _on_loaded(self, models) -> None:
        target, _ = models
        info = target.model.info
        self.status.setText(f"{target.spec} on {info.device} ({info.dtype}, {info.backend})")
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000)
        self.run_button.setEnabled(True)

    def _run(self) -> None:
        self.output.clear()
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.sig_generate.emit({"prompt": self.prompt.toPlainText(), "method": "autoregressive",
                                "config": GenerationConfig(max_new_tokens=self.max_tokens.value())})

    def _on_finished(self, result) -> None:
        m = result.metrics
        self.status.setText(f"{m.new_tokens} tokens, {m.tokens_per_s:.1f} tok/s ({result.stop_reason.value})")
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)

    def _on_failed(self, message: str) -> None:
        self.status.setText(f"Error: {message}")
        self.run_button.setEnabled(self.worker.target is not None)
        self.stop_button.setEnabled(False)

    def closeEvent(self, event):  # noqa: N802 (Qt name)
        self.worker.cancel()
        self.thread.quit()
        self.thread.wait(5000)
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(0)
        super().closeEvent(event)
