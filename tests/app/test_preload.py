"""The remembered models' loads begun before the window is built, taken over by the engine's load:
its progress then reported to the taker and its Stop obeyed, one load at a time, dropped when other
models are asked for, and nothing kept from a load that failed."""

import threading

import pytest

from specplay.app import preload
from specplay.core.errors import Cancelled, ModelError

TARGET, DRAFT = ("target", "t", "cpu", "auto", "auto"), ("draft", "d", "cpu", "auto", "auto")


@pytest.fixture(autouse=True)
def _nothing_pending():
    preload.keep_only(())
    yield
    preload.keep_only(())


def gated(result, gate: threading.Event, log: list):
    def load(progress, should_cancel):
        log.append(("start", result))
        progress("Reading", 0.5)
        gate.wait(10)
        progress("Mapping", 1.0)
        log.append(("end", result))
        return result
    return load


def test_a_load_begun_before_is_taken_over_with_its_progress_and_taken_once():
    gate, log, seen = threading.Event(), [], []
    preload.start(TARGET, gated("model", gate, log))
    threading.Timer(0.2, gate.set).start()
    assert preload.take(TARGET, lambda stage, fraction: seen.append(stage), lambda: False) == "model"
    assert seen == ["Reading", "Mapping"]  # the stage said before the taker listened, then the rest
    assert preload.take(TARGET, lambda *a: None, lambda: False) is None


def test_loads_run_one_after_the_other_and_a_stop_of_the_taker_cancels_its_load():
    first, second, log = threading.Event(), threading.Event(), []
    preload.start(TARGET, gated("target", first, log))
    preload.start(DRAFT, gated("draft", second, log))
    first.set()
    assert preload.take(TARGET, lambda *a: None, lambda: False) == "target"
    stopped = []
    threading.Timer(0.2, lambda: (stopped.append(True), second.set())).start()
    with pytest.raises(Cancelled):
        preload.take(DRAFT, lambda *a: None, lambda: bool(stopped))
    assert log == [("start", "target"), ("end", "target"), ("start", "draft")]  # the draft's after the target's


def test_other_models_asked_for_drop_the_pending_loads_and_a_failed_load_is_loaded_again():
    gate, log = threading.Event(), []
    preload.start(TARGET, gated("target", gate, log))
    preload.keep_only({("target", "another", "cpu", "auto", "auto")})
    gate.set()
    assert preload.take(TARGET, lambda *a: None, lambda: False) is None

    def failing(progress, should_cancel):
        raise ModelError("the file is gone")
    preload.start(TARGET, failing)
    assert preload.take(TARGET, lambda *a: None, lambda: False) is None  # the engine loads it and says why
