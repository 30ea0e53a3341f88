"""Whether a GGUF model file's metadata agrees with its tensors, checked before any weight is read.

A model's config is made from its file's metadata (``transformers`` maps it, then
:class:`~specplay.core.models.layers.DecoderConfig`), its matrices come from its tensors. A file
whose head counts, widths or vocabulary disagree with its matrices would reach the decoder with one
of the two wrong: a traceback from the prefill at best, and the k-quant kernel's C layer, which
sizes its buffers from the config, reading or writing past them at worst. :func:`check_gguf` holds
every shape of a Llama/Qwen2 file against every other, the way the config will be made from it.
"""

from __future__ import annotations

from pathlib import Path

from specplay.core.errors import ModelError
from specplay.core.weights.gguf_index import GGUFIndex

#: Architectures whose config takes its head size from ``rope.dimension_count`` (``transformers``' GGUF mapping);
#: the others' is the embedding length over the head count.
_HEAD_SIZE_FROM_ROPE = ("llama",)


class _Disagreement(Exception):
    """What is wrong, in a sentence; :func:`check_gguf` adds the file."""


def check_gguf(path: Path, architectures: tuple[str, ...]) -> None:
    """Raise a :class:`ModelError` naming ``path`` and the first disagreement between its metadata
    and its tensors (or what is malformed in its header). Only ``architectures`` (those the native
    decoder runs) are held to their layout; ``transformers`` checks the others' shapes as it loads."""
    index = GGUFIndex(path)
    if index.architecture not in architectures:
        return
    try:
        _check(index)
    except _Disagreement as exc:
        raise ModelError(f"{path}: its metadata disagrees with its tensors: {exc}") from None


def _number(index: GGUFIndex, key: str) -> int:
    value = index.metadata.get(key)
    if value is None:
        raise _Disagreement(f"{key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Disagreement(f"{key} is {value!r}, not a positive whole number")
    return value


def _check(index: GGUFIndex) -> None:
    arch = index.architecture
    heads, kv_heads = _number(index, f"{arch}.attention.head_count"), _number(index, f"{arch}.attention.head_count_kv")
    hidden, inter = _number(index, f"{arch}.embedding_length"), _number(index, f"{arch}.feed_forward_length")
    layers = _number(index, f"{arch}.block_count")
    if heads % kv_heads:
        raise _Disagreement(f"{heads} attention heads ({arch}.attention.head_count) cannot share "
                            f"{kv_heads} key/value heads ({arch}.attention.head_count_kv) evenly")
    rope_key = f"{arch}.rope.dimension_count"
    if arch in _HEAD_SIZE_FROM_ROPE and rope_key in index.metadata:
        head, head_why = _number(index, rope_key), rope_key
    else:
        head, head_why = hidden // heads, f"{arch}.embedding_length {hidden} / head_count {heads}"
    if head == 0 or head % 2:
        raise _Disagreement(f"the head size {head} ({head_why}) is not a positive even number (RoPE rotates pairs)")
    if index.metadata.get(rope_key, head) != head:
        raise _Disagreement(f"{rope_key} {index.metadata[rope_key]} is not the head size {head} ({head_why})")
    q_rows = (heads * head, f"{arch}.attention.head_count {heads} × head size {head} ({head_why})")
    kv_rows = (kv_heads * head, f"{arch}.attention.head_count_kv {kv_heads} × head size {head} ({head_why})")
    width, ffn = (hidden, f"{arch}.embedding_length"), (inter, f"{arch}.feed_forward_length")

    if f"{arch}.vocab_size" in index.metadata:
        vocab_key = f"{arch}.vocab_size"
        vocab = _number(index, vocab_key)
    else:
        vocab_key = "tokenizer.ggml.tokens"
        vocab = index.lengths.get(vocab_key)
        if not vocab:
            raise _Disagreement(f"it has no vocabulary (neither {arch}.vocab_size nor tokenizer.ggml.tokens)")
    for name in ("token_embd.weight", "output.weight"):  # the head is the embedding where output is left out
        if name == "token_embd.weight" or name in index.tensors:
            rows = _shape(index, name, width=width)[1]
            if rows < vocab:
                raise _Disagreement(f"{name} has {rows:,} rows, fewer than the {vocab:,} tokens of {vocab_key}")
    _shape(index, "output_norm.weight", length=width)
    parts = (("attn_norm.weight", True, dict(length=width)), ("ffn_norm.weight", True, dict(length=width)),
             ("attn_q.weight", True, dict(rows=q_rows, width=width)),
             ("attn_k.weight", True, dict(rows=kv_rows, width=width)),
             ("attn_v.weight", True, dict(rows=kv_rows, width=width)),
             ("attn_output.weight", True, dict(rows=width, width=q_rows)),
             ("ffn_gate.weight", True, dict(rows=ffn, width=width)), ("ffn_up.weight", True, dict(rows=ffn, width=width)),
             ("ffn_down.weight", True, dict(rows=width, width=ffn)),
             # Qwen2's q, k and v have biases; Llama's may.
             ("attn_q.bias", arch == "qwen2", dict(length=q_rows)), ("attn_k.bias", arch == "qwen2", dict(length=kv_rows)),
             ("attn_v.bias", arch == "qwen2", dict(length=kv_rows)), ("attn_output.bias", False, dict(length=width)))
    for i in range(layers):
        for part, required, want in parts:
            name = f"blk.{i}.{part}"
            if name in index.tensors:
                _shape(index, name, **want)
            elif required:
                raise _Disagreement(f"{name} is missing ({arch}.block_count is {layers})")


def _shape(index: GGUFIndex, name: str, rows=None, width=None, length=None) -> tuple[int, ...]:
    """Tensor ``name``'s shape (GGUF's order: the row length first) once it is what ``rows``,
    ``width`` (a matrix) or ``length`` (a vector) want: each a (number, the metadata that makes it)."""
    tensor = index.tensors.get(name)
    if tensor is None:
        raise _Disagreement(f"{name} is missing")
    shape = tensor.shape
    if len(shape) != (1 if length else 2):
        raise _Disagreement(f"{name} has {len(shape)} dimensions, not {'1' if length else '2'}")
    for got, want, what in ((shape[0], length or width, "values" if length else "values a row"),
                            (shape[-1], rows, "rows")):
        if want is not None and got != want[0]:
            raise _Disagreement(f"{name} has {got:,} {what} where {want[1]} makes {want[0]:,}")
    return shape
