"""The target's greedy answers to many prompts at once, for training data (self-distillation).

Training data for the heads needs many of the target's own answers; one sequence at a time
leaves a CPU idle (a pass over 16 rows costs ~1.8x a pass over one). Here ``slots`` sequences
decode together, each in its own row of a batched KV cache, and a finished slot takes the next
prompt at once (continuous batching). Each prompt is read by the model itself (its prefill),
whose cache is then copied into the slot; the decoding steps run the model's layers
(:mod:`specplay.core.models.layers`) over one row per live slot. Exactness does not matter here:
the rows are not meant to match single-sequence decoding bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specplay.core.errors import Cancelled
from specplay.core.models.layers import DecoderConfig, LayerWeights, apply_rope, attention_inputs, finish_layer
from specplay.core.models.native import NativeDecoder


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


def batched_layer(c: DecoderConfig, layer: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, visible: torch.Tensor,
                  dense: bool) -> torch.Tensor:
    """One decoder layer over one new token per sequence: ``x`` ``[m, hidden]`` for the cache rows
    ``rows`` at positions ``pos``, writing their keys and values into ``kv``
    (``[2, slots, kv_heads, capacity, head_dim]``) and attending to the ``visible`` slots of their
    own row. ``dense``: every row is live, so attention reads the cache itself, not a gathered copy."""
    m, length = x.shape[0], visible.shape[-1]
    q, k, v = (t[:, :, None] for t in attention_inputs(c, layer, x))  # [m, heads, 1, head_dim]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv[0, rows, :, pos] = k[:, :, 0]
    kv[1, rows, :, pos] = v[:, :, 0]
    keys = kv[0, :, :, :length] if dense else kv[0, rows, :, :length]
    values = kv[1, :, :, :length] if dense else kv[1, rows, :, :length]
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=c.num_kv_heads != c.num_heads)
    return finish_layer(c, layer, x, attn.reshape(m, c.num_heads * c.head_dim))


@torch.inference_mode()
def greedy_batch(model: NativeDecoder, prompts: Sequence[tuple[int, Sequence[int]]], max_new_tokens: int,
                 stop_ids: Sequence[int], on_done: Callable[[int, Generated], None], slots: int = 16,
                 should_cancel: Callable[[], bool] = lambda: False) -> None:
    """Greedy answers to ``prompts`` (key, token ids), keeping every position's feature and argmax.

    ``on_done(key, generated)`` receives each sequence as it finishes, in finishing order.
    """
    todo = list(prompts)
    if not todo:
        return
    slots = max(1, min(slots, len(todo)))
    batch = _Batch(model, slots, max(len(p) for _, p in todo) + max_new_tokens, max_new_tokens,
                   set(int(t) for t in stop_ids), on_done)
    for s in range(slots):
        batch.fill(s, todo)
    while batch.live():
        if should_cancel():
            raise Cancelled("generation cancelled")
        batch.step(todo)


class _Batch:
    """The sequences in the slots, and their batched cache."""

    def __init__(self, model: NativeDecoder, slots: int, capacity: int, max_new_tokens: int, stop: set[int],
                 on_done: Callable[[int, Generated], None]):
        c = model.cfg
        self.model, self.max_new_tokens, self.stop, self.on_done = model, max_new_tokens, stop, on_done
        self.kv = torch.zeros(c.num_layers, 2, slots, c.num_kv_heads, capacity, c.head_dim, dtype=model.compute_dtype,
                              device=model.device)
        self.state: list[dict | None] = [None] * slots

    def live(self) -> list[int]:
        return [s for s, st in enumerate(self.state) if st is not None]

    def finish(self, s: int) -> None:
        st = self.state[s]
        self.state[s] = None
        self.on_done(st["key"], Generated(tokens=torch.tensor(st["tokens"][:-1], dtype=torch.int32),
                                          features=torch.cat(st["features"]), labels=torch.cat(st["labels"]),
                                          prompt_len=st["prompt_len"]))

    def fill(self, s: int, todo: list) -> None:
        """Give slot ``s`` the next prompt of ``todo``: the model reads it and its cache is copied in."""
        model = self.model
        while todo and self.state[s] is None:
            key, ids = todo.pop(0)
            model.reset()
            out = model.forward(list(ids), hidden=True, prefill=True)
            n = len(ids)
            model.commit(n)
            self.kv[:, :, s, :, :n] = model.committed_kv().to(self.kv.dtype)
            label = out.logits.argmax(-1).to(torch.int32)
            self.state[s] = {"key": key, "tokens": list(ids) + [int(label[-1])], "features": [out.hidden.half()],
                             "labels": [label], "prompt_len": n, "pos": n}
            if int(label[-1]) in self.stop or self.max_new_tokens <= 1:
                self.finish(s)
        model.reset()

    def step(self, todo: list) -> None:
        """Decode one token in every live slot; a slot whose sequence finishes takes the next prompt."""
        model, c = self.model, self.model.cfg
        live = self.live()
        tokens = torch.tensor([self.state[s]["tokens"][-1] for s in live], device=model.device)
        pos = torch.tensor([self.state[s]["pos"] for s in live], device=model.device)
        rows = torch.tensor(live, device=model.device)
        cos, sin = model.rope(pos)
        cos, sin = cos[0][:, None, None], sin[0][:, None, None]
        visible = (torch.arange(int(pos.max()) + 1, device=model.device)[None] <= pos[:, None])[:, None, None]
        x = model.embed(tokens)
        dense = len(live) == len(self.state)
        for i, layer in enumerate(model.layers):
            x = batched_layer(c, layer, x, cos, sin, self.kv[i], rows, pos, visible, dense)
        normed = model.final_norm(x)
        labels = model.lm_logits(normed).argmax(-1).to(torch.int32)
        for j, s in enumerate(live):
            st = self.state[s]
            st["features"].append(normed[j:j + 1].half())
            st["labels"].append(labels[j:j + 1])
            st["tokens"].append(int(labels[j]))
            st["pos"] += 1
            if int(labels[j]) in self.stop or len(st["tokens"]) - st["prompt_len"] >= self.max_new_tokens:
                self.finish(s)
                self.fill(s, todo)
