"""A draft model run by llama.cpp (``llama-cpp-python``, the ``peers`` extra) on a CPU.

A draft's numerics never affect losslessness: the verifier accepts against the q that was
actually sampled, and at temperature 0 only the target's argmax decides. So the draft may run
on the fastest CPU engine there is, even one that is not batch-invariant (llama.cpp's batched
logits differ from its one-token logits, which is why it can never *verify*). On two cores
llama.cpp decodes the 0.5B default draft in 4 bits in about 10-11 ms a token, against about
20 ms for SpecPlay's own int4 layers: its kernels multiply 4-bit weights by 8-bit activations
with integer dot products, where torch's CPU int4 kernel widens every weight to bfloat16 first.

The model is a chain drafter: tokens are appended after the committed cache, a prefix of them
is kept, the cache is cropped back after a rejection. Only the last new token's logits are
computed (all a chain draft reads). Its 4-bit weights file is made once into the model's cache
folder (:func:`specplay.core.weights.prepare.make_draft_gguf`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specplay.core.errors import ModelError
from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo
from specplay.core.models.llamacpp import LlamaCppFileError, LlamaCppSession, LlamaSettings, ProbeResult, usable_settings
from specplay.core.progress import Progress, log_progress
from specplay.core.weights.cache import DRAFT_GGUF
from specplay.core.weights.prepare import make_draft_gguf

log = logging.getLogger(__name__)

_FIRST_CONTEXT = 4096


def _file_type(desc: str) -> str:
    """The weights' type from llama.cpp's model description: ``qwen2 1B IQ4_NL - 4.5 bpw`` -> ``iq4_nl``."""
    return desc.split(" - ")[0].split()[-1].lower()


class LlamaCppDraft(CausalLM):
    """A chain draft model on llama.cpp, with SpecPlay's cache interface (forward, commit, crop)."""

    def __init__(self, gguf: Path, name: str, config, eos: tuple[int, ...], threads: int,
                 settings: LlamaSettings = LlamaSettings()):
        self._gguf = gguf
        self._threads = threads
        self._settings = settings
        self._tokens: list[int] = []  # committed, kept to refill a larger context
        self._pending: list[int] = []
        self._max_positions = getattr(config, "max_position_embeddings", 32768)
        self._session = LlamaCppSession(gguf, min(_FIRST_CONTEXT, self._max_positions), threads, settings)
        self.info = ModelInfo(
            name=name, architecture=config.model_type, vocab_size=self._session.n_vocab,
            hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
            num_parameters=self._session.n_params, device="cpu", dtype=_file_type(self._session.description),
            backend="llama.cpp", eos_token_ids=eos, max_positions=self._max_positions)

    @property
    def settings(self) -> LlamaSettings:
        return self._settings

    def close(self) -> None:
        """Free llama.cpp's model and context now (a draft measured slower than the native one)."""
        self._session.close()

    @property
    def cache_len(self) -> int:
        return len(self._tokens)

    def reset(self) -> None:
        self._tokens, self._pending = [], []

    def forward(self, tokens, positions=None, attn_mask=None, *, hidden=False, layers=(), logit_rows=None,
                prefill=False) -> ForwardOutput:
        ids = [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]
        n = len(ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if positions is not None or attn_mask is not None or hidden or layers:
            raise NotImplementedError("the llama.cpp draft runs chains only: no positions, masks or hidden states")
        rows = list(range(n)) if logit_rows is None else [int(r) for r in logit_rows]
        if rows not in ([], [n - 1]):
            raise NotImplementedError("the llama.cpp draft computes the last new token's logits only")
        if len(self._tokens) + n > self._session.n_ctx:
            self._grow(len(self._tokens) + n)
        # The session drops its cache past the committed tokens, then appends: a crop or a partial
        # commit is just a shorter kept prefix.
        logits = self._session.eval(ids, len(self._tokens))
        self._pending = ids
        if not rows:
            return ForwardOutput(logits=torch.empty(0, self.info.vocab_size))
        return ForwardOutput(logits=torch.from_numpy(logits.copy())[None])

    def _grow(self, needed: int) -> None:
        """Move to a context that holds ``needed`` tokens, refilled with the committed ones; the old
        one is closed only once the new one works, so a failure leaves the draft as it was."""
        n_ctx = self._session.n_ctx
        while n_ctx < needed:
            n_ctx *= 2
        n_ctx = min(n_ctx, self._max_positions)
        if n_ctx < needed:
            raise ModelError(f"the llama.cpp draft holds at most {self._max_positions} tokens; this run needs "
                             f"{needed}: shorten the prompt or the answer")
        bigger = LlamaCppSession(self._gguf, n_ctx, self._threads, self._settings)
        if self._tokens:
            bigger.eval(self._tokens, 0)
        self._session.close()
        self._session = bigger

    def commit(self, keep) -> None:
        if not isinstance(keep, int):
            raise NotImplementedError("the llama.cpp draft keeps chain prefixes only")
        if not 0 <= keep <= len(self._pending):
            raise ValueError(f"cannot keep {keep} of {len(self._pending)} pending tokens")
        self._tokens += self._pending[:keep]
        self._pending = []

    def crop(self, length: int) -> None:
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"cannot crop a cache of {len(self._tokens)} tokens to {length}")
        del self._tokens[length:]
        self._pending = []

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the llama.cpp draft exposes no embeddings")

    def lm_head_weight(self) -> torch.Tensor:
        raise NotImplementedError("the llama.cpp draft exposes no LM head")

    def head_rows(self, rows: int):
        raise ModelError("a draft vocabulary needs the native draft (--draft-backend native): llama.cpp computes "
                         "its whole vocabulary")


def load_llamacpp_draft(spec: str, folder: Path, config, eos: tuple[int, ...],
                        progress: Progress = log_progress) -> tuple[LlamaCppDraft | None, list[ProbeResult]]:
    """The draft ``spec`` (a catalog id or a ``.gguf`` file, converted into ``folder``) on llama.cpp,
    with the fastest settings a child process survived here, and what each probe found; ``None``
    for the draft when no settings are safe on this machine.

    Its 4-bit file is made once into ``folder``; one that llama.cpp cannot read (damaged) is
    made again, never used; any other failure (a context that cannot be allocated) is reported
    as it is. A catalog model's original GGUF is assembled only to be quantized and is not kept
    unless it was there before.
    """
    make_draft_gguf(spec, folder, progress)
    try:
        return _open_draft(spec, folder, config, eos, progress)
    except LlamaCppFileError:
        log.warning("%s: llama.cpp cannot read %s; quantizing it again", spec, DRAFT_GGUF)
        progress(f"The llama.cpp draft file of {spec} is damaged: quantizing it again", None)
        (folder / DRAFT_GGUF).unlink()
    make_draft_gguf(spec, folder, progress)
    return _open_draft(spec, folder, config, eos, progress)


def _open_draft(spec, folder, config, eos, progress) -> tuple[LlamaCppDraft | None, list[ProbeResult]]:
    threads = torch.get_num_threads()
    settings, probes = usable_settings(folder / DRAFT_GGUF, threads, progress)
    if settings is None:
        return None, probes
    return LlamaCppDraft(folder / DRAFT_GGUF, spec, config, eos, threads, settings), probes


