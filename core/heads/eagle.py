"""The EAGLE head: a projection of [token embedding, feature] (2h -> h) and one decoder layer.

One concept, two forms of the same weights: :class:`EagleHead` is the trainable module
(batched, causal over a window; :mod:`specplay.core.training.eagle`), :class:`EagleDrafter` the
head at inference, with its own KV cache and tree masks (:mod:`specplay.core.methods.eagle`
drafts with it, training's simulated τ too). The head keeps the q/k/v and gate/up projections
apart, as its files store them; the drafter runs them fused, as the decoder's layers do
(:data:`specplay.core.models.layers.FUSED` says how, in both directions). The layer is shaped
like the target's, so it can start from the target's last layer (:func:`init_from_target_layer`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specplay.core.kernels.kquant import FusedLayers
from specplay.core.kernels.linear import make_linear
from specplay.core.models.layers import (FUSED, DecoderConfig, LayerWeights, apply_rope, attention_kernels,
                                         layer_forward, rms_norm, rope_tables)


def head_config(target_cfg: DecoderConfig, intermediate: int | None = None) -> DecoderConfig:
    """The head's layer: the target's attention shape, optionally a narrower MLP."""
    from dataclasses import replace

    return replace(target_cfg, num_layers=1, intermediate_size=intermediate or target_cfg.intermediate_size)


class EagleHead(nn.Module):
    """Trainable EAGLE head (batched, causal over a window of positions).

    Its layer keeps the projections apart, as its files store them; :class:`EagleDrafter` runs the
    same weights fused (:data:`~specplay.core.models.layers.FUSED`) through the decoder's layer code.
    """

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
        return x, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

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
    if layer.gate_up.out_features != 2 * c.intermediate_size:
        raise ValueError(f"the head's MLP width {c.intermediate_size} is not the target layer's "
                         f"{layer.gate_up.out_features // 2}")
    for fused, names in FUSED.items():
        target = getattr(layer, fused)
        parts = [getattr(head, name) for name in names]
        sizes = [part.out_features for part in parts]
        biases = target.bias.split(sizes) if target.bias is not None else [None] * len(parts)
        for part, weight, bias in zip(parts, target.dequantized_weight().split(sizes), biases):
            part.weight.copy_(weight)
            if part.bias is not None:
                part.bias.copy_(bias if bias is not None else 0.0)
    head.input_layernorm.copy_(layer.ln_in.float())
    head.post_attention_layernorm.copy_(layer.ln_post.float())


class EagleDrafter:
    """The head at inference: its own KV cache, explicit positions and tree masks (batch size 1).

    Built from a head's weights (a head file's tensors, or :meth:`from_head`), with its layers in
    ``storage`` (:func:`specplay.core.kernels.linear.make_linear`) and computed in float32; ``embed``
    is the target's token embedding.
    """

    def __init__(self, cfg: DecoderConfig, weights: dict[str, torch.Tensor], storage: str, embed,
                 device: str = "cpu"):
        self.device = torch.device(device)
        self.cfg = cfg
        self.embed = embed
        self.fc = make_linear(self._weight(weights, "fc.weight"), self._bias(weights, "fc.bias"), storage)
        linears = {fused: self._fused_linear(weights, names, storage) for fused, names in FUSED.items()}
        self.layer = LayerWeights(**linears, ln_in=self._weight(weights, "input_layernorm"),
                                  ln_post=self._weight(weights, "post_attention_layernorm"))
        # On k-quant blocks the layer is one C call (norm, projections, RoPE, cache write, tree-masked
        # attention, MLP), as the target's are: torch's forty small operations cost more than its arithmetic.
        self._fused = FusedLayers(cfg, [self.layer]) if FusedLayers.fits(cfg, [self.layer]) else None
        self.inv_freq = torch.tensor(cfg.inv_freq, device=self.device)
        self.kv = torch.zeros(2, cfg.num_kv_heads, 256, cfg.head_dim, device=self.device)
        self.len = 0

    @classmethod
    def from_head(cls, head: EagleHead, storage: str, embed) -> "EagleDrafter":
        """The drafter of a trainable head's current weights (on the CPU)."""
        return cls(head.cfg, {k: v.detach().float() for k, v in head.state_dict().items()}, storage, embed)

    def _weight(self, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return weights[name].float().to(self.device)

    def _bias(self, weights: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        return self._weight(weights, name) if name in weights else None

    def _fused_linear(self, weights: dict[str, torch.Tensor], names: tuple[str, ...], storage: str):
        """The head's projections ``names`` as one layer (a bias where each of them has one)."""
        biases = [self._bias(weights, name + ".bias") for name in names]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        return make_linear(torch.cat([self._weight(weights, name + ".weight") for name in names]), bias, storage)

    def run(self, feats: torch.Tensor, tokens: list[int], positions: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``n`` (feature, token) pairs; return the predicted next features ``[n, h]``.

        ``mask``: ``[n, len + n]`` boolean over (cache, new); None = causal chain.
        """
        n = len(tokens)
        if self.len + n > self.kv.shape[2]:
            grown = torch.zeros(2, self.cfg.num_kv_heads, max(2 * self.kv.shape[2], self.len + n), self.cfg.head_dim,
                                device=self.device)
            grown[:, :, : self.len] = self.kv[:, :, : self.len]
            self.kv = grown
        if mask is None and n > 1:
            mask = torch.ones(n, self.len + n, dtype=torch.bool)
            mask[:, self.len:] = torch.ones(n, n, dtype=torch.bool).tril()
        if mask is not None:
            mask = mask.to(self.device)
        positions = positions.to(self.device)
        emb = self.embed(torch.tensor(tokens, device=self.device)).float()
        x = self.fc(torch.cat([emb, feats.float()], dim=-1))
        cos, sin = rope_tables(positions, self.inv_freq, self.cfg.rope_scaling, torch.float32)
        if self._fused is not None:
            out = x.contiguous()  # updated in place
            self._fused.run(0, out, cos[0].contiguous(), sin[0].contiguous(), self.kv, self.len, mask, causal=False)
        else:
            with attention_kernels(self.device):
                out = layer_forward(self.cfg, self.layer, x, cos, sin, self.kv, self.len,
                                    None if mask is None else mask[None, None])
        self.len += n
        return out

    def crop(self, length: int) -> None:
        self.len = min(self.len, length)
