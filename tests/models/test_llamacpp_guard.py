"""llama.cpp never takes the process down: a child tries each setting first, and a child that
dies by a signal leads to the next setting, or to the native draft, with the reason said."""

import signal
import sys

import pytest
import torch

from specplay.core.errors import ModelError
from specplay.core.models import llamacpp, loader
from specplay.core.models.llamacpp import LlamaCppFileError, LlamaSettings, probe, usable_settings
from specplay.core.weights.cache import DRAFT_GGUF
from specplay.core.weights.prepare import prepare_draft_gguf
from tiny import need_llama_cpp, tiny_hf_model, write_tiny_gguf

_DIE_BY_SIGILL = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"]


@pytest.fixture
def model():
    return tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64)


@pytest.fixture
def gguf(model, tmp_path, monkeypatch):
    need_llama_cpp()
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measured"))  # verdicts of this test only
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, path)
    return path


def _crash_with_extra_buffers(monkeypatch, crash_all: bool = False) -> list[LlamaSettings]:
    """Children die by SIGILL with llama.cpp's extra buffers (or always), as on an AMX guest."""
    tried = []
    real = llamacpp._probe_command

    def command(gguf, settings, threads):
        tried.append(settings)
        return _DIE_BY_SIGILL if (settings.extra_buffers or crash_all) else real(gguf, settings, threads)

    monkeypatch.setattr(llamacpp, "_probe_command", command)
    return tried


def test_a_probe_decodes_in_a_child_and_measures_its_cost(gguf):
    result = probe(gguf, LlamaSettings(False), threads=1)
    assert result.ok and 0 < result.ms_per_token < 1000, result


def test_a_child_killed_by_sigill_is_reported_and_the_next_setting_is_used_once(gguf, monkeypatch):
    tried = _crash_with_extra_buffers(monkeypatch)
    settings, results = usable_settings(gguf, threads=1)
    assert settings.extra_buffers is False
    crashed = [r for r in results if r.settings.extra_buffers]
    assert len(crashed) == 2 and all(not r.ok and "SIGILL" in r.reason and "does not allow" in r.reason
                                     for r in crashed)
    assert all(r.ok for r in results if not r.settings.extra_buffers)
    assert "extra buffers on, flash attention on: died by SIGILL" in llamacpp.describe(results)
    again, _ = usable_settings(gguf, threads=1)  # the verdicts are kept: no child this time
    assert again == settings and len(tried) == len(llamacpp.CANDIDATES)


def _damaged(whole: bytes) -> dict[str, bytes]:
    """A GGUF file's damage patterns: truncated at a few sizes (inside its header, its metadata and
    its tensors), a garbage header, nothing at all."""
    return {"truncated at 24 bytes": whole[:24], "truncated at 100 bytes": whole[:100],
            "truncated at 1000 bytes": whole[:1000], "truncated to half": whole[: len(whole) // 2],
            "zeros after the magic": b"GGUF" + bytes(64), "no magic": b"NOTAGGUF" * 16,
            "garbage after the version": b"GGUF\x03\x00\x00\x00" + b"\xff" * 100, "empty": b""}


@pytest.mark.parametrize("damage", list(_damaged(b"")))
def test_a_damaged_file_is_an_error_not_a_verdict(model, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measured"))
    monkeypatch.setattr(llamacpp, "build_key", lambda: "a llama.cpp build")  # the header is read without it
    children = []
    monkeypatch.setattr(llamacpp, "_probe_command", lambda *a: children.append(a) or _DIE_BY_SIGILL)
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(model, whole)
    assert llamacpp.file_type(whole) == "0"  # all float32
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_damaged(whole.read_bytes())[damage])
    with pytest.raises(LlamaCppFileError, match=r"^cannot read the GGUF header of .*bad\.gguf: "):
        usable_settings(bad, threads=1)
    assert not children and not (tmp_path / "measured" / "llamacpp-probes.json").exists()


def test_the_draft_runs_without_extra_buffers_where_they_crash(model, gguf, tmp_path, monkeypatch):
    _crash_with_extra_buffers(monkeypatch)
    folder = tmp_path / "entry"
    folder.mkdir()
    prepare_draft_gguf(gguf, folder)
    notes = []
    draft = loader._draft_on_llamacpp(str(gguf), folder, model.config, (2,), "int8-draft", "llamacpp", notes,
                                      lambda *a: None)
    assert draft.settings.extra_buffers is False
    assert "extra buffers off" in notes[0] and "SIGILL" in notes[0]
    assert draft.forward_chain([5, 9, 13], logit_rows=[2]).logits.shape == (1, 64)


def test_where_every_setting_crashes_the_native_draft_runs_and_says_why(model, gguf, tmp_path, monkeypatch):
    _crash_with_extra_buffers(monkeypatch, crash_all=True)
    folder = tmp_path / "entry"
    folder.mkdir()
    prepare_draft_gguf(gguf, folder)
    assert (folder / DRAFT_GGUF).is_file()
    notes = []
    assert loader._draft_on_llamacpp(str(gguf), folder, model.config, (2,), "int8-draft", "auto", notes,
                                     lambda *a: None) is None
    assert "unsafe on this CPU" in notes[0] and "SIGILL" in notes[0] and "own int8-draft layers" in notes[0]
    with pytest.raises(ModelError, match="unsafe on this CPU"):  # asked for by name: a clear error
        loader._draft_on_llamacpp(str(gguf), folder, model.config, (2,), "int8-draft", "llamacpp", [],
                                  lambda *a: None)


def test_signal_names_and_exit_codes_read_as_words():
    assert "SIGILL" in llamacpp.exit_reason(-signal.SIGILL)
    assert "SIGKILL" in llamacpp.exit_reason(-signal.SIGKILL) and "memory" in llamacpp.exit_reason(-9)
    assert llamacpp.exit_reason(1) == "exited with code 1"


def test_the_servers_defaults_are_called_unsafe_where_their_child_died(gguf, monkeypatch):
    assert llamacpp.defaults_unsafe(gguf, threads=1) is None
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(gguf.parent / "measured-elsewhere"))
    _crash_with_extra_buffers(monkeypatch)
    assert "extra buffers on, flash attention on: died by SIGILL" in llamacpp.defaults_unsafe(gguf, threads=1)


def test_the_frozen_app_runs_the_probe_child_through_its_own_executable(gguf, monkeypatch, capsys):
    import json

    from specplay.app.launcher import main

    monkeypatch.setattr(sys, "frozen", True, raising=False)
    command = llamacpp._probe_command(gguf, LlamaSettings(False), 1)
    assert command[:2] == [sys.executable, llamacpp.PROBE_ARGUMENT] and "-m" not in command
    # What that executable does with it (extra buffers off: safe to run in this process).
    assert main(command[1:]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ms_per_token"] > 0
