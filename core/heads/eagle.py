"""The EAGLE head: a projection of [token embedding, feature] (2h -> h) and one decoder layer.

Shared by the method (:mod:`specplay.core.methods.eagle`, which drafts with it) and the trainer
(:mod:`specplay.core.training.eagle`). The layer is shaped like the target's, so it can start from
the target's last layer (:func:`init_from_target_layer`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specplay.core.models.layers import DecoderConfig, LayerWeights, rms_norm, rope_tables, rotate_half


def head_config(target_cfg: DecoderConfig, intermediate: int | None = None) -> DecoderConfig:
    """The head's layer: the target's attention shape, optionally a narrower MLP."""
    from dataclasses import replace

    return replace(target_cfg, num_layers=1, intermediate_size=intermediate or target_cfg.intermediate_size)


class EagleHead(nn.Module):
    """Trainable EAGLE head (batched, causal over a window of positions)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h)
        self.q_proj = nn.Linear(h, q, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=cfg.o_bias)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq), persistent=False)
        with torch.no_grad():  # start by passing the feature through: f_{t+1} ~ f_t
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
            self.fc.bias.zero_()
            for lin in (self.o_proj, self.down_proj):
                lin.weight.mul_(0.1)

    def forward(self, embeds: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """``[B, T, h]`` token embeddings (x_{t+1}) and features (f_t) -> predicted f_{t+1}."""
        x, q, k, v = self._project(embeds, feats)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.cfg.num_kv_heads != self.cfg.num_heads)
        return self._finish(x, attn)

    def unrolled(self, embeds: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Predictions as drafting makes them, ``depth`` levels deep (the first is :meth:`forward`).

        At level j > 1, position t's input feature is level j-1's prediction from position
        t-1, and its query sees what the drafter's cache holds at that depth: the true
        pairs up to position t-j+1, then its own chain of predicted pairs, one per level.
        Positions t < j-1 have no such chain; their outputs are not meaningful.
        """
        c = self.cfg
        x, q, k, v = self._project(embeds, feats)
        rep = c.num_heads // c.num_kv_heads
        k1, v1 = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        outs = [self._finish(x, F.scaled_dot_product_attention(q, k1, v1, is_causal=True))]
        t = feats.shape[1]
        chain_k, chain_v = [], []  # levels 2..j: keys/values, shifted so index t is the chain of position t
        for level in range(2, depth + 1):
            prev = outs[-1]
            x, q, k, v = self._project(embeds, torch.cat([feats[:, :1], prev[:, :-1]], dim=1))
            chain_k = [F.pad(kk, (0, 0, 1, 0))[:, :, :t] for kk in chain_k] + [k.repeat_interleave(rep, 1)]
            chain_v = [F.pad(vv, (0, 0, 1, 0))[:, :, :t] for vv in chain_v] + [v.repeat_interleave(rep, 1)]
            scores = q @ k1.transpose(-1, -2) / math.sqrt(c.head_dim)
            visible = torch.ones(t, t, dtype=torch.bool, device=q.device).tril(-(level - 1))
            scores = scores.masked_fill(~visible, float("-inf"))
            diag = torch.stack([(q * kk).sum(-1) for kk in chain_k], dim=-1) / math.sqrt(c.head_dim)
            weights = torch.softmax(torch.cat([scores, diag], dim=-1), dim=-1)
            attn = weights[..., :t] @ v1 + sum(weights[..., t + i, None] * vv for i, vv in enumerate(chain_v))
            outs.append(self._finish(x, attn))
        return outs

    def _project(self, embeds: torch.Tensor, feats: torch.Tensor):
        c = self.cfg
        b, t, _ = feats.shape
        x = self.fc(torch.cat([embeds, feats], dim=-1))
        h = rms_norm(x, self.input_layernorm, c.rms_norm_eps)
        q = self.q_proj(h).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rope_tables(torch.arange(t), self.inv_freq, c.rope_scaling, q.dtype)
        return x, q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        h = rms_norm(x, self.post_attention_layernorm, self.cfg.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


@torch.no_grad()
def init_from_target_layer(head: EagleHead, layer: LayerWeights) -> None:
    """Start the head's decoder layer from one of the target's (usually its last).

    The head then begins as a layer that already reads the target's hidden states; only the
    input projection starts afresh (passing the feature through). Needs the head's MLP width
    to be the target's.
    """
    c = head.cfg
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = layer.qkv.dequantized_weight()
    gate_up = layer.gate_up.dequantized_weight()
    if gate_up.shape[0] != 2 * c.intermediate_size:
        raise ValueError(f"the head's MLP width {c.intermediate_size} is not the target layer's {gate_up.shape[0] // 2}")
    pairs = [(head.q_proj, qkv[:q_size], layer.qkv.bias, 0),
             (head.k_proj, qkv[q_size:q_size + kv_size], layer.qkv.bias, q_size),
             (head.v_proj, qkv[q_size + kv_size:], layer.qkv.bias, q_size + kv_size),
             (head.o_proj, layer.o.dequantized_weight(), layer.o.bias, 0),
             (head.gate_proj, gate_up[:c.intermediate_size], layer.gate_up.bias, 0),
             (head.up_proj, gate_up[c.intermediate_size:], layer.gate_up.bias, c.intermediate_size),
             (head.down_proj, layer.down.dequantized_weight(), layer.down.bias, 0)]
    for linear, weight, bias, offset in pairs:
        linear.weight.copy_(weight)
        if linear.bias is not None:
            linear.bias.copy_(bias[offset:offset + weight.shape[0]] if bias is not None else 0.0)
    head.input_layernorm.copy_(layer.ln_in.float())
    head.post_attention_layernorm.copy_(layer.ln_post.float())
