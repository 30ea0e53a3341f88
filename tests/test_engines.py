"""The int8 kernel is chosen by measurement on the machine, among engines proved row-exact."""

import torch

from specplay.core.models import engines, linear


def test_the_report_proves_each_engine_row_exact_and_times_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path))
    before = torch.backends.quantized.engine
    report = engines._engine_report()
    assert torch.backends.quantized.engine == before  # measuring leaves the process as it was
    assert report and all(r["exact"] for r in report.values())
    assert all(set(r["ms"]) == {"1", "8", "16"} and min(r["ms"].values()) > 0 for r in report.values())


def test_an_engine_that_is_not_row_exact_is_never_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path))
    # Without the pinning columns the kernel takes its scale from the whole block: not row-exact.
    monkeypatch.setattr(linear, "_PINS", torch.zeros(2))
    report = engines._engine_report()
    assert report and not any(r["exact"] for r in report.values())


def test_the_fastest_exact_engine_wins_and_is_measured_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(engines, "_DEFAULT_ENGINE", "x86")
    fake = {"x86": {"exact": True, "ms": {"1": 0.2, "8": 0.6, "16": 1.4}},
            "fbgemm": {"exact": False, "ms": {}},
            "onednn": {"exact": True, "ms": {"1": 0.2, "8": 0.5, "16": 1.0}}}
    monkeypatch.setattr(engines, "_engine_report", lambda progress=None: calls.append(1) or fake)
    assert engines.quant_engine() == "onednn"
    assert engines.quant_engine() == "onednn" and len(calls) == 1
    line = engines.describe_quant_engine()
    assert line.startswith("int8 kernel onednn") and "fbgemm not row-exact" in line


def test_a_tie_keeps_torchs_default_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(engines, "_DEFAULT_ENGINE", "x86")
    fake = {"x86": {"exact": True, "ms": {"1": 0.34, "8": 0.37, "16": 0.68}},
            "fbgemm": {"exact": True, "ms": {"1": 0.33, "8": 0.37, "16": 0.68}}}
    monkeypatch.setattr(engines, "_engine_report", lambda progress=None: fake)
    assert engines.quant_engine() == "x86"
