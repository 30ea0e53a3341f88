"""The history panel and the exports."""

from __future__ import annotations

import csv
import json
import os

import pytest

from app_window import TIMEOUT, model_dirs, run, window  # noqa: F401 (model_dirs: the window fixture's)


def test_history_runs_reopen_exactly(window, qtbot):
    window.methods_panel.set_method("speculative")
    result = run(qtbot, window.run_single())
    window.live.view.clear_run()
    run(qtbot, window.open_saved(window.history_panel.entries[-1]))  # the record is read from the history file
    view = window.live.view
    assert view.committed_text() == result.text
    assert [t.fate for t in view.shown_tokens()] == [t.fate for e in result.events for t in e.tokens]
    assert len(window.internals.steps) == len(result.events)
    assert window.charts.series["speculative"].accept_lengths == result.metrics.accept_lengths


def test_the_history_panel_keeps_the_newest_runs_it_is_told_to(window, qtbot):
    for name in ("autoregressive", "prompt_lookup", "autoregressive"):
        window.methods_panel.set_method(name)
        run(qtbot, window.run_single())
    panel = window.history_panel
    assert len(panel.entries) == 3
    panel.keep.setValue(2)
    panel.keep_button.click()
    qtbot.waitUntil(lambda: len(panel.entries) == 2, timeout=TIMEOUT)
    assert [r["method"] for r in window.session.history.load()] == ["prompt_lookup", "autoregressive"]
    assert panel.table.rowCount() == 2 and "older run(s) removed" in window.status.text()


def test_export_writes_the_selected_runs(window, qtbot, tmp_path):
    results = []
    for name in ("autoregressive", "prompt_lookup"):
        window.methods_panel.set_method(name)
        results.append(run(qtbot, window.run_single()))
    window.history_panel.select_indices([0, 1])
    chosen = window.history_panel.selected_entries()
    assert [e.summary["method"] for e in chosen] == ["autoregressive", "prompt_lookup"]
    out = tmp_path / "runs.jsonl"
    assert run(qtbot, window.export_entries(str(out), chosen, "jsonl"))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["method"], x["token_ids"], x["text"]) for x in lines] == [(r.method, r.token_ids, r.text)
                                                                           for r in results]
    assert all(len(x["events"]) == len(r.events) for x, r in zip(lines, results))
    out_csv = tmp_path / "runs.csv"
    assert run(qtbot, window.export_entries(str(out_csv), chosen, "csv"))
    rows = list(csv.DictReader(out_csv.open(newline="")))
    assert [(r["method"], int(r["new_tokens"]), r["text"]) for r in rows] == [
        (r.method, len(r.token_ids), r.text) for r in results]
    png = tmp_path / "charts.png"
    assert run(qtbot, window.session.export_png(png, window.charts.grab().toImage()))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_export_says_so_and_keeps_the_old_file(window, qtbot, tmp_path, monkeypatch):
    run(qtbot, window.run_single())
    records = window.session.history.load()
    # no such directory (a file stands where the folder should be)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    for kind in ("jsonl", "csv"):
        assert not run(qtbot, window.session.export_runs(blocker / f"runs.{kind}", records, kind))
        assert "Could not write" in window.last_error and "not-a-dir" in window.last_error
    assert not run(qtbot, window.session.export_png(blocker / "c.png", window.charts.grab().toImage()))
    # the disk fills up at the last moment: the existing file keeps its content, no temp file is left
    old = tmp_path / "keep.jsonl"
    old.write_text("precious\n")

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert not run(qtbot, window.session.export_runs(old, records, "jsonl"))
    assert "No space left on device" in window.last_error
    assert old.read_text() == "precious\n" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl",
                                                                                               "not-a-dir"]
    assert window.session.history.load() == records  # nothing lost


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores directory permissions")
def test_export_into_a_read_only_folder_says_so(window, qtbot, tmp_path):
    run(qtbot, window.run_single())
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert not run(qtbot, window.session.export_runs(ro / "runs.csv", window.session.history.load(), "csv"))
        assert not run(qtbot, window.session.export_runs(ro / "runs.jsonl", window.session.history.load(), "jsonl"))
        assert "Could not write" in window.last_error
    finally:
        ro.chmod(0o755)
