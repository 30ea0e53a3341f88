"""The GPU check script runs on the CPU too (tiny shapes), so its code runs in CI."""

import dataclasses

import pytest
import torch

import gpu_check

TINY_FLOAT32 = ["--device", "cpu", "--dtype", "float32", "--scale", "tiny", "--max-new-tokens", "24"]
METHODS = ["autoregressive", "speculative", "prompt_lookup", "lookahead", "medusa", "eagle"]


@pytest.fixture
def steady_sizes(monkeypatch):
    """Prompt lookup and lookahead size their drafts by a timing of the target: on a loaded machine a
    tiny target's timing could keep them from drafting anything worth accepting. Lookahead gets the
    nearly flat curve of the GPU the check is for (its window's 15 rows then pay). (The check runs
    EAGLE's trees unsized, as it runs `speculative`'s γ fixed: a random head's nodes seldom pay.)"""
    import specplay.core.methods.lookahead
    import specplay.core.methods.prompt_lookup
    from specplay import core
    from specplay.core.decoding.costmodel import CostCurve

    monkeypatch.setattr(core.methods.prompt_lookup, "cost_curve", lambda model: CostCurve.linear(0.05))
    monkeypatch.setattr(core.methods.lookahead, "cost_curve", lambda model: CostCurve.linear(0.01))


def test_float32_is_identical_for_every_method_and_the_cost_curve_is_reported(tmp_path, steady_sizes):
    report = gpu_check.main(TINY_FLOAT32 + ["--out", str(tmp_path / "report.json")])
    assert [m["method"] for m in report["methods"]] == METHODS
    assert all(m["identical"] and m["first_difference"] is None for m in report["methods"]), report["methods"]
    # Identity says something about a method's accepted path only where it accepted drafts.
    assert all(m["accepted"] > 0 and m["tau"] > 1 for m in report["methods"][1:]), report["methods"]
    curve = report["verify_cost"]
    assert set(curve) == {str(k) for k in gpu_check.COST_SIZES} | {"T1_ms"} and curve["1"] == 1.0
    assert (tmp_path / "report.json").is_file()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_half_precision_paths_run_every_method(dtype, steady_sizes):
    """Whether they match is what the check reports; here every method must run to its end, draft
    and report (drafts sized on a fixed curve: a tiny model's timing, kept once measured, may be one
    taken on a busy machine)."""
    report = gpu_check.main(["--device", "cpu", "--dtype", dtype, "--scale", "tiny", "--max-new-tokens", "16"])
    assert [m["method"] for m in report["methods"]] == METHODS
    assert all(m["error"] is None and m["tokens_per_s"] > 0 for m in report["methods"])
    assert all(m["drafted"] > 0 for m in report["methods"][1:])


def break_third_step(monkeypatch, culprit: str, how: str) -> dict:
    """Make every run of the method ``culprit`` go wrong at its third step.

    ``how``: "wrong token" commits a token the target did not choose; "out of memory" ends the
    run there, as the engine does when an allocation fails. Returns a dict whose "at" is, once
    the check has run, the output position where the culprit's last run went wrong.
    """
    import specplay.core.decoding.engine
    from specplay import core
    state = {"method": None}
    real_build, real_verify = gpu_check.build_method, core.decoding.engine.verify
    real_generate = core.decoding.engine.generate

    def build_method(name, *args):
        state["method"] = name
        return real_build(name, *args)

    def generate(*args, **kwargs):
        state.update(step=0, committed=0)
        return real_generate(*args, **kwargs)

    def verify(draft, target_logits, *args, **kwargs):
        verdict = real_verify(draft, target_logits, *args, **kwargs)
        if state["method"] == culprit and state["step"] == 2:
            state["at"] = state["committed"]
            if how == "out of memory":
                raise torch.OutOfMemoryError("CUDA out of memory")
            state["at"] += len(verdict.accepted)
            verdict = dataclasses.replace(verdict, next_token=(verdict.next_token + 1) % target_logits.shape[-1])
        state["step"] += 1
        state["committed"] += len(verdict.accepted) + 1
        return verdict

    monkeypatch.setattr(gpu_check, "build_method", build_method)
    monkeypatch.setattr(core.decoding.engine, "generate", generate)  # each run, warm-up included, starts afresh
    monkeypatch.setattr(core.decoding.engine, "verify", verify)
    return state


@pytest.mark.parametrize("culprit", ["eagle", "autoregressive"])
def test_the_check_reports_a_method_that_emits_a_wrong_token_where_it_does(monkeypatch, culprit):
    """Every method is compared with autoregressive's output: a wrong eagle token flags eagle
    alone, a wrong autoregressive token flags every other method, at the same position."""
    broken = break_third_step(monkeypatch, culprit, "wrong token")
    report = gpu_check.main(TINY_FLOAT32)
    assert broken.get("at"), "the culprit's run never reached a third step"
    if culprit == "autoregressive":
        want = {name: broken["at"] for name in METHODS} | {culprit: None}
    else:
        want = {name: None for name in METHODS} | {culprit: broken["at"]}
    assert {m["method"]: m["first_difference"] for m in report["methods"]} == want
    assert {m["method"]: m["identical"] for m in report["methods"]} == {n: at is None for n, at in want.items()}


def test_a_run_cut_short_is_reported_where_it_ends(monkeypatch):
    """Out of memory at full size ends a run early; the tokens it kept agree with autoregressive's,
    yet it is not identical, and the report says where it ends and why."""
    broken = break_third_step(monkeypatch, "medusa", "out of memory")
    report = gpu_check.main(TINY_FLOAT32)
    assert broken.get("at"), "the culprit's run never reached a third step"
    row = next(m for m in report["methods"] if m["method"] == "medusa")
    assert not row["identical"] and row["first_difference"] == broken["at"]
    assert "out of memory" in row["error"]


def test_every_token_of_every_method_names_its_proposer(steady_sizes):
    report = gpu_check.main(TINY_FLOAT32)
    rows = {m["method"]: m for m in report["methods"]}
    assert all(m["unsourced"] == 0 for m in rows.values()), rows
    drafters = {"speculative": "draft model", "prompt_lookup": "copy", "lookahead": "lookahead pool",
                "medusa": "Medusa head 1", "eagle": "EAGLE level 1"}
    assert set(rows["autoregressive"]["sources"]) == {"target"}
    for name, first in drafters.items():
        sources = rows[name]["sources"]
        assert sum(sources.values()) == 24 and first in sources, (name, sources)
        drafted = {s for s in sources if s not in ("target", "bonus")}
        assert sum(sources[s] for s in drafted) == rows[name]["accepted"], (name, sources)
