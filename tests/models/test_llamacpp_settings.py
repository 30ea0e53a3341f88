"""Which llama.cpp settings a peer opens a file with, decided from the probe children's verdicts alone
(no llama.cpp, no model: the verdict tables are written out here)."""

import pytest

from specplay.core.measure.peers import LlamaCppPeer
from specplay.core.errors import ModelError
from specplay.core.models.llamacpp import LlamaSettings, ProbeResult

ON_ON, ON_OFF, OFF_ON, OFF_OFF = (LlamaSettings(True, True), LlamaSettings(True, False),
                                  LlamaSettings(False, True), LlamaSettings(False, False))
SIGILL = "died by SIGILL (an instruction this CPU or its hypervisor does not allow)"


def _ok(settings, ms):
    return ProbeResult(settings, True, ms_per_token=ms)


def _failed(settings, reason=SIGILL):
    return ProbeResult(settings, False, reason=reason)


#: The AMD EPYC (family 25, AVX2) table: every setting survived, extra buffers off the fastest.
ALL_SAFE = [_ok(ON_ON, 62.6), _ok(ON_OFF, 65.9), _ok(OFF_ON, 60.5), _ok(OFF_OFF, 63.0)]
EXTRA_UNSAFE = [_failed(ON_ON), _failed(ON_OFF), _ok(OFF_ON, 60.5), _ok(OFF_OFF, 63.0)]
ALL_UNSAFE = [_failed(s) for s in (ON_ON, ON_OFF, OFF_ON, OFF_OFF)]
TRANSIENT = [_failed(ON_ON, "did not finish within 180 s"), _ok(ON_OFF, 65.9), _ok(OFF_ON, 60.5),
             _ok(OFF_OFF, 63.0)]


def test_where_every_setting_survived_prompt_lookup_takes_the_fastest_with_extra_buffers():
    assert LlamaCppPeer.settings_for("llamacpp_prompt_lookup", ALL_SAFE) == ON_ON
    assert LlamaCppPeer.settings_for("llamacpp_generate", ALL_SAFE) == OFF_ON


def test_where_extra_buffers_crash_prompt_lookup_refuses_and_plain_decoding_runs_without_them():
    with pytest.raises(ModelError, match="llamacpp_prompt_lookup: llama.cpp is unsafe on this CPU with extra "
                                         "buffers on, which llama_cpp.Llama always uses") as err:
        LlamaCppPeer.settings_for("llamacpp_prompt_lookup", EXTRA_UNSAFE)
    assert "extra buffers on, flash attention on: died by SIGILL" in str(err.value)
    assert LlamaCppPeer.settings_for("llamacpp_generate", EXTRA_UNSAFE) == OFF_ON


def test_where_every_setting_crashes_both_peers_refuse_with_the_reasons():
    for name in ("llamacpp_generate", "llamacpp_prompt_lookup"):
        with pytest.raises(ModelError, match=f"{name}: llama.cpp is unsafe on this CPU") as err:
            LlamaCppPeer.settings_for(name, ALL_UNSAFE)
        assert "extra buffers off, flash attention off: died by SIGILL" in str(err.value)


def test_a_transient_failure_of_one_setting_leaves_the_others_usable():
    assert LlamaCppPeer.settings_for("llamacpp_prompt_lookup", TRANSIENT) == ON_OFF
    assert LlamaCppPeer.settings_for("llamacpp_generate", TRANSIENT) == OFF_ON


def test_the_prompt_lookup_peer_opens_llama_cpp_with_the_flash_attention_its_setting_was_proved_with(
        monkeypatch, tmp_path):
    import sys
    import types

    from specplay.core.measure import peers
    from specplay.core.models import llamacpp

    opened = []
    fake = types.ModuleType("llama_cpp")
    fake.Llama = lambda **kw: opened.append(kw)
    speculative = types.ModuleType("llama_cpp.llama_speculative")
    speculative.LlamaPromptLookupDecoding = lambda **kw: kw
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.setattr(llamacpp, "available", lambda: None)
    monkeypatch.setattr(llamacpp, "usable_settings", lambda gguf, threads: (OFF_ON, TRANSIENT))
    monkeypatch.setattr(peers, "gguf_file", lambda target: tmp_path / "target.gguf")
    peer = LlamaCppPeer("llamacpp_prompt_lookup", target=None)
    assert opened[0]["flash_attn"] is False  # extra buffers on, flash attention off: the one that survived
    assert peer.params()["engine"].startswith("extra buffers on, flash attention off (")
