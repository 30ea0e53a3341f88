"""llama.cpp as a benchmark peer: a clear message without the extra; a real run with it."""

import sys

import pytest

from specplay.core.errors import ConfigError
from specplay.core.measure.peers import LlamaCppPeer, gguf_file


def test_without_the_peers_extra_the_message_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[peers\]"'):
        LlamaCppPeer("llamacpp_generate", target=None)


def test_a_target_that_is_not_a_gguf_file_is_refused_clearly():
    class Folder:
        model_id = "/some/model-folder"

    with pytest.raises(ConfigError, match="need a GGUF file"):
        gguf_file(Folder())


@pytest.mark.real_model
def test_llamacpp_decodes_the_default_target_in_the_bench(tmp_path):
    from conftest import require_or_skip
    from specplay.core.measure.bench import BenchSpec, run_bench
    from specplay.core.measure.prompts import Question
    from specplay.core.models import load_model
    from specplay.core.weights.catalog import DEFAULT_TARGET, get_entry
    from tiny import need_llama_cpp

    need_llama_cpp()
    if not get_entry(DEFAULT_TARGET).installed():
        require_or_skip("SPECPLAY_REQUIRE_REAL_MODELS", "the default target is not installed")
    target = load_model(DEFAULT_TARGET, "cpu")
    spec = BenchSpec(methods=["autoregressive", "llamacpp_generate", "llamacpp_prompt_lookup"], max_new_tokens=12)
    result = run_bench(target, None, [Question(1, "code", ("Write a Python function that adds two numbers.",))], spec,
                       tmp_path, log=lambda m: None)
    # The prompt-lookup peer needs llama.cpp's extra buffers (llama_cpp.Llama always uses them):
    # where a child died with them (an Intel Xeon guest that lists AMX: SIGILL) it is refused
    # with that reason, and only there.
    from torch import get_num_threads

    from specplay.core.measure.peers import gguf_file
    from specplay.core.models.llamacpp import fastest_safe, usable_settings

    _, probes = usable_settings(gguf_file(target), get_num_threads())  # the verdicts the bench just used
    unsafe = fastest_safe(probes, extra_buffers=True) is None
    for peer in ("llamacpp_generate", "llamacpp_prompt_lookup"):
        entry = result["summary"][peer]["overall"]
        if peer == "llamacpp_prompt_lookup" and unsafe:
            assert entry["failures"] == 1 and "unsafe on this CPU with extra buffers on" in entry["errors"][0]
            continue
        assert entry["tokens_per_s"] > 0 and entry["time_to_first_token"] > 0 and entry["failures"] == 0


def _tiny_target(tmp_path):
    import torch

    from tiny import loaded, native_from_hf, need_llama_cpp, tiny_hf_model, write_tiny_gguf

    need_llama_cpp()
    model = tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, path)
    return loaded(native_from_hf(model), model_id=str(path))


def test_llamacpp_generate_decodes_greedily_and_survives_a_crashing_setting(tmp_path, monkeypatch):
    import torch

    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.errors import ModelError
    from test_llamacpp_guard import _crash_with_extra_buffers

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measured"))  # verdicts of this test only
    target = _tiny_target(tmp_path)
    _crash_with_extra_buffers(monkeypatch)
    peer = LlamaCppPeer("llamacpp_generate", target)
    assert "SIGILL" in peer.params()["engine"]
    gen = GenerationConfig(max_new_tokens=10, stop_at_eos=False)
    turn = peer.run([5, 9, 13, 4], gen)
    # llama.cpp keeps its cache in float16, the native reference is float64: the same argmax chain.
    ids, expected = [5, 9, 13, 4], []
    for _ in range(10):
        target.model.reset()
        expected.append(int(target.model.forward(torch.tensor(ids + expected)).logits[-1].argmax()))
    assert turn.token_ids == expected
    # The prompt-lookup peer needs llama_cpp.Llama, which always uses the extra buffers that crash here.
    with pytest.raises(ModelError, match="unsafe on this CPU.*SIGILL"):
        LlamaCppPeer("llamacpp_prompt_lookup", target)
