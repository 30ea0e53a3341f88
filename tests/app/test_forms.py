"""The methods' settings forms, built from their configuration classes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app_window import model_dirs, run, window  # noqa: F401 (model_dirs: the window fixture's)


@dataclass(frozen=True)
class _DemoConfig:
    count: int = dataclasses.field(default=3, metadata={"help": "how many", "label": "count", "min": 1, "max": 9})
    ratio: float = dataclasses.field(default=0.5, metadata={"help": "a ratio", "min": 0.0, "max": 1.0})
    fast: bool = dataclasses.field(default=False, metadata={"help": "cut corners", "lossy": True})
    mode: str = dataclasses.field(default="a", metadata={"help": "mode", "choices": ["a", "b"]})
    path: str = dataclasses.field(default="", metadata={"help": "a file", "kind": "file"})
    limit: "int | None" = dataclasses.field(default=None, metadata={"help": "optional"})

    def __post_init__(self):
        from specplay.core.errors import ConfigError

        if self.mode == "b" and self.count > 5:
            raise ConfigError("mode b allows at most 5")


def test_forms_are_built_generically_from_config_dataclasses(qtbot):
    from PySide6.QtWidgets import QCheckBox, QComboBox, QDoubleSpinBox, QLabel, QLineEdit, QSpinBox

    from specplay.app.forms import ConfigForm

    form = ConfigForm(_DemoConfig)
    qtbot.addWidget(form)
    e = form.editors
    assert isinstance(e["count"].editor, QSpinBox) and e["count"].editor.maximum() == 9
    assert isinstance(e["ratio"].editor, QDoubleSpinBox)
    assert isinstance(e["fast"].editor, QCheckBox) and e["fast"].lossy
    assert any(lab.text() == "LOSSY" for lab in e["fast"].findChildren(QLabel))
    assert isinstance(e["mode"].editor, QComboBox)
    assert isinstance(e["path"].editor, QLineEdit) and e["path"].kind == "file"
    assert e["limit"].enable is not None and e["limit"].value() is None
    assert form.config() == _DemoConfig()
    e["limit"].set_value(4)
    e["mode"].set_value("b")
    e["count"].set_value(7)
    assert form.validate() == "mode b allows at most 5"
    assert form.error.isVisibleTo(form) and "at most 5" in form.error.text()
    e["count"].set_value(2)
    assert form.validate() is None and form.config().limit == 4


def test_the_method_panel_scrolls_over_the_chosen_form_only(qtbot):
    """A short form (autoregressive has none to speak of) must not keep the height of the longest
    (speculative's): in a stacked widget it did, and left blank space to scroll into under Xvfb."""
    from specplay.app.panels import MethodsPanel

    panel = MethodsPanel()
    qtbot.addWidget(panel)
    panel.resize(320, 300)
    panel.show()
    heights = {}
    for name in ("speculative", "autoregressive", "eagle", "speculative"):
        panel.set_method(name)
        qtbot.wait(10)
        heights[name] = panel.pages.sizeHint().height()
        assert heights[name] == panel.current_form().sizeHint().height()
    assert heights["autoregressive"] < heights["eagle"] < heights["speculative"]


def test_methods_panel_picks_up_new_methods_without_code(qtbot, monkeypatch):
    from specplay.app.panels import MethodsPanel
    from specplay.core import methods
    from specplay.core.methods import METHODS, MethodSpec

    spec = MethodSpec("demo", "Demo method", _DemoConfig, False, lambda c, t, d: None, "A method added later.")
    monkeypatch.setitem(METHODS, "demo", spec)
    assert methods.METHODS["demo"] is spec
    panel = MethodsPanel()
    qtbot.addWidget(panel)
    panel.set_method("demo")
    assert panel.method() == "demo" and panel.summary.text() == "A method added later."
    assert set(panel.forms["demo"].editors) == {f.name for f in dataclasses.fields(_DemoConfig)}
    assert "LOSSY" in panel.badges.text()
    for name, s in METHODS.items():  # every real method gets one editor per field
        assert set(panel.forms[name].editors) == {f.name for f in dataclasses.fields(s.config_class)}


def test_a_bad_method_setting_blocks_the_run_with_the_message(window, qtbot):
    window.methods_panel.set_method("prompt_lookup")
    form = window.methods_panel.forms["prompt_lookup"]
    form.editors["min_ngram"].set_value(4)
    form.editors["max_ngram"].set_value(2)
    assert "min n" in form.error.text()
    steps = []
    window.session.client.worker.sig_step.connect(steps.append)
    assert run(qtbot, window.run_single()) is None
    assert "min n" in window.last_error and not steps


def test_heads_learnt_on_another_targets_features_say_so_under_the_run(window, qtbot, tmp_path):
    """Medusa heads whose manifest says they learnt an int8 target's features, run on this float32
    target: the run goes on (its drafts are checked as any) and the line under it warns."""
    import torch

    from specplay.core.heads import MedusaHeads, save_heads

    path = tmp_path / "int8-heads.safetensors"
    save_heads(path, dict(MedusaHeads(32, 2).state_dict(), vocab_ids=torch.arange(64)),
               {"kind": "medusa", "target": "tiny", "hidden_size": 32, "vocab_size": 64, "num_heads": 2,
                "accuracy": [[0.5, 0.1], [0.3, 0.1]], "feature_dtype": "int8"})
    window.methods_panel.set_method("medusa")
    window.methods_panel.forms["medusa"].editors["heads"].set_value(str(path))
    result = run(qtbot, window.run_single())
    assert result is not None and len(result.token_ids) == 16
    assert "warning: int8-heads.safetensors learnt the features of the target stored as int8; this one runs on " \
           "float32" in window.live.stats.text()
