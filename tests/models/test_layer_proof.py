"""The C decoder layer proved as the kernel is: every block of 1-65 rows gives its rows decoded one at a
time, at one and two threads, on both instruction sets, on a file's own layers before the target runs."""

import numpy as np
import pytest
import torch

from conftest import require_or_skip
from specplay.core.kernels import kquant
from specplay.core.kernels.kquant import Q4_K, Q6_K, FusedLayers, KQuantLinear
from specplay.core.models import layer_proof
from specplay.core.models.layers import DecoderConfig, LayerWeights
from specplay.core.weights import gguf_blocks
from test_kquant import ISAS, random_blocks, weight
from tiny import tiny_hf_config

if kquant.unavailable() is not None:  # the module skips, or fails where CI requires the kernel
    require_or_skip("SPECPLAY_REQUIRE_KERNEL", f"no k-quant kernel: {kquant.unavailable()}")

HIDDEN, HEADS, KV_HEADS, INTER = 256, 4, 2, 512  # heads of 64 values, one block a row


def tiny_config() -> DecoderConfig:
    return DecoderConfig.from_hf(tiny_hf_config(vocab=64, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, inter=INTER))


def tiny_layer(seed: int = 0) -> LayerWeights:
    """A decoder layer on random blocks: v and down in Q6_K, the rest Q4_K, q/k/v with biases."""
    gen = torch.Generator().manual_seed(seed)
    kv = KV_HEADS * HIDDEN // HEADS
    return LayerWeights(
        KQuantLinear([weight(Q4_K, HIDDEN, HIDDEN, seed), weight(Q4_K, kv, HIDDEN, seed + 1),
                      weight(Q6_K, kv, HIDDEN, seed + 2)], torch.randn(HIDDEN + 2 * kv, generator=gen) * 0.1),
        KQuantLinear(weight(Q4_K, HIDDEN, HIDDEN, seed + 3)),
        KQuantLinear([weight(Q4_K, INTER, HIDDEN, seed + 4), weight(Q4_K, INTER, HIDDEN, seed + 5)]),
        KQuantLinear(weight(Q6_K, HIDDEN, INTER, seed + 6)),
        1 + 0.1 * torch.randn(HIDDEN, generator=gen), 1 + 0.1 * torch.randn(HIDDEN, generator=gen))


@pytest.mark.parametrize("isa", ISAS)
def test_every_block_of_the_c_layer_gives_its_rows_decoded_alone_at_one_and_two_threads(isa, monkeypatch):
    """Blocks of every size 1-65 after a short cache, on the AVX2 path forced as on the host's own."""
    monkeypatch.setattr(kquant, "isa", lambda: isa)
    built = []
    monkeypatch.setattr(FusedLayers, "run", lambda self, *a, real=FusedLayers.run: built.append(self._isa) or
                        real(self, *a))
    assert layer_proof.prove_layers(tiny_config(), [tiny_layer(0), tiny_layer(10)])
    assert set(built) == {isa}


def test_both_instruction_sets_give_the_same_layer_bits(monkeypatch):
    if len(ISAS) < 2:
        pytest.skip("this CPU has one of the two paths")
    cfg, layer = tiny_config(), tiny_layer(3)
    x = kquant.adversarial_rows(HIDDEN, 9)
    cos, sin = torch.rand(9, cfg.head_dim), torch.rand(9, cfg.head_dim)
    outs = []
    for isa in ISAS:
        monkeypatch.setattr(kquant, "isa", lambda isa=isa: isa)
        y, kv = x.clone(), torch.zeros(2, KV_HEADS, 16, cfg.head_dim)
        FusedLayers(cfg, [layer]).run(0, y, cos, sin, kv, 4, torch.ones(9, 13, dtype=torch.bool).tril_(4), False)
        outs.append((y, kv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_span_of_layers_in_one_call_gives_each_layer_run_in_turn():
    """The model's forward runs its layers as one call (``sp_layers``); the proofs run one layer a call:
    the same rows and caches, bit for bit, for a tree's block after a cache."""
    cfg, layers = tiny_config(), [tiny_layer(0), tiny_layer(10), tiny_layer(3)]
    fused, x = FusedLayers(cfg, layers), kquant.adversarial_rows(HIDDEN, 6)
    cos, sin = torch.rand(6, cfg.head_dim), torch.rand(6, cfg.head_dim)
    mask = torch.ones(6, 10, dtype=torch.bool).tril_(4)
    mask[4, 8] = False  # row 4 a sibling of row 3, not its child
    one, span = x.clone(), x.clone()
    one_kv, span_kv = torch.rand(3, 2, KV_HEADS, 12, cfg.head_dim), torch.zeros(3, 2, KV_HEADS, 12, cfg.head_dim)
    span_kv[:, :, :, :4] = one_kv[:, :, :, :4]
    for i in range(3):
        fused.run(i, one, cos, sin, one_kv[i], 4, mask, False)
    fused.run_span(0, 3, span, cos, sin, span_kv, 4, mask, False)
    assert torch.equal(one, span) and torch.equal(one_kv[:, :, :, :10], span_kv[:, :, :, :10])
    assert not torch.equal(one, x)


def _nudged(x: torch.Tensor) -> None:
    x.mul_(1 + 1e-6)


# What a C layer with another path somewhere would do: rows that depend on their block's size, keys and
# values written otherwise in a block, rows that depend on the thread count.
FAULTS = {"rows in blocks of 33 or more": lambda x, kv, m, base: _nudged(x) if m >= 33 else None,
          "the cache a block writes": lambda x, kv, m, base: _nudged(kv[:, :, base:base + m]) if m > 1 else None,
          "rows at two threads": lambda x, kv, m, base: _nudged(x) if torch.get_num_threads() == 2 else None}


@pytest.mark.parametrize("fault", FAULTS)
def test_the_layer_proof_fails_a_layer_whose_rows_depend_on_their_block_or_threads(fault, monkeypatch):
    real = FusedLayers.run

    def faulty(self, i, x, cos, sin, kv, base, mask, causal):
        real(self, i, x, cos, sin, kv, base, mask, causal)
        FAULTS[fault](x, kv, x.shape[0], base)

    monkeypatch.setattr(FusedLayers, "run", faulty)
    assert not layer_proof.prove_layers(tiny_config(), [tiny_layer()])


def test_torch_set_num_threads_sets_the_kernels_openmp_threads(monkeypatch):
    """The kernel's own OpenMP runtime (asked through its library) runs what torch is set to, so the
    proofs' two threads are two; where it did not follow, neither proof would hold."""
    before = torch.get_num_threads()
    try:
        for n in (2, 1, 3):
            torch.set_num_threads(n)
            assert kquant.kernel_threads() == n
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # a runtime torch does not reach
    assert not layer_proof.prove_layers(tiny_config(), [tiny_layer()])
    assert not kquant.row_exact(KQuantLinear(weight(Q4_K, 32, 256)), kquant.adversarial_rows(256, 3))


def _kquant_gguf(path, layers: int = 3) -> None:
    """A Qwen2 GGUF on k-quant blocks whose layers 0 and 2 ship v and down in Q6_K, layer 1 all in Q4_K
    (two mixes, as Q4_K_M files have)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="qwen2")
    for key, value in (("embedding_length", HIDDEN), ("block_count", layers), ("feed_forward_length", INTER),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS)):
        w.add_uint32(f"qwen2.{key}", value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    kv = KV_HEADS * HIDDEN // HEADS
    rng = np.random.default_rng(0)
    for i in range(layers):
        six = Q4_K if i == 1 else Q6_K
        for k, (name, kind, rows, cols) in enumerate(
                (("attn_q", Q4_K, HIDDEN, HIDDEN), ("attn_k", Q4_K, kv, HIDDEN), ("attn_v", six, kv, HIDDEN),
                 ("attn_output", Q4_K, HIDDEN, HIDDEN), ("ffn_gate", Q4_K, INTER, HIDDEN),
                 ("ffn_up", Q4_K, INTER, HIDDEN), ("ffn_down", six, HIDDEN, INTER))):
            w.add_tensor(f"blk.{i}.{name}.weight", random_blocks(kind, rows, cols, 10 * i + k),
                         raw_dtype=gguf.GGMLQuantizationType(kind))
        for name, size in (("attn_q", HIDDEN), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(f"blk.{i}.{name}.bias", rng.normal(0, 0.1, size).astype(np.float32))
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_proof_runs_the_first_layer_of_each_mix_with_the_sizes_the_metadata_states(tmp_path):
    path = tmp_path / "mixes.gguf"
    _kquant_gguf(path)
    reader = gguf_blocks.GGUFBlocksReader(path)
    cfg, layers = layer_proof.proof_layers(reader)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == \
        (HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, INTER)
    assert cfg.inv_freq[1] == pytest.approx(1e6 ** (-2 / 64))  # the file's RoPE base, not a default
    assert [[p.type for p in layer.qkv.parts] + [layer.down.parts[0].type] for layer in layers] == \
        [[Q4_K, Q4_K, Q6_K, Q6_K], [Q4_K, Q4_K, Q4_K, Q4_K]]  # layers 0 and 1; 2 repeats 0's mix
    assert torch.equal(layers[1].o.parts[0].data, reader.get("model.layers.1.self_attn.o_proj.weight").data)
    assert layers[0].qkv.bias is not None and layers[0].qkv.bias.numel() == HIDDEN + 2 * KV_HEADS * HIDDEN // HEADS
    assert layer_proof.prove_layers(cfg, layers)


def test_the_target_is_offered_its_blocks_only_once_its_layers_are_proved_and_an_old_verdict_is_proved_again(
        tmp_path, monkeypatch):
    from specplay.core.kernels.kernel_build import library_digest
    from specplay.core.models import loader, measurements

    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measurements"))
    path = tmp_path / "mixes.gguf"
    _kquant_gguf(path)
    # What an earlier version kept: the matrices' verdict alone.
    measurements.measured(f"kquant exact {library_digest()} {path.name}", lambda: {"exact": True})
    proved = []
    real = layer_proof.prove_layers
    monkeypatch.setattr(layer_proof, "prove_layers", lambda cfg, layers: proved.append(len(layers)) or False)
    reader, why = loader._exact_gguf_reader(str(path), lambda *a: None)
    assert reader is None and "not bit-exact" in why and proved == [2]
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "again"))
    monkeypatch.setattr(layer_proof, "prove_layers", lambda cfg, layers: proved.append(len(layers)) or real(cfg, layers))
    reader, why = loader._exact_gguf_reader(str(path), lambda *a: None)
    assert why is None and reader.path == path and proved == [2, 2]
    assert loader._exact_gguf_reader(str(path), lambda *a: None)[0] is not None and proved == [2, 2]  # kept
