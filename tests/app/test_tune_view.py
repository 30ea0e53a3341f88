"""The Tune view."""

from __future__ import annotations

import pytest

from app_window import model_dirs, run, window  # noqa: F401 (model_dirs: the window fixture's)


def test_a_tune_shows_predictions_beside_measurements_and_its_settings_can_be_applied(window, qtbot):
    window.methods_panel.set_method("speculative")
    window.methods_panel.current_form().set_values({"gamma": 5})
    record = run(qtbot, window.run_tune(), timeout=120_000)
    view = window.tune_view
    assert window.tabs.currentWidget() is view and not window.session.busy and view.run_button.isEnabled()
    assert record["kind"] == "tune" and record["method"] == "speculative"
    assert record["default"]["identical"] and record["best"]["identical"]
    rows = 1 if record["best_is_default"] else 2
    assert view.table.rowCount() == rows
    assert view.table.item(0, 2).text() == f"{record['default']['predicted_tokens_per_s']:.2f}"
    assert view.table.item(0, 3).text() == f"{record['default']['measured_tokens_per_s']:.2f}"
    assert view.table.item(0, 4).text() == f"{record['default']['prediction_error']:+.1%}"
    # the chart: predicted speedup along γ for the default's other knobs, the two measured runs on it
    xs, ys = view.default_line.getData()
    assert list(xs) == list(range(1, 13)) and all(y > 0 for y in ys)
    measured = view.measured.getData()
    assert measured[0][0] == 5 and measured[1][1] == pytest.approx(
        record["best"]["measured_tokens_per_s"] / record["autoregressive_tokens_per_s"])
    assert "Assumes:" in view.assumptions.text() and view.apply_button.isEnabled()

    saved = window.session.history.load()[-1]
    assert saved["kind"] == "tune" and saved["settings"] == record["settings"]
    assert window.history_panel.table.item(0, 1).text() == "Tune: Speculative (draft model)"
    window.tabs.setCurrentWidget(window.live)
    view.begin("something else")
    window.run_views.show_saved(saved)
    assert window.tabs.currentWidget() is view and view.record == saved and view.series("default")

    window.methods_panel.set_method("autoregressive")
    view.apply_button.click()
    assert window.methods_panel.method() == "speculative"
    values = window.methods_panel.current_form().values()
    assert {k: values[k] for k in record["knobs"]} == record["best"]["params"]


def test_a_tune_of_llama_servers_draft_shows_its_command_to_copy(window, qtbot, monkeypatch):
    """The Tune view's llama-server button tunes the server's draft size (not the Method panel's method),
    shows the best as a command line with a button that copies it, and offers nothing to apply."""
    from PySide6.QtGui import QGuiApplication

    from specplay.core.decoding.costmodel import CostCurve
    from specplay.core.measure import tune_server
    from specplay.core.measure.tune import Setting, Trial, TuneResult

    asked = []

    def tuned(target, draft, ids, config, *, prompt=None, should_stop=None, on_stage=None):
        asked.append((draft, ids))
        curve = CostCurve((1, 2), (0.05, 0.07))
        return TuneResult(
            method="llamacpp_speculative", knobs=("n_max",), base_params={"n_max": 3}, prompt=prompt,
            prompt_tokens=len(ids), new_tokens=16, autoregressive={"tokens_per_s": 11.0},
            default=Trial({"n_max": 3}, 13.0, 2.5, 12.5, 2.4, True, {}, [12.5]),
            best=Trial({"n_max": 5}, 15.0, 3.5, 14.0, 3.2, True, {}, [14.0]),
            settings=[Setting({"n_max": n}, 10.0 + n, 1 + n / 2, 10) for n in range(1, 13)],
            costs=tune_server.ServerStepCosts(verify=curve, draft_unit=0.01, other=0.0, prefill=0.1, draft_block=curve),
            best_config={"n_max": 5}, baseline="plain llama-server", same_as="llama.cpp's greedy answer",
            command="llama-server -m t.gguf -md d.gguf --spec-draft-n-max 5",
            notes=("llama-server without a draft was faster still",))

    monkeypatch.setattr(tune_server, "tune_llamacpp_speculative", tuned)
    view = window.tune_view
    view.server_ready = True  # as where the server is built
    window.methods_panel.set_method("lookahead")  # not a tuned method: the server's tune does not ask
    record = run(qtbot, window.run_tune(server=True), timeout=60_000)
    assert asked and asked[0][0] is window.session.models.draft
    assert record["method"] == "llamacpp_speculative" and record["command"].endswith("--spec-draft-n-max 5")
    assert view.command.text().splitlines() == ["Best as a command: " + record["command"],
                                                "llama-server without a draft was faster still"]
    assert not view.command.isHidden()
    assert "plain llama-server" in view.title.text() and not view.apply_button.isEnabled()
    assert view.table.horizontalHeaderItem(7).text() == "Same as llama.cpp's greedy answer"
    view.copy_button.click()
    assert QGuiApplication.clipboard().text() == record["command"]
    assert window.history_panel.table.item(0, 1).text().startswith("Tune: llama-server's draft")


def test_tune_refuses_what_it_cannot_predict_with_the_reason(window, qtbot):
    window.methods_panel.set_method("lookahead")
    assert run(qtbot, window.run_tune()) is None and "Tune predicts" in window.last_error
    window.methods_panel.set_method("prompt_lookup")
    window.prompt_panel.temperature.setValue(0.8)
    assert run(qtbot, window.run_tune()) is None and "temperature to 0" in window.last_error
