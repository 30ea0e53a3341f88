"""The exact k-quant kernel: GGUF's Q4_K and Q6_K blocks as shipped, bit-exact at every block size."""

import numpy as np
import pytest
import torch

from conftest import require_or_skip
from specplay.core.kernels import kquant
from specplay.core.kernels.kquant import PROVED_ROWS, Q4_K, Q6_K, KQuantLinear, KQuantWeight
from specplay.core.weights import gguf_blocks

if kquant.unavailable() is not None:  # no C compiler, say: the module skips, or fails where CI requires the kernel
    require_or_skip("SPECPLAY_REQUIRE_KERNEL", f"no k-quant kernel: {kquant.unavailable()}")

ISAS = [code for code in (2, 3) if code <= (kquant.isa() or 0)]


def _halves(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(type_: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks ``[rows, bytes]`` of random values: every bit pattern of the quants and the
    6-bit scales, half-precision scales that give weights of a few tenths."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    if type_ == Q4_K:
        blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
        blocks[:, 0:2] = _halves(rng.uniform(2e-4, 8e-4, n))  # d
        blocks[:, 2:4] = _halves(rng.uniform(1e-3, 5e-3, n))  # dmin
        return blocks.reshape(rows, -1)
    blocks = rng.integers(0, 256, size=(n, 210), dtype=np.uint8)
    blocks[:, 208:210] = _halves(rng.uniform(5e-5, 2e-4, n))
    return blocks.reshape(rows, -1)


def weight(type_: int, rows: int, cols: int, seed: int = 0) -> KQuantWeight:
    return KQuantWeight.from_raw(type_, random_blocks(type_, rows, cols, seed), cols)


@pytest.mark.parametrize("type_", [Q4_K, Q6_K])
def test_repacked_blocks_keep_the_files_values_exactly(type_):
    """The kernel's layout dequantizes to gguf's own reference values, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(type_, 8, 512, seed=3)
    want = dequantize(raw, GGMLQuantizationType(type_)).reshape(8, 512)
    assert torch.equal(weight_from(raw, type_).dequantize(), torch.from_numpy(want))


def weight_from(raw, type_):
    return KQuantWeight.from_raw(type_, raw, raw.shape[1] // (144 if type_ == Q4_K else 210) * 256)


BLOCKX = np.dtype([("q", np.int8, 256), ("neg32", np.int32, (4, 4)), ("xmin", np.float32, (2, 4)),
                   ("d", np.float32), ("pad", np.float32, 3)])


def _quantized_as_the_rule_says(row: np.ndarray, k: int) -> np.ndarray:
    """kquant.h's activation blocks of one row, value by value in NumPy: the row zero-padded to ``k``;
    per block of 256 the largest magnitude past NaNs, q = rint(value * (127 / it)) (ties to even) clamped
    to -127..127 with a NaN product 0, q in ``position``'s order, the 16-group sums' xmin and neg32."""
    v = np.zeros(k, np.float32)
    v[:row.size] = row
    out = np.zeros(k // 256, BLOCKX)
    byte = np.arange(256)
    position = 128 * (byte // 128) + 32 * ((byte % 16) // 4) + 4 * ((byte % 128) // 16) + byte % 4
    with np.errstate(invalid="ignore", over="ignore"):
        for i, block in enumerate(v.reshape(-1, 256)):
            mags = np.abs(block[~np.isnan(block)])
            amax = np.float32(mags.max() if mags.size else 0.0)
            inverse = np.float32(127) / amax if amax > 0 else np.float32(0)
            x = block * inverse
            q = np.where(np.isnan(x), 0, np.clip(np.rint(np.nan_to_num(x, nan=0.0)), -127, 127)).astype(np.int32)
            sums = q.reshape(16, 16).sum(1)
            out[i]["d"] = amax / np.float32(127)
            out[i]["q"] = q[position]
            for i4 in range(4):
                for e in range(2):
                    out[i]["xmin"][e, i4] = out[i]["d"] * np.float32(sums[8 * e + 2 * i4] + sums[8 * e + 2 * i4 + 1])
                for hu in range(4):
                    out[i]["neg32"][hu, i4] = -32 * sums[8 * (hu // 2) + 2 * i4 + hu % 2]
    return out


def test_activations_are_quantized_as_the_rule_says_nans_ties_and_a_rows_tail_included():
    """The kernel's quantization of activation rows (eight values at a time) against the rule value by
    value: ties at a half, NaNs and infinities, a block of zeros, subnormals, a row that ends inside a block."""
    import ctypes

    rng = np.random.default_rng(7)
    width, k, m = 700, 768, 3
    x = (rng.normal(size=(m, width)) * 3).astype(np.float32)
    x[0, :256] = np.arange(256, dtype=np.float32) - 127.5  # after scaling by 127 / 127.5: ties everywhere
    x[0, 256:512] = 0.0
    x[1, 3], x[1, 300], x[1, 301] = np.nan, np.inf, -np.inf
    x[2, 10:20] = np.float32(1e-40)
    lib = kquant._lib()
    lib.sp_quantize_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_void_p]
    got = np.zeros(m * k // 256, BLOCKX)
    lib.sp_quantize_rows(x.ctypes.data, m, k, width, width, got.ctypes.data)
    want = np.concatenate([_quantized_as_the_rule_says(row, k) for row in x])
    for field in ("q", "neg32", "xmin", "d"):
        assert np.array_equal(got[field], want[field], equal_nan=True), field


@pytest.mark.parametrize("type_", [Q4_K, Q6_K])
def test_the_layer_computes_x_times_the_weights(type_):
    w = weight(type_, 96, 768, seed=1)
    bias = torch.randn(96)
    x = torch.randn(5, 768)
    want = x @ w.dequantize().T + bias
    got = KQuantLinear(w, bias)(x)
    # Only the activations' rounding to 8 bits per block of 256 separates the two.
    assert ((got - want).norm(dim=1) / want.norm(dim=1)).max() < 0.02


@pytest.mark.parametrize("type_", [Q4_K, Q6_K])
@pytest.mark.parametrize("isa", ISAS)
def test_every_block_size_gives_the_rows_alone_bits_at_one_and_two_threads(type_, isa, monkeypatch):
    monkeypatch.setattr(kquant, "isa", lambda: isa)
    layer = KQuantLinear([weight(type_, 80, 512, seed=2), weight(Q4_K, 48, 512, seed=5)])
    assert kquant.row_exact(layer, kquant.adversarial_rows(512, PROVED_ROWS))


@pytest.mark.parametrize("type_", [Q4_K, Q6_K])
@pytest.mark.parametrize("isa", ISAS)
def test_outputs_past_the_last_whole_group_of_columns_are_computed_too(type_, isa, monkeypatch):
    """The kernel takes the columns four (AVX2: two) at a time; 83 and a cut to 41 leave a short group."""
    monkeypatch.setattr(kquant, "isa", lambda: isa)
    w = weight(type_, 83, 512, seed=4)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    layer = KQuantLinear(w)
    got, want = layer(x), x @ w.dequantize().T
    assert ((got - want).norm(dim=0) / want.norm(dim=0)).max() < 0.03  # every output column
    assert torch.equal(layer.first_rows(41)(x), got[:, :41])
    assert kquant.row_exact(layer, kquant.adversarial_rows(512, 9))


def test_both_instruction_sets_give_the_same_bits(monkeypatch):
    if len(ISAS) < 2:
        pytest.skip("this CPU has one of the two paths")
    x = kquant.adversarial_rows(512, 9)
    outs = []
    for isa in ISAS:
        monkeypatch.setattr(kquant, "isa", lambda isa=isa: isa)
        outs.append(KQuantLinear([weight(Q6_K, 64, 512), weight(Q4_K, 32, 512)])(x))
    assert torch.equal(*outs)


def test_the_proof_fails_a_kernel_whose_rows_depend_on_their_block(monkeypatch):
    w = weight(Q4_K, 64, 256)
    assert kquant.prove([w])
    real = KQuantLinear.__call__

    def batch_dependent(self, x):  # what a kernel with another path for larger blocks would do
        y = real(self, x)
        return y * (1 + 1e-7) if x.reshape(-1, x.shape[-1]).shape[0] >= 33 else y

    monkeypatch.setattr(KQuantLinear, "__call__", batch_dependent)
    assert not kquant.prove([w])


def test_first_rows_share_the_blocks_and_cut_the_output():
    w = weight(Q6_K, 64, 256)
    x = torch.randn(3, 256)
    full = KQuantLinear(w)
    assert torch.equal(full.first_rows(40)(x), full(x)[:, :40])


def test_bad_shapes_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="multiples of 256"):
        KQuantWeight.from_raw(Q4_K, np.zeros((2, 144), dtype=np.uint8), 200)
    with pytest.raises(ValueError, match="takes 144 bytes"):
        KQuantWeight.from_raw(Q4_K, np.zeros((2, 100), dtype=np.uint8), 256)
    with pytest.raises(ValueError, match="Q4_K and Q6_K"):
        KQuantWeight.from_raw(8, np.zeros((2, 34 * 8), dtype=np.uint8), 256)


def _tiny_gguf_decoder(seed: int = 0, heads: int = 4):
    """A two-layer Qwen2 decoder on random k-quant blocks (hidden 256: one block per row), ``heads``
    attention heads over 2 key/value heads."""
    from specplay.core.models.native import NativeDecoder
    from tiny import tiny_hf_config

    from specplay.core.models.layers import DecoderConfig

    cfg = DecoderConfig.from_hf(tiny_hf_config(vocab=64, hidden=256, heads=heads, kv_heads=2, inter=512))
    gen = torch.Generator().manual_seed(seed)
    kv = 2 * 256 // heads
    shapes = {"q_proj": (256, 256), "k_proj": (kv, 256), "v_proj": (kv, 256), "o_proj": (256, 256),
              "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}
    tensors = {"model.embed_tokens.weight": weight(Q4_K, 64, 256, seed), "lm_head.weight": weight(Q6_K, 64, 256, seed),
               "model.norm.weight": torch.ones(256)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for k, (name, shape) in enumerate(shapes.items()):
            block = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            kind = Q6_K if name in ("v_proj", "down_proj") else Q4_K
            tensors[f"{p}.{block}.{name}.weight"] = weight(kind, *shape, seed=100 * i + k + seed)
            if name in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{p}.{block}.{name}.bias"] = torch.randn(shape[0], generator=gen) * 0.1
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(256)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(256)
    return NativeDecoder(cfg, tensors.get, name="tiny-gguf", storage="gguf", eos_token_ids=(2,))


@pytest.mark.parametrize("heads", [4, 8])  # heads of 64 values, and of 32 (attention's lanes past the last 64)
def test_a_gguf_model_verifies_like_it_decodes(heads):
    from tiny import block_and_singles

    a, b = _tiny_gguf_decoder(heads=heads), _tiny_gguf_decoder(heads=heads)
    assert a.info.dtype == "gguf" and a._fused is not None and a._kv.dtype == torch.float32
    block, singles = block_and_singles(a, b, [1, 5, 9, 13, 7, 3, 22, 40, 41, 17, 8, 30])
    assert torch.equal(block, singles)


def test_a_tree_verified_on_the_c_layer_gives_its_paths_decoded_alone():
    """Root r, its children c1 and c2 (the same position), c2's child g: the path r, c2, g read
    inside the tree gives the logits of r, c2, g decoded one at a time, bit for bit."""
    a, b = _tiny_gguf_decoder(seed=3), _tiny_gguf_decoder(seed=3)
    prompt, tree = [1, 5, 9, 13, 7], [22, 40, 41, 17]  # r, c1, c2, g
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    a.forward_chain(prompt, prefill=True)
    base = a.cache_len
    block = a.forward(torch.tensor(tree), positions=torch.tensor([base, base + 1, base + 1, base + 2]),
                      attn_mask=mask).logits
    b.forward_chain(prompt, prefill=True)
    alone = []
    for t in (22, 41, 17):
        alone.append(b.forward(torch.tensor([t])).logits)
        b.commit(1)
    assert torch.equal(block[[0, 2, 3]], torch.cat(alone))


@pytest.mark.parametrize("heads", [4, 8])
def test_the_c_layer_computes_torchs_layer(heads):
    """The one-call layers are the same function as the torch layers they replace: logits within
    float32 rounding (the norms' last bits can move an activation across a quantization step)."""
    fused, plain = _tiny_gguf_decoder(seed=1, heads=heads), _tiny_gguf_decoder(seed=1, heads=heads)
    plain._fused = None
    seq = [1, 5, 9, 13, 7, 3, 22, 40, 41, 17, 8, 30]
    got, want = (m.forward_chain(seq).logits for m in (fused, plain))
    assert (got - want).norm() / want.norm() < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_speculation_on_a_gguf_target_emits_greedy_decodings_tokens():
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import SpeculativeConfig
    from tiny import loaded

    target = loaded(_tiny_gguf_decoder(seed=0))
    draft = loaded(_tiny_gguf_decoder(seed=0))  # the same weights: every draft is accepted until it is not
    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    prompt = [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]
    want = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=5), target, draft)
    res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    assert res.token_ids == want.token_ids
    assert res.metrics.accepted > 0


def _knowing_eagle_head(target, path):
    """An EAGLE head trained briefly on the target's greedy answer to a prompt (its drafts are then
    mostly accepted there), saved to ``path``; returns (the prompt, the head file)."""
    from specplay.core.heads import EagleHead, head_config, save_heads
    from specplay.core.training.common import TrainSettings
    from specplay.core.training.eagle import train_eagle
    from tiny import greedy_continuations, target_features

    model, prompt = target.model, [4, 5, 6, 3, 7, 8, 4, 5, 6, 3, 7]
    answers = greedy_continuations(target, [prompt, prompt[::-1]], 40)  # the second is held out
    torch.manual_seed(0)
    head = EagleHead(head_config(model.cfg, 256))
    train_eagle(target_features(model, answers), head, model.embed, model.lm_head_weight(), torch.arange(64), 64,
                TrainSettings(steps=200, batch_size=8, lr=3e-3, eval_every=200, warmup=10), window=32)
    save_heads(path, dict(head.state_dict(), vocab_ids=torch.arange(64)),
               {"kind": "eagle", "target": "tiny", "hidden_size": 256, "vocab_size": 64, "intermediate_size": 256})
    return prompt, path


def test_beside_a_gguf_target_eagles_head_runs_on_fitted_blocks_in_one_c_call_and_stays_exact(tmp_path):
    """The head's layer on Q4_K blocks fitted to it, as one C call with its tree mask; the LM head's
    rows the target's own blocks. Its drafts differ from torch's layer on the same blocks by float
    rounding only (a tree's siblings each see their own path), and EAGLE still emits greedy's tokens."""
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.eagle import EagleConfig
    from tiny import assert_drafts_accepted, loaded

    target = loaded(_tiny_gguf_decoder(seed=0))
    prompt, path = _knowing_eagle_head(target, tmp_path / "head.safetensors")
    method = build_method("eagle", EagleConfig(head=str(path)), target)
    drafter = method.drafter
    assert drafter._fused is not None and isinstance(drafter.fc, KQuantLinear)
    assert isinstance(method.lm_rows, KQuantLinear) and method.lm_rows.parts[0].type == Q6_K

    # Two pairs in the cache, then a tree of two siblings and a child of the second.
    feats = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    c_layer, outs = drafter._fused, []
    for fused in (c_layer, None):
        drafter._fused = fused
        drafter.crop(0)
        drafter.run(feats[:2], [5, 9], torch.arange(2))
        outs.append(drafter.run(feats[2:], [13, 7, 3], torch.tensor([2, 2, 3]), mask))
    drafter._fused = c_layer
    got, want = outs
    assert (got - want).norm() / want.norm() < 1e-5

    gen = GenerationConfig(max_new_tokens=40, stop_at_eos=False, stand_down=False)
    plain = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    assert res.token_ids == plain.token_ids
    assert_drafts_accepted(res, 1.5)


def test_a_draft_matrix_fitted_into_q4_k_blocks_keeps_its_values_and_pads_its_rows():
    """A draft's matrix with rows of 896 (the 0.5B draft's, not a multiple of 256) fitted into Q4_K
    blocks: zero-padded to 1024 values a row, its values within 4-bit rounding, its layer the product."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 896, generator=gen) * 0.05
    w[3, 7] = 1.0  # an outlier takes its own 32-group's scale, not the row's
    q = KQuantWeight.quantize(w)
    assert (q.type, q.shape, q.cols) == (Q4_K, torch.Size((40, 896)), 1024)
    back = q.dequantize()
    assert back.shape == (40, 896)
    assert (back - w).norm() / w.norm() < 0.09  # 16 levels over each 32-group's range: about 7%
    assert abs(float(back[3, 7]) - 1.0) < 0.02
    x = torch.randn(5, 896, generator=gen)
    y, want = KQuantLinear(q)(x), x @ back.T
    assert y.shape == (5, 40) and (y - want).norm() / want.norm() < 0.02  # activations in int8


def test_fitted_blocks_are_kept_read_back_and_fitted_again_under_another_kernel(tmp_path, monkeypatch):
    from specplay.core.kernels import kernel_build
    from specplay.core.weights import cache

    q = KQuantWeight.quantize(torch.randn(8, 300))
    dest = tmp_path / cache.KQUANT_DRAFT_WEIGHTS
    gguf_blocks.save_blocks({"a.weight": q, "n.weight": torch.ones(3)}, dest)
    cache.record_weights(tmp_path, "kquant-draft")
    cache._checked.clear()  # as in a new process: the file of the recorded size and time is not read again
    monkeypatch.setattr(cache, "file_record", lambda path: pytest.fail("read through"))
    assert cache.check_weights(tmp_path, "kquant-draft") == "ok"
    monkeypatch.undo()
    reader = gguf_blocks.BlocksFileReader(dest)
    back = reader.get("a.weight")
    assert (back.type, back.rows, back.cols, back.width) == (Q4_K, 8, 512, 300) and torch.equal(back.data, q.data)
    assert torch.equal(reader.get("n.weight"), torch.ones(3)) and reader.get("b.weight") is None
    # Mapped, not copied: every read is a view of the one mapping, each tensor on a 64-byte boundary.
    assert reader.get("a.weight").data.data_ptr() == back.data.data_ptr() and back.data.data_ptr() % 64 == 0
    assert reader.get("n.weight").data_ptr() % 64 == 0
    assert KQuantLinear([back])(torch.ones(2, 300)).equal(KQuantLinear([q])(torch.ones(2, 300)))
    monkeypatch.setattr(kernel_build, "library_digest", lambda: "a kernel with another layout")
    assert cache.check_weights(tmp_path, "kquant-draft") == "stale"


@pytest.mark.parametrize("damage", ["cut", "index", "magic"])
def test_a_damaged_blocks_file_is_found_out_and_never_mapped(tmp_path, damage):
    """Cut short, its index overwritten or its magic lost: the cache's check calls it damaged (the
    size or checksum differs from the record), and a reader refuses it with the file's name."""
    from specplay.core.errors import ModelError
    from specplay.core.weights import cache

    dest = tmp_path / cache.KQUANT_WEIGHTS
    gguf_blocks.save_blocks({"a.weight": KQuantWeight.quantize(torch.randn(8, 256)), "n.weight": torch.ones(3)}, dest)
    cache.record_weights(tmp_path, "kquant")
    data = bytearray(dest.read_bytes())
    if damage == "cut":
        data = data[:len(data) // 2]
    elif damage == "index":
        data[20:40] = b"9" * 20
    else:
        data[:8] = b"NOTBLOCK"
    dest.write_bytes(bytes(data))  # written in place: another modification time, so its checksum is read
    assert cache.check_weights(tmp_path, "kquant") == "damaged"
    with pytest.raises(ModelError, match=cache.KQUANT_WEIGHTS):
        gguf_blocks.BlocksFileReader(dest).get("a.weight")


def test_a_gguf_draft_runs_on_fitted_blocks_fits_them_once_and_drafts_losslessly(tmp_path, monkeypatch):
    """A .gguf draft (float32 tensors, rows of 32) loads on the kernel without a conversion: its
    blocks fitted and kept in the cache at the first load, read back at the next; speculation with
    it emits greedy's tokens."""
    from specplay.core.decoding.engine import drain, generate
    from specplay.core.decoding.types import GenerationConfig
    from specplay.core.methods import build_method
    from specplay.core.methods.speculative import SpeculativeConfig
    from specplay.core.models import loader
    from specplay.core.weights.cache import KQUANT_DRAFT_WEIGHTS, check_weights
    from tiny import loaded, native_from_hf, tiny_hf_model, write_tiny_gguf

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, path)
    seen = []
    draft = loader.load_model(str(path), dtype="int8", role="draft", backend="native",
                              progress=lambda stage, fraction: seen.append((stage, fraction)))
    fitting = [f for s, f in seen if s.startswith("Fitting")]
    assert fitting[0] == 0.0 and fitting[-1] == 1.0 and fitting == sorted(fitting)  # a real fraction
    assert draft.model.storage == "kquant-draft" and draft.model.info.dtype == "kquant"
    assert check_weights(draft.path, "kquant-draft") == "ok"
    # The cache's folder holds the config, the tokenizer and the fitted blocks: nothing converted.
    assert sorted(p.name for p in draft.path.glob("weights-*")) == [KQUANT_DRAFT_WEIGHTS]
    monkeypatch.setattr(kquant.KQuantWeight, "quantize", lambda *a: pytest.fail("fitted again"))
    again = loader.load_model(str(path), dtype="int8", role="draft", backend="native")
    assert isinstance(again.model.linears["lm_head.weight"], KQuantLinear)
    assert (draft.path / KQUANT_DRAFT_WEIGHTS).is_file()

    target = loaded(native_from_hf(model, torch.float32, "int8"))
    gen = GenerationConfig(max_new_tokens=24, stop_at_eos=False, stand_down=False)
    prompt = [4, 5, 6, 3, 7, 8, 4, 5, 6]
    want = drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), prompt, gen))
    method = build_method("speculative", SpeculativeConfig(cost_sized=False, gamma=4), target, again)
    res = drain(generate(target.model, target.tokenizer, method, prompt, gen))
    assert res.token_ids == want.token_ids and res.metrics.accepted > 0


def test_a_first_load_runs_the_kquant_draft_without_trying_llamacpp_unless_it_was_timed_faster(tmp_path,
                                                                                             monkeypatch):
    """No 4-bit file to make and no child process on the critical path: ``auto`` runs the kernel's
    draft at once, and tries llama.cpp's only where `specplay models measure` timed it faster here."""
    from specplay.core.models import llamacpp, llamacpp_draft, loader, measurements
    from tiny import tiny_hf_model, write_tiny_gguf

    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measurements"))
    monkeypatch.setattr(llamacpp, "available", lambda: None)
    tried = []
    monkeypatch.setattr(llamacpp_draft, "load_llamacpp_draft", lambda *a: tried.append(a) or (None, []))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_hf_model(seed=3, dtype=torch.float32, vocab=64, hidden=32, inter=64), path)
    first = loader.load_model(str(path), dtype="auto", role="draft")
    assert first.model.storage == "kquant-draft" and tried == []
    assert any("specplay models measure" in note for note in first.notes)
    measurements.measured(loader._draft_choice_key(str(path)), lambda: {"llamacpp_won": True})
    loader.load_model(str(path), dtype="auto", role="draft")
    assert len(tried) == 1


def test_the_gguf_index_reads_what_gguf_reader_reads_and_refuses_a_cut_file(tmp_path):
    """The header read directly (an eleventh of a second, not GGUFReader's 11 s on the 1.5B file):
    the same tensors, shapes, types and bytes; the tokenizer's hash shared by files with one
    tokenizer; a file cut inside its header or its tensors is refused with a reason."""
    from gguf import GGUFReader

    from specplay.core.errors import ModelError
    from specplay.core.weights.gguf_index import GGUFIndex
    from tiny import tiny_hf_model, write_tiny_gguf

    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for seed, path in enumerate(paths):
        write_tiny_gguf(tiny_hf_model(seed=seed, dtype=torch.float32, vocab=64, hidden=32, inter=64), path)
    index = GGUFIndex(paths[0])
    theirs = GGUFReader(str(paths[0]))
    assert index.architecture == "qwen2" and len(index.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        ours = index.tensors[t.name]
        assert ours.shape == tuple(int(d) for d in t.shape) and ours.tensor_type == t.tensor_type
        assert np.array_equal(ours.data, np.asarray(t.data))
    assert GGUFIndex(paths[1]).tokenizer_digest == index.tokenizer_digest  # other weights, the same tokenizer
    data = paths[0].read_bytes()
    for size in (100, len(data) - 1000):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelError, match="ends inside its header|runs past the end"):
            GGUFIndex(cut)


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0"])
def test_a_drafts_32_value_blocks_are_fitted_straight_from_the_file_as_from_their_values(kind):
    """Q8_0 and Q5_0 matrices (the 0.5B draft's) fitted in C from their blocks give the same
    Q4_K blocks, bit for bit, as their values dequantized by gguf and then fitted."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[kind]
    values = np.random.default_rng(1).normal(0, 0.05, size=(24, 96)).astype(np.float32)
    raw = quantize(values, kind)
    fitted = KQuantWeight.fit_blocks(int(kind), raw, values.shape[1])
    want = KQuantWeight.quantize(torch.from_numpy(dequantize(raw, kind).copy()))
    assert (fitted.rows, fitted.width, fitted.cols) == (24, 96, 256) and torch.equal(fitted.data, want.data)


def test_an_embedding_beside_a_head_of_its_own_is_read_row_by_row_from_the_files_mapping(tmp_path):
    """The target's embedding is never repacked whole (131 MB of the 1.5B's blocks): its rows come
    from the file's mapping, with the values the repacked matrix has; a tied embedding (the head
    too) and a draft's stay in memory."""
    import gguf

    from specplay.core.kernels.kquant import MappedRows
    from specplay.core.weights.gguf_blocks import GGUFBlocksReader, GGUFDraftReader

    embedding, head = random_blocks(Q4_K, 64, 256, 1), random_blocks(Q6_K, 64, 256, 2)
    read = {}
    for with_head in (True, False):
        path = tmp_path / f"head-{with_head}.gguf"
        w = gguf.GGUFWriter(str(path), arch="qwen2")
        w.add_tensor("token_embd.weight", embedding, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        if with_head:
            w.add_tensor("output.weight", head, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        read[with_head] = GGUFBlocksReader(path).get("model.embed_tokens.weight")
        assert isinstance(GGUFDraftReader(path).get("model.embed_tokens.weight"), KQuantWeight)
    assert isinstance(read[True], MappedRows) and isinstance(read[False], KQuantWeight)
    assert read[True].shape == read[False].shape == (64, 256) and read[True].numel() == 64 * 256
    ids = torch.tensor([5, 0, 63, 5, 17])
    assert torch.equal(read[True].rows_float(ids), read[False].rows_float(ids))
    # A lookup keeps the ids' shape, as an embedding does (Hydra's heads look up [roots, nodes] at once).
    grid = torch.tensor([[5, 0, 63], [5, 17, 2]])
    for weight in read.values():
        looked_up = weight.rows_float(grid)
        assert looked_up.shape == (2, 3, 256)
        assert torch.equal(looked_up.reshape(6, 256), weight.rows_float(grid.reshape(-1)))
