"""A hostile model file against the k-quant kernel: its sizes are checked before C sees them, every C
entry's status is raised, nothing of a failed call is kept, and a file changed under a running model
is an error, not a signal. (The C entries' own checks: tests/kernels/test_kquant_sanitized.py.)"""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import require_or_skip
from specplay.core.errors import ModelError
from specplay.core.kernels import kquant
from specplay.core.kernels.kquant import Q4_K, Q6_K, KQuantLinear, KQuantWeight
from test_kquant import random_blocks, weight

if kquant.unavailable() is not None:  # the module skips, or fails where CI requires the kernel
    require_or_skip("SPECPLAY_REQUIRE_KERNEL", f"no k-quant kernel: {kquant.unavailable()}")

#: A Qwen2 layer of hidden 256: 4 heads of 64 values over 2 key/value heads, an MLP of 512.
SHAPES = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
          "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}


def tiny_config(**kw):
    from specplay.core.models.layers import DecoderConfig
    from tiny import tiny_hf_config

    sizes = dict(vocab=64, hidden=256, layers=1, heads=4, kv_heads=2, inter=512) | kw
    return DecoderConfig.from_hf(tiny_hf_config(**sizes))


def tiny_tensors(shapes=SHAPES, hidden: int = 256, vocab: int = 64, replaced: dict | None = None) -> dict:
    """A one-layer model's tensors in k-quant blocks, some ``replaced`` by name."""
    tensors = {"model.embed_tokens.weight": weight(Q4_K, vocab, hidden, 1),
               "lm_head.weight": weight(Q6_K, vocab, hidden, 2), "model.norm.weight": torch.ones(hidden)}
    p = "model.layers.0"
    for k, (name, (rows, cols)) in enumerate(shapes.items()):
        block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        tensors[f"{p}.{block}.{name}.weight"] = weight(Q6_K if name == "v_proj" else Q4_K, rows, cols, k)
        if name in ("q_proj", "k_proj", "v_proj"):
            tensors[f"{p}.{block}.{name}.bias"] = torch.zeros(rows)
    tensors[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
    tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
    return tensors | (replaced or {})


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


ENTRIES = ("sp_repack", "sp_quantize_q4k", "sp_fit_q4k_from", "sp_dequantize_rows", "sp_linear", "sp_layers")


def _call(entry: str):
    """The Python side's call of ``entry``, its inputs made first (before the kernel is swapped)."""
    w, raw, q8 = weight(Q4_K, 8, 256), random_blocks(Q4_K, 4, 256), _q8_rows()
    model = decoder(tiny_config(), tiny_tensors()) if entry == "sp_layers" else None
    return {"sp_repack": lambda: KQuantWeight.from_raw(Q4_K, raw, 256),
            "sp_quantize_q4k": lambda: KQuantWeight.quantize(torch.randn(4, 300)),
            "sp_fit_q4k_from": lambda: KQuantWeight.fit_blocks(8, q8, 96),  # GGML's Q8_0
            "sp_dequantize_rows": lambda: w.rows_float(torch.tensor([0, 3])),
            "sp_linear": lambda: KQuantLinear(w)(torch.randn(2, 256)),
            "sp_layers": lambda: model.forward(torch.tensor([5]))}[entry]


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


@pytest.mark.parametrize("change, message", [
    ({"num_heads": 6}, r"layer 0's q/k/v projection is 256\+128\+128 x 256 \(rows x inputs\), where 6 heads and 2 "
                       r"key/value heads of 64 values and a hidden size of 256 make it 384\+128\+128 x 256"),
    ({"num_kv_heads": 8}, "4 attention heads cannot share 8 key/value heads"),
    ({"num_heads": 3}, "3 attention heads cannot share 2 key/value heads"),
    ({"num_kv_heads": 0}, "cannot share 0 key/value heads"),
    ({"num_kv_heads": 4}, "q/k/v projection"),
    ({"head_dim": 32}, "q/k/v projection"),
    ({"hidden_size": 512}, "the token embedding is 64 rows of 256 values, where a vocabulary of 64 tokens and a "
                           "hidden size of 512 need 64 or more rows of 512"),
    ({"intermediate_size": 256}, r"gate/up projection is 512\+512 x 256"),
    ({"vocab_size": 65}, "the token embedding is 64 rows"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused_at_load(change, message):
    """A head count, an embedding length or a vocabulary changed in a file's metadata: one line naming
    the file and the disagreement, before any layer runs (the C layer was handed such sizes: more
    key/value heads than heads divided by zero, an output projection past hidden wrote past its scratch)."""
    with pytest.raises(ModelError, match=f"^lying.gguf: its metadata disagrees with its tensors: .*{message}"):
        decoder(dataclasses.replace(tiny_config(), **change), tiny_tensors())


@pytest.mark.parametrize("shapes, replaced, message", [
    ({"o_proj": (512, 256)}, {}, "attention output is 512 x 256"),
    ({"down_proj": (256, 256)}, {}, "down projection is 256 x 256"),
    ({"k_proj": (128, 512)}, {}, "fused k-quant matrices must share their input size"),
    ({}, {"model.layers.0.self_attn.k_proj.bias": torch.zeros(64)}, "a bias of 448 values for a layer of 512 outputs"),
    ({}, {"model.layers.0.input_layernorm.weight": torch.ones(128)}, "layer 0's norm has 128 values"),
    ({}, {"model.norm.weight": torch.ones(128)}, "the final norm has 128 values"),
    ({}, {"lm_head.weight": (Q6_K, 64, 512)}, "the output head takes 512 inputs"),
    ({}, {"model.embed_tokens.weight": (Q4_K, 48, 256)}, "the token embedding is 48 rows"),
])
def test_tensors_that_disagree_with_each_other_are_refused_at_load(shapes, replaced, message):
    """``replaced``: tensors by name, a matrix as its (type, rows, columns)."""
    replaced = {name: weight(*t) if isinstance(t, tuple) else t for name, t in replaced.items()}
    with pytest.raises(ModelError, match=f"^lying.gguf: .*{message}"):
        decoder(tiny_config(), tiny_tensors(SHAPES | shapes, replaced=replaced))


def test_heads_the_c_layer_does_not_run_load_on_torchs_layers_and_a_lie_in_them_is_still_refused():
    """Heads of 512 values are valid, only not the C layer's (at most 256): such a model loads and
    decodes on torch's layers; the same model with a changed MLP size is refused."""
    cfg = tiny_config(hidden=512, heads=1, kv_heads=1, inter=256)
    shapes = {"q_proj": (512, 512), "k_proj": (512, 512), "v_proj": (512, 512), "o_proj": (512, 512),
              "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}
    tensors = tiny_tensors(shapes, hidden=512)
    model = decoder(cfg, tensors)
    assert cfg.head_dim == 512 and model._fused is None
    assert torch.isfinite(model.forward_chain([1, 5, 9]).logits).all()
    with pytest.raises(ModelError, match=r"gate/up projection is 256\+256 x 512"):
        decoder(dataclasses.replace(cfg, intermediate_size=128), tensors)


def test_embedding_rows_outside_the_matrix_are_refused(tmp_path):
    """Ids are checked against the embedding's real rows, repacked or read from the file (the kernel
    read past the matrix; the file's rows wrapped a negative id round to the last row)."""
    from specplay.core.kernels.kquant import MappedRows
    from specplay.core.weights.gguf_blocks import GGUFBlocksReader

    path = tmp_path / "rows.gguf"
    _write_embedding_gguf(path)
    mapped = GGUFBlocksReader(path).get("model.embed_tokens.weight")
    assert isinstance(mapped, MappedRows)
    for embedding in (weight(Q4_K, 64, 256, 1), mapped):
        assert embedding.rows_float(torch.tensor([0, 63])).shape == (2, 256)
        for bad in (64, -1):
            with pytest.raises(IndexError, match=f"token id {bad} is outside the embedding's 64 rows"):
                embedding.rows_float(torch.tensor([3, bad]))


def test_blocks_that_do_not_fill_the_matrix_they_claim_are_refused():
    """A matrix's rows and columns are what the kernel reads by: its bytes must hold them (a kept file of
    fitted blocks states both)."""
    w = weight(Q4_K, 8, 256)
    with pytest.raises(ValueError, match="are not a 9 x 256 matrix of Q4_K blocks"):
        KQuantWeight(Q4_K, w.data, 9, 256)


def test_a_draft_whose_fit_fails_stores_no_blocks(tmp_path, monkeypatch):
    """An allocation the fit could not have ends the load with a clear message, and no fitted blocks
    are written to the cache (they had been stored as good weights, uninitialised, and trusted at every
    later load)."""
    from specplay.core.models import loader
    from specplay.core.weights.cache import KQUANT_DRAFT_WEIGHTS
    from tiny import tiny_hf_model, write_tiny_gguf

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64), path)
    failing = FailingKernel(kquant._lib(), "sp_quantize_q4k", -2)
    monkeypatch.setattr(kquant, "_lib", lambda: failing)
    with pytest.raises(ModelError, match="not enough memory"):
        loader.load_model(str(path), dtype="int8", role="draft", backend="native")
    assert list((tmp_path / "cache").rglob(KQUANT_DRAFT_WEIGHTS)) == []


def _write_embedding_gguf(path) -> None:
    """A GGUF of a Q4_K embedding (64 rows of 256) and a Q6_K head: the embedding is read by rows."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="qwen2")
    w.add_tensor("token_embd.weight", random_blocks(Q4_K, 64, 256, 1), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.add_tensor("output.weight", random_blocks(Q6_K, 64, 256, 2), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CUT_WHILE_IN_USE = """
import os, sys
from pathlib import Path
import torch
from specplay.core.errors import ModelError
from specplay.core.weights.gguf_blocks import GGUFBlocksReader
from specplay.core.weights.gguf_index import GGUFIndex

path = Path(sys.argv[1])
start = GGUFIndex(path).tensors["token_embd.weight"].offset
embedding = GGUFBlocksReader(path).get("model.embed_tokens.weight")
before = embedding.rows_float(torch.tensor([60]))
os.truncate(path, start + 10 * 144)  # cut in place inside the embedding, as a copy over it starts
try:
    embedding.rows_float(torch.tensor([60]))
except ModelError as exc:
    print(exc)
"""


def test_a_file_cut_under_a_loaded_embedding_is_an_error_not_a_signal(tmp_path):
    """The embedding's rows come from the file as the model runs; a .gguf overwritten or cut in place
    (a re-download, ``cp``) then gives a clear error at the next token (a mapping of it killed the
    process by SIGBUS). In a child process, so that a signal fails this test, not the test run."""
    path = tmp_path / "model.gguf"
    _write_embedding_gguf(path)
    done = subprocess.run([sys.executable, "-c", CUT_WHILE_IN_USE, str(path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.startswith(f"{path} changed on disk while in use: row 60 of its token embedding is cut short")
