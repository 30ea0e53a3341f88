"""The engine worker: all model work runs here, in one thread, and only signals leave it."""

from __future__ import annotations

import logging
import threading
import traceback

from PySide6.QtCore import QObject, Signal, Slot

from core.errors import Cancelled, SpecPlayError

log = logging.getLogger(__name__)


class EngineWorker(QObject):
    """Loads models and runs generations; lives in its own ``QThread``.

    Signals:
        sig_progress(str, float): a loading or conversion stage and its fraction (-1: unknown).
        sig_models_loaded(object): ``(target, draft)`` LoadedModels.
        sig_step(object): a ``StepEvent`` of the current run.
        sig_run_finished(object): the ``RunResult``.
        sig_failed(str): a message for the user.
    """

    sig_progress = Signal(str, float)
    sig_models_loaded = Signal(object)
    sig_step = Signal(object)
    sig_run_finished = Signal(object)
    sig_failed = Signal(str)

    def __init__(self):
        super().__init__()
        self._cancel = threading.Event()
        self.target = None
        self.draft = None

    def cancel(self) -> None:
        """Thread-safe: ask the current job to stop at its next check."""
        self._cancel.set()

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, SpecPlayError):
            self.sig_failed.emit(str(exc))
        else:
            log.error("unexpected error\n%s", traceback.format_exc())
            self.sig_failed.emit(f"Unexpected error: {exc!r}")

    @Slot(str, str, str)
    def load(self, target_spec: str, device: str, dtype: str) -> None:
        from core.models import load_model

        self._cancel.clear()
        try:
            def progress(stage, fraction):
                self.sig_progress.emit(stage, -1.0 if fraction is None else float(fraction))

            target = load_model(target_spec, device, dtype, progress=progress, should_cancel=self._cancel.is_set)
            self.target = target
            self.sig_models_loaded.emit((target, None))
        except Cancelled as exc:
            self.sig_failed.emit(str(exc))
        except Exception as exc:  # the worker must survive any failure
            self._fail(exc)

    @Slot(object)
    def generate(self, request) -> None:
        from core.engine import drain, generate
        from core.methods import build_method
        from core.text import encode_prompt

        self._cancel.clear()
        try:
            if self.target is None:
                raise SpecPlayError("load a model first")
            ids = encode_prompt(self.target.tokenizer, request["prompt"], request.get("chat_template", True))
            method = build_method(request["method"], None, self.target, self.draft)
            result = drain(generate(self.target.model, self.target.tokenizer, method, ids, request["config"],
                                    self._cancel.is_set), self.sig_step.emit)
            self.sig_run_finished.emit(result)
        except Exception as exc:
            self._fail(exc)
