"""A hostile model file against the k-quant kernel: its sizes are checked before C sees them, every C
entry's status is raised, nothing of a failed call is kept, and a file changed under a running model
is an error, not a signal. (The C entries' own checks: tests/test_kquant_sanitized.py.)"""

import numpy as np
import pytest
import torch

from specplay.core.errors import ModelError
from specplay.core.models import kquant
from specplay.core.models.kquant import Q4_K, Q6_K, KQuantLinear, KQuantWeight
from test_kquant import random_blocks, weight

pytestmark = pytest.mark.skipif(kquant.unavailable() is not None, reason=f"no k-quant kernel: {kquant.unavailable()}")

#: A Qwen2 layer of hidden 256: 4 heads of 64 values over 2 key/value heads, an MLP of 512.
SHAPES = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
          "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}


def tiny_config(**kw):
    from specplay.core.models.layers import DecoderConfig
    from tiny import tiny_hf_config

    sizes = dict(vocab=64, hidden=256, heads=4, kv_heads=2, inter=512) | kw
    return DecoderConfig.from_hf(tiny_hf_config(**sizes))


def tiny_tensors(shapes=SHAPES, hidden: int = 256, vocab: int = 64, **replaced) -> dict:
    """A two-layer model's tensors in k-quant blocks, ``replaced`` by name."""
    tensors = {"model.embed_tokens.weight": weight(Q4_K, vocab, hidden, 1),
               "lm_head.weight": weight(Q6_K, vocab, hidden, 2), "model.norm.weight": torch.ones(hidden)}
    for i in range(2):
        p = f"model.layers.{i}"
        for k, (name, (rows, cols)) in enumerate(shapes.items()):
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"{p}.{block}.{name}.weight"] = weight(Q6_K if name == "v_proj" else Q4_K, rows, cols, 10 * i + k)
            if name in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{p}.{block}.{name}.bias"] = torch.zeros(rows)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
    return tensors | replaced


def decoder(cfg, tensors: dict):
    from specplay.core.models.native import NativeDecoder

    return NativeDecoder(cfg, tensors.get, name="lying.gguf", storage="gguf", eos_token_ids=(2,))


class FailingKernel:
    """The kernel with one entry returning ``status`` at once (doing nothing), the others as they are."""

    def __init__(self, lib, entry: str, status: int):
        self.lib, self.entry, self.status = lib, entry, status

    def __getattr__(self, name):
        return (lambda *args: self.status) if name == self.entry else getattr(self.lib, name)


def _q8_rows() -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = np.random.default_rng(0).normal(0, 0.05, size=(8, 96)).astype(np.float32)
    return quantize(values, GGMLQuantizationType.Q8_0)


ENTRIES = ("sp_repack", "sp_quantize_q4k", "sp_fit_q4k_from", "sp_dequantize_rows", "sp_linear", "sp_layer")


def _call(entry: str):
    """The Python side's call of ``entry``, its inputs made first (before the kernel is swapped)."""
    w, raw, q8 = weight(Q4_K, 8, 256), random_blocks(Q4_K, 4, 256), _q8_rows()
    model = decoder(tiny_config(), tiny_tensors()) if entry == "sp_layer" else None
    return {"sp_repack": lambda: KQuantWeight.from_raw(Q4_K, raw, 256),
            "sp_quantize_q4k": lambda: KQuantWeight.quantize(torch.randn(4, 300)),
            "sp_fit_q4k_from": lambda: KQuantWeight.fit_blocks(8, q8, 96),  # GGML's Q8_0
            "sp_dequantize_rows": lambda: w.rows_float(torch.tensor([0, 3])),
            "sp_linear": lambda: KQuantLinear(w)(torch.randn(2, 256)),
            "sp_layer": lambda: model.forward(torch.tensor([5]))}[entry]


@pytest.mark.parametrize("status, error", [(-1, ModelError), (-2, MemoryError)])
@pytest.mark.parametrize("entry", ENTRIES)
def test_every_kernel_status_is_raised(entry, status, error, monkeypatch):
    """Bad arguments (which the checks before C should have stopped) and out of memory each raise:
    nothing is returned as if the kernel had computed it."""
    call = _call(entry)
    failing = FailingKernel(kquant._lib(), entry, status)
    monkeypatch.setattr(kquant, "_lib", lambda: failing)
    with pytest.raises(error):
        call()
