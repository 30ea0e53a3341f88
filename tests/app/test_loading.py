"""Loading models in the window: progress, cancel, failures, the draft loading behind the target."""

from __future__ import annotations

import asyncio

from app_window import TIMEOUT, make_window, model_dirs, run, window
from PySide6.QtCore import Qt


def test_load_shows_each_model_and_memory(window):
    panel = window.models_panel
    assert "cpu · float32 · native" in panel.target_info.text()
    assert "cpu · float32 · native" in panel.draft_info.text()
    # tiny twin draft: not smaller than the target, so the compatibility check warns
    assert "not smaller" in panel.messages.text()
    assert "RAM" in panel.memory.text() and "GiB" in panel.memory.text()
    assert window.run_action.isEnabled() and not window.stop_action.isEnabled()
    assert window.methods_panel.draft_available


def test_incompatible_draft_is_refused_with_the_message(qtbot, aloop, model_dirs):
    w = make_window(qtbot)
    loaded = run(qtbot, w.load_models(str(model_dirs["target"]), str(model_dirs["alien"]), "cpu", "float32"))
    assert loaded.draft is None and "does not share the tokenizer" in loaded.draft_error
    assert "does not share the tokenizer" in w.models_panel.messages.text()
    w.methods_panel.set_method("speculative")
    w.prompt_panel.editor.setPlainText("ab cd")
    assert run(qtbot, w.run_single()) is None
    assert "needs a draft model" in w.last_error
    assert w.live.banner_box.isVisibleTo(w)
    w.close()


def test_a_missing_model_fails_visibly_and_the_window_recovers(qtbot, aloop, tmp_path, model_dirs):
    w = make_window(qtbot)
    assert run(qtbot, w.load_models(str(tmp_path / "nothing-here"), "", "cpu", "float32")) is None
    assert "Loading failed" in w.last_error and "nothing-here" in w.models_panel.messages.text()
    assert not w.session.busy and not w.run_action.isEnabled() and w.models_panel.load_button.isEnabled()
    assert run(qtbot, w.load_models(str(model_dirs["target"]), "", "cpu", "float32")) is not None
    assert w.run_action.isEnabled()
    w.close()


def test_the_draft_engine_choice_reaches_the_loader_and_a_refusal_says_why(qtbot, aloop, model_dirs):
    w = make_window(qtbot)
    target, draft = str(model_dirs["target"]), str(model_dirs["same"])
    w.models_panel.draft_engine.setCurrentText("llamacpp")
    loaded = run(qtbot, w.load_models(target, draft, "cpu", "float32"))
    # float32 weights in a folder cannot run on llama.cpp: the target loads, the draft is refused with the reason.
    assert loaded is not None and loaded.draft is None
    assert "llama.cpp draft is unavailable" in w.models_panel.messages.text()
    w.models_panel.draft_engine.setCurrentText("native")
    loaded = run(qtbot, w.load_models(target, draft, "cpu", "float32"))
    assert loaded.draft is not None and loaded.draft.model.info.backend == "native"
    w.close()
    assert w.settings.draft_engine == "native"


def test_loading_shows_progress_and_cancel_stops_it(qtbot, aloop, monkeypatch):
    """A slow load (as a first-time conversion is) reports progress, keeps the window live and cancels."""
    import time

    import specplay.core.models

    from specplay import core
    from specplay.core.errors import Cancelled

    def slow_load(spec, device, dtype, progress, should_cancel, **kw):
        for i in range(400):
            if should_cancel():
                raise Cancelled(f"loading {spec} was cancelled")
            progress(f"Converting {spec}", i / 400)
            time.sleep(0.01)
        raise AssertionError("the load was never cancelled")

    monkeypatch.setattr(core.models, "load_model", slow_load)
    w = make_window(qtbot)
    task = asyncio.ensure_future(w.load_models("some-model", "", "cpu", "float32"))
    qtbot.waitUntil(lambda: w.models_panel.progress.value() > 0, timeout=TIMEOUT)
    assert "Converting some-model" in w.models_panel.stage.text()
    assert w.models_panel.cancel_button.isEnabled() and not w.models_panel.load_button.isEnabled()
    assert not w.run_action.isEnabled()
    qtbot.mouseClick(w.models_panel.cancel_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(task.done, timeout=TIMEOUT)
    assert task.result() is None
    assert "cancelled" in w.models_panel.messages.text() and "cancelled" in w.last_error
    assert w.models_panel.load_button.isEnabled() and not w.session.busy
    w.close()


def draft_loader(monkeypatch, draft_step):
    """``load_model`` as the worker calls it: the target loads for real, the draft runs ``draft_step(progress)``."""
    import specplay.core.models as models

    real = models.load_model

    def load(spec, device, dtype, *, role="target", progress, should_cancel, **kw):
        if role == "draft":
            return draft_step(progress)
        return real(spec, device, dtype, role=role, progress=progress, should_cancel=should_cancel, **kw)

    monkeypatch.setattr(models, "load_model", load)


def slow_assembly(progress):
    """A first draft load's slow step as make_draft_gguf runs it: it reports progress and takes no cancel callback."""
    import time

    for i in range(1000):
        progress("Assembling the draft's GGUF", i / 1000)
        time.sleep(0.02)
    raise AssertionError("the draft's slow step was never stopped")


def test_a_draft_that_fails_with_any_error_leaves_the_target_loaded_and_says_why(qtbot, aloop, model_dirs,
                                                                                  monkeypatch):
    def truncated_gguf(progress):
        raise IndexError("index 3 is out of bounds for axis 0 with size 3")  # what a cut GGUF header raises

    draft_loader(monkeypatch, truncated_gguf)
    w = make_window(qtbot)
    loaded = run(qtbot, w.load_models(str(model_dirs["target"]), "some-draft", "cpu", "float32"))
    assert loaded is not None and loaded.target is not None and loaded.draft is None
    assert "IndexError" in loaded.draft_error and "some-draft" in loaded.draft_error
    assert "IndexError" in w.models_panel.messages.text() and w.run_action.isEnabled()
    w.close()


def test_cancel_reaches_a_first_draft_loads_slow_steps(qtbot, aloop, model_dirs, monkeypatch):
    import time

    draft_loader(monkeypatch, slow_assembly)
    w = make_window(qtbot)
    task = asyncio.ensure_future(w.load_models(str(model_dirs["target"]), "some-draft", "cpu", "float32"))
    qtbot.waitUntil(lambda: "Assembling" in w.models_panel.stage.text(), timeout=TIMEOUT)
    pressed = time.perf_counter()
    w.session.stop()
    qtbot.waitUntil(task.done, timeout=TIMEOUT)
    assert time.perf_counter() - pressed < 5
    loaded = task.result()
    assert loaded.target is not None and loaded.draft is None and "cancelled" in loaded.draft_error
    w.close()


def test_autoregressive_runs_while_the_draft_still_loads_and_drafting_methods_wait_for_it(qtbot, aloop, model_dirs,
                                                                                        monkeypatch):
    """A first launch makes the draft after the target (its blocks fitted, half a minute): the
    target's methods run at once, the drafting ones say what they wait for, then run too."""
    import threading

    import specplay.core.models as models

    real = models.load_model
    release = threading.Event()

    def draft_when_released(progress):
        while not release.wait(0.02):
            progress("Fitting the draft's matrices into k-quant blocks (once)", None)
        return real(str(model_dirs["same"]), "cpu", "float32", role="draft", progress=progress)

    draft_loader(monkeypatch, draft_when_released)
    w = make_window(qtbot)
    w.prompt_panel.editor.setPlainText("ab cd ab cd ab")
    w.prompt_panel.chat_template.setChecked(False)
    w.prompt_panel.max_new_tokens.setValue(8)
    task = asyncio.ensure_future(w.load_models(str(model_dirs["target"]), "some-draft", "cpu", "float32"))
    qtbot.waitUntil(lambda: w.session.draft_loading, timeout=TIMEOUT)
    assert w.run_action.isEnabled() and "loading" in w.models_panel.draft_info.text()
    assert w.models_panel.cancel_button.isEnabled()  # Cancel reaches the draft's load
    w.methods_panel.set_method("autoregressive")
    result = run(qtbot, w.run_single())
    assert result is not None and len(result.token_ids) == 8 and not task.done()
    w.methods_panel.set_method("speculative")
    assert "it is loading" in w.methods_panel.badges.text()
    assert run(qtbot, w.run_single()) is None and "still loading" in w.status.text()
    release.set()
    qtbot.waitUntil(task.done, timeout=TIMEOUT)
    loaded = task.result()
    assert loaded.draft is not None and not w.session.draft_loading and w.methods_panel.draft_available
    drafted = run(qtbot, w.run_single())
    assert drafted.method == "speculative" and drafted.token_ids[:8] == result.token_ids
    w.close()


def test_closing_the_window_during_a_load_ends_the_engine_thread_soon(qtbot, aloop, model_dirs, monkeypatch):
    import time

    draft_loader(monkeypatch, slow_assembly)
    w = make_window(qtbot)
    closed = w.closed_future()
    w.show()
    asyncio.ensure_future(w.load_models(str(model_dirs["target"]), "some-draft", "cpu", "float32"))
    qtbot.waitUntil(lambda: "Assembling" in w.models_panel.stage.text(), timeout=TIMEOUT)
    started = time.perf_counter()
    w.close()
    qtbot.waitUntil(closed.done, timeout=TIMEOUT)
    assert time.perf_counter() - started < 5
    assert w.session.client.thread.isFinished() and not w.isVisible()
