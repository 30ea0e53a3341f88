"""Row-exact int8: a row's result must not depend on the other rows of its block."""

import pytest
import torch

from specplay.core.kernels.linear import Int8RowExactLinear, int8_supported
from tiny import block_and_singles, native_from_hf, tiny_hf_model

pytestmark = pytest.mark.skipif(not int8_supported(), reason="no x86 quantized engine")


def test_rows_are_bit_identical_alone_or_in_a_block():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.05
    b = torch.randn(96, generator=g)
    lin = Int8RowExactLinear(w, b)
    # Rows of very different scales: with one scale per block, the small rows would lose precision.
    x = torch.randn(16, 64, generator=g) * torch.logspace(-2, 2, 16)[:, None]
    block = lin(x)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(16)])
    assert torch.equal(block, alone)
    ref = x @ w.T + b
    rel = (block - ref).norm(dim=1) / ref.norm(dim=1)
    assert rel.max() < 0.03


def test_int8_model_verifies_like_it_decodes():
    """In int8 storage, the logits of a token are the same whether it is decoded alone or in a block."""
    model = tiny_hf_model(seed=2)
    a, b = native_from_hf(model, torch.float32, "int8"), native_from_hf(model, torch.float32, "int8")
    block, singles = block_and_singles(a, b, [1, 5, 9, 13, 7, 3, 22])
    # Linear layers are exact (test above) and attention runs in float64, whose shape-dependent
    # rounding differences vanish when results return to float32.
    assert torch.equal(block, singles)


def test_the_draft_layers_approximate_the_float_layer():
    from specplay.core.kernels.linear import Int4DraftLinear, Int8DraftLinear, QuantizedWeight

    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g) * 0.05
    b = torch.randn(96, generator=g)
    x = torch.randn(3, 64, generator=g)
    want = torch.nn.functional.linear(x, w, b)
    int8 = Int8DraftLinear(w, b)
    assert (int8(x) - want).abs().max() < 0.05 * want.abs().max()
    assert torch.allclose(int8.dequantized_weight(), w, atol=w.abs().max() / 127)
    # int4 in groups of 32: a coarser copy, from float or from the cache's int8 rows alike.
    for source in (w, QuantizedWeight.quantize(w)):
        int4 = Int4DraftLinear(source, b)
        err = torch.nn.functional.linear(x, w) - (int4(x) - b)
        assert err.norm() < 0.15 * torch.nn.functional.linear(x, w).norm()


@pytest.mark.parametrize("storage", ["int8-draft", "int4-draft"])
def test_a_fast_draft_with_a_reduced_vocabulary_keeps_speculation_exact(storage):
    """Draft layers that are not batch-invariant, a float32 cache, the first 40 of 64 ids: still exact."""
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import SpeculativeConfig
    from tiny import loaded, perturbed_copy

    base = tiny_hf_model(seed=0, dtype=torch.float64)
    target = loaded(native_from_hf(base, dtype=torch.float32, storage="int8"))
    draft_native = native_from_hf(perturbed_copy(base, 0.05), dtype=torch.float32, storage=storage)
    assert draft_native._kv.dtype == torch.float32
    draft = loaded(draft_native)
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    prompt = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]
    want = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=4, draft_vocab=40), target, draft)
    res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    assert res.token_ids == want.token_ids
    assert res.metrics.accepted > 0



def test_an_int8_prompt_prefill_attends_in_float32_and_every_method_still_agrees(monkeypatch):
    """The float64 attention that keeps decoding row-exact is not needed for a prompt all methods share."""
    import torch.nn.functional as F

    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.prompt_lookup import PromptLookupConfig
    from tiny import loaded

    target = loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float64), dtype=torch.float32, storage="int8"))
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    prompt = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7, 9, 10, 4, 5, 6]
    gen = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stand_down=False)
    want = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    layers = target.model.cfg.num_layers
    assert seen[:layers] == [torch.float32] * layers and set(seen[layers:]) == {torch.float64}
    method = build_method("prompt_lookup", PromptLookupConfig(adaptive=False), target)
    assert drain(generate(target.model, target.tokenizer, method, prompt, gen)).token_ids == want.token_ids
