"""The weights files of a converted model in the user cache, what they hold and whether they are whole.

A converted model folder holds the model's config and tokenizer, a marker (``specplay.json``)
and the weights in the form the model runs on:

* ``weights-int8.safetensors`` for int8 storage (``--dtype int8``, or a CPU target without a GGUF
  source or the k-quant kernel): every matrix as int8 rows
  with a float32 scale per row (``name:q``, ``name:scale``), vectors in float32. A quarter of
  float32's bytes, read straight into the int8 layers, so a load neither re-quantizes nor
  keeps a float32 copy mapped.
* ``weights-int4-draft.safetensors`` for a model loaded as an int4 draft: its layers in the
  int4 kernel's packed layout, written from the int8 file at the first such load, so later
  loads neither re-quantize nor pack. The layout is torch's, so the marker records the torch
  version that wrote it, and another version packs it again.
* ``weights-kquant-draft.blocks`` for a model loaded as a k-quant draft: its matrices in the
  k-quant kernel's repacked blocks, written at the first such load (fitting a GGUF's other block
  types into Q4_K takes seconds a load otherwise). The marker records the kernel's digest, and a
  kernel with another layout fits them again.
* ``weights-kquant.blocks`` for a target on its GGUF's own blocks: its matrices as the kernel
  repacked them at the first load (its embedding is read by rows from the GGUF), kept by the same
  digest. Both blocks files are memory-mapped (:class:`~specplay.core.kernels.gguf_blocks.BlocksFileReader`):
  a later start neither repacks nor copies them, and a mapped file is only ever replaced by a
  rename, never rewritten.
* ``model.safetensors``, float32, written only when a float dtype is asked for.
* ``draft-iq4_nl.gguf``, the model's 4-bit weights for llama.cpp, written at its first load as a
  llama.cpp draft (:mod:`specplay.core.models.llamacpp_draft`).

The marker records the cache format and, per weights file, its size, modification time and CRC-32
as written; a file that no longer matches (truncated, corrupt) is rebuilt, never loaded. A file of
the size and time recorded is the one written (files here are replaced by renames, never written in
place): only another one is read through for its checksum, which costs a second per 1.5 GB. A folder written
by an older SpecPlay (format 1: a float32 file, nothing recorded) still loads, and gets its
int8 file when int8 is first asked for. What writes them, and when, is
:mod:`specplay.core.weights.prepare`'s.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path
from typing import Callable, Iterable

import torch

from specplay.core.atomic import replacing, write_text_atomic
from specplay.core.kernels.linear import Storage

log = logging.getLogger(__name__)

MARKER = "specplay.json"
FORMAT = 2
WEIGHT_KINDS = (Storage.INT8, "float32")  # what a conversion writes; int4 draft layers are made from int8
INT8_WEIGHTS = "weights-int8.safetensors"
INT4_WEIGHTS = "weights-int4-draft.safetensors"
KQUANT_DRAFT_WEIGHTS = "weights-kquant-draft.blocks"
KQUANT_WEIGHTS = "weights-kquant.blocks"
#: Files earlier versions made on a load, replaced by the files above (removed when those are written).
OLD_MADE_FILES = ("weights-kquant-draft.safetensors",)
FLOAT_WEIGHTS = "model.safetensors"
#: The file a draft's 4-bit weights are kept in, and earlier versions' names for it.
DRAFT_GGUF = "draft-iq4_nl.gguf"
OLD_DRAFT_GGUFS = ("draft-q4_0.gguf",)
_Q, _SCALE = ":q", ":scale"
_INT4, _INT4_SCALES, _ROWS = ":int4", ":int4scales", ":rows"
_CHUNK = 16 << 20


def weights_name(kind: str) -> str:
    """The weights file for ``kind``: a storage's own (int8 rows, a draft's int4 layers or k-quant
    blocks), a target's kept k-quant blocks (``"kquant"``) or float weights (``"float32"``)."""
    return {Storage.INT8: INT8_WEIGHTS, Storage.INT4_DRAFT: INT4_WEIGHTS, Storage.KQUANT_DRAFT: KQUANT_DRAFT_WEIGHTS,
            "kquant": KQUANT_WEIGHTS}.get(kind, FLOAT_WEIGHTS)


def read_marker(folder: Path) -> dict:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_marker(folder: Path, marker: dict) -> None:
    write_text_atomic(folder / MARKER, json.dumps(marker, indent=2) + "\n")


def file_record(path: Path) -> dict:
    """Size, modification time and CRC-32 of a file (about a second per 1.5 GB)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
        stat = os.fstat(f.fileno())
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "crc32": crc}


# Files this process has checked, with their size and modification time then: not read again.
_checked: set[tuple[str, int, int, int]] = set()


def check_weights(folder: Path, kind: str) -> str:
    """``"ok"``, ``"missing"``, ``"stale"`` (int4 layers packed by another torch, k-quant blocks by
    another kernel), or ``"damaged"`` (its size or checksum differs from what was written)."""
    name = weights_name(kind)
    path = folder / name
    if not path.is_file():
        return "missing"
    recorded = read_marker(folder).get("files", {}).get(name)
    if recorded is None:
        # A format-1 folder recorded nothing: its float32 file is taken as it is.
        return "ok" if kind == "float32" and "format" not in read_marker(folder) else "missing"
    if any(recorded.get(key) != value for key, value in _made_by(kind).items()):
        return "stale"
    stat = path.stat()
    seen = (str(path), stat.st_size, stat.st_mtime_ns, recorded["crc32"])
    if seen in _checked or (stat.st_size, stat.st_mtime_ns) == (recorded["size"], recorded.get("mtime_ns")):
        return "ok"
    if stat.st_size != recorded["size"] or file_record(path)["crc32"] != recorded["crc32"]:
        return "damaged"
    _checked.add(seen)
    return "ok"


def record_weights(folder: Path, kind: str) -> None:
    """Note in the marker that ``kind``'s weights file is complete, with its size and checksum."""
    marker = read_marker(folder)
    marker["format"] = FORMAT
    record = file_record(folder / weights_name(kind))
    record.update(_made_by(kind))
    marker.setdefault("files", {})[weights_name(kind)] = record
    write_marker(folder, marker)


def _made_by(kind: str) -> dict:
    """What a weights kind's layout depends on, recorded with its file: another value makes it stale."""
    if kind == Storage.INT4_DRAFT:
        return {"torch": torch.__version__}
    if kind in (Storage.KQUANT_DRAFT, "kquant"):
        from specplay.core.kernels.kernel_build import library_digest

        return {"kquant": library_digest()}
    return {}


def write_int8_weights(tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], dest: Path) -> None:
    """Write (name, float tensor) pairs as an int8 weights file: matrices quantized per row."""
    from safetensors.torch import save_file

    from specplay.core.kernels.linear import QuantizedWeight

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors():
        if t.dim() == 2 and t.is_floating_point():
            qw = QuantizedWeight.quantize(t)
            out[name + _Q], out[name + _SCALE] = qw.q.contiguous(), qw.scale.contiguous()
        else:
            out[name] = t.detach().to(torch.float32).contiguous()
    with replacing(dest) as tmp:
        save_file(out, str(tmp), metadata={"format": "pt", "specplay": "int8 rows with float32 scales"})


def write_int4_weights(model, source: "CachedWeightsReader", folder: Path) -> None:
    """Store an int4 draft's packed layers (``model.linears``), with the int8 file's other tensors, and record it."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for key in source.names():  # vectors, and the embedding's int8 rows with their scales
        if not key.endswith((_Q, _SCALE)) or key.startswith("model.embed_tokens.weight:"):
            out[key] = source.read(key)
    for name, layer in model.linears.items():
        w = layer.weight
        out[name + _INT4], out[name + _INT4_SCALES] = w.packed.contiguous(), w.scales.contiguous()
        out[name + _ROWS] = torch.tensor([w.rows], dtype=torch.int64)
    with replacing(folder / INT4_WEIGHTS) as tmp:
        save_file(out, str(tmp), metadata={"format": "pt", "specplay": f"int4 draft layers packed by torch "
                                                                       f"{torch.__version__}"})
    record_weights(folder, Storage.INT4_DRAFT)


class CachedWeightsReader:
    """``get(name)`` from a cache weights file: a :class:`QuantizedWeight` for an int8 matrix, an
    :class:`Int4Packed` for a packed int4 one, a float32 tensor otherwise, None if absent.

    Reads each tensor with plain file reads at the offsets the safetensors header gives, not
    through a memory map: a mapped file's touched pages count as resident until it is closed,
    which during a load doubled the peak memory of the int8 weights.
    """

    _DTYPES = {"I8": torch.int8, "U8": torch.uint8, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I32": torch.int32, "I64": torch.int64}

    def __init__(self, path: Path):
        import struct

        self.path = path
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self._start = 8 + size
        self._entries = header

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str):
        from specplay.core.kernels.linear import Int4Packed, QuantizedWeight

        if name + _Q in self._entries:
            return QuantizedWeight(self.read(name + _Q), self.read(name + _SCALE))
        if name + _INT4 in self._entries:
            return Int4Packed(self.read(name + _INT4), self.read(name + _INT4_SCALES), int(self.read(name + _ROWS)[0]))
        return self.read(name) if name in self._entries else None

    def read(self, key: str) -> torch.Tensor:
        entry = self._entries[key]
        begin, end = entry["data_offsets"]
        out = torch.empty(entry["shape"], dtype=self._DTYPES[entry["dtype"]])
        view = out.view(torch.uint8).reshape(-1).numpy()
        with open(self.path, "rb") as f:
            f.seek(self._start + begin)
            if f.readinto(view) != end - begin:
                raise OSError(f"{self.path} ends inside tensor '{key}'")
        return out


def add_int8_weights(folder: Path, progress: Callable[[str, "float | None"], None]) -> None:
    """Make a folder's int8 weights file from its float32 one (an older cache), then drop the float32 file."""
    from safetensors import safe_open

    source = folder / FLOAT_WEIGHTS
    progress(f"Storing {folder.name} in int8 (once)", None)

    def tensors():
        with safe_open(str(source), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    write_int8_weights(tensors, folder / INT8_WEIGHTS)
    record_weights(folder, Storage.INT8)
    marker = read_marker(folder)
    marker.get("files", {}).pop(FLOAT_WEIGHTS, None)
    write_marker(folder, marker)
    source.unlink()
    log.info("%s: int8 weights written; the float32 copy is made again if a float dtype is asked for", folder.name)


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
