"""The Audit view."""

from __future__ import annotations

import asyncio
import csv

import pytest

from app_window import TIMEOUT, model_dirs, run, window  # noqa: F401 (model_dirs: the window fixture's)


def test_an_audit_shows_its_verdict_and_histogram_and_goes_into_the_history_and_exports(window, qtbot, tmp_path):
    window.methods_panel.set_method("speculative")
    window.prompt_panel.temperature.setValue(1.0)
    record = run(qtbot, window.run_audit(200, 2), timeout=120_000)
    view = window.audit_view
    assert window.tabs.currentWidget() is view and not window.session.busy and view.run_button.isEnabled()
    assert (record["kind"], record["method"], record["samples"], record["depth"], record["temperature"]) == (
        "audit", "speculative", 200, 2, 1.0)
    assert record["verdict"] == "consistent" and "Consistent with the target" in view.verdict.text()
    assert "Power: at N = 200" in view.power.text()
    assert view.progress.text() == "Done: 200 samples tested"  # not the last stage's name left standing
    assert [view.table.item(r, 0).text() for r in range(view.table.rowCount())] == ["joint", "position 1",
                                                                                   "position 2"]
    assert view.table.item(0, 1).text() == f"{record['p_value']:.3g}"
    bins = view.shown_bins()
    assert bins and list(view.observed_bars.opts["height"]) == [b[1] for b in bins]
    assert list(view.expected_bars.opts["height"]) == pytest.approx([b[2] for b in bins])
    view.test_choice.setCurrentIndex(2)  # position 2's bins
    assert view.shown_bins() and view.shown_bins() != bins

    saved = window.session.history.load()[-1]
    assert saved["kind"] == "audit" and saved["p_values"] == record["p_values"]
    assert window.history_panel.table.item(0, 1).text().startswith("Audit: ")
    assert window.history_panel.table.item(0, 7).text().startswith("consistent (p = ")
    window.tabs.setCurrentWidget(window.live)
    view.begin("something else")
    window.run_views.show_saved(saved)
    assert window.tabs.currentWidget() is view and view.record == saved and view.shown_bins() == bins
    out = tmp_path / "audit.csv"
    assert run(qtbot, window.session.export_runs(out, [saved], "csv"))
    row = next(csv.DictReader(out.open(newline="")))
    # new_tokens counts every token the samples' runs made: at least K = 2 each, more where a step
    # drafted past the tested tokens (the audit lets each draft go as deep as a real run's).
    assert row["method"] == "speculative" and row["text"] == record["text"]
    assert row["new_tokens"] == str(record["new_tokens"]) and record["new_tokens"] >= 400


def test_stop_ends_an_audit_and_the_samples_drawn_are_tested(window, qtbot):
    window.methods_panel.set_method("autoregressive")
    window.prompt_panel.temperature.setValue(1.0)
    task = asyncio.ensure_future(window.run_audit(100_000, 2))
    qtbot.waitUntil(lambda: window.audit_view.progress.value() >= 1, timeout=TIMEOUT)  # 100 samples drawn
    assert window.stop_action.isEnabled() and not window.audit_view.run_button.isEnabled()
    window.stop_action.trigger()
    qtbot.waitUntil(task.done, timeout=TIMEOUT)
    record = task.result()
    assert record["cancelled"] and 100 <= record["samples"] < 100_000 and record["p_value"] is not None
    assert "stopped early" in window.audit_view.title.text() and window.session.history.load()[-1]["cancelled"]
    assert window.audit_view.progress.text() == f"Stopped: {record['samples']} samples tested"
    assert window.run_action.isEnabled() and not window.stop_action.isEnabled()
