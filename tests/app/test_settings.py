"""Settings, presets, the launcher and the window's redraws."""

from __future__ import annotations

import sys

import pytest

from app_window import model_dirs
from test_token_view import KNOWN, _step


def test_settings_round_trip(qtbot, aloop, tmp_path, model_dirs):
    from specplay.app.settings import AppSettings, open_settings
    from specplay.app.window import MainWindow

    w = MainWindow(settings=AppSettings())
    qtbot.addWidget(w)
    w.models_panel.target.set_spec(str(model_dirs["target"]))
    w.models_panel.draft.set_spec("")
    w.models_panel.device.setCurrentText("cpu")
    w.models_panel.dtype.setCurrentText("float32")
    w.prompt_panel.editor.setPlainText("line one\nline, two = \"quoted\"")
    w.prompt_panel.chat_template.setChecked(False)
    w.prompt_panel.stand_down.setChecked(False)  # not the default
    w.prompt_panel.max_new_tokens.setValue(77)
    w.prompt_panel.temperature.setValue(0.7)
    w.prompt_panel.top_p.setValue(0.9)
    w.prompt_panel.seed.setValue(1234)
    w.methods_panel.set_method("prompt_lookup")
    w.methods_panel.forms["prompt_lookup"].editors["num_tokens"].set_value(21)
    w.methods_panel.forms["speculative"].editors["adaptive"].set_value(True)
    w.compare.set_selected(["autoregressive", "prompt_lookup"])
    w.live.rejected_inline.setChecked(True)  # not the default
    w.resize(777, 555)  # within the offscreen screen (restoring clamps to the screen)
    w.close()  # saves

    s = AppSettings.load(open_settings())
    assert (s.target, s.draft, s.device, s.dtype) == (str(model_dirs["target"]), "", "cpu", "float32")
    assert s.prompt == "line one\nline, two = \"quoted\"" and s.chat_template is False and s.stand_down is False
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed) == (77, 0.7, 0.9, 1234)
    assert s.method == "prompt_lookup" and s.method_values["prompt_lookup"]["num_tokens"] == 21
    assert s.method_values["speculative"]["adaptive"] is True
    assert s.compare_methods == ["autoregressive", "prompt_lookup"] and s.rejected_inline is True

    w2 = MainWindow()  # reads the same file
    qtbot.addWidget(w2)
    assert w2.models_panel.target.model_id() == str(model_dirs["target"]) and w2.models_panel.draft.model_id() == ""
    assert w2.prompt_panel.prompt() == "line one\nline, two = \"quoted\""
    assert w2.prompt_panel.max_new_tokens.value() == 77 and w2.prompt_panel.seed.value() == 1234
    assert not w2.prompt_panel.stand_down.isChecked()
    assert w2.prompt_panel.generation_config().stand_down is False
    assert w2.methods_panel.method() == "prompt_lookup"
    assert w2.methods_panel.forms["prompt_lookup"].config().num_tokens == 21
    assert w2.compare.selected() == ["autoregressive", "prompt_lookup"]
    assert w2.live.rejected_inline.isChecked() and w2.compare.rejected_inline.isChecked()
    assert (w2.width(), w2.height()) == (777, 555)
    w2.close()


def test_unreadable_settings_fall_back_to_defaults(qtbot):
    from specplay.app.settings import AppSettings, open_settings

    qs = open_settings()
    qs.setValue("max_new_tokens", "lots")
    qs.setValue("method_values", "{not json")
    qs.setValue("compare_methods", "42")
    qs.sync()
    s = AppSettings.load(open_settings())
    assert s.max_new_tokens == AppSettings().max_new_tokens
    assert s.method_values == {} and s.compare_methods == AppSettings().compare_methods


def test_presets_load_from_assets():
    from specplay.app.panels import load_presets

    presets = load_presets()
    cats = {p["category"] for p in presets}
    assert {"code", "chat", "summarisation", "translation"} <= cats
    assert all(p["prompt"].strip() for p in presets)


def test_launcher_without_arguments_opens_the_window(monkeypatch):
    import specplay.app.main
    from specplay import app
    from specplay.app import launcher

    called = []
    monkeypatch.setattr(app.main, "run_app", lambda argv: called.append(argv) or 0)
    assert launcher.main([]) == 0 and called == [[]]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="None is immortal from Python 3.12: its count never moves")
def test_qt_calls_to_python_overrides_keep_every_reference_to_none(qtbot):
    """PySide6 6.12.0 releases None once too often each time C++ calls a Python override
    (every paint of every chart item); on Python 3.11 a few comparisons later the app
    aborts with "Fatal Python error: none_dealloc". The Qt binding we pin must not do that."""
    from PySide6.QtWidgets import QWidget

    class Painted(QWidget):
        def paintEvent(self, event):
            pass

    w = Painted()
    qtbot.addWidget(w)
    w.resize(40, 40)
    w.show()
    qtbot.waitExposed(w)
    before = sys.getrefcount(None)
    for _ in range(1000):
        w.repaint()
    assert sys.getrefcount(None) - before > -500


def test_while_a_run_streams_only_the_rate_curve_is_redrawn_the_rest_when_it_ends(qtbot):
    """Redrawing every chart during a run takes CPU from the model; the run's end draws them all."""
    from specplay.app.charts import ChartsPanel

    charts = ChartsPanel(["speculative"])
    qtbot.addWidget(charts)
    charts.begin_run("speculative")
    charts._refresh_if_dirty()  # the new run's empty charts
    for i in range(4):
        charts.add_step("speculative", _step(list(KNOWN), step=i))
    charts._refresh_if_dirty()  # a live tick
    assert len(charts.curves["speculative"].getData()[0]) == 4
    assert len(charts.hist_bars["speculative"].opts["height"]) == 0
    charts.finish_run("speculative", {"accept_lengths": [3, 3, 3, 3]})
    assert sum(charts.hist_bars["speculative"].opts["height"]) == 4
