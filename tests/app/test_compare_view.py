"""The Compare view, the endpoints beside it, and Why this speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app_window import model_dirs, run, window  # noqa: F401 (model_dirs: the window fixture's)
from PySide6.QtCore import Qt
from specplay.core.decoding.types import StepEvent, StepTiming


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
