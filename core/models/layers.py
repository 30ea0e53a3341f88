"""The Llama / Qwen2 decoder layer: its shape (:class:`DecoderConfig`) and its computation.

One home for the pieces every user of such a layer shares: the native decoder
(:mod:`specplay.core.models.native`), the EAGLE heads (:mod:`specplay.core.heads.eagle`) and the
training's batched generation (:mod:`specplay.core.training.batched`). A layer is pre-norm:
``x + o(attention(rope(q), rope(k), v))``, then ``x + down(silu(gate) * up)``, with q/k/v and
gate/up each computed by one fused matrix (:class:`LayerWeights`). Callers own their caches and
attention layouts; the pieces here are the same arithmetic for all of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys ``x`` by their positions' angles (tables from :func:`rope_tables`)."""
    return x * cos + rotate_half(x) * sin


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos and sin ``[1, n, head_dim]`` for explicit positions (transformers' rotate-half layout)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype)[None], (emb.sin() * scaling).to(dtype)[None]


#: A layer's projections as it computes them (:class:`LayerWeights`), and the separate matrices,
#: by their checkpoint names, each is made of, in order: the decoder fuses a checkpoint's so, an
#: EAGLE drafter its head's, and a head started from a target layer splits them back so.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


class LayerWeights:
    """One decoder layer's weights: fused q/k/v and gate/up projections, output and down, two norms."""

    def __init__(self, qkv, o, gate_up, down, ln_in, ln_post):
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.ln_in, self.ln_post = ln_in, ln_post


def attention_inputs(c: DecoderConfig, layer: LayerWeights, x: torch.Tensor):
    """Rows ``x`` ``[n, hidden]`` -> q ``[n, heads, head_dim]``, k and v ``[n, kv_heads, head_dim]``
    (views of one fused projection of the normed rows, before RoPE)."""
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = layer.qkv(rms_norm(x, layer.ln_in, c.rms_norm_eps)).to(x.dtype)
    q = qkv[:, :q_size].unflatten(-1, (c.num_heads, c.head_dim))
    k = qkv[:, q_size: q_size + kv_size].unflatten(-1, (c.num_kv_heads, c.head_dim))
    v = qkv[:, q_size + kv_size:].unflatten(-1, (c.num_kv_heads, c.head_dim))
    return q, k, v


def finish_layer(c: DecoderConfig, layer: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The rest of the layer once attention is done: ``attn`` ``[n, heads * head_dim]`` through the
    output projection into the residual ``x``, then the gated MLP."""
    dt = x.dtype
    x = x + layer.o(attn.to(dt)).to(dt)
    h = rms_norm(x, layer.ln_post, c.rms_norm_eps)
    gate, up = layer.gate_up(h).to(dt).chunk(2, dim=-1)
    return x + layer.down(F.silu(gate) * up).to(dt)


#: The attention kernels layers may use on a GPU: cuDNN's is left out. It builds a plan for every new
#: shape, and decoding meets a new key length at every step: a random model of the 1.5B target's shapes
#: on an NVIDIA H200 in bfloat16 decoded at 64 ms a step with it, 14.7 ms without (docs/benchmarks.md).
_GPU_ATTENTION = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def attention_kernels(device: torch.device):
    """A context in which a pass's layers run (:func:`layer_forward`) on ``device``: on CUDA, SDPA limited
    to :data:`_GPU_ATTENTION`; elsewhere nothing changes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, name) for name in _GPU_ATTENTION])


def layer_forward(c: DecoderConfig, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv: torch.Tensor, base: int, mask4: torch.Tensor | None,
                  attn_dtype: torch.dtype | None = None, causal: bool = False) -> torch.Tensor:
    """One pre-norm decoder layer over ``n`` new rows ``x`` of one sequence, writing their keys and
    values into ``kv`` (``[2, kv_heads, capacity, head_dim]``) at slots ``base .. base + n`` and
    attending to slots ``0 .. base + n`` under ``mask4`` (None: everything; ``causal``: each row to
    itself and the rows before it, with ``base`` 0), in ``attn_dtype`` (default: the cache's)."""
    n = x.shape[0]
    end = base + n
    q, k, v = attention_inputs(c, layer, x)
    q = apply_rope(q.transpose(0, 1), cos, sin)
    kv[0, :, base:end] = apply_rope(k.transpose(0, 1), cos, sin)
    kv[1, :, base:end] = v.transpose(0, 1)
    adt = attn_dtype or kv.dtype
    attn = F.scaled_dot_product_attention(
        q[None].to(adt), kv[0, :, :end][None].to(adt), kv[1, :, :end][None].to(adt), attn_mask=mask4,
        is_causal=causal, enable_gqa=c.num_kv_heads != c.num_heads,
    )
    return finish_layer(c, layer, x, attn[0].transpose(0, 1).reshape(n, c.num_heads * c.head_dim))
