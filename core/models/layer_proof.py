"""The C decoder layer (``core/kernels/layer.c``) proved exact as the k-quant kernel is, on a file's own layers.

:func:`specplay.core.kernels.kquant.prove` proves the kernel's matrices; a target decodes and
verifies through :class:`~specplay.core.kernels.kquant.FusedLayers`, whose norm, RoPE, cache
write, attention and threads are C of their own. Before a target is offered the file's blocks,
:func:`prove_layers` runs one real layer of each mix of shapes and block types the file holds
(:func:`proof_layers`) over every block of 1 to :data:`~specplay.core.kernels.kquant.PROVED_ROWS`
rows, put into the cache as verification puts them, against the same rows decoded one at a time
(:func:`layer_exact`), at one and two threads.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specplay.core.kernels.kquant import PROVED_ROWS, FusedLayers, KQuantLinear, adversarial_rows, use_threads
from specplay.core.models.layers import FUSED, LayerWeights, rope_frequencies, rope_tables
from specplay.core.weights.gguf_blocks import GGUFBlocksReader

#: The cache a proved block is put after: tokens the layer itself wrote.
PROOF_CONTEXT = 8


def layer_exact(fused: FusedLayers, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                base: int, threads=(1, 2)) -> bool:
    """Layer ``i`` over every block of the first 1 .. len(x) rows, put at slot ``base`` of ``kv`` (a cache
    of ``base`` tokens) as verification puts a block (each row seeing the cache and the rows before
    it), bit-identical to the rows decoded one at a time, each at its own slot: the rows it gives and
    the keys and values it writes, at each of ``threads``. ``cos``/``sin``: the rows' RoPE tables."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone_kv, alone = kv.clone(), x.clone()
        for r in range(x.shape[0]):  # as a decoded token runs: no mask, every slot up to its own
            fused.run(i, alone[r:r + 1], cos[r:r + 1], sin[r:r + 1], alone_kv, base + r, None, False)
        for n in threads:
            if not use_threads(n):
                return False
            block_kv = kv.clone()
            for m in range(1, x.shape[0] + 1):
                y, slots = x[:m].clone(), slice(base, base + m)
                fused.run(i, y, cos[:m], sin[:m], block_kv, base, torch.ones(m, base + m, dtype=torch.bool).tril_(base),
                          False)
                if not (torch.equal(y, alone[:m]) and torch.equal(block_kv[:, :, slots], alone_kv[:, :, slots])):
                    return False
        return True
    finally:
        torch.set_num_threads(before)


def prove_layers(cfg, layers: list) -> bool:
    """The C layer on these (real) decoder layers: every block of 1 .. ``PROVED_ROWS`` adversarial rows
    after a cache of :data:`PROOF_CONTEXT` tokens exact (:func:`layer_exact`), at one and two
    threads. ``cfg``: the sizes :class:`FusedLayers` reads, and ``inv_freq``. True where the C layer
    does not run such layers (:meth:`FusedLayers.fits`: torch's layers do, on the proved kernel).

    Its cost, once a machine and file, measured on a two-core Xeon shared with other work: a layer of
    the 1.5B target (hidden 1536, MLP 8960) took 2 s at one thread and 2-8 s at two (its threads meet
    after each step of a layer, and wait on whatever else holds the cores); the target's file holds
    two mixes of block types, so its first launch pays 8-20 s here, beside the matrices' 4-6 s."""
    if not FusedLayers.fits(cfg, layers):
        return True
    fused, cap = FusedLayers(cfg, layers), PROOF_CONTEXT + PROVED_ROWS
    cos, sin = (t[0].contiguous() for t in rope_tables(torch.arange(cap), torch.tensor(cfg.inv_freq), 1.0,
                                                      torch.float32))
    for i in range(len(layers)):
        kv = torch.zeros(2, cfg.num_kv_heads, cap, cfg.head_dim)
        context = adversarial_rows(cfg.hidden_size, PROOF_CONTEXT, seed=100 + i)
        fused.run(i, context, cos[:PROOF_CONTEXT], sin[:PROOF_CONTEXT], kv, 0, None, True)
        if not layer_exact(fused, i, adversarial_rows(cfg.hidden_size, PROVED_ROWS, seed=i), cos[PROOF_CONTEXT:],
                           sin[PROOF_CONTEXT:], kv, PROOF_CONTEXT):
            return False
    return True


_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BLOCKS = {"qkv": "self_attn", "o": "self_attn", "gate_up": "mlp", "down": "mlp"}


def proof_layers(reader: GGUFBlocksReader) -> tuple[SimpleNamespace, list[LayerWeights]]:
    """What :func:`prove_layers` runs on for a Qwen2 file: the sizes its metadata states, and the first
    decoder layer of each distinct mix of shapes and block types among its layers."""
    firsts: dict[tuple, int] = {}
    i = 0
    while f"blk.{i}.attn_q.weight" in reader.tensors:
        tensors = [reader.tensors[f"blk.{i}.{name}.weight"] for name in _LAYER_MATRICES]
        firsts.setdefault(tuple((int(t.tensor_type), tuple(t.shape)) for t in tensors), i)
        i += 1
    layers = []
    for i in firsts.values():
        p, parts = f"model.layers.{i}", {}
        for fused, names in FUSED.items():
            prefixes = [f"{p}.{_BLOCKS[fused]}.{name}" for name in names]
            biases = [reader.get(f"{prefix}.bias") for prefix in prefixes]
            parts[fused] = KQuantLinear([reader.get(f"{prefix}.weight") for prefix in prefixes],
                                        None if any(b is None for b in biases) else torch.cat(biases))
        layers.append(LayerWeights(**parts, ln_in=reader.get(f"{p}.input_layernorm.weight"),
                                   ln_post=reader.get(f"{p}.post_attention_layernorm.weight")))
    meta, arch = reader.metadata, reader.architecture
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = layers[0].qkv.parts[0].rows // heads
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    cfg = SimpleNamespace(hidden_size=layers[0].ln_in.numel(), num_heads=heads, head_dim=head_dim,
                          num_kv_heads=int(meta[f"{arch}.attention.head_count_kv"]),
                          intermediate_size=layers[0].gate_up.parts[0].rows,
                          rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
                          inv_freq=tuple(rope_frequencies(SimpleNamespace(rope_theta=theta), head_dim)[0].tolist()))
    return cfg, layers
