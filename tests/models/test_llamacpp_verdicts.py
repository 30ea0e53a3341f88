"""What the probe children found is kept only where it is a verdict on the settings, per host, apart
from the user's cache in tests, and forgotten on request. The children here are stand-ins (a Python
one-liner per outcome), so neither llama.cpp nor a model is needed."""

import socket
import sys

import pytest

from specplay.core import cli
from specplay.core.models import llamacpp, measurements
from specplay.core.models.llamacpp import CANDIDATES, LlamaSettings, probe, usable_settings
from specplay.core.paths import cache_dir

_CHILD = {  # one outcome a setting: killed (out of memory?), an import error, SIGILL, a measured cost
    LlamaSettings(True, True): "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    LlamaSettings(True, False): "import specplay_no_such_module",
    LlamaSettings(False, True): "import os, signal; os.kill(os.getpid(), signal.SIGILL)",
    LlamaSettings(False, False): "print('{\"ms_per_token\": 5.0}')",
}


@pytest.fixture
def children(tmp_path, monkeypatch):
    """The settings each stand-in child was run with, in order; verdicts of this test only."""
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measured"))
    monkeypatch.setattr(llamacpp, "build_key", lambda: "a llama.cpp build")
    monkeypatch.setattr(llamacpp, "file_type", lambda gguf: "1")
    tried = []

    def command(gguf, settings, threads):
        tried.append(settings)
        return [sys.executable, "-c", _CHILD[settings]]

    monkeypatch.setattr(llamacpp, "_probe_command", command)
    return tried


def test_only_definite_verdicts_are_kept_and_transient_outcomes_are_probed_again(children, tmp_path):
    settings, results = usable_settings(tmp_path / "m.gguf", threads=1)
    assert settings == LlamaSettings(False, False)
    by = {r.settings: r for r in results}
    assert "SIGKILL" in by[LlamaSettings(True, True)].reason and by[LlamaSettings(True, True)].transient
    assert "ModuleNotFoundError" in by[LlamaSettings(True, False)].reason and by[LlamaSettings(True, False)].transient
    assert not by[LlamaSettings(False, True)].transient and not by[LlamaSettings(False, False)].transient
    kept = llamacpp._read_verdicts()
    assert len(kept) == 2 and all(key.endswith(("extra buffers off, flash attention on",
                                                "extra buffers off, flash attention off")) for key in kept)
    again, results = usable_settings(tmp_path / "m.gguf", threads=1)
    assert again == settings and children[len(CANDIDATES):] == [LlamaSettings(True, True), LlamaSettings(True, False)]
    assert "SIGILL" in {r.settings: r for r in results}[LlamaSettings(False, True)].reason  # read back


def test_a_probe_past_its_time_is_transient(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "_probe_command", lambda *a: [sys.executable, "-c", "import time; time.sleep(30)"])
    result = probe(tmp_path / "m.gguf", LlamaSettings(), threads=1, timeout=0.5)
    assert not result.ok and result.transient and result.reason.startswith("did not finish within")


def test_verdicts_and_measurements_are_kept_per_host(children, tmp_path, monkeypatch):
    usable_settings(tmp_path / "m.gguf", threads=1)
    measurements.measured("memory bandwidth", lambda: {"read_gb_per_s": 9.0})
    probed = len(children)
    monkeypatch.setattr(socket, "gethostname", lambda: "a-copy-of-this-home-elsewhere")
    usable_settings(tmp_path / "m.gguf", threads=1)
    assert len(children) == probed + len(CANDIDATES)  # another host: nothing read back
    assert not measurements.has_measured("memory bandwidth")


def test_models_measure_forgets_this_hosts_measurements_and_measures_the_int8_kernels_again(
        children, tmp_path, monkeypatch, capsys):
    """It also times the default draft's engines against each other (what a first load skips)."""
    from specplay.core.models import loader
    from specplay.core.weights.catalog import DEFAULT_DRAFT

    compared = []
    monkeypatch.setattr(loader, "compare_draft_engines", lambda model_id, progress=None: compared.append(model_id)
                        or ["weights: ...", "draft engine native kquant-draft: 20.0 ms/token against llama.cpp's 30.0"])
    usable_settings(tmp_path / "m.gguf", threads=1)
    measurements.measured("memory bandwidth", lambda: {"read_gb_per_s": 9.0})
    other = {"another host [0] torch 2 1 threads|memory bandwidth": {"read_gb_per_s": 1.0}}
    measurements.write_table(measurements._file(), {**measurements._read(), **other})
    fake = {"x86": {"exact": True, "ms": {"1": 0.2, "8": 0.6, "16": 1.4}}}
    monkeypatch.setattr(measurements, "_engine_report", lambda progress=None: fake)
    assert cli.main(["models", "measure"]) == 0
    out = capsys.readouterr().out
    assert "forgot 1 measurement and 2 llama.cpp verdicts of this machine" in out
    assert "int8 kernel x86" in out
    if llamacpp.available() is None:
        assert compared == [DEFAULT_DRAFT] and f"{DEFAULT_DRAFT}: draft engine native kquant-draft: 20.0" in out
    else:
        assert compared == [] and "measured again on the next load" in out
    assert llamacpp._read_verdicts() == {} and not measurements.has_measured("memory bandwidth")
    assert measurements.has_measured(measurements.QUANT_KEY) and other.keys() <= measurements._read().keys()


def test_tests_keep_their_measurements_out_of_the_model_cache():
    assert not measurements._file().is_relative_to(cache_dir())
    assert not llamacpp._probe_file().is_relative_to(cache_dir())


def _prefix() -> str:
    return f"{measurements.machine_key()}|a llama.cpp build|type 1|1 llama.cpp threads|"


MALFORMED = {  # what a damaged or hand-edited verdict file may hold instead of a verdict, setting by setting
    LlamaSettings(True, True): {"settings": {"extra_buffers": True}, "ok": True, "ms_per_token": 1.0},
    LlamaSettings(True, False): ["not", "a", "verdict"],
    LlamaSettings(False, True): {"settings": {"extra_buffers": False, "flash_attn": True}, "ok": "yes"},
    LlamaSettings(False, False): {"settings": {"extra_buffers": False, "flash_attn": False}, "ok": True,
                                  "ms_per_token": "fast"},
}


def test_entries_of_a_malformed_verdict_file_are_dropped_and_probed_again(children, tmp_path):
    llamacpp._probe_file().parent.mkdir(parents=True)
    llamacpp._probe_file().write_text("[1, 2, 3]")  # valid JSON, not a table
    assert usable_settings(tmp_path / "m.gguf", threads=1)[0] == LlamaSettings(False, False)
    assert len(children) == len(CANDIDATES)
    table = {_prefix() + s.label: entry for s, entry in MALFORMED.items()}
    measurements.write_table(llamacpp._probe_file(), table)
    assert llamacpp.known_verdicts() == []
    settings, results = usable_settings(tmp_path / "m.gguf", threads=1)
    assert settings == LlamaSettings(False, False) and len(children) == 2 * len(CANDIDATES)
    assert [r.settings for r in results] == list(CANDIDATES)


def test_the_settings_of_a_verdict_must_be_those_of_its_key(children, tmp_path):
    usable_settings(tmp_path / "m.gguf", threads=1)
    table = llamacpp._read_verdicts()
    ok = table[_prefix() + "extra buffers off, flash attention off"]
    table[_prefix() + "extra buffers off, flash attention on"] = ok  # the ok of another setting
    measurements.write_table(llamacpp._probe_file(), table)
    _, results = usable_settings(tmp_path / "m.gguf", threads=1)
    assert "SIGILL" in {r.settings: r for r in results}[LlamaSettings(False, True)].reason  # probed again


def test_models_list_reads_a_malformed_verdict_file_without_a_traceback(children, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp, "available", lambda: None)
    usable_settings(tmp_path / "m.gguf", threads=1)
    table = llamacpp._read_verdicts()
    table.update({_prefix() + s.label: entry for s, entry in MALFORMED.items() if s.extra_buffers})
    table[measurements.machine_key() + "|no build or settings"] = {"ok": True, "ms_per_token": 1.0}
    measurements.write_table(llamacpp._probe_file(), table)
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "type 1|1 llama.cpp threads|extra buffers off, flash attention off: ok, 5.0 ms/token" in out
    assert "extra buffers off, flash attention on: died by SIGILL" in out and "extra buffers on" not in out
