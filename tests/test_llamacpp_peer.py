"""llama.cpp as a benchmark peer: a clear message without the extra; a real run with it."""

import sys

import pytest

from core.bench import LlamaCppPeer, gguf_file
from core.errors import ConfigError


def test_without_the_peers_extra_the_message_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[peers\]"'):
        LlamaCppPeer("llamacpp_generate", target=None)


def test_a_target_that_is_not_a_gguf_file_is_refused_clearly():
    class Folder:
        spec = "/some/model-folder"

    with pytest.raises(ConfigError, match="need a GGUF file"):
        gguf_file(Folder())


@pytest.mark.real_model
def test_llamacpp_decodes_the_default_target_in_the_bench(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e \".[peers]\")")
    from core.bench import BenchSpec, Question, run_bench
    from core.models import load_model
    from core.models.catalog import DEFAULT_TARGET, get_entry

    if not get_entry(DEFAULT_TARGET).installed():
        pytest.skip("the default target is not installed")
    target = load_model(DEFAULT_TARGET, "cpu")
    spec = BenchSpec(methods=["autoregressive", "llamacpp_generate", "llamacpp_prompt_lookup"], max_new_tokens=12)
    result = run_bench(target, None, [Question(1, "code", ("Write a Python function that adds two numbers.",))], spec,
                       tmp_path, log=lambda m: None)
    for peer in ("llamacpp_generate", "llamacpp_prompt_lookup"):
        entry = result["summary"][peer]["overall"]
        assert entry["tokens_per_s"] > 0 and entry["time_to_first_token"] > 0 and entry["failures"] == 0
