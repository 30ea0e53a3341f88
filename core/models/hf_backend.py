"""The same :class:`CausalLM` interface over a ``transformers`` model.

This is the fallback for architectures the native path does not implement, and the
reference the native path is tested against. It passes a custom 4-D additive attention mask
and explicit ``position_ids``, keeps a ``DynamicCache``, and commits a subset of a block by
rebuilding each layer's key/value tensors.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo, expand_mask, keep_indices


class HFCausalLM(CausalLM):
    def __init__(self, model, *, name: str, eos_token_ids: Sequence[int] = ()):
        from transformers import DynamicCache

        self._DynamicCache = DynamicCache
        self.model = model.eval()
        cfg = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._len = 0
        self._pending = 0
        self._cache = DynamicCache(config=cfg)
        # transformers 5.x renamed ``past_key_values`` to ``cache`` in forward (old name deprecated).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._can_skip_logits = "logits_to_keep" in params
        self.info = ModelInfo(
            name=name,
            architecture=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_parameters=sum(p.numel() for p in model.parameters()),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            backend="transformers",
            eos_token_ids=tuple(eos_token_ids),
            max_positions=getattr(cfg, "max_position_embeddings", 32768),
        )

    @property
    def cache_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._cache = self._DynamicCache(config=self.model.config)
        self._len = 0
        self._pending = 0

    def _trim_pending(self) -> None:
        """Drop keys/values of an uncommitted block left by the previous forward."""
        if self._pending:
            for layer in self._cache.layers:
                if layer.is_initialized:
                    layer.keys = layer.keys[..., : self._len, :]
                    layer.values = layer.values[..., : self._len, :]
            self._pending = 0

    @torch.inference_mode()
    def forward(self, tokens, positions=None, attn_mask=None, *, hidden=False, layers=(),
                logit_rows=None, prefill=False) -> ForwardOutput:
        self._trim_pending()
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(1, -1)
        n = tokens.shape[1]
        if positions is None:
            positions = torch.arange(self._len, self._len + n, device=self.device)
        positions = torch.as_tensor(positions, dtype=torch.long, device=self.device).reshape(1, -1)
        mask = expand_mask(attn_mask, n, self._len, self.device)
        additive = torch.zeros(mask.shape, dtype=self.dtype, device=self.device)
        additive.masked_fill_(~mask, torch.finfo(self.dtype).min)
        want_states = hidden or bool(layers)
        skip = {"logits_to_keep": 1} if self._can_skip_logits and logit_rows is not None and not len(logit_rows) else {}
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=additive[None, None],
            use_cache=True,
            output_hidden_states=want_states,
            **{self._cache_kwarg: self._cache},
            **skip,
        )
        self._pending = n
        logits = out.logits[0] if logit_rows is None else out.logits[0][torch.as_tensor(logit_rows, dtype=torch.long)]
        result = ForwardOutput(logits=logits.float())
        if want_states:
            # hidden_states[0] is the embedding output, [i + 1] is layer i's output and the last
            # entry has the final norm applied.
            states = out.hidden_states
            if hidden:
                result.hidden = states[-1][0]
            result.layers = {i: states[i + 1][0] for i in layers}
        return result

    def commit(self, keep) -> None:
        idx = keep_indices(keep, self._pending)
        base = self._len
        sel = torch.tensor([base + i for i in idx], dtype=torch.long, device=self.device)
        for layer in self._cache.layers:
            if layer.is_initialized:
                layer.keys = torch.cat([layer.keys[..., :base, :], layer.keys.index_select(-2, sel)], dim=-2)
                layer.values = torch.cat([layer.values[..., :base, :], layer.values.index_select(-2, sel)], dim=-2)
        self._len += len(idx)
        self._pending = 0

    def crop(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"cannot crop a cache of {self._len} tokens to {length}")
        self._pending = 0
        for layer in self._cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self._len = length

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens.to(self.device))

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach().float()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(x)
