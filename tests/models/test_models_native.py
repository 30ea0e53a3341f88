"""The native decoder against transformers, and the cache operations speculation relies on."""

import pytest
import torch

from specplay.core.models.base import expand_mask
from specplay.core.decoding.tree import ancestor_mask
from tiny import native_from_hf, tiny_hf_model, tiny_pair


@pytest.mark.parametrize("arch,tie,kv", [("qwen2", False, 2), ("qwen2", True, 4), ("llama", False, 1)])
def test_native_matches_transformers_float32(arch, tie, kv):
    native, hf = tiny_pair(arch, dtype=torch.float32, tie=tie, kv_heads=kv)
    prompt = torch.tensor([1, 5, 9, 13, 7, 3, 22, 40, 41])
    a, b = native.forward(prompt, hidden=True, layers=(0,)), hf.forward(prompt, hidden=True, layers=(0,))
    assert (a.logits - b.logits).abs().max() <= 1e-4
    assert (a.hidden - b.hidden).abs().max() <= 1e-4
    assert (a.layers[0] - b.layers[0]).abs().max() <= 1e-4
    native.commit(9)
    hf.commit(9)
    # A tree block with explicit positions and mask, then a partial path commit.
    parents = [-1, 0, 0, 1]
    tokens = torch.tensor([4, 8, 11, 30, 31])
    positions = torch.tensor([9, 10, 11, 11, 12])
    mask = ancestor_mask(parents)
    a, b = native.forward(tokens, positions, mask), hf.forward(tokens, positions, mask)
    assert (a.logits - b.logits).abs().max() <= 1e-4
    native.commit([0, 1, 2])
    hf.commit([0, 1, 2])
    a, b = native.forward(torch.tensor([17, 19])), hf.forward(torch.tensor([17, 19]))
    assert (a.logits - b.logits).abs().max() <= 1e-4


def test_tree_commit_equals_fresh_chain():
    """Keeping a root-to-leaf path of a tree leaves the cache exactly as if the path had been run alone."""
    model = tiny_hf_model(seed=3, dtype=torch.float64)
    live, fresh = native_from_hf(model), native_from_hf(model)
    prompt = [1, 5, 9, 13]
    live.forward_chain(prompt)
    # Tree: root 7 with children 8 (node 0) and 9 (node 1); node 2 (10) under node 1; node 3 (11) under node 0.
    parents = [-1, -1, 1, 0]
    tokens = torch.tensor([7, 8, 9, 10, 11])
    depth = torch.tensor([0, 1, 1, 2, 2])
    live.forward(tokens, 4 + depth, ancestor_mask(parents))
    live.commit([0, 2, 3])  # root, node 1 (9), node 2 (10)
    assert live.cache_len == 7
    tail = torch.tensor([12, 13])
    got = live.forward(tail).logits
    want = fresh.forward(torch.tensor(prompt + [7, 9, 10, 12, 13])).logits[-2:]
    assert torch.allclose(got, want, atol=1e-10)


def test_uncommitted_block_is_discarded_and_crop_rolls_back():
    model = tiny_hf_model(seed=4, dtype=torch.float64)
    live, fresh = native_from_hf(model), native_from_hf(model)
    live.forward_chain([1, 2, 3, 4, 5, 6])
    live.forward(torch.tensor([7, 8, 9]))  # never committed
    live.crop(4)
    got = live.forward(torch.tensor([10])).logits
    want = fresh.forward(torch.tensor([1, 2, 3, 4, 10])).logits[-1:]
    assert torch.allclose(got, want, atol=1e-10)


def test_cache_grows_past_initial_capacity():
    model = tiny_hf_model(seed=5, dtype=torch.float64)
    live, fresh = native_from_hf(model), native_from_hf(model)
    seq = [int(i % 60) + 3 for i in range(300)]
    for t in seq:
        live.forward_chain([t])
    assert live.cache_len == 300
    assert torch.allclose(live.forward(torch.tensor([5])).logits, fresh.forward(torch.tensor(seq + [5])).logits[-1:],
                          atol=1e-9)


def test_bad_masks_and_keep_indices_are_rejected():
    native, _ = tiny_pair()
    native.forward_chain([1, 2, 3])
    with pytest.raises(ValueError, match="attention mask"):
        native.forward(torch.tensor([4, 5]), attn_mask=torch.ones(3, 3, dtype=torch.bool))
    native.forward(torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="out of range"):
        native.commit([0, 5])
    with pytest.raises(ValueError, match="crop"):
        native.crop(10)


def test_expand_mask_full_and_block_forms():
    block = torch.tensor([[True, False], [True, True]])
    full = expand_mask(block, 2, 3, "cpu")
    assert full.shape == (2, 5) and full[:, :3].all() and torch.equal(full[:, 3:], block)
    assert torch.equal(expand_mask(full, 2, 3, "cpu"), full)


def test_a_prefill_into_an_empty_cache_attends_causally_without_a_mask(monkeypatch):
    """SDPA's causal mode skips the blocks above the diagonal; the cache it fills is the masked one's."""
    import torch.nn.functional as F

    native, _ = tiny_pair(seed=5)
    seq = torch.tensor([4, 5, 6, 7, 8, 9, 10])
    native.reset()
    native.forward_chain(seq[:-1], logit_rows=[], prefill=True, attn_mask=torch.ones(6, 6, dtype=torch.bool).tril())
    want = native.forward(seq[-1:]).logits
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((kw["attn_mask"], kw["is_causal"])) or real(*a, **kw))
    native.reset()
    native.forward_chain(seq[:-1], logit_rows=[], prefill=True)
    assert calls and all(mask is None and causal for mask, causal in calls)
    got = native.forward(seq[-1:]).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


def test_a_block_without_logit_rows_fills_the_cache_like_a_full_one():
    """A prefill asks for no logits: no LM head work, the same cache for the next token."""
    native, _ = tiny_pair(seed=5)
    seq = torch.tensor([4, 5, 6, 7, 8, 9])
    native.reset()
    full = native.forward_chain(seq[:-1])
    want = native.forward(seq[-1:]).logits
    native.reset()
    lean = native.forward_chain(seq[:-1], logit_rows=[])
    assert lean.logits.shape == (0, full.logits.shape[1])
    assert torch.equal(native.forward(seq[-1:]).logits, want)


def test_a_float64_models_prefill_attends_in_float64():
    """Only row-exact int8 reads a prompt with float32 attention: a float64 model is the exact
    reference, so its prefill must equal reading the prompt a token at a time to float64 precision."""
    model = tiny_hf_model(seed=6, dtype=torch.float64)
    whole, stepwise = native_from_hf(model), native_from_hf(model)
    prompt = [1, 5, 9, 13, 7, 3, 22, 40, 41, 2, 8]
    got = whole.forward(torch.tensor(prompt), prefill=True).logits
    want = []
    for t in prompt:
        want.append(stepwise.forward(torch.tensor([t])).logits)
        stepwise.commit(1)
    # float32 attention leaves differences near 1e-7; float64 near 1e-15.
    assert (got - torch.cat(want)).abs().max() < 1e-11
