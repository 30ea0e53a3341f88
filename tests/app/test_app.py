"""The desktop app, offscreen, on tiny random model folders.

The window's orchestration is asyncio on a qasync loop; the ``aloop`` fixture installs one
as the running loop on top of pytest-qt's application, and :func:`run` drives a coroutine
by processing Qt events until it is done (exactly as the real app's loop would).
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtCore import QPoint, Qt  # noqa: E402  (PySide6 before qasync, so qasync binds to it)
from PySide6.QtGui import QTextCursor  # noqa: E402

qasync = pytest.importorskip("qasync")
from tiny import save_tiny_model  # noqa: E402

from specplay.core.decoding.types import Fate, Rule, StepEvent, StepTiming, StopReason, TokenEvent  # noqa: E402

TIMEOUT = 30_000


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_tiny_model(root / "target", seed=0),
        "same": save_tiny_model(root / "same", seed=0),  # the target's twin: every draft token is accepted
        "other": save_tiny_model(root / "other", seed=1),  # an unrelated draft: rejections
        "alien": save_tiny_model(root / "alien", seed=0, shuffle=3),  # another vocabulary mapping
    }


def run(qtbot, coro, timeout=TIMEOUT):
    task = asyncio.ensure_future(coro)
    qtbot.waitUntil(task.done, timeout=timeout)
    return task.result()


def make_window(qtbot, history=None):
    from specplay.app.settings import AppSettings
    from specplay.app.window import MainWindow

    w = MainWindow(settings=AppSettings(), history=history)
    qtbot.addWidget(w)
    w.resize(1400, 900)
    return w


@pytest.fixture()
def window(qtbot, aloop, model_dirs):
    w = make_window(qtbot)
    loaded = run(qtbot, w.load_models(str(model_dirs["target"]), str(model_dirs["same"]), "cpu", "float32"))
    assert loaded is not None and loaded.draft is not None
    w.prompt_panel.editor.setPlainText("ab cd ab cd ab")
    w.prompt_panel.chat_template.setChecked(False)
    w.prompt_panel.max_new_tokens.setValue(16)
    # The views are tested on drafting steps: tiny models' steps take microseconds, where the
    # stand-down gate's timings are noise (it is tested in test_standdown.py and test_engine.py).
    w.prompt_panel.stand_down.setChecked(False)
    yield w
    w.close()


def token_format(view, index):
    start, end = view._spans[index][:2]
    cursor = QTextCursor(view.document())
    cursor.setPosition(start + 1)  # the format of the character after the cursor's position - 1
    return cursor.charFormat(), view.document().toPlainText()[start:end]


# ----------------------------------------------------------------------------------- loading
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


# ----------------------------------------------------------------------------------- runs
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


# ----------------------------------------------------------------------------------- token view + X-ray
def _step(tokens, step=3, tree=None, internals=None):
    return StepEvent(step=step, tokens=tokens, committed=[t.token_id for t in tokens if t.fate is not Fate.REJECTED],
                     text="".join(t.text for t in tokens if t.fate is not Fate.REJECTED),
                     num_drafted=sum(t.depth > 0 for t in tokens),
                     num_accepted=sum(t.fate is Fate.ACCEPTED for t in tokens), timing=StepTiming(0.01, 0.02, 0.001),
                     elapsed_s=0.5, total_new_tokens=3, tree=tree or {}, internals=internals or {})


KNOWN = [
    TokenEvent(11, "alpha", Fate.ACCEPTED, depth=1, node=0, p=0.8125, q=0.5, u=0.25, accept_prob=1.0,
               rule=Rule.SAMPLED),
    TokenEvent(12, "beta", Fate.REJECTED, depth=2, node=1, p=0.125, q=0.5, u=0.75, accept_prob=0.25,
               rule=Rule.SAMPLED),
    TokenEvent(13, "gamma", Fate.RESAMPLED, depth=0, node=-1, p=0.375),
    TokenEvent(14, "delta", Fate.BONUS, depth=0, node=-1, p=0.9),
    TokenEvent(15, "eps", Fate.TARGET, depth=0, node=-1, p=0.6),
]


def test_token_view_colours_each_fate(qtbot):
    from specplay.app.palette import FATE_STYLES
    from specplay.app.tokenview import TokenView

    view = TokenView()
    qtbot.addWidget(view)
    view.set_rejected_inline(True)
    view.append_step(_step(KNOWN))
    assert view.document().toPlainText() == "alphabetagammadeltaeps"
    for i, tok in enumerate(KNOWN):
        fmt, text = token_format(view, i)
        style = FATE_STYLES[tok.fate]
        assert text == tok.text
        assert fmt.foreground().color().name() == style.text
        assert fmt.fontStrikeOut() == (tok.fate is Fate.REJECTED)
        assert fmt.fontUnderline() == (tok.fate is Fate.RESAMPLED)
        assert fmt.fontOverline() == (tok.fate is Fate.BONUS)
        if tok.fate is not Fate.TARGET:
            assert fmt.background().color().name() in {style.background(s).name() for s in (0, 1)}
    # distinct colours for distinct fates
    assert len({s.colour for s in FATE_STYLES.values()}) == len(FATE_STYLES)
    view.set_rejected_inline(False)
    assert view.document().toPlainText() == "alpha✕gammadeltaeps"
    assert view.markers == {1: [KNOWN[1]]}
    assert "1 draft token rejected here" in view._tooltip(1) and "<code>beta</code>" in view._tooltip(1)


def test_hovering_a_token_shows_its_xray(qtbot):
    from specplay.app.tokenview import TokenView
    from specplay.app.xray import XRayPanel

    view, xray = TokenView(), XRayPanel()
    qtbot.addWidget(view)
    qtbot.addWidget(xray)
    view.sig_token_hovered.connect(xray.show_token)
    view.resize(500, 200)
    view.show()
    qtbot.waitExposed(view)
    step = _step(KNOWN, step=7)
    view.append_step(step)
    for i, tok in enumerate(KNOWN[:2]):
        rect = view.token_rect(i)
        qtbot.mouseMove(view.viewport(), rect.center())
        qtbot.waitUntil(lambda tok=tok: xray.token is tok, timeout=2000)
        v = {k: lab.text() for k, lab in xray.values.items()}
        assert v["p"] == f"{tok.p:.4f}" and v["q"] == f"{tok.q:.4f}" and v["u"] == f"{tok.u:.4f}"
        assert v["accept"] == f"{tok.accept_prob:.4f}"
        assert v["step"].startswith("7")
        assert f"draft position {tok.depth}" in v["depth"]
        assert tok.fate.value in v["fate"]
        assert v["rule"] == "min(1, p(x) / q(x))"
    assert xray.explanation.text() == "u = 0.7500 ≥ acceptance probability 0.2500: rejected."
    # nowhere near a token: no hit
    assert view.span_at(QPoint(490, 190)) is None


def test_xray_shows_the_rule_the_verifier_recorded():
    from specplay.app.xray import accept_rule, explain

    # A deterministic candidate that still carries the draft's own probability q (EAGLE, Medusa at
    # temperature > 0): the rule is p(x), not min(1, p/q).
    det = TokenEvent(5, "x", Fate.REJECTED, depth=1, node=0, p=0.2, q=0.7, u=0.9, accept_prob=0.2, rule=Rule.ONE_HOT)
    greedy = TokenEvent(5, "x", Fate.ACCEPTED, depth=1, node=0, p=0.7, q=0.6, u=None, accept_prob=1.0,
                        rule=Rule.GREEDY)
    typical = TokenEvent(5, "x", Fate.ACCEPTED, depth=1, node=0, p=0.4, u=None, accept_prob=1.0, rule=Rule.TYPICAL)
    unreached = TokenEvent(5, "x", Fate.REJECTED, depth=3, node=2)
    assert accept_rule(det).startswith("p(x)") and "0.9000 ≥" in explain(det)
    assert "greedy" in accept_rule(greedy) and "greedy choice" in explain(greedy)
    assert "LOSSY" in accept_rule(typical) and "typical-acceptance bar: accepted" in explain(typical)
    assert accept_rule(unreached) == "" and "Never checked" in explain(unreached)


# ----------------------------------------------------------------------------------- internals
def test_internals_draw_the_tree_and_lookahead_state_robustly(qtbot):
    from specplay.app.internals import InternalsPanel

    panel = InternalsPanel(lambda t: f"<{t}>")
    qtbot.addWidget(panel)
    tree = {"tokens": [11, 12, 21], "parents": [-1, 0, -1], "fates": ["accepted", "rejected", "rejected"],
            "accepted": [0]}
    look = {"window": [[1, 2, 3], [4, 5, 6]], "pool_size": 17, "candidates": [[7, 8], [11, 12]], "won": 1,
            "hits": 4}
    panel.add_step(_step(KNOWN, tree=tree, internals=look))
    assert panel.tree_view.tree["accepted"] == [0]
    assert panel.tree_view.texts[:2] == ["alpha", "beta"] and panel.tree_view.texts[2] == "<21>"
    assert panel.tree_view.next_pos is not None  # the target's own token is drawn after the path
    assert len(panel.window_grid.rows) == 2 and "17" in panel.window_title.text()
    assert panel.candidates_grid.highlight == 1 and "#1 verified" in panel.candidates_title.text()
    assert "hits" in panel.details.text()
    # missing or malformed keys: nothing drawn, nothing raised
    for bad_tree, bad_internals in [({}, {}), ({"tokens": [1, 2], "parents": [-1]}, {"window": "x"}),
                                    ({"tokens": [1], "parents": [5]}, {"candidates": [[1], "zz"], "won": 9}),
                                    (None, None), ({"tokens": "abc", "parents": None}, {"pool_size": "many"})]:
        panel.add_step(_step(KNOWN, tree=bad_tree, internals=bad_internals))
        panel.grab()
    assert panel.tree_view.tree is None
    prompt_lookup = {"match": {"ngram": 2, "at": 5, "proposed": 4}}
    panel.add_step(_step(KNOWN, internals=prompt_lookup))
    assert "copying from position 5" in panel.details.text()
    panel.add_step(_step(KNOWN, internals={"gamma": 5, "drafted": 5, "stopped_early": False}))
    assert "gamma" in panel.details.text() and "stopped early" in panel.details.text()


# ----------------------------------------------------------------------------------- forms
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


# ----------------------------------------------------------------------------------- stop and errors
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


# ----------------------------------------------------------------------------------- compare
def test_compare_fills_the_table_with_identical_flags(window, qtbot):
    names = ["autoregressive", "speculative", "prompt_lookup"]
    records = run(qtbot, window.run_compare(names), timeout=60_000)
    assert [r["method"] for r in records] == names
    table = window.compare.table
    assert table.rowCount() == 3
    for row, r in enumerate(records):
        assert r["identical_to_baseline"] is True
        assert table.item(row, 1).text() == "✓"
        assert table.item(row, 2).text() == f"{r['tokens_per_s']:.2f}"
        assert table.item(row, 3).text() == f"{r['time_to_first_token']:.2f} s"
        assert abs(r["speedup"] - r["tokens_per_s"] / records[0]["tokens_per_s"]) < 1e-9
    assert table.item(0, 4).text() == "1.00×"
    # side by side: one column per method, each showing that run's text
    for r in records:
        assert window.compare.column(r["method"]).view.committed_text() == r["text"]
    bars = window.compare.speedup_bars.opts
    assert list(bars["width"]) == pytest.approx([r["speedup"] for r in records])
    # each run went to the history as soon as it ended
    assert [r["method"] for r in window.session.history.load()[-3:]] == names
    # clicking a token of one column shows that run's step in the X-ray and the internals
    window.show()
    qtbot.waitExposed(window)
    view = window.compare.column("speculative").view
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=view.token_rect(2).center())
    token, step = view.token(2)
    assert window.xray.token is token
    assert window.internals.steps == view.steps and window.internals.step_box.value() == view.steps.index(step)


def test_compare_runs_remote_endpoints_beside_local_methods(window, qtbot):
    """Two OpenAI-compatible endpoints after a local method: their text streams into their own
    columns, the table shows their speeds, first-token times and (where exposed) τ, and the runs
    go to the history in the same record format."""
    from test_remote import FakeEngine

    with FakeEngine(spec="none") as plain, FakeEngine(spec="vllm") as spec:
        window.compare.endpoints_edit.setText(f"{plain.url},name=plain; {spec.url},name=spec")
        records = run(qtbot, window.run_compare(["autoregressive"]), timeout=60_000)
    assert [r["method"] for r in records] == ["autoregressive", "remote:plain", "remote:spec"]
    table = window.compare.table
    assert table.rowCount() == 3
    assert table.item(1, 0).text() == "remote:plain" and "speculation not exposed" in table.item(1, 9).text()
    assert table.item(2, 5).text() == "3.00" and table.item(2, 4).text() == f"{records[2]['speedup']:.2f}×"
    assert table.item(1, 4).text() == "1.00×" and records[2]["identical_to_baseline"] is True
    assert window.compare.column("remote:spec").view.committed_text() == records[2]["text"]
    assert [r["method"] for r in window.session.history.load()[-3:]] == ["autoregressive", "remote:plain", "remote:spec"]
    assert window.why.table.rowCount() == 1  # only local runs have step costs to explain
    # a streamed chunk is no step of known length: no bar at "0 tokens a step" for an endpoint
    window.charts.refresh()
    assert len(window.charts.hist_bars["remote:spec"].opts["x"]) == 0
    assert len(window.charts.hist_bars["autoregressive"].opts["x"]) == 1


def test_compare_starts_llama_server_for_its_run_and_stops_it(window, qtbot, tmp_path, monkeypatch):
    """A checked llama-server peer: the worker starts the server on the loaded models, sends it the
    prompt as the target's token ids, streams its answer into a column of its own, and stops it."""
    import json

    from specplay.core.measure import peers
    from specplay.core.remote.llama_server import LlamaServer
    from specplay.core.text import encode_prompt
    from test_llama_server import _stand_in

    stand_in = _stand_in(tmp_path, "serve")
    started = []

    def server_for(name, target, draft):
        started.append(LlamaServer(["-m", "target.gguf"], path=stand_in))
        return started[-1], {}

    monkeypatch.setattr(peers, "server_for", server_for)
    box = window.compare.server_checks["llamacpp_ngram"]
    box.setEnabled(True)  # as where the server is built
    box.setChecked(True)
    records = run(qtbot, window.run_compare(["autoregressive"]), timeout=60_000)
    assert [r["method"] for r in records] == ["autoregressive", "remote:llamacpp_ngram"]
    assert records[1]["error"] is None and records[1]["text"] == "ab cd" and records[1]["drafted"] == 4
    assert window.compare.column("remote:llamacpp_ngram").view.committed_text() == "ab cd"
    sent = json.loads(Path(str(stand_in) + ".request").read_text())
    assert sent["prompt"] == encode_prompt(window.session.models.target.tokenizer, "ab cd ab cd ab", False)
    assert len(started) == 1 and started[0].proc is None  # stopped after its run


def test_an_unreachable_endpoint_is_a_message_and_the_window_stays_usable(window, qtbot):
    from test_remote import FakeEngine

    with FakeEngine() as engine:
        port = engine.server.server_address[1]
    window.compare.endpoints_edit.setText(f"http://127.0.0.1:{port}/v1")
    records = run(qtbot, window.run_compare([]), timeout=30_000)
    assert len(records) == 1 and "cannot reach" in records[0]["error"]
    assert "cannot reach" in window.live.banner.text() and not window.session.busy
    window.compare.endpoints_edit.setText("ftp://nowhere")
    assert run(qtbot, window.run_compare([])) is None and "Endpoint:" in window.last_error


def test_why_this_speed_shows_the_measured_curve_and_each_methods_costs(window, qtbot):
    """The first run says it measures the machine's verification cost; after a comparison the
    "Why this speed" tab holds that curve, the break-even lines and one cost row per method,
    the same numbers ``specplay compare --why`` prints."""
    from specplay.core.decoding.costmodel import cost_curve
    from specplay.core.measure.whyspeed import break_even_cost, explain
    from specplay.core.records.runlog import RunRecord

    seen = []
    window.session.client.worker.sig_progress.connect(lambda stage, fraction: seen.append(stage))
    assert window.why.table.rowCount() == 0 and "first run measures" in window.why.summary.text()
    names = ["autoregressive", "speculative", "prompt_lookup"]
    records = run(qtbot, window.run_compare(names), timeout=60_000)
    assert sum("verification cost, once" in s for s in seen) == 1
    curve = cost_curve(window.session.models.target.model)
    xs, ys = window.why.cost_line.getOriginalDataset()
    assert list(xs) == list(curve.sizes) and list(ys) == pytest.approx(curve.relative)
    kept_xs, kept_ys = window.why.kept_line.getOriginalDataset()  # the kept curve beside the corrected one
    assert list(kept_xs) == list(curve.kept.sizes) and list(kept_ys) == pytest.approx(curve.kept.relative)
    assert curve.observed, "the comparison's passes correct the curve"
    _, even = window.why.even_lines[5].getData()
    assert even[50] == pytest.approx(break_even_cost(0.5, 5, curve), rel=0.05)
    want = explain([RunRecord.from_dict(r) for r in records], curve)
    table = window.why.table
    assert table.rowCount() == 3
    for row, e in enumerate(want):
        assert table.item(row, 6).text() == f"{e.predicted_speedup:.2f}×"
        assert table.item(row, 7).text() == f"{e.measured_speedup:.2f}×"
    # methods that draft sit on the break-even chart at their measured acceptance and draft cost
    placed = {s.data(): (s.pos().x(), s.pos().y()) for s in window.why.points.points()}
    assert set(placed) == {"speculative", "prompt_lookup"}
    spec = next(r for r in records if r["method"] == "speculative")
    assert placed["speculative"] == pytest.approx((spec["acceptance_rate"], want[1].draft_cost_per_token))
    assert "T(1)" in window.why.summary.text()


def test_the_two_speedups_say_which_time_each_counts(qtbot):
    """The Compare table's speedup is over each run's wall time (prefill included), "Why this speed"'s over
    its decoding steps' own time: the headers name which, and the tips say why they differ."""
    from specplay.app.compare_view import COLUMN_TIPS, TABLE_COLUMNS
    from specplay.app.whyspeed_view import WHY_COLUMNS, WHY_TIPS

    wall, steps = TABLE_COLUMNS.index("Speedup (wall)"), WHY_COLUMNS.index("Measured (steps)")
    assert "prefill" in COLUMN_TIPS[wall] and "Measured (steps)" in COLUMN_TIPS[wall]
    assert "prefill" in WHY_TIPS[steps] and "Speedup (wall)" in WHY_TIPS[steps]


def axis_labels(axis, qtbot) -> list[tuple[str, object]]:
    """The tick labels an axis draws and their rectangles (what a user sees along it)."""
    from PySide6.QtGui import QImage, QPainter

    image = QImage(10, 10, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        _, _, texts = axis.generateDrawSpecs(painter)
    finally:
        painter.end()
    return [(text, rect) for rect, _, text in texts]


def test_the_cost_curve_axis_labels_each_block_size_once_without_overlap(qtbot):
    from specplay.app.whyspeed_view import WhySpeedView
    from specplay.core.decoding.costmodel import CostCurve

    view = WhySpeedView()
    qtbot.addWidget(view)
    view.resize(900, 600)
    view.show()
    view.set_curve(CostCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.1, 1.3, 1.7, 2.6, 4.4, 8.1)))
    qtbot.wait(50)
    labels = axis_labels(view.cost_plot.getAxis("bottom"), qtbot)
    assert [text for text, _ in labels] == ["1", "2", "4", "8", "16", "32", "64"]
    rects = [rect for _, rect in labels]
    assert all(not a.intersects(b) for i, a in enumerate(rects) for b in rects[i + 1:])


def test_the_time_split_counts_a_runs_plain_first_step_as_its_own_time_not_as_stood_down():
    from specplay.app.charts import Series

    series = Series()
    note = "the first token is the target's alone: it comes as soon as plain decoding's would"
    series.add(StepEvent(step=0, tokens=[], committed=[1], text="a", num_drafted=0, num_accepted=0,
                         timing=StepTiming(0.0, 0.04, 0.001), elapsed_s=0.05, total_new_tokens=1, stood_down=note))
    series.add(StepEvent(step=1, tokens=[], committed=[2], text="b", num_drafted=0, num_accepted=0,
                         timing=StepTiming(0.0, 0.05, 0.002), elapsed_s=0.1, total_new_tokens=2,
                         stood_down="drafting stood down: 10.0 tokens/s drafting against 20.0 plain"))
    assert series.split == pytest.approx([0.0, 0.04, 0.001, 0.052])


def test_the_time_split_axis_starts_at_zero_seconds_while_a_run_streams(qtbot):
    from specplay.app.charts import ChartsPanel

    charts = ChartsPanel(["autoregressive", "speculative"])
    qtbot.addWidget(charts)
    charts.resize(900, 500)
    charts.show()
    charts.begin_run("autoregressive")
    charts.add_step("autoregressive", StepEvent(step=0, tokens=[], committed=[1], text="a", num_drafted=0,
                                                num_accepted=0, timing=StepTiming(0.01, 0.02, 0.003), elapsed_s=0.05,
                                                total_new_tokens=1))
    charts.refresh()
    (low, high), _ = charts.split_plot.viewRange()
    assert low == 0 and high > 0
    charts.finish_run("autoregressive", {"draft_s": 2.0, "verify_s": 3.0, "other_s": 1.0})
    (low, high), _ = charts.split_plot.viewRange()
    assert low == 0 and 6.0 <= high < 7.0


def test_every_compared_method_is_warmed_up_before_its_timed_run(window, qtbot, monkeypatch):
    """The first method must not be timed cold: each runs the shared core warm-up first."""
    import specplay.core.decoding.engine
    from specplay import core
    order = []
    real_warm_up, real_drain = core.decoding.engine.warm_up, core.decoding.engine.drain

    def warm_up(target_lm, tokenizer, method, prompt_ids, sampling, tokens=core.decoding.engine.WARMUP_TOKENS,
                should_stop=None):
        if tokens > 0:
            order.append(("warm-up", method.name, tokens))
        return real_warm_up(target_lm, tokenizer, method, prompt_ids, sampling, tokens, should_stop)

    def drain(gen, on_event=None):
        result = real_drain(gen, on_event)
        if on_event is not None:  # the timed run streams its steps
            order.append(("timed", result.method))
        return result

    monkeypatch.setattr(core.decoding.engine, "warm_up", warm_up)
    monkeypatch.setattr(core.decoding.engine, "drain", drain)
    run(qtbot, window.run_compare(["autoregressive", "prompt_lookup"]), timeout=60_000)
    tokens = core.decoding.engine.WARMUP_TOKENS
    assert order == [("warm-up", "autoregressive", tokens), ("timed", "autoregressive"),
                     ("warm-up", "prompt_lookup", tokens), ("timed", "prompt_lookup")]


def test_compare_table_marks_a_differing_output():
    from specplay.app.compare_view import identical_text
    from specplay.core.measure.compare import annotate

    recs = [{"method": "autoregressive", "tokens_per_s": 10.0, "token_ids": [1, 2, 3]},
            {"method": "speculative", "tokens_per_s": 20.0, "token_ids": [1, 2, 4]}]
    annotate(recs, greedy=True)
    assert [identical_text(r["identical_to_baseline"]) for r in recs] == ["✓", "✗ differs"]
    annotate(recs, greedy=False)
    assert identical_text(recs[1]["identical_to_baseline"]) == "–"


def test_the_endpoints_tooltip_says_when_an_api_key_is_sent(qtbot):
    """It said every endpoint got $OPENAI_API_KEY; a key goes only to an endpoint that names its
    variable (key-env=) or has a keyring entry, and never over plain http:// to another machine."""
    from specplay.app.compare_view import CompareView

    view = CompareView()
    qtbot.addWidget(view)
    tip = view.endpoints_edit.toolTip()
    assert "$OPENAI_API_KEY" not in tip
    for rule in ("the variable its key-env= names", "keyring entry for its exact URL", "never over plain http://"):
        assert rule in tip


def test_compare_at_temperature_above_zero_does_not_claim_identity(window, qtbot):
    window.prompt_panel.temperature.setValue(0.8)
    records = run(qtbot, window.run_compare(["autoregressive", "speculative"]), timeout=60_000)
    assert all(r["identical_to_baseline"] is None for r in records)
    assert window.compare.table.item(1, 1).text() == "–"


# ----------------------------------------------------------------------------------- history and export
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


# ----------------------------------------------------------------------------------- settings
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


# ----------------------------------------------------------------------------------- audit
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


# ------------------------------------------------------------------------------------ tune
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
