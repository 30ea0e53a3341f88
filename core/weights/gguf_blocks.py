"""A GGUF file's tensors as the k-quant kernel's blocks, and the cache's kept blocks files.

:class:`GGUFBlocksReader` reads a target's Q4_K and Q6_K matrices as the file ships them (repacked
in memory), :class:`GGUFDraftReader` a draft's, fitting the other formats into Q4_K blocks;
:func:`save_blocks` and :class:`BlocksFileReader` keep what was read in one memory-mapped file, so
the next load neither repacks nor fits again. Every reader answers ``get(name)`` by ``transformers``'
weight names.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from specplay.core.atomic import replacing
from specplay.core.errors import ModelError
from specplay.core.kernels.kquant import QK, TYPES, KQuantWeight, MappedRows
from specplay.core.weights.gguf_index import GGUFIndex


#: A Llama/Qwen2 checkpoint's names (``transformers``') -> the GGUF file's.
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm"}
_GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                     "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                     "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``."""
    stem, _, leaf = hf_name.rpartition(".")
    if stem in _GGUF_NAMES:
        return f"{_GGUF_NAMES[stem]}.{leaf}"
    parts = stem.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _GGUF_LAYER_NAMES:
        return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:])]}.{leaf}"
    raise KeyError(f"weight '{hf_name}' has no GGUF name")


class GGUFBlocksReader:
    """A GGUF file's tensors by ``transformers``' names: matrices as :class:`KQuantWeight` (their
    blocks as shipped), norms and biases as float32. Only Qwen2's layout, whose q and k matrices
    GGUF stores unpermuted, is read (llama's are permuted for llama.cpp's RoPE)."""

    def __init__(self, path: Path):
        try:
            index = GGUFIndex(path)
        except Exception as exc:  # a damaged file: ValueError, struct.error, KeyError of an unknown type
            raise ModelError(f"cannot read the GGUF file {path}: {exc}") from None
        self.architecture = index.architecture
        self.metadata = index.metadata
        self.tensors = index.tensors
        self.path = path

    def unreadable(self) -> str | None:
        """Why the kernel cannot run this file's matrices, or None."""
        if self.architecture != "qwen2":
            return f"the exact k-quant path reads Qwen2 GGUF files, not {self.architecture}"
        other = sorted({t.tensor_type.name for t in self.tensors.values()
                        if len(t.shape) == 2 and int(t.tensor_type) not in TYPES})
        return f"its matrices include {', '.join(other)} blocks (the kernel reads Q4_K and Q6_K)" if other else None

    #: Whether an embedding beside a head of its own is read from the mapping (:class:`MappedRows`).
    map_embedding = True

    def get(self, hf_name: str):
        tensor = self.tensors.get(gguf_name(hf_name))
        if tensor is None:
            return None
        if len(tensor.shape) == 1:
            return torch.from_numpy(np.array(tensor.data, dtype=np.float32))
        if (self.map_embedding and hf_name == "model.embed_tokens.weight"
                and gguf_name("lm_head.weight") in self.tensors):  # not tied: it is never a head
            # Read from the file by rows: the file's whole mapping (every page repacking read) can then go.
            return MappedRows(int(tensor.tensor_type), self.path, tensor.offset, int(tensor.data.shape[0]),
                              int(tensor.shape[0]))
        return KQuantWeight.from_raw(int(tensor.tensor_type), tensor.data, int(tensor.shape[0]))

    def matrices(self, count: int) -> list[KQuantWeight]:
        """The first ``count`` matrices of each block type the file holds (what :func:`prove` runs on)."""
        found: dict[int, list] = {}
        for t in self.tensors.values():
            kind = int(t.tensor_type)
            if len(t.shape) == 2 and kind in TYPES and t.shape[1] <= 16384 and len(found.setdefault(kind, [])) < count:
                found[kind].append(KQuantWeight.from_raw(kind, t.data, int(t.shape[0])))
        return [w for ws in found.values() for w in ws]


class GGUFDraftReader(GGUFBlocksReader):
    """A draft model's GGUF for the kernel: matrices in Q4_K or Q6_K blocks kept as shipped, the
    others (Q5_0, Q8_0, float, rows of 896) dequantized and fitted into Q4_K blocks here. A draft's
    numerics never decide a token, so no proof is needed; only its speed and its guesses change.
    Its matrices are all kept (in the cache too: :class:`KeptBlocks`), the embedding included."""

    map_embedding = False

    def unreadable(self) -> str | None:
        if self.architecture != "qwen2":
            return f"the k-quant draft reads Qwen2 GGUF files, not {self.architecture}"
        return None

    def get(self, hf_name: str):
        tensor = self.tensors.get(gguf_name(hf_name))
        shipped = tensor is not None and int(tensor.tensor_type) in TYPES and int(tensor.shape[0]) % QK == 0
        if tensor is None or len(tensor.shape) == 1 or shipped:
            return super().get(hf_name)
        fitted = KQuantWeight.fit_blocks(int(tensor.tensor_type), tensor.data, int(tensor.shape[0]))
        if fitted is not None:
            return fitted
        from gguf.quants import dequantize

        return KQuantWeight.quantize(torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), np.float32)))


class CountedReads:
    """Hands on what a reader gives (``get``), reporting the share of its file's bytes read so far: a
    matrix's repacking or fitting takes time in proportion to its bytes (the 0.5B draft's embedding
    is a quarter of them), so the fraction, and the time left said from it, keeps its pace."""

    def __init__(self, reader, report):
        self.reader, self.report, self._read = reader, report, 0
        self._total = max(1, sum(t.data.nbytes for t in reader.tensors.values()))

    def get(self, hf_name: str):
        value = self.reader.get(hf_name)
        if value is not None:
            self._read += self.reader.tensors[gguf_name(hf_name)].data.nbytes
            self.report(min(self._read / self._total, 1.0))
        return value


class KeptBlocks:
    """Hands on what a reader gives (``get``), keeping each tensor, so that a draft fitted once
    can be written (:func:`save_blocks`) and read back (:class:`BlocksFileReader`) next time."""

    def __init__(self, reader):
        self.reader, self.kept = reader, {}

    def get(self, hf_name: str):
        value = self.reader.get(hf_name)
        if value is not None:
            self.kept[hf_name] = value
        return value


#: A blocks file: this magic, the index's length (u64), the index (JSON), then each tensor's bytes.
_BLOCKS_MAGIC = b"SPBLOCKS"
_BLOCKS_HEAD = len(_BLOCKS_MAGIC) + 8  # the magic and the index's length
_BLOCKS_ALIGN = 64  # each tensor's bytes start on a cache line: the kernel's loads see the layout repack gave
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _aligned(n: int) -> int:
    return -(-n // _BLOCKS_ALIGN) * _BLOCKS_ALIGN


def save_blocks(tensors: dict, dest: Path) -> None:
    """Write matrices (:class:`KQuantWeight`, in the kernel's repacked layout) and float vectors by
    name into one file that :class:`BlocksFileReader` maps: nothing is repacked or copied to read it."""
    index, at, parts = {}, 0, []
    for name, value in tensors.items():
        if isinstance(value, KQuantWeight):
            data, entry = value.data, {"blocks": [value.type, value.rows, value.cols, value.width]}
        else:
            data = value.contiguous()
            entry = {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape)}
        raw = data.reshape(-1).view(torch.uint8).numpy()
        index[name] = {**entry, "offset": at, "bytes": raw.size}
        parts.append((at, raw))
        at = _aligned(at + raw.size)
    header = json.dumps(index).encode()
    start = _aligned(_BLOCKS_HEAD + len(header))
    with replacing(dest) as tmp:
        with open(tmp, "wb") as f:
            f.write(_BLOCKS_MAGIC + struct.pack("<Q", len(header)) + header)
            for offset, raw in parts:
                f.seek(start + offset)
                f.write(memoryview(raw))
            f.truncate(start + at)


class BlocksFileReader:
    """``get(name)`` from a file :func:`save_blocks` wrote: a :class:`KQuantWeight` or a float32 vector,
    each a view of the file's one memory map (copy-on-write, never written: its pages are the page
    cache's, shared and reclaimable). A file whose index does not fit it is a :class:`ModelError`."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(_BLOCKS_HEAD)
                if len(head) < _BLOCKS_HEAD or head[:len(_BLOCKS_MAGIC)] != _BLOCKS_MAGIC:
                    raise ValueError("it is not a blocks file")
                length = struct.unpack("<Q", head[len(_BLOCKS_MAGIC):])[0]
                if length > size:
                    raise ValueError("its index runs past its end")
                self._index = json.loads(f.read(length))
            start = _aligned(_BLOCKS_HEAD + length)
            for name, entry in self._index.items():
                if not 0 <= entry["offset"] <= entry["offset"] + entry["bytes"] <= size - start:
                    raise ValueError(f"{name} runs past its end")
            self._map = np.memmap(path, dtype=np.uint8, mode="c")[start:] if self._index else None
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise ModelError(f"the kept blocks {path} cannot be read ({exc})") from None

    def get(self, hf_name: str):
        entry = self._index.get(hf_name)
        if entry is None:
            return None
        data = torch.from_numpy(self._map[entry["offset"]:entry["offset"] + entry["bytes"]])
        try:
            if "blocks" in entry:
                type_, rows, cols, width = entry["blocks"]
                return KQuantWeight(type_, data, rows, cols, width)
            return data.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        except (ValueError, KeyError, RuntimeError) as exc:  # an index that does not describe its bytes
            raise ModelError(f"the kept blocks {self.path} cannot be read: {hf_name} ({exc})") from None


class FirstOf:
    """``get(name)`` from the first reader that has it: a target's kept blocks, then its GGUF (the
    embedding, read by rows from the file, is not kept)."""

    def __init__(self, *readers):
        self.readers = readers

    def get(self, hf_name: str):
        for reader in self.readers:
            value = reader.get(hf_name)
            if value is not None:
                return value
        return None
