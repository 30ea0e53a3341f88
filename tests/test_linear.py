"""Row-exact int8: a row's result must not depend on the other rows of its block."""

import pytest
import torch

from core.models.linear import Int8RowExactLinear, int8_supported
from tiny import native_from_hf, tiny_hf_model

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
    seq = [1, 5, 9, 13, 7, 3, 22]
    a.forward_chain(seq[:3])
    block = a.forward(torch.tensor(seq[3:])).logits
    b.forward_chain(seq[:3])
    singles = []
    for t in seq[3:]:
        singles.append(b.forward(torch.tensor([t])).logits)
        b.commit(1)
    # Linear layers are exact (test above) and attention runs in float64, whose shape-dependent
    # rounding differences vanish when results return to float32.
    assert torch.equal(block, torch.cat(singles))
