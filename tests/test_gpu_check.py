"""The GPU check script runs on the CPU too (tiny shapes), so its code runs in CI."""

import pytest

import gpu_check


def test_float32_is_identical_for_every_method_and_the_cost_curve_is_reported(tmp_path):
    report = gpu_check.main(["--device", "cpu", "--dtype", "float32", "--scale", "tiny", "--max-new-tokens", "24",
                             "--out", str(tmp_path / "report.json")])
    assert [m["method"] for m in report["methods"]] == ["autoregressive", "speculative", "prompt_lookup", "lookahead",
                                                        "medusa", "eagle"]
    assert all(m["identical"] for m in report["methods"]), report["methods"]
    assert any(m["tau"] > 1 for m in report["methods"][1:]), "no method accepted a draft: nothing was verified"
    curve = report["verify_cost"]
    assert set(curve) == {str(k) for k in gpu_check.COST_SIZES} | {"T1_ms"} and curve["1"] == 1.0
    assert (tmp_path / "report.json").is_file()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_half_precision_paths_run_every_method(dtype):
    """Whether they match is what the check reports; here every method must run and report."""
    report = gpu_check.main(["--device", "cpu", "--dtype", dtype, "--scale", "tiny", "--max-new-tokens", "16"])
    assert len(report["methods"]) == 6 and report["methods"][0]["identical"]
    assert all(m["tokens_per_s"] > 0 for m in report["methods"])
