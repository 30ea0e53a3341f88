"""The llama.cpp draft: SpecPlay's cache interface on llama.cpp, its file, and how the loader picks it.

A tiny random Qwen2 model is written as a float32 GGUF, so llama.cpp and the native decoder
run the same weights: the draft must follow the native model through prefills, partial
commits, crops and a context that outgrows its first size.
"""

import sys

import pytest
import torch

from specplay.core.decoding.engine import drain, generate
from specplay.core.decoding.types import GenerationConfig
from specplay.core.errors import ModelError
from specplay.core.methods import build_method
from specplay.core.methods.speculative import SpeculativeConfig
from specplay.core.models import llamacpp_draft
from specplay.core.models.llamacpp_draft import LlamaCppDraft, load_llamacpp_draft
from specplay.core.weights.cache import DRAFT_GGUF
from specplay.core.weights.prepare import prepare_draft_gguf
from tiny import loaded, native_from_hf, need_llama_cpp, perturbed_copy, tiny_hf_model, write_tiny_gguf


@pytest.fixture
def model():
    return tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64)


@pytest.fixture
def gguf(model, tmp_path):
    need_llama_cpp()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, path)
    return path


def _close(ours: torch.Tensor, native: torch.Tensor) -> None:
    # llama.cpp keeps its cache in float16: close to the float64 reference, same argmax.
    assert (ours.double() - native.double()).abs().max() < 2e-2
    assert int(ours.argmax()) == int(native.argmax())


def test_the_draft_follows_the_native_model_through_commits_crops_and_a_growing_context(model, gguf, monkeypatch):
    monkeypatch.setattr(llamacpp_draft, "_FIRST_CONTEXT", 8)  # grows twice below
    draft = LlamaCppDraft(gguf, "tiny", model.config, (2,), threads=1)
    native = native_from_hf(model)
    assert draft.info.backend == "llama.cpp" and draft.info.dtype == "f32" and draft.info.vocab_size == 64
    assert draft.settings.flash_attn and draft.settings.extra_buffers

    def expect(sequence: list[int]) -> torch.Tensor:
        native.reset()
        return native.forward(torch.tensor(sequence)).logits[-1]

    kept = [5, 9, 13, 4, 22]
    assert draft.forward_chain(kept, logit_rows=[], prefill=True).logits.shape == (0, 64)
    out = draft.forward(torch.tensor([7, 30, 11]), logit_rows=[2]).logits[0]
    _close(out, expect(kept + [7, 30, 11]))
    draft.commit(1)  # keep 7, drop 30 and 11
    kept.append(7)
    assert draft.cache_len == 6
    _close(draft.forward_chain([40, 41, 42, 43], logit_rows=[3]).logits[0], expect(kept + [40, 41, 42, 43]))
    kept += [40, 41, 42, 43]
    draft.crop(7)  # keep 40 only
    kept = kept[:7]
    _close(draft.forward_chain([50] * 12, logit_rows=[11]).logits[0], expect(kept + [50] * 12))
    assert draft.cache_len == 19
    with pytest.raises(NotImplementedError, match="last new token"):
        draft.forward(torch.tensor([1, 2]), logit_rows=[0])
    with pytest.raises(NotImplementedError, match="chain prefixes"):
        draft.commit([0])


def test_speculation_with_the_llama_cpp_draft_emits_greedy_decodings_tokens(model, tmp_path):
    need_llama_cpp()
    target = loaded(native_from_hf(model))
    path = tmp_path / "near.gguf"
    write_tiny_gguf(perturbed_copy(model, 0.05), path)
    draft = loaded(LlamaCppDraft(path, "near", model.config, (2,), threads=1))
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    prompt = [5, 9, 13, 4]
    plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    spec = drain(generate(target.model, target.tokenizer,
                          build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=4), target, draft), prompt, gen))
    assert spec.token_ids == plain.token_ids
    assert spec.metrics.mean_accepted > 1.5  # a near copy drafts tokens the target accepts


def test_a_draft_window_lets_the_draft_read_only_the_prompts_tail(model, gguf):
    target = loaded(native_from_hf(model))
    draft = LlamaCppDraft(gguf, "tiny", model.config, (2,), threads=1)
    gen = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stand_down=False)
    prompt = [5, 9, 13, 4, 22, 7, 30, 11, 40, 41]
    plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=4, draft_window=3), target, loaded(draft))
    fed = []
    forward = draft.forward
    draft.forward = lambda tokens, **kw: fed.append(torch.as_tensor(tokens).tolist()) or forward(tokens, **kw)
    spec = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    assert spec.token_ids == plain.token_ids
    assert fed[0] == prompt[-4:-1]  # the prefill: the window before the root token
    # Whatever was kept lines up with the text from the window's start (prompt[6:]).
    text = prompt + spec.token_ids
    assert draft._tokens == text[6: 6 + len(draft._tokens)] and len(draft._tokens) > 20


def test_the_4_bit_file_is_made_once_and_a_damaged_one_is_made_again(model, gguf, tmp_path, monkeypatch):
    import llama_cpp

    calls = []
    quantize = llama_cpp.llama_model_quantize
    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: calls.append(a) or quantize(*a))
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "draft-q4_0.gguf").write_bytes(b"an earlier version's draft file")
    draft, probes = load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    assert draft.info.dtype == "iq4_nl" and [p.name for p in folder.iterdir()] == [DRAFT_GGUF]
    assert all(p.ok for p in probes)
    load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    assert len(calls) == 1  # the second load reads the kept file
    data = (folder / DRAFT_GGUF).read_bytes()
    (folder / DRAFT_GGUF).write_bytes(data[: len(data) // 2])  # truncated
    again, _ = load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    assert len(calls) == 2 and again.info.dtype == "iq4_nl"
    assert (folder / DRAFT_GGUF).read_bytes() == data


@pytest.mark.parametrize("size", [24, 1000])
def test_a_draft_file_truncated_inside_its_header_is_made_again(model, gguf, tmp_path, size):
    folder = tmp_path / "cache"
    folder.mkdir()
    load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    data = (folder / DRAFT_GGUF).read_bytes()
    (folder / DRAFT_GGUF).write_bytes(data[:size])  # gguf's reader raised IndexError on these
    again, _ = load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    assert again.info.dtype == "iq4_nl" and (folder / DRAFT_GGUF).read_bytes() == data


def test_the_weights_type_is_read_from_llama_cpps_model_description():
    assert llamacpp_draft._file_type("qwen2 1B IQ4_NL - 4.5 bpw") == "iq4_nl"
    assert llamacpp_draft._file_type("qwen2 1B Q4_0") == "q4_0"
    assert llamacpp_draft._file_type("qwen2 ?B all F32") == "f32"


def test_a_failed_quantization_leaves_no_file(gguf, tmp_path, monkeypatch):
    import llama_cpp

    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: 1)
    with pytest.raises(ModelError, match="could not quantize"):
        prepare_draft_gguf(gguf, tmp_path)
    assert list(tmp_path.iterdir()) == [gguf]


def test_the_loader_picks_llama_cpp_only_where_it_can_and_says_why_not(monkeypatch):
    from specplay.core.models import loader

    need_llama_cpp()
    assert loader._llamacpp_draft_unavailable("model.gguf", "cpu", "int4-draft") is None
    assert "quantized drafts on the CPU" in loader._llamacpp_draft_unavailable("model.gguf", "cpu", "float")
    assert "quantized drafts on the CPU" in loader._llamacpp_draft_unavailable("model.gguf", "cuda", "int8-draft")
    assert "GGUF source" in loader._llamacpp_draft_unavailable("/some/hf-folder", "cpu", "int4-draft")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    assert 'pip install -e ".[peers]"' in loader._llamacpp_draft_unavailable("model.gguf", "cpu", "int4-draft")


def test_llama_cpp_never_loads_a_target():
    from specplay.core.models import load_model

    with pytest.raises(ModelError, match="draft models only"):
        load_model("anything", "cpu", backend="llamacpp")


def test_a_context_past_the_models_limit_is_a_clear_error_and_the_draft_stays_usable(model, gguf, monkeypatch):
    monkeypatch.setattr(llamacpp_draft, "_FIRST_CONTEXT", 8)
    model.config.max_position_embeddings = 16
    draft = LlamaCppDraft(gguf, "tiny", model.config, (2,), threads=1)
    draft.forward_chain(list(range(4, 16)), logit_rows=[])
    with pytest.raises(ModelError, match="at most 16 tokens"):
        draft.forward(torch.tensor([5] * 8), logit_rows=[7])
    assert draft.forward_chain([5], logit_rows=[0]).logits.shape == (1, 64)  # still open, same cache


def test_a_context_that_cannot_be_opened_leaves_the_draft_open(model, gguf, monkeypatch):
    monkeypatch.setattr(llamacpp_draft, "_FIRST_CONTEXT", 8)
    draft = LlamaCppDraft(gguf, "tiny", model.config, (2,), threads=1)
    draft.forward_chain([5, 9, 13], logit_rows=[])
    real = llamacpp_draft.LlamaCppSession

    def refuse(*a, **kw):
        raise ModelError("llama.cpp cannot make a context of 16 tokens (out of memory?)")

    monkeypatch.setattr(llamacpp_draft, "LlamaCppSession", refuse)
    with pytest.raises(ModelError, match="cannot make a context"):
        draft.forward(torch.tensor([4] * 8), logit_rows=[7])
    monkeypatch.setattr(llamacpp_draft, "LlamaCppSession", real)
    assert draft.cache_len == 3 and draft.forward_chain([4], logit_rows=[0]).logits.shape == (1, 64)


def test_only_a_file_llama_cpp_cannot_read_is_quantized_again(model, gguf, tmp_path, monkeypatch):
    import llama_cpp

    calls = []
    quantize = llama_cpp.llama_model_quantize
    monkeypatch.setattr(llama_cpp, "llama_model_quantize", lambda *a: calls.append(a) or quantize(*a))
    folder = tmp_path / "cache"
    folder.mkdir()
    load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    monkeypatch.setattr(llamacpp_draft, "LlamaCppSession", lambda *a, **kw: (_ for _ in ()).throw(
        ModelError("llama.cpp cannot make a context of 4096 tokens (out of memory?)")))
    with pytest.raises(ModelError, match="cannot make a context"):
        load_llamacpp_draft(str(gguf), folder, model.config, (2,))
    assert len(calls) == 1 and (folder / DRAFT_GGUF).is_file()  # the file was fine: kept, not made again
