"""The run session without a window: it sequences loads, runs, comparisons and audits on tiny
model folders, and says everything through its signals.

As in the window's tests (``app_window.py``), a qasync loop runs on pytest-qt's application and
:func:`run` drives a coroutine by processing Qt events until it is done.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import Qt  # noqa: E402

qasync = pytest.importorskip("qasync")
from tiny import save_tiny_model  # noqa: E402

from specplay.app.session import RunSession  # noqa: E402
from specplay.app.worker import AuditRequest, LoadRequest, RunRequest  # noqa: E402
from specplay.core.records.history import History  # noqa: E402
from specplay.core.methods import method_title  # noqa: E402
from specplay.core.decoding.types import GenerationConfig, SamplingConfig  # noqa: E402

TIMEOUT = 30_000
SIGNALS = ("sig_busy_changed", "sig_status", "sig_error", "sig_models_changed", "sig_load_failed", "sig_run_started",
           "sig_steps", "sig_run_finished", "sig_run_failed", "sig_compare_updated", "sig_record_saved")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "target", seed=0)


def run(qtbot, coro, timeout=TIMEOUT):
    task = asyncio.ensure_future(coro)
    qtbot.waitUntil(task.done, timeout=timeout)
    return task.result()


@pytest.fixture()
def session(qtbot, aloop, target_dir, tmp_path):
    s = RunSession(History(tmp_path / "history.jsonl"))
    assert run(qtbot, s.load(LoadRequest(target=str(target_dir), device="cpu", dtype="float32"))) is not None
    yield s
    s.shutdown()


class Recorder:
    """The arguments of every signal a session emits, by signal."""

    def __init__(self, session: RunSession):
        self.seen: list[tuple[str, tuple]] = []
        for name in SIGNALS:
            getattr(session, name).connect(lambda *args, name=name: self.seen.append((name, args)))

    def __call__(self, name: str) -> list[tuple]:
        return [args for signal, args in self.seen if signal == name]


def request(method: str = "autoregressive", tokens: int = 16, warmup: int = 0) -> RunRequest:
    # Stand-down off: on tiny models its decisions follow timing noise (see app_window.py's window fixture).
    config = GenerationConfig(max_new_tokens=tokens, stand_down=False, sampling=SamplingConfig(temperature=0.0))
    return RunRequest(prompt="ab cd ab cd ab", method=method, config=config, chat_template=False,
                      warmup_tokens=warmup)


def slow_steps(session: RunSession) -> None:
    """Each step takes 20 ms more (in the engine thread), so a run lasts until Stop is pressed."""
    session.client.worker.sig_step.connect(lambda e: time.sleep(0.02), Qt.ConnectionType.DirectConnection)


def test_a_run_streams_its_steps_and_ends_with_its_saved_record(session, qtbot):
    seen = Recorder(session)
    result = run(qtbot, session.run(request("prompt_lookup", tokens=40)))
    assert result is not None and len(result.token_ids) == 40
    assert seen("sig_busy_changed") == [("run",), ("",)]
    assert seen("sig_run_started") == [("prompt_lookup", "")]
    # the steps arrive in batches (one a frame), every one of them, in order, under the run's name
    assert {name for name, _ in seen("sig_steps")} == {"prompt_lookup"}
    assert [e.step for _, batch in seen("sig_steps") for e in batch] == [e.step for e in result.events]
    (name, finished, record), = seen("sig_run_finished")
    assert name == "prompt_lookup" and finished is result
    assert record["token_ids"] == result.token_ids and record["chat_template"] is False
    (entry,), = seen("sig_record_saved")
    assert entry.summary["answer_id"] == record["answer_id"] and session.history.read(entry) == record
    assert session.history.load()[-1]["answer_id"] == record["answer_id"]
    assert seen("sig_status")[0] == (f"Running {method_title('prompt_lookup')}…",)
    assert seen("sig_status")[-1][0].startswith("Done: ") and not seen("sig_error")


def test_the_record_is_made_in_the_engine_thread(session, qtbot, monkeypatch):
    """Records read the models, which only the engine thread touches."""
    import specplay.core.records.runlog as runlog

    threads = []
    real = runlog.run_record
    monkeypatch.setattr(runlog, "run_record",
                        lambda *a, **k: threads.append(threading.current_thread()) or real(*a, **k))
    assert run(qtbot, session.run(request())) is not None
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


def test_stop_ends_a_run_and_what_it_made_is_kept(session, qtbot):
    seen = Recorder(session)
    slow_steps(session)
    task = asyncio.ensure_future(session.run(request(tokens=450)))
    qtbot.waitUntil(lambda: len(seen("sig_steps")) >= 2, timeout=TIMEOUT)
    session.stop()
    qtbot.waitUntil(task.done, timeout=TIMEOUT)
    result = task.result()
    assert result.cancelled and 0 < len(result.token_ids) < 450
    assert ("Stopping…",) in seen("sig_status") and seen("sig_status")[-1][0].startswith("Cancelled: ")
    saved = session.history.load()[-1]
    assert saved["cancelled"] is True and saved["token_ids"] == result.token_ids
    assert not session.busy and seen("sig_busy_changed")[-1] == ("",)
    session.stop()  # nothing runs: nothing happens
    assert seen("sig_status")[-1][0].startswith("Cancelled: ")


def test_while_busy_nothing_else_starts(session, qtbot, target_dir):
    seen = Recorder(session)
    slow_steps(session)
    first = asyncio.ensure_future(session.run(request(tokens=300)))
    qtbot.waitUntil(lambda: bool(seen("sig_steps")), timeout=TIMEOUT)
    assert session.busy and session.activity == "run"
    assert run(qtbot, session.run(request("prompt_lookup"))) is None
    assert run(qtbot, session.compare([request("prompt_lookup")], [], greedy=True)) is None
    assert run(qtbot, session.audit(AuditRequest(run=request(), samples=10, depth=1))) is None
    assert run(qtbot, session.load(LoadRequest(target=str(target_dir), device="cpu", dtype="float32"))) is None
    assert not first.done()
    session.stop()
    qtbot.waitUntil(first.done, timeout=TIMEOUT)
    assert first.result().cancelled
    assert seen("sig_run_started") == [("autoregressive", "")] and seen("sig_busy_changed") == [("run",), ("",)]
    assert [r["method"] for r in session.history.load()] == ["autoregressive"]


def test_an_engine_error_is_a_signal_with_its_message_and_the_session_goes_on(session, qtbot):
    seen = Recorder(session)
    assert run(qtbot, session.run(request(tokens=8000))) is None  # beyond the tiny model's 512 positions
    (message,), = seen("sig_error")
    assert message.startswith(f"{method_title('autoregressive')}: ") and "context" in message
    assert seen("sig_run_failed") == [("autoregressive",)] and not seen("sig_run_finished")
    assert not session.busy and seen("sig_busy_changed") == [("run",), ("",)]
    assert run(qtbot, session.run(request())) is not None


def test_a_run_the_engine_ends_early_is_kept_saved_and_said(session, qtbot, monkeypatch):
    import dataclasses

    import specplay.core.decoding.engine as engine
    from specplay.core.decoding.types import StopReason

    real = engine.drain

    def failing_drain(gen, on_event=None):  # the engine's out-of-memory path, as RunResult reports it
        return dataclasses.replace(real(gen, on_event), stop_reason=StopReason.ERROR, error="out of memory")

    monkeypatch.setattr(engine, "drain", failing_drain)
    seen = Recorder(session)
    result = run(qtbot, session.run(request()))
    assert result is not None and len(result.token_ids) == 16
    (message,), = seen("sig_error")
    assert "stopped early: out of memory" in message and "The 16 token(s) it made are kept" in message
    saved = session.history.load()[-1]
    assert saved["stop_reason"] == "error" and saved["token_ids"] == result.token_ids


def test_a_history_that_cannot_be_written_is_said_and_the_record_still_reaches_the_views(session, qtbot, tmp_path):
    session.history = History(tmp_path)  # a folder: appending to it fails
    seen = Recorder(session)
    result = run(qtbot, session.run(request()))
    assert result is not None
    (message,), = seen("sig_error")
    assert message.startswith("Could not save the run to the history")
    (entry,), = seen("sig_record_saved")
    assert entry.offset is None and session.history.read(entry)["token_ids"] == result.token_ids


def test_a_comparison_streams_each_method_as_its_own_run_and_annotates_the_records(session, qtbot):
    seen = Recorder(session)
    requests = [request("autoregressive", warmup=2), request("prompt_lookup", warmup=2)]
    records = run(qtbot, session.compare(requests, [], greedy=True), timeout=60_000)
    assert [r["method"] for r in records] == ["autoregressive", "prompt_lookup"]
    assert all(r["identical_to_baseline"] is True for r in records)
    assert seen("sig_run_started") == [("autoregressive", "warming up…"), ("prompt_lookup", "warming up…")]
    streamed: dict[str, list] = {}
    for name, batch in seen("sig_steps"):
        streamed.setdefault(name, []).extend(e.step for e in batch)
    assert streamed == {name: [e.step for e in result.events] for name, result, _ in seen("sig_run_finished")}
    assert seen("sig_compare_updated")[-1] == (records,)
    assert [r["method"] for r in session.history.load()] == ["autoregressive", "prompt_lookup"]
    assert seen("sig_busy_changed") == [("compare",), ("",)]
    assert seen("sig_status")[-1] == ("Comparison done: 2 run(s).",)


def test_a_failed_load_is_said_and_leaves_no_models(qtbot, aloop, tmp_path):
    s = RunSession(History(tmp_path / "history.jsonl"))
    seen = Recorder(s)
    assert run(qtbot, s.load(LoadRequest(target=str(tmp_path / "nothing-here"), device="cpu", dtype="float32"))) is None
    (message,), = seen("sig_load_failed")
    assert "nothing-here" in message and seen("sig_error") == [(f"Loading failed: {message}",)]
    assert s.models is None and seen("sig_models_changed") == [(None,)]
    assert seen("sig_busy_changed") == [("load",), ("",)]
    assert run(qtbot, s.run(request())) is None  # no models: nothing runs
    s.shutdown()


def test_a_comparison_is_saved_annotated_even_when_its_baseline_is_checked_last(session, qtbot, tmp_path):
    """Each record goes into the history with its speedup and identity to the baseline, so a reloaded
    history (a restart) still has them; the baseline runs first for that."""
    requests = [request("prompt_lookup", warmup=2), request("autoregressive", warmup=2)]
    records = run(qtbot, session.compare(requests, [], greedy=True), timeout=60_000)
    saved = {r["method"]: r for r in History(session.history.path).load()}  # as the next start reads it
    assert {m: (r.get("identical_to_baseline"), r.get("speedup")) for m, r in saved.items()} == {
        r["method"]: (True, r["speedup"]) for r in records}
    assert saved["autoregressive"]["speedup"] == 1.0 and saved["prompt_lookup"]["speedup"] > 0
    assert [r["method"] for r in records] == ["autoregressive", "prompt_lookup"]
    assert [e.summary["speedup"] for e in History(session.history.path).entries()] == [r["speedup"] for r in records]


def test_history_writes_happen_off_the_gui_thread(session, qtbot, monkeypatch):
    threads = []
    append = session.history.append

    def noting(record):
        threads.append(threading.current_thread())
        return append(record)

    monkeypatch.setattr(session.history, "append", noting)
    assert run(qtbot, session.run(request())) is not None
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


def test_a_load_begun_at_launch_is_taken_over_by_the_sessions_load(qtbot, aloop, target_dir, tmp_path, monkeypatch):
    """The launch begins loading the remembered target before the window is built (app.preload): the
    session's load of that model takes it over instead of loading it again."""
    from specplay.app import preload
    from specplay.core import models

    load = models.load_model
    preload.start(("target", str(target_dir), "cpu", "float32", "auto"),
                  lambda progress, should_cancel: load(str(target_dir), "cpu", "float32", progress=progress,
                                                       should_cancel=should_cancel))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded again"))
    s = RunSession(History(tmp_path / "history.jsonl"))
    try:
        loaded = run(qtbot, s.load(LoadRequest(target=str(target_dir), device="cpu", dtype="float32")))
        assert loaded is not None and loaded.target.model_id == str(target_dir)
    finally:
        s.shutdown()
