"""What the target knows at each position of a text, kept for the EAGLE-3 and Hydra recipes.

The classic recipes keep one feature per position (the final-norm hidden state) and the
target's argmax. EAGLE-3 reads a low, a middle and a high layer of the target instead, and
both new recipes learn from the target's distribution rather than its argmax alone (soft
distillation, Hydra++'s teacher loss). A :class:`TeacherSet` holds all of it for sequences
read once by the target (teacher forcing), in resumable shards named by what they hold.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specplay.core.atomic import replacing
from specplay.core.errors import Cancelled
from specplay.core.progress import Progress
from specplay.core.training.data import FeatureSet, sequence_rows

TOP_K = 8  # the target's most likely tokens kept per position: nearly all of its mass on code answers


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high layer outputs (0-based) that EAGLE-3's fused feature reads.

    The high one is the last layer's input, so a head whose layer starts as the target's last
    layer (:func:`specplay.core.heads.eagle.init_from_target_layer`) first computes that layer exactly.
    """
    return 1, num_layers // 2 - 1, num_layers - 2


@dataclass
class TeacherSet:
    """Per position of concatenated sequences: ``tokens`` ``[T]``, ``labels`` ``[T]`` (the
    target's argmax), ``final`` ``[T, h]`` float16 (final-norm hidden state), ``layers``
    ``[T, 3, h]`` float16 (the fused layers' outputs), ``top_ids`` / ``top_logp`` ``[T, K]``
    (the target's K likeliest next tokens and their log-probabilities); ``starts`` ``[S + 1]``;
    ``prompt_lens`` ``[S]``: where each sequence's answer begins (0 for source text), since
    decoding drafts only there."""

    tokens: torch.Tensor
    labels: torch.Tensor
    final: torch.Tensor
    layers: torch.Tensor
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    starts: torch.Tensor
    prompt_lens: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def features(self) -> FeatureSet:
        """The classic recipes' view of the same positions."""
        return FeatureSet(self.final, self.tokens, self.labels, self.starts)

    def same_sequence_shift(self, k: int) -> torch.Tensor:
        return self.features().same_sequence_shift(k)

    _FIELDS = ("tokens", "labels", "final", "layers", "top_ids", "top_logp", "starts", "prompt_lens")
    _PER_POSITION = _FIELDS[:6]

    def save(self, path: Path, meta: dict[str, str]) -> None:
        from safetensors.torch import save_file

        with replacing(path) as tmp:  # a shard on disk counts as done, so it is never half written
            save_file({k: getattr(self, k).contiguous() for k in self._FIELDS}, str(tmp), metadata=meta)

    @staticmethod
    def load(path: Path) -> "TeacherSet":
        from safetensors.torch import load_file

        d = load_file(str(path))
        return TeacherSet(**{k: d[k] for k in TeacherSet._FIELDS})

    @staticmethod
    def concat(parts: list["TeacherSet"]) -> "TeacherSet":
        starts, offset = [torch.zeros(1, dtype=torch.long)], 0
        for p in parts:
            starts.append(p.starts[1:] + offset)
            offset += p.num_tokens
        fields = {k: torch.cat([getattr(p, k) for p in parts]) for k in TeacherSet._PER_POSITION}
        return TeacherSet(**fields, starts=torch.cat(starts), prompt_lens=torch.cat([p.prompt_lens for p in parts]))

    def sequences(self, keep: list[int]) -> "TeacherSet":
        """The sequences at indices ``keep``, in that order."""
        rows, starts = sequence_rows(self.starts, keep)
        return TeacherSet(**{k: getattr(self, k)[rows] for k in self._PER_POSITION}, starts=starts,
                          prompt_lens=self.prompt_lens[keep])


def read_teacher(model, seq: list[int], layers: tuple[int, ...], top_k: int = TOP_K,
                 dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """One teacher-forced pass of the target over ``seq`` from an empty cache (the prompt path),
    its states kept in ``dtype`` (float16 on disk)."""
    model.reset()
    out = model.forward(torch.tensor(seq), hidden=True, layers=layers, prefill=True)
    model.reset()
    logp = torch.log_softmax(out.logits.float(), dim=-1).topk(top_k, dim=-1)
    # float16 holds the residual stream's largest activations (a few thousand on Qwen2.5) without overflow
    stacked = torch.stack([out.layers[i] for i in layers], dim=1).clamp(-65000, 65000).to(dtype) if layers \
        else out.hidden.new_zeros(len(seq), 0, out.hidden.shape[-1]).to(dtype)  # Hydra reads no layers
    return {"tokens": torch.tensor(seq, dtype=torch.int32), "labels": logp.indices[:, 0].to(torch.int32),
            "final": out.hidden.to(dtype), "layers": stacked, "top_ids": logp.indices.to(torch.int32),
            "top_logp": logp.values.half()}


def capture_teacher(model, sequences: list[list[int]], prompt_lens: list[int], shard_dir: Path, *, target_key: str,
                    layers: tuple[int, ...], top_k: int = TOP_K, shard_size: int = 16,
                    progress: Progress | None = None, should_cancel: Callable[[], bool] = lambda: False) -> TeacherSet:
    """The target's view of ``sequences`` (:class:`TeacherSet`), one pass each (~160 tokens a
    second for the 1.5B target on two cores). Finished shards are kept under names that say what
    they hold (the target, layers, K and the token ids), so an interrupted capture resumes and a
    changed text or another target never reads them."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    chunks = [sequences[i:i + shard_size] for i in range(0, len(sequences), shard_size)]
    parts = []
    for n, chunk in enumerate(chunks):
        lens = prompt_lens[n * shard_size:(n + 1) * shard_size]
        digest = hashlib.sha256(json.dumps([target_key, list(layers), top_k, chunk, lens]).encode()).hexdigest()[:16]
        path = shard_dir / f"teacher-{n:05d}-{digest}.safetensors"
        if path.is_file():
            parts.append(TeacherSet.load(path))
            continue
        rows = []
        for seq in chunk:
            if should_cancel():
                raise Cancelled("reading the target's features cancelled")
            rows.append(read_teacher(model, seq, layers, top_k))
        part = TeacherSet(**{k: torch.cat([r[k] for r in rows]) for k in rows[0]},
                          starts=torch.tensor([0] + [len(s) for s in chunk]).cumsum(0),
                          prompt_lens=torch.tensor(lens, dtype=torch.long))
        part.save(path, {"target": target_key})
        parts.append(part)
        if progress:
            progress(f"Reading the target's layers (shard {n + 1}/{len(chunks)})", (n + 1) / len(chunks))
    return TeacherSet.concat(parts)


def corpus_sequences(corpus: dict[int, list[int]], prompts: dict[int, list[int]]) -> tuple[list[list[int]], list[int]]:
    """(sequences, prompt lengths) of the corpus answers (prompt and answer ids,
    :func:`specplay.core.training.data.load_corpus`) to ``prompts`` (index -> chat prompt ids) that answer
    them: every token but the last, whose prediction is the last label."""
    keys = [k for k in sorted(prompts) if k in corpus and corpus[k][:len(prompts[k])] == prompts[k]
            and len(corpus[k]) > len(prompts[k]) + 1]
    return [corpus[k][:-1] for k in keys], [len(prompts[k]) for k in keys]
