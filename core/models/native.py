"""A compact native implementation of the Llama / Qwen2 decoder family.

It loads the same weights as ``transformers`` and is tested against it, but owns what
speculation needs: a preallocated KV cache written by slot, explicit positions and masks,
commit of any subset of a block (chain prefix or tree path), and the choice of weight
storage (float, or row-exact int8 on x86 CPUs; see :mod:`specplay.core.models.linear`).

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
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo, expand_mask, keep_indices
from specplay.core.models.linear import Int4DraftLinear, Int4Packed, QuantizedWeight, make_linear

log = logging.getLogger(__name__)

#: ``model_type`` values the native path implements.
NATIVE_ARCHITECTURES = ("qwen2", "llama")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    max_positions: int
    inv_freq: tuple[float, ...]
    rope_scaling: float

    @staticmethod
    def from_hf(cfg) -> "DecoderConfig":
        """Build from a ``transformers`` config; raise ``NotImplementedError`` with the reason if unsupported."""
        reason = unsupported_reason(cfg)
        if reason:
            raise NotImplementedError(reason)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        inv_freq, scaling = rope_frequencies(cfg, head_dim)
        if cfg.model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:
            qkv_bias = o_bias = bool(getattr(cfg, "attention_bias", False))
            mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        return DecoderConfig(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_positions=getattr(cfg, "max_position_embeddings", 32768),
            inv_freq=tuple(inv_freq.tolist()),
            rope_scaling=scaling,
        )


def _rope_parameters(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return params
    scaling = getattr(cfg, "rope_scaling", None) or {}
    return {"rope_type": scaling.get("rope_type", "default"), "rope_theta": getattr(cfg, "rope_theta", 10000.0), **scaling}


def unsupported_reason(cfg) -> str | None:
    """Why the native path cannot run this config, or None if it can."""
    mt = getattr(cfg, "model_type", "?")
    if mt not in NATIVE_ARCHITECTURES:
        return f"architecture '{mt}' is not implemented natively (native: {', '.join(NATIVE_ARCHITECTURES)})"
    if mt == "qwen2" and getattr(cfg, "use_sliding_window", False):
        return "Qwen2 with sliding-window attention is not implemented natively"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation '{cfg.hidden_act}' is not implemented natively"
    params = _rope_parameters(cfg)
    if params.get("rope_type", "default") not in ("default", "linear", "llama3"):
        return f"RoPE type '{params.get('rope_type')}' is not implemented natively"
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings are not implemented natively"
    return None


def rope_frequencies(cfg, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies ``[head_dim/2]`` and the cos/sin scaling factor."""
    params = _rope_parameters(cfg)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
    return inv_freq.float(), float(scaling)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' RMSNorm: normalise in float32, then scale.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fused_name(prefixes: Sequence[str]) -> str:
    """The name of matrices computed as one (``…self_attn.q_proj+k_proj+v_proj``)."""
    return "+".join([prefixes[0]] + [p.rsplit(".", 1)[-1] for p in prefixes[1:]])


class LayerWeights:
    """One decoder layer's weights: fused q/k/v and gate/up projections, output and down, two norms."""

    def __init__(self, qkv, o, gate_up, down, ln_in, ln_post):
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.ln_in, self.ln_post = ln_in, ln_post


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos and sin ``[1, n, head_dim]`` for explicit positions (transformers' rotate-half layout)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[None], (emb.sin() * scaling).to(dtype)[None]


def layer_forward(c: DecoderConfig, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv: torch.Tensor, base: int, mask4: torch.Tensor | None,
                  attn_dtype: torch.dtype | None = None, causal: bool = False) -> torch.Tensor:
    """One pre-norm decoder layer over ``n`` new rows ``x``, writing their keys and values into
    ``kv`` (``[2, kv_heads, capacity, head_dim]``) at slots ``base .. base + n`` and attending
    to slots ``0 .. base + n`` under ``mask4`` (None: everything; ``causal``: each row to itself
    and the rows before it, with ``base`` 0), in ``attn_dtype`` (default: the cache's)."""
    n = x.shape[0]
    dt = x.dtype
    q_size = c.num_heads * c.head_dim
    kv_size = c.num_kv_heads * c.head_dim
    end = base + n
    h = rms_norm(x, layer.ln_in, c.rms_norm_eps)
    qkv = layer.qkv(h).to(dt)
    q = qkv[:, :q_size].view(n, c.num_heads, c.head_dim).transpose(0, 1)
    k = qkv[:, q_size: q_size + kv_size].view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
    v = qkv[:, q_size + kv_size:].view(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    kv[0, :, base:end] = k
    kv[1, :, base:end] = v
    adt = attn_dtype or kv.dtype
    attn = F.scaled_dot_product_attention(
        q[None].to(adt), kv[0, :, :end][None].to(adt), kv[1, :, :end][None].to(adt), attn_mask=mask4,
        is_causal=causal, enable_gqa=c.num_kv_heads != c.num_heads,
    )
    x = x + layer.o(attn[0].transpose(0, 1).reshape(n, q_size).to(dt)).to(dt)
    h = rms_norm(x, layer.ln_post, c.rms_norm_eps)
    gate, up = layer.gate_up(h).to(dt).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up).to(dt)


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
        storage: str = "float",
        eos_token_ids: Sequence[int] = (),
    ):
        """Build from weights fetched one at a time by ``get_tensor(hf_name)`` (None if absent).

        ``dtype`` is the compute and cache dtype; ``storage`` is ``"float"`` (weights in
        ``dtype``), ``"int8"`` (row-exact int8 linear weights, computed in float32) or
        ``"int8-draft"`` (int8 for a draft model: faster, not batch-invariant). In int8 the
        embedding is int8 rows with scales too (the same table for plain decoding and
        verification, so exactness holds), and ``get_tensor`` may hand over matrices already
        quantized (:class:`QuantizedWeight`, from the model cache). No float copy of the
        weights is kept, nor a view into the file they came from.
        """
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.storage = storage

        quantized = storage != "float"

        def tensor(key: str, required: bool = True):
            t = get_tensor(key)
            if t is None:
                if required:
                    raise KeyError(f"weight '{key}' missing from the checkpoint")
                return None
            if isinstance(t, (QuantizedWeight, Int4Packed)):
                return t
            # In int8, a kept float tensor (norms, biases) must not pin a memory-mapped file.
            return t.to(device=self.device, dtype=dtype, copy=quantized)

        def matrix(key: str, required: bool = True):
            w = tensor(key, required)
            return QuantizedWeight.quantize(w) if quantized and isinstance(w, torch.Tensor) else w

        # Weights are read here, one layer at a time; building the layers (int8: the kernel's
        # slow weight packing) runs on a pool meanwhile, at most two layers behind the reading.
        pool = ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads()))

        # Layers by their (fused) weight names, as a cache of prepared layers stores them
        # (futures while building, the layers once built).
        self.linears: dict[str, object] = {}

        def linear(prefixes: Sequence[str], bias: bool) -> Future:
            name = fused_name(prefixes) + ".weight"
            # A cache of int4 layers holds fused matrices, already packed for the kernel.
            weight = get_tensor(name) if storage == "int4-draft" and len(prefixes) > 1 else None
            if not isinstance(weight, Int4Packed):
                parts = [matrix(p + ".weight") for p in prefixes]
                if len(parts) == 1:
                    weight = parts[0]
                else:
                    weight = QuantizedWeight.cat(parts) if quantized else torch.cat(parts, dim=0)
            b = torch.cat([tensor(p + ".bias") for p in prefixes], dim=0) if bias else None
            self.linears[name] = pool.submit(make_linear, weight, b, storage)
            return self.linears[name]

        with pool:
            self._embedding = matrix("model.embed_tokens.weight")
            # The head first: the largest matrix, packed while the layers are read, not after them.
            # A tied head is the embedding; an int4 cache stores it packed under the head's name.
            head = (matrix("lm_head.weight", required=False)
                    if not cfg.tie_word_embeddings or storage == "int4-draft" else None)
            self.linears["lm_head.weight"] = pool.submit(make_linear, self._embedding if head is None else head,
                                                         None, storage)
            pending: list[dict] = []
            for i in range(cfg.num_layers):
                p = f"model.layers.{i}"
                attn = f"{p}.self_attn"
                pending.append(dict(
                    qkv=linear([f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], cfg.qkv_bias),
                    o=linear([f"{attn}.o_proj"], cfg.o_bias),
                    gate_up=linear([f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], cfg.mlp_bias),
                    down=linear([f"{p}.mlp.down_proj"], cfg.mlp_bias),
                    ln_in=tensor(f"{p}.input_layernorm.weight"),
                    ln_post=tensor(f"{p}.post_attention_layernorm.weight"),
                ))
                if i >= 2:
                    wait([f for f in pending[i - 2].values() if isinstance(f, Future)])
            self.norm_weight = tensor("model.norm.weight")
            self.layers = [LayerWeights(**{k: v.result() if isinstance(v, Future) else v for k, v in layer.items()})
                           for layer in pending]
            self._head = self.linears["lm_head.weight"].result()
        self.linears = {name: f.result() for name, f in self.linears.items()}
        self._inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32, device=self.device)

        self._kv = torch.empty(0)
        self._capacity = 0
        self._len = 0
        self._pending = 0
        self.reset()

        n_params = self._embedding.numel() + (0 if head is None or cfg.tie_word_embeddings else head.numel())
        n_params += sum(
            (l.qkv.out_features * cfg.hidden_size + l.o.out_features * cfg.num_heads * cfg.head_dim
             + l.gate_up.out_features * cfg.hidden_size + l.down.out_features * cfg.intermediate_size)
            for l in self.layers
        )
        self.info = ModelInfo(
            name=name,
            architecture=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_parameters=n_params,
            device=str(self.device),
            dtype=storage.split("-")[0] if storage != "float" else str(dtype).removeprefix("torch."),
            backend="native",
            eos_token_ids=tuple(eos_token_ids),
            max_positions=cfg.max_positions,
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
        # Row-exact int8: attention runs in float64 (see the module doc), so the cache is kept in
        # float64. A draft's int8 needs no exactness: float32.
        return torch.float64 if self.storage == "int8" else self._compute_dtype

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

    # --------------------------------------------------------------- compute
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._embed_rows(tokens.to(self.device))

    def _embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        if isinstance(self._embedding, QuantizedWeight):
            return self._embedding.rows(tokens)
        return F.embedding(tokens, self._embedding).to(self._compute_dtype)

    @property
    def _compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.storage != "float" else self.dtype

    def lm_head_weight(self) -> torch.Tensor:
        """The output embedding as a float32 ``[vocab, hidden]`` tensor (dequantized for int8)."""
        if isinstance(self._head, Int4DraftLinear):
            raise NotImplementedError("an int4 draft keeps no readable copy of its LM head; use head_rows")
        return self._head.dequantized_weight()

    def head_rows(self, rows: int):
        """A linear layer for the LM head's first ``rows`` outputs, in this model's storage."""
        if isinstance(self._head, Int4DraftLinear):
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

        dt = self._compute_dtype
        # Row-exact int8 only: a prompt is read alike by every method, so the float64 attention that
        # keeps its decoding and verification row-exact is not needed there (on a long prompt it cost
        # a third of the time). A float64 model keeps float64 everywhere: it is the exact reference.
        attn_dtype = torch.float32 if prefill and self.storage == "int8" else None
        cos, sin = rope_tables(positions, self._inv_freq, c.rope_scaling, dt)
        x = self._embed_rows(tokens).to(dt)
        wanted = set(layers)
        layer_out: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer_forward(c, layer, x, cos, sin, self._kv[i], base, mask4, attn_dtype, causal)
            if i in wanted:
                layer_out[i] = x
        self._pending = n
        normed = self.final_norm(x)
        head_in = normed if logit_rows is None else normed[torch.as_tensor(logit_rows, dtype=torch.long)]
        if head_in.shape[0]:
            logits = self._head(head_in).float()
        else:  # nobody reads them (a prefill): skip the costliest layer
            logits = torch.empty(0, c.vocab_size, device=self.device)
        return ForwardOutput(logits=logits, hidden=normed if hidden else None, layers=layer_out)


@dataclass
class Generated:
    """One sequence from :func:`greedy_batch`.

    ``tokens`` ``[T]``: the prompt, then the answer without its last token; ``features``
    ``[T, hidden]`` float16: the final-norm hidden state at each of them; ``labels`` ``[T]``:
    the model's argmax there (so ``labels[-1]`` is the answer's last token).
    """

    tokens: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    prompt_len: int


@torch.inference_mode()
def greedy_batch(model: NativeDecoder, prompts: Sequence[tuple[int, Sequence[int]]], max_new_tokens: int,
                 stop_ids: Sequence[int], on_done: Callable[[int, Generated], None], slots: int = 16,
                 should_cancel: Callable[[], bool] = lambda: False) -> None:
    """Greedy answers to many prompts at once, keeping every position's feature and argmax.

    Training data for the heads (self-distillation) needs many of the target's own answers;
    one sequence at a time leaves a CPU idle (a pass over 16 rows costs ~1.8x a pass over
    one). ``slots`` sequences decode together, each in its own row of the cache, and
    a finished slot takes the next prompt at once (continuous batching). Exactness does not
    matter here: the rows are not meant to match single-sequence decoding bit for bit.
    ``on_done(key, generated)`` receives each sequence as it finishes, in finishing order.
    """
    from specplay.core.errors import Cancelled

    c = model.cfg
    dt = model._compute_dtype
    todo = list(prompts)
    if not todo:
        return
    slots = max(1, min(slots, len(todo)))
    capacity = max(len(p) for _, p in todo) + max_new_tokens
    kv = torch.zeros(c.num_layers, 2, slots, c.num_kv_heads, capacity, c.head_dim, dtype=dt, device=model.device)
    stop = set(int(t) for t in stop_ids)
    state: list[dict | None] = [None] * slots
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def finish(s: int) -> None:
        st = state[s]
        state[s] = None
        on_done(st["key"], Generated(tokens=torch.tensor(st["tokens"][:-1], dtype=torch.int32),
                                     features=torch.cat(st["features"]), labels=torch.cat(st["labels"]),
                                     prompt_len=st["prompt_len"]))

    def fill(s: int) -> None:
        while todo and state[s] is None:
            key, ids = todo.pop(0)
            model.reset()
            out = model.forward(list(ids), hidden=True, prefill=True)
            n = len(ids)
            kv[:, :, s, :, :n] = model._kv[:, :, :, :n].to(dt)
            label = out.logits.argmax(-1).to(torch.int32)
            state[s] = {"key": key, "tokens": list(ids) + [int(label[-1])], "features": [out.hidden.half()],
                        "labels": [label], "prompt_len": n, "pos": n}
            if int(label[-1]) in stop or max_new_tokens <= 1:
                finish(s)
        model.reset()

    for s in range(slots):
        fill(s)
    while any(st is not None for st in state):
        if should_cancel():
            raise Cancelled("generation cancelled")
        live = [s for s in range(slots) if state[s] is not None]
        tokens = torch.tensor([state[s]["tokens"][-1] for s in live], device=model.device)
        pos = torch.tensor([state[s]["pos"] for s in live], device=model.device)
        rows = torch.tensor(live, device=model.device)
        m, length = len(live), int(pos.max()) + 1
        cos, sin = rope_tables(pos, model._inv_freq, c.rope_scaling, dt)
        cos, sin = cos[0][:, None, None], sin[0][:, None, None]
        visible = (torch.arange(length, device=model.device)[None] <= pos[:, None])[:, None, None]
        x = model._embed_rows(tokens).to(dt)
        dense = m == slots  # all slots live: attend over cache views instead of gathered copies
        for i, layer in enumerate(model.layers):
            h = rms_norm(x, layer.ln_in, c.rms_norm_eps)
            qkv = layer.qkv(h).to(dt)
            q = qkv[:, :q_size].view(m, c.num_heads, 1, c.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(m, c.num_kv_heads, 1, c.head_dim)
            v = qkv[:, q_size + kv_size:].view(m, c.num_kv_heads, 1, c.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            kv[i, 0, rows, :, pos] = k[:, :, 0]
            kv[i, 1, rows, :, pos] = v[:, :, 0]
            keys = kv[i, 0, :, :, :length] if dense else kv[i, 0, rows, :, :length]
            values = kv[i, 1, :, :, :length] if dense else kv[i, 1, rows, :, :length]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible,
                                                  enable_gqa=c.num_kv_heads != c.num_heads)
            x = x + layer.o(attn.reshape(m, q_size)).to(dt)
            h = rms_norm(x, layer.ln_post, c.rms_norm_eps)
            gate, up = layer.gate_up(h).to(dt).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up).to(dt)
        normed = model.final_norm(x)
        labels = model._head(normed).float().argmax(-1).to(torch.int32)
        for j, s in enumerate(live):
            st = state[s]
            st["features"].append(normed[j:j + 1].half())
            st["labels"].append(labels[j:j + 1])
            st["tokens"].append(int(labels[j]))
            st["pos"] += 1
            if int(labels[j]) in stop or len(st["tokens"]) - st["prompt_len"] >= max_new_tokens:
                finish(s)
                fill(s)
