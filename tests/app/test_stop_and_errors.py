"""Stop and errors in the window: a run ends within a step, an error is shown."""

from __future__ import annotations

import asyncio

from app_window import TIMEOUT, model_dirs, run, window  # noqa: F401 (model_dirs: the window fixture's)
from specplay.core.decoding.types import StopReason


def test_stop_cancels_within_one_step(window, qtbot):
    from PySide6.QtCore import Qt as _Qt

    from specplay.core.decoding.types import StopReason

    window.prompt_panel.max_new_tokens.setValue(400)
    window.methods_panel.set_method("autoregressive")
    seen = []

    def press_stop(event):  # runs in the worker thread, right after the step: the next check must stop
        seen.append(event)
        if len(seen) == 3:
            window.session.client.cancel()

    window.session.client.worker.sig_step.connect(press_stop, _Qt.ConnectionType.DirectConnection)
    result = run(qtbot, window.run_single())
    assert result.stop_reason is StopReason.CANCELLED and len(result.events) == 3
    assert window.session.history.load()[-1]["cancelled"] is True
    assert "Cancelled" in window.status.text()


def test_stop_button_ends_a_long_run(window, qtbot):
    import time

    from PySide6.QtCore import Qt as _Qt

    window.prompt_panel.max_new_tokens.setValue(450)
    window.methods_panel.set_method("autoregressive")
    # slow the tiny model down (in the worker thread) so the run cannot end before Stop is pressed
    window.session.client.worker.sig_step.connect(lambda e: time.sleep(0.02), _Qt.ConnectionType.DirectConnection)
    task = asyncio.ensure_future(window.run_single())
    qtbot.waitUntil(lambda: len(window.live.view.steps) >= 2, timeout=TIMEOUT)
    assert window.stop_action.isEnabled()
    window.stop_action.trigger()
    qtbot.waitUntil(task.done, timeout=TIMEOUT)
    result = task.result()
    assert result.cancelled and len(result.token_ids) < 450
    assert window.run_action.isEnabled() and not window.stop_action.isEnabled()


def test_engine_errors_appear_in_the_window(window, qtbot):
    window.methods_panel.set_method("autoregressive")
    window.prompt_panel.max_new_tokens.setValue(8000)  # beyond the tiny model's 512 positions
    assert run(qtbot, window.run_single()) is None
    assert "context" in window.live.banner.text() and window.live.banner_box.isVisibleTo(window)
    assert "context" in window.status.text()
    assert not window.session.busy and window.run_action.isEnabled()
    window.prompt_panel.editor.setPlainText("   ")
    assert run(qtbot, window.run_single()) is None and "empty" in window.last_error


def test_a_run_the_engine_ends_early_keeps_its_tokens_and_says_why(window, qtbot, monkeypatch):
    import dataclasses as dc

    import specplay.core.decoding.engine

    from specplay import core
    from specplay.core.decoding.types import StopReason

    real = core.decoding.engine.drain

    def failing_drain(gen, on_event=None):  # the engine's out-of-memory path, as RunResult reports it
        result = real(gen, on_event)
        return dc.replace(result, stop_reason=StopReason.ERROR, error="out of memory while generating")

    monkeypatch.setattr(core.decoding.engine, "drain", failing_drain)
    result = run(qtbot, window.run_single())
    assert result.token_ids and "out of memory while generating" in window.live.banner.text()
    assert window.session.history.load()[-1]["stop_reason"] == "error"
