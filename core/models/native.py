"""A compact native implementation of the Llama / Qwen2 decoder family.

It loads the same weights as ``transformers`` and is tested against it, but owns what
speculation needs: a preallocated KV cache written by slot, explicit positions and masks,
commit of any subset of a block (chain prefix or tree path), and the choice of weight
storage (float, or row-exact int8 on x86 CPUs; see :mod:`specplay.core.kernels.linear`). A
layer's arithmetic is :mod:`specplay.core.models.layers`'; this module reads the weights into
layers and runs them over its cache.

Batch invariance. Lossless speculation at temperature 0 needs a token's logits to be the
same whether the token is decoded alone or verified inside a block. Float kernels choose
their blocking by shape, so a block changes the last bits of attention (about 1e-7
relative). In float storage that is harmless; with int8 activations it is not, because a
last-bit change can move a value across a quantization step and shift logits by ~0.05,
enough to flip near-ties. With int8 storage, attention therefore runs in float64 (keys and
values cached in float64): its shape-dependent rounding then almost never survives the
cast back to float32, and every other operation is row-wise or exact.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specplay.core.errors import ModelError
from specplay.core.kernels.kquant import FusedLayers, KQuantLinear, KQuantWeight, MappedRows, check_shapes
from specplay.core.kernels.linear import (EXACT_QUANTIZED, KQUANT_STORAGES, Int4DraftLinear, Int4Packed,
                                          QuantizedWeight, Storage, make_linear)
from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo, expand_mask, keep_indices
from specplay.core.models.layers import (FUSED, DecoderConfig, LayerWeights, attention_kernels, layer_forward, rms_norm,
                                         rope_tables)

log = logging.getLogger(__name__)

#: Storages on the k-quant kernel: a GGUF's own blocks (a target's, exact), or a draft's fitted ones.


def fused_name(prefixes: Sequence[str]) -> str:
    """The name of matrices computed as one (``…self_attn.q_proj+k_proj+v_proj``)."""
    return "+".join([prefixes[0]] + [p.rsplit(".", 1)[-1] for p in prefixes[1:]])


class _WeightBuilder:
    """Reads weights by their checkpoint names, one at a time, into a model's storage, and builds
    its linear layers on ``pool`` (int8: the kernel's slow weight packing) while reading goes on.

    ``linears`` holds every layer by its (fused) weight name, as a cache of prepared layers stores
    them: futures while building.
    """

    def __init__(self, get_tensor: Callable[[str], "torch.Tensor | QuantizedWeight | None"], device: torch.device,
                 dtype: torch.dtype, storage: Storage, pool: ThreadPoolExecutor):
        self.get_tensor, self.device, self.dtype, self.storage, self.pool = get_tensor, device, dtype, storage, pool
        self.quantized = storage != Storage.FLOAT
        self.linears: dict[str, Future] = {}

    def tensor(self, key: str, required: bool = True):
        t = self.get_tensor(key)
        if t is None:
            if required:
                raise KeyError(f"weight '{key}' missing from the checkpoint")
            return None
        if isinstance(t, (QuantizedWeight, Int4Packed, KQuantWeight, MappedRows)):
            return t
        # In int8, a kept float tensor (norms, biases) must not pin a memory-mapped file.
        return t.to(device=self.device, dtype=self.dtype, copy=self.quantized)

    def matrix(self, key: str, required: bool = True):
        w = self.tensor(key, required)
        if self.storage in KQUANT_STORAGES and isinstance(w, torch.Tensor):
            raise KeyError(f"weight '{key}' is not in k-quant blocks")
        return QuantizedWeight.quantize(w) if self.quantized and isinstance(w, torch.Tensor) else w

    def linear(self, prefixes: Sequence[str], bias: bool) -> Future:
        """The layer of matrices ``prefixes`` computed as one (q/k/v, gate/up), with their biases."""
        name = fused_name(prefixes) + ".weight"
        # A cache of int4 layers holds fused matrices, already packed for the kernel.
        weight = self.get_tensor(name) if self.storage == Storage.INT4_DRAFT and len(prefixes) > 1 else None
        if not isinstance(weight, Int4Packed):
            parts = [self.matrix(p + ".weight") for p in prefixes]
            if len(parts) == 1:
                weight = parts[0]
            elif self.storage in KQUANT_STORAGES:  # the kernel runs the parts one after another into one output
                weight = parts
            else:
                weight = QuantizedWeight.cat(parts) if self.quantized else torch.cat(parts, dim=0)
        b = torch.cat([self.tensor(p + ".bias") for p in prefixes], dim=0) if bias else None
        return self.submit(name, weight, b)

    def submit(self, name: str, weight, bias) -> Future:
        self.linears[name] = self.pool.submit(make_linear, weight, bias, self.storage)
        return self.linears[name]

    def decoder_layer(self, cfg: DecoderConfig, i: int) -> dict:
        """Layer ``i``'s parts: futures for its linear layers (:data:`FUSED`), its two norms' weights."""
        p = f"model.layers.{i}"
        block = {"qkv": f"{p}.self_attn", "o": f"{p}.self_attn", "gate_up": f"{p}.mlp", "down": f"{p}.mlp"}
        bias = {"qkv": cfg.qkv_bias, "o": cfg.o_bias, "gate_up": cfg.mlp_bias, "down": cfg.mlp_bias}
        parts = {fused: self.linear([f"{block[fused]}.{name}" for name in names], bias[fused])
                 for fused, names in FUSED.items()}
        return dict(**parts, ln_in=self.tensor(f"{p}.input_layernorm.weight"),
                    ln_post=self.tensor(f"{p}.post_attention_layernorm.weight"))


class NativeDecoder(CausalLM):
    """Llama/Qwen2 decoder with a preallocated, slot-addressed KV cache (batch size 1)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        get_tensor: Callable[[str], "torch.Tensor | QuantizedWeight | None"],
        *,
        name: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        storage: Storage = Storage.FLOAT,
        eos_token_ids: Sequence[int] = (),
    ):
        """Build from weights fetched one at a time by ``get_tensor(hf_name)`` (None if absent).

        ``dtype`` is the compute and cache dtype; ``storage`` (a :class:`Storage`) is floats (weights in
        ``dtype``), row-exact int8 linear weights computed in float32, a draft's int8, int4 or
        k-quant layers, or the GGUF's own blocks. In int8 the
        embedding is int8 rows with scales too (the same table for plain decoding and
        verification, so exactness holds), and ``get_tensor`` may hand over matrices already
        quantized (:class:`QuantizedWeight`, from the model cache). No float copy of the
        weights is kept, nor a view into the file they came from.
        """
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.storage = Storage(storage)
        try:
            separate_head = self._read_weights(get_tensor)
        except ValueError as exc:  # a matrix whose blocks or sizes disagree with each other (a damaged file)
            raise ModelError(f"{name}: {exc}") from None
        self._check_shapes(name)
        # On the k-quant kernel a layer is one C call (decoding and verification alike; a prompt's
        # prefill keeps torch's attention, which is faster over many rows).
        self._fused = (FusedLayers(cfg, self.layers)
                       if storage in KQUANT_STORAGES and FusedLayers.fits(cfg, self.layers) else None)
        self._inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32, device=self.device)

        self._kv = torch.empty(0)
        self._capacity = 0
        self._len = 0
        self._pending = 0
        self.reset()
        self.info = ModelInfo(
            name=name,
            architecture=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_parameters=self._count_parameters(separate_head),
            device=str(self.device),
            dtype=self.storage.split("-")[0] if self.storage != Storage.FLOAT else str(dtype).removeprefix("torch."),
            backend="native",
            eos_token_ids=tuple(eos_token_ids),
            max_positions=cfg.max_positions,
        )

    def _read_weights(self, get_tensor) -> "torch.Tensor | QuantizedWeight | None":
        """Set the embedding, the layers, the final norm and the LM head; return the head's own
        matrix when the checkpoint has one (None: tied to the embedding).

        Weights are read here, one layer at a time; building the layers runs on a pool meanwhile,
        at most two layers behind the reading.
        """
        cfg, storage = self.cfg, self.storage
        with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
            weights = _WeightBuilder(get_tensor, self.device, self.dtype, storage, pool)
            self._embedding = weights.matrix("model.embed_tokens.weight")
            # The head first: the largest matrix, packed while the layers are read, not after them.
            # A tied head is the embedding; an int4 cache stores it packed under the head's name, and a
            # GGUF may ship its own (the 1.5B target's is Q6_K, its embedding Q4_K).
            head = (weights.matrix("lm_head.weight", required=False)
                    if not cfg.tie_word_embeddings or storage in (Storage.INT4_DRAFT, *KQUANT_STORAGES) else None)
            weights.submit("lm_head.weight", self._embedding if head is None else head, None)
            pending: list[dict] = []
            for i in range(cfg.num_layers):
                pending.append(weights.decoder_layer(cfg, i))
                if i >= 2:
                    wait([f for f in pending[i - 2].values() if isinstance(f, Future)])
            self.norm_weight = weights.tensor("model.norm.weight")
            self.layers = [LayerWeights(**{k: v.result() if isinstance(v, Future) else v for k, v in layer.items()})
                           for layer in pending]
            self._head = weights.linears["lm_head.weight"].result()
        # Layers by their (fused) weight names, as a cache of prepared layers stores them.
        self.linears = {name: f.result() for name, f in weights.linears.items()}
        return head

    def _check_shapes(self, name: str) -> None:
        """Raise :class:`ModelError` naming ``name`` where the weights disagree with the config: the token
        embedding (every id of the vocabulary must be one of its rows), the final norm and, on the
        k-quant kernel, every layer's matrices (:func:`check_shapes`)."""
        cfg = self.cfg
        rows, width = self._embedding.shape
        if width != cfg.hidden_size or rows < cfg.vocab_size:
            raise ModelError(f"{name}: its metadata disagrees with its tensors: the token embedding is {rows} rows "
                             f"of {width} values, where a vocabulary of {cfg.vocab_size} tokens and a hidden size of "
                             f"{cfg.hidden_size} need {cfg.vocab_size} or more rows of {cfg.hidden_size}")
        if self.norm_weight.numel() != cfg.hidden_size:
            raise ModelError(f"{name}: its metadata disagrees with its tensors: the final norm has "
                             f"{self.norm_weight.numel()} values for a hidden size of {cfg.hidden_size}")
        if self.storage in KQUANT_STORAGES:
            check_shapes(cfg, self.layers, self._head, name)

    def _count_parameters(self, separate_head) -> int:
        cfg = self.cfg
        n_params = self._embedding.numel() + (
            0 if separate_head is None or cfg.tie_word_embeddings else separate_head.numel())
        return n_params + sum(
            (l.qkv.out_features * cfg.hidden_size + l.o.out_features * cfg.num_heads * cfg.head_dim
             + l.gate_up.out_features * cfg.hidden_size + l.down.out_features * cfg.intermediate_size)
            for l in self.layers
        )

    # ----------------------------------------------------------------- cache
    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._len = 0
        self._pending = 0
        if self._capacity == 0:
            self._grow(256)

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self._capacity, 256)
        c = self.cfg
        kv = torch.zeros(c.num_layers, 2, c.num_kv_heads, cap, c.head_dim, dtype=self._cache_dtype, device=self.device)
        if self._capacity:
            kv[:, :, :, : self._capacity] = self._kv
        self._kv, self._capacity = kv, cap

    @property
    def _cache_dtype(self) -> torch.dtype:
        # Row-exact storage (int8, the GGUF's blocks) on torch's layers: attention runs in float64 (see
        # the module doc), so the cache is kept in float64. The C layer's attention is row-invariant in
        # float32; a draft needs no exactness: float32.
        exact_on_torch = self.storage in EXACT_QUANTIZED and self._fused is None
        return torch.float64 if exact_on_torch else self.compute_dtype

    @torch.inference_mode()  # the cache may have been (re)allocated inside a forward pass
    def commit(self, keep) -> None:
        idx = keep_indices(keep, self._pending)
        if idx != list(range(len(idx))):
            base = self._len
            src = torch.tensor(idx, device=self.device) + base
            dst = torch.arange(len(idx), device=self.device) + base
            # Advanced indexing on the right makes a copy, so overlapping slots are safe.
            self._kv[:, :, :, dst] = self._kv[:, :, :, src]
        self._len += len(idx)
        self._pending = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a cache of {self._len} tokens to {length}")
        self._len = length
        self._pending = 0

    def committed_kv(self) -> torch.Tensor:
        """The committed tokens' keys and values, ``[layers, 2, kv_heads, cache_len, head_dim]`` (a view)."""
        return self._kv[:, :, :, : self._len]

    # --------------------------------------------------------------- compute
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embed_rows(tokens.to(self.device))

    def _embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self._embedding, QuantizedWeight):
            return self._embedding.rows(tokens)
        if isinstance(self._embedding, (KQuantWeight, MappedRows)):
            return self._embedding.rows_float(tokens)
        return F.embedding(tokens, self._embedding).to(self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the layers compute in: the model's dtype, float32 for quantized storage."""
        return torch.float32 if self.storage != Storage.FLOAT else self.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[1, n, head_dim]`` at ``positions``, in the compute dtype."""
        return rope_tables(positions, self._inv_freq, self.cfg.rope_scaling, self.compute_dtype)

    def lm_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, vocab]`` of final-norm hidden states ``[n, hidden]``."""
        return self._head(normed).float()

    def lm_head_weight(self) -> torch.Tensor:
        """The output embedding as a float32 ``[vocab, hidden]`` tensor (dequantized for int8)."""
        if isinstance(self._head, Int4DraftLinear):
            raise NotImplementedError("an int4 draft keeps no readable copy of its LM head; use head_rows")
        return self._head.dequantized_weight()

    def head_rows(self, rows):
        """As :meth:`CausalLM.head_rows`, sharing this model's blocks where it can."""
        if isinstance(self._head, KQuantLinear):
            return self._head.first_rows(rows) if isinstance(rows, int) else self._head.chosen_rows(rows)
        if isinstance(self._head, Int4DraftLinear) and isinstance(rows, int):
            return self._head.first_rows(rows)
        return super().head_rows(rows)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm_weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, tokens, positions=None, attn_mask=None, *, hidden=False, layers=(),
                logit_rows=None, prefill=False) -> ForwardOutput:
        c = self.cfg
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        n = tokens.numel()
        if n == 0:
            raise ValueError("forward needs at least one token")
        base = self._len
        if positions is None:
            positions = torch.arange(base, base + n, device=self.device)
        else:
            positions = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(-1)
        if base + n > self._capacity:
            self._grow(base + n)
        # One token attending to everything needs no mask; SDPA is faster without one. A prompt
        # read into an empty cache is plainly causal: SDPA then skips the blocks above the
        # diagonal instead of computing and masking them (0.3 s of a 1000-token prompt's 7.5 s).
        causal = prefill and base == 0 and attn_mask is None and n > 1
        mask = None if ((n == 1 and attn_mask is None) or causal) else expand_mask(attn_mask, n, base, self.device)
        if mask is not None and bool(mask.all()):
            mask = None
        mask4 = None if mask is None else mask[None, None]

        dt = self.compute_dtype
        # Row-exact storage only (int8, the GGUF's blocks): a prompt is read alike by every method, so
        # the float64 attention that keeps its decoding and verification row-exact is not needed there
        # (on a long prompt it cost a third of the time). A float64 model keeps float64 everywhere: it is the exact reference.
        attn_dtype = torch.float32 if prefill and self.storage in EXACT_QUANTIZED else None
        cos, sin = self.rope(positions)
        x = self._embed_rows(tokens).to(dt)
        wanted = set(layers)
        layer_out: dict[int, torch.Tensor] = {}
        if self._fused is not None and not prefill:
            x, cos, sin = x.contiguous(), cos[0].contiguous(), sin[0].contiguous()
            start = 0
            for stop in sorted({i + 1 for i in wanted if 0 <= i < len(self.layers)} | {len(self.layers)}):
                self._fused.run_span(start, stop, x, cos, sin, self._kv[start:stop], base, mask, causal)
                if stop - 1 in wanted:
                    layer_out[stop - 1] = x.clone()
                start = stop
        else:
            with attention_kernels(self.device):
                for i, layer in enumerate(self.layers):
                    x = layer_forward(c, layer, x, cos, sin, self._kv[i], base, mask4, attn_dtype, causal)
                    if i in wanted:
                        layer_out[i] = x
        self._pending = n
        normed = self.final_norm(x)
        head_in = normed if logit_rows is None else normed[torch.as_tensor(logit_rows, dtype=torch.long)]
        if head_in.shape[0]:
            logits = self.lm_logits(head_in)
        else:  # nobody reads them (a prefill): skip the costliest layer
            logits = torch.empty(0, c.vocab_size, device=self.device)
        return ForwardOutput(logits=logits, hidden=normed if hidden else None, layers=layer_out)
