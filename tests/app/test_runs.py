"""Runs in the window: each method streams into the live view, tokens coloured by fate."""

from __future__ import annotations

import pytest

from app_window import make_window, model_dirs, run, token_format, window
from specplay.core.decoding.types import Fate, StopReason


def test_a_method_is_built_once_per_loaded_models_and_runs_alike_again(window, qtbot, model_dirs, monkeypatch):
    """Run after run the worker reuses the built method (Medusa and EAGLE would otherwise read and
    prepare their heads every time); each run still starts afresh, and loading models rebuilds."""
    import specplay.core.methods
    from specplay import core
    built = []
    real = core.methods.build_method
    monkeypatch.setattr(core.methods, "build_method", lambda *a, **k: built.append(a[0]) or real(*a, **k))
    # The verify curve held as it is: corrected by the first run's passes, it would size the second's copies.
    monkeypatch.setattr(core.decoding.costmodel, "observe", lambda *a: None)
    window.methods_panel.set_method("prompt_lookup")
    first = run(qtbot, window.run_single())
    second = run(qtbot, window.run_single())
    assert built == ["prompt_lookup"]
    assert second.token_ids == first.token_ids
    assert [e.num_drafted for e in second.events] == [e.num_drafted for e in first.events]
    run(qtbot, window.load_models(str(model_dirs["target"]), str(model_dirs["same"]), "cpu", "float32"))
    run(qtbot, window.run_single())
    assert built == ["prompt_lookup", "prompt_lookup"]


@pytest.mark.parametrize("method", ["autoregressive", "speculative", "prompt_lookup"])
def test_each_method_streams_into_the_live_view(window, qtbot, method):
    window.methods_panel.set_method(method)
    steps = []
    window.session.client.worker.sig_step.connect(steps.append)
    result = run(qtbot, window.run_single())
    assert result is not None and result.method == method
    assert len(result.token_ids) == 16
    view = window.live.view
    assert view.committed_text() == result.text
    assert len(view.steps) == len(result.events) == len(steps)
    # every shown token carries its fate's format
    from specplay.app.palette import FATE_STYLES

    for i, tok in enumerate(view.shown_tokens()):
        fmt, _ = token_format(view, i)
        if i in view.markers:  # rejected drafts leave a raised mark, not struck text
            assert tok.fate is Fate.REJECTED and view.markers[i][0] is tok
            assert fmt.verticalAlignment() == fmt.VerticalAlignment.AlignSuperScript
            continue
        assert tok.fate is not Fate.REJECTED and not fmt.fontStrikeOut()
        assert fmt.foreground().color().name() == FATE_STYLES[tok.fate].text
    # the run went to the history file and the panel
    assert window.session.history.load()[-1]["token_ids"] == result.token_ids
    assert window.history_panel.entries[-1].summary["method"] == method
    # charts: one point per step, histogram counts all steps
    curve = window.charts.curves[method]
    assert len(curve.getData()[0]) == len(result.events)
    assert sum(window.charts.hist_bars[method].opts["height"]) == len(result.events)


def test_step_events_are_drawn_per_frame_not_per_token(window, qtbot):
    """A fast run's events arrive many per frame; the views get every one of them, in order,
    but the window draws them in batches (drawing per token would slow the model on two cores)."""
    window.methods_panel.set_method("autoregressive")
    window.prompt_panel.max_new_tokens.setValue(200)
    before = window.session.frames
    result = run(qtbot, window.run_single())
    assert [e.step for e in window.live.view.steps] == [e.step for e in result.events]
    assert window.live.view.committed_text() == result.text
    assert 0 < window.session.frames - before < len(result.events)


#: Methods that cannot run on the tiny test models, and the reason each must give: no trained heads ship for them.
NEEDS_HEADS = {"medusa": "no medusa heads ship for", "eagle": "no eagle heads ship for"}


def test_every_registered_method_runs_or_explains_why_not(window, qtbot):
    """Every registered method that can run on the tiny models runs with its default settings, to the token
    budget, and gives autoregressive's tokens at temperature 0; only those that need trained heads refuse,
    saying so and how to train them. A method added to the registry later must be one or the other."""
    from specplay.core.methods import METHODS

    tokens = {}
    for name in METHODS:
        window.methods_panel.set_method(name)
        window.live.clear_error()
        result = run(qtbot, window.run_single())
        banner = window.live.banner.text() if window.live.banner_box.isVisibleTo(window) else ""
        assert not window.session.busy
        if name in NEEDS_HEADS:
            assert result is None and NEEDS_HEADS[name] in banner and f"specplay train {name}" in banner, (name, banner)
            continue
        assert result is not None and result.error is None and not banner, (name, banner)
        assert result.stop_reason is StopReason.MAX_TOKENS and len(result.token_ids) == 16, name
        assert window.live.view.committed_text() == result.text, name
        tokens[name] = result.token_ids
    assert set(tokens) == set(METHODS) - set(NEEDS_HEADS)
    assert {name: ids for name, ids in tokens.items() if ids != tokens["autoregressive"]} == {}


def test_lossless_methods_match_the_baseline_at_temperature_zero(window, qtbot):
    texts = {}
    for name in ("autoregressive", "speculative", "prompt_lookup"):
        window.methods_panel.set_method(name)
        texts[name] = run(qtbot, window.run_single()).token_ids
    assert texts["speculative"] == texts["autoregressive"] == texts["prompt_lookup"]


def test_twin_draft_tokens_are_accepted_and_coloured_so(window, qtbot):
    window.methods_panel.set_method("speculative")
    window.methods_panel.forms["speculative"].editors["gamma"].set_value(4)
    result = run(qtbot, window.run_single())
    fates = [t.fate for e in result.events for t in e.tokens]
    assert Fate.ACCEPTED in fates and Fate.BONUS in fates and Fate.REJECTED not in fates
    from specplay.app.palette import FATE_STYLES

    view = window.live.view
    for i, tok in enumerate(view.shown_tokens()):
        if tok.fate is Fate.TARGET:  # the last step drafts nothing (no room left)
            continue
        fmt, _ = token_format(view, i)
        bg = fmt.background().color().name()
        assert bg in {FATE_STYLES[tok.fate].background(s).name() for s in (0, 1)}


def test_rejected_drafts_leave_marks_and_can_be_shown_inline(qtbot, aloop, model_dirs):
    """With an unrelated draft many tokens are rejected: by default the text stays the answer,
    each run of rejections a ✕ mark counting them; inline, each is shown struck through."""
    from specplay.app.tokenview import marker_text

    w = make_window(qtbot)
    run(qtbot, w.load_models(str(model_dirs["target"]), str(model_dirs["other"]), "cpu", "float32"))
    w.prompt_panel.editor.setPlainText("ab cd ab cd ab")
    w.prompt_panel.chat_template.setChecked(False)
    w.prompt_panel.max_new_tokens.setValue(12)
    w.methods_panel.set_method("speculative")
    result = run(qtbot, w.run_single())
    rejected = [t for e in result.events for t in e.tokens if t.fate is Fate.REJECTED]
    assert rejected, "an unrelated random draft should be rejected at least once"
    view = w.live.view
    assert sum(len(r) for r in view.markers.values()) == len(rejected)
    assert view.document().toPlainText() == "".join(
        marker_text(view.markers[i]) if i in view.markers else t.text for i, t in enumerate(view.shown_tokens()))
    assert not any(token_format(view, i)[0].fontStrikeOut() for i in range(len(view.shown_tokens())))
    assert view.committed_text() == result.text
    w.live.rejected_inline.setChecked(True)
    assert not view.markers
    struck = [i for i, t in enumerate(view.shown_tokens()) if token_format(view, i)[0].fontStrikeOut()]
    assert len(struck) == len(rejected)
    assert len(view.shown_tokens()) == sum(len(e.tokens) for e in result.events)
    assert view.committed_text() == result.text
    w.close()
