"""The model interface that speculative methods drive.

A :class:`CausalLM` holds one sequence's KV cache. Each call to :meth:`CausalLM.forward` runs
a block of *new* tokens with explicit positions and an explicit attention mask over
(committed cache + new tokens). The new keys and values stay *pending* until
:meth:`CausalLM.commit` keeps a subset of them (a chain prefix or a root-to-leaf path
through a tree), compacted right after the committed ones. A later ``forward`` without a
commit simply overwrites the pending block. Positions are the one truth: the cache never
guesses them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of SpecPlay needs to know about a loaded model."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_parameters: int
    device: str
    dtype: str
    backend: str  # "native" or "transformers"
    eos_token_ids: tuple[int, ...] = ()
    max_positions: int = 32768


@dataclass
class ForwardOutput:
    """Result of one forward pass over ``n`` new tokens.

    ``logits``: ``[n, vocab]`` float32. ``hidden``: ``[n, hidden]`` final-norm hidden states
    (the LM head's input) when requested. ``layers``: requested intermediate layer outputs,
    keyed by layer index, each ``[n, hidden]``.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    layers: dict[int, torch.Tensor] = field(default_factory=dict)


class CausalLM(ABC):
    """A decoder-only language model with a single-sequence KV cache built for speculation."""

    info: ModelInfo

    @property
    @abstractmethod
    def cache_len(self) -> int:
        """Number of committed tokens in the KV cache."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache (start a new sequence)."""

    @abstractmethod
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        hidden: bool = False,
        layers: Sequence[int] = (),
        logit_rows: Sequence[int] | None = None,
        prefill: bool = False,
    ) -> ForwardOutput:
        """Run ``n`` new tokens after the committed cache.

        Args:
            tokens: ``[n]`` token ids.
            positions: ``[n]`` absolute positions; default ``cache_len + arange(n)``.
            attn_mask: boolean, True = may attend. ``[n, n]`` over the new tokens (every new
                token sees the whole committed cache) or ``[n, cache_len + n]`` over
                (cache + new). Default: causal over the new block.
            hidden: also return the final-norm hidden states (all ``n`` rows).
            layers: also return these decoder layers' outputs (0-based).
            logit_rows: compute logits only for these rows, in this order (the LM head
                is the costliest layer per row on a CPU); empty for none (a prefill whose
                logits nobody reads). Default: all rows.
            prefill: the block is a prompt, which every method reads alike before decoding;
                it need not round like single tokens do, so a model may take a faster path
                (the native int8 path attends in float32 there, not float64).
        """

    @abstractmethod
    def commit(self, keep: int | Sequence[int] | torch.Tensor) -> None:
        """Keep pending tokens in the cache.

        ``keep`` is either a count (the first ``keep`` pending tokens, a chain prefix) or the
        indices, within the last forward's block, of the tokens to keep, in order (a path
        through a tree). They become contiguous right after the committed cache.
        """

    @abstractmethod
    def crop(self, length: int) -> None:
        """Drop committed tokens beyond ``length``."""

    @abstractmethod
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[n, hidden]`` (the frozen input embedding)."""

    @abstractmethod
    def lm_head_weight(self) -> torch.Tensor:
        """The output embedding as a float32 ``[vocab, hidden]`` tensor (frozen; heads slice it)."""

    def head_rows(self, rows: "int | Sequence[int]"):
        """A linear layer for the LM head's first ``rows`` outputs, or for the outputs of the ids ``rows`` in
        that order (a draft vocabulary), in this model's storage."""
        from specplay.core.kernels.linear import Storage, make_linear

        # info.dtype names a quantized draft's storage by its first word (int8, int4)
        storage = {"int8": Storage.INT8_DRAFT, "int4": Storage.INT4_DRAFT}.get(self.info.dtype, Storage.FLOAT)
        weight = self.lm_head_weight()
        return make_linear(weight[:rows] if isinstance(rows, int) else weight[torch.as_tensor(rows)], None, storage)

    def forward_chain(self, tokens: Sequence[int] | torch.Tensor, **kwargs) -> ForwardOutput:
        """Convenience: run a causal chain of new tokens and commit all of them."""
        t = torch.as_tensor(tokens, dtype=torch.long)
        out = self.forward(t, **kwargs)
        self.commit(int(t.numel()))
        return out


def expand_mask(attn_mask: torch.Tensor | None, n: int, cache_len: int, device) -> torch.Tensor:
    """Return the full boolean mask ``[n, cache_len + n]`` from the accepted mask forms."""
    if attn_mask is None:
        block = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    else:
        attn_mask = attn_mask.to(device=device, dtype=torch.bool)
        if attn_mask.shape == (n, cache_len + n):
            return attn_mask
        if attn_mask.shape != (n, n):
            raise ValueError(
                f"attention mask must be [{n}, {n}] or [{n}, {cache_len + n}], got {tuple(attn_mask.shape)}"
            )
        block = attn_mask
    prefix = torch.ones(n, cache_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, block], dim=1)


def keep_indices(keep: int | Sequence[int] | torch.Tensor, pending: int) -> list[int]:
    """Normalise the ``keep`` argument of :meth:`CausalLM.commit` to a list of block indices."""
    if isinstance(keep, int):
        if not 0 <= keep <= pending:
            raise ValueError(f"cannot keep {keep} of {pending} pending tokens")
        return list(range(keep))
    idx = [int(i) for i in (keep.tolist() if isinstance(keep, torch.Tensor) else keep)]
    if any(not 0 <= i < pending for i in idx):
        raise ValueError(f"keep indices {idx} out of range for {pending} pending tokens")
    return idx
