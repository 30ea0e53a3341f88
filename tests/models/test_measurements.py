"""The int8 kernel is chosen by measurement on the machine, among engines proved row-exact."""

import pytest
import torch

from specplay.core.kernels import linear

from specplay.core.models import measurements


def test_the_report_proves_each_engine_row_exact_and_times_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    before = torch.backends.quantized.engine
    report = measurements._engine_report()
    assert torch.backends.quantized.engine == before  # measuring leaves the process as it was
    # Each engine is proved on every shape of PROVED_SHAPES (onednn was exact on the 1536-wide layer
    # and not on a 64-wide one, on an Intel Xeon): only the exact ones are timed.
    assert report and any(r["exact"] for r in report.values())
    assert all(set(r["ms"]) == {"1", "8", "16"} and min(r["ms"].values()) > 0 for r in report.values() if r["exact"])
    assert all(not r["ms"] for r in report.values() if not r["exact"])


def _inexact_at(monkeypatch, rows: int, engine: str | None = None):
    """The int8 layer's result for a block of ``rows`` rows (with ``engine`` only, if named) is off
    by one unit in the last place: that engine is not row-exact at that size."""
    real = linear.Int8RowExactLinear.__call__

    def call(self, x):
        y = real(self, x)
        if x.shape[0] == rows and engine in (None, torch.backends.quantized.engine):
            y = torch.nextafter(y, torch.full_like(y, float("inf")))
        return y

    monkeypatch.setattr(linear.Int8RowExactLinear, "__call__", call)


def test_an_engine_that_is_not_row_exact_is_never_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    _inexact_at(monkeypatch, 8, engine=torch.backends.quantized.engine)  # torch's default, chosen on a tie
    chosen = measurements.quant_engine()
    assert chosen is not None and chosen != torch.backends.quantized.engine
    assert f"{torch.backends.quantized.engine} not row-exact" in measurements.describe_quant_engine()


def test_where_no_engine_is_row_exact_none_is_chosen_and_the_reason_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    # Without the pinning columns the kernel takes its scale from the whole block: not row-exact.
    monkeypatch.setattr(linear, "_PINS", torch.zeros(2))
    before = torch.backends.quantized.engine
    assert measurements.quant_engine() is None
    assert measurements.use_fastest_quant_engine() is None and torch.backends.quantized.engine == before
    why = measurements.why_no_exact_engine()
    assert why.startswith(f"no int8 kernel here is row-exact for blocks of 1 to {measurements.VERIFY_ROWS} rows")
    assert "x86: not row-exact" in why
    assert measurements.describe_quant_engine().startswith("int8 kernel none row-exact")


def test_exactness_is_proved_up_to_the_largest_verification_block(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    _inexact_at(monkeypatch, measurements.VERIFY_ROWS)
    assert not any(r["exact"] for r in measurements._engine_report().values())


def test_the_proved_rows_cover_every_methods_default_verification_block():
    from specplay.core.methods import medusa
    from specplay.core.methods.eagle import EagleConfig
    from specplay.core.methods.lookahead import Lookahead, LookaheadConfig
    from specplay.core.methods.prompt_lookup import PromptLookupConfig
    from specplay.core.methods.speculative import SpeculativeConfig

    # Each block is the root and the draft's nodes (lookahead's window rows included).
    blocks = {"medusa": medusa._AUTO_MAX + 1, "eagle": EagleConfig().total_tokens + 1,
              "lookahead": Lookahead(LookaheadConfig()).max_draft_nodes + 1,
              "prompt_lookup": PromptLookupConfig().num_tokens + 1, "speculative": SpeculativeConfig().max_gamma + 1}
    assert max(blocks.values()) == measurements.VERIFY_ROWS, blocks


def test_a_target_runs_in_float32_where_no_int8_kernel_is_row_exact(tmp_path, monkeypatch):
    from specplay.core.errors import ModelError
    from specplay.core.models import load_model
    from tiny import save_tiny_model

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measured"))
    monkeypatch.setattr(linear, "_PINS", torch.zeros(2))
    folder = save_tiny_model(tmp_path / "m", seed=4)
    loaded = load_model(str(folder), device="cpu")
    assert loaded.model.storage == "float" and loaded.model.info.dtype == "float32"
    assert any(n.startswith("no int8 kernel here is row-exact") and "float32 storage" in n for n in loaded.notes)
    with pytest.raises(ModelError, match="no int8 kernel here is row-exact.*--dtype float32"):
        load_model(str(folder), device="cpu", dtype="int8")


def test_the_fastest_exact_engine_wins_and_is_measured_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    calls = []
    monkeypatch.setattr(measurements, "_DEFAULT_ENGINE", "x86")
    fake = {"x86": {"exact": True, "ms": {"1": 0.2, "8": 0.6, "16": 1.4}},
            "fbgemm": {"exact": False, "ms": {}},
            "onednn": {"exact": True, "ms": {"1": 0.2, "8": 0.5, "16": 1.0}}}
    monkeypatch.setattr(measurements, "_engine_report", lambda progress=None: calls.append(1) or fake)
    assert measurements.quant_engine() == "onednn"
    assert measurements.quant_engine() == "onednn" and len(calls) == 1
    line = measurements.describe_quant_engine()
    assert line.startswith("int8 kernel onednn") and "fbgemm not row-exact" in line


def test_a_tie_keeps_torchs_default_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    monkeypatch.setattr(measurements, "_DEFAULT_ENGINE", "x86")
    fake = {"x86": {"exact": True, "ms": {"1": 0.34, "8": 0.37, "16": 0.68}},
            "fbgemm": {"exact": True, "ms": {"1": 0.33, "8": 0.37, "16": 0.68}}}
    monkeypatch.setattr(measurements, "_engine_report", lambda progress=None: fake)
    assert measurements.quant_engine() == "x86"


@pytest.mark.parametrize("kept", [["x86"], {"x86": "fast"}, {"x86": {"exact": True}},
                                  {"x86": {"exact": "yes", "ms": {}}}, {"x86": {"exact": True, "ms": {"1": "fast"}}}])
def test_a_malformed_measurement_is_measured_again_not_a_traceback(tmp_path, monkeypatch, kept):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    measurements.write_table(measurements._file(), {f"{measurements.machine_key()}|{measurements.QUANT_KEY}": kept,
                                          f"{measurements.machine_key()}|memory bandwidth": "fast"})
    fake = {"onednn": {"exact": True, "ms": {"1": 0.2, "8": 0.5, "16": 1.0}}}
    monkeypatch.setattr(measurements, "_engine_report", lambda progress=None: fake)
    assert measurements.quant_engine() == "onednn" and measurements.describe_quant_engine().startswith("int8 kernel onednn")
    assert measurements.measured("memory bandwidth", lambda: {"read_gb_per_s": 9.0}) == {"read_gb_per_s": 9.0}
