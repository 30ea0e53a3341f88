"""A GGUF file's header, read directly: its metadata and where each tensor's blocks lie.

``gguf.GGUFReader`` turns every metadata value into Python objects, the tokenizer's 151,936 tokens
and 151,387 merges included: seconds to open the 1.5B target on a two-core CPU, most of a later
start (``docs/benchmarks.md``, "Footprint"). This reads the header once, skips what it does not
need, and maps the tensors' bytes as numpy views of one memory map (the same arrays ``GGUFReader``
gives for them), in well under a second. The tokenizer's metadata is hashed as it is read, so two
files with the same tokenizer can share one converted copy.

The file may come from anyone: every count and length it claims is checked against its size
before anything is read or allocated for it, and every tensor's type, shape, alignment and bytes
(inside the file, overlapping no other tensor's) before it is offered. Whatever is wrong is a
:class:`~specplay.core.errors.ModelError` naming the file and the field or tensor.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specplay.core.errors import ModelError

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: The fewest bytes an array item of each value type takes (a string: its length; an array: its type and count).
_ITEM_BYTES = {**{kind: struct.calcsize(fmt) for kind, fmt in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_NESTING = 8  # arrays of arrays deeper than this are refused (each level is a Python call)
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
#: The fewest header bytes a metadata entry (key length, type, a one-byte value) and a tensor's info take.
_KV_BYTES, _TENSOR_BYTES = 13, 32


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the row length first
    tensor_type: "object"  # gguf.GGMLQuantizationType
    data: np.ndarray  # a matrix not in F32/F16: [rows, bytes a row] of uint8; else the values, rows first
    offset: int = 0  # where its bytes start in the file


class _Cursor:
    """Reads the header from a bytes copy of the file's start (the header is a few MB). ``where``
    names the field being read, for the message when the file ends inside it."""

    def __init__(self, path: Path, size: int, digest):
        self.path, self.size, self.at, self.digest, self.hashing = path, size, 0, digest, False
        self.where = "its magic number"
        self.buf = b""
        self._more(1 << 24)

    def bad(self, what: str) -> ModelError:
        return ModelError(f"{self.path} is not a readable GGUF file: {what}")

    def _more(self, size: int) -> None:
        try:
            with open(self.path, "rb") as f:
                self.buf = f.read(min(size, self.size))
        except OSError as exc:
            raise self.bad(f"it cannot be read ({exc.strerror or exc})") from None

    def _need(self, n: int) -> None:
        if self.at + n > self.size:
            raise self.bad(f"the file ends inside its header, in {self.where}")
        if self.at + n > len(self.buf):
            self._more(max(2 * len(self.buf), self.at + n))
            if self.at + n > len(self.buf):
                raise self.bad(f"the file got shorter while its header was read, in {self.where}")

    def left(self) -> int:
        return self.size - self.at

    def take(self, n: int) -> bytes:
        self._need(n)
        out = self.buf[self.at:self.at + n]
        self.at += n
        if self.hashing:
            self.digest.update(out)
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        start, at, buf = self.at, self.at, self.buf
        for _ in range(count):  # the tokenizer's 300,000 strings: _need only where the buffer ends
            if at + 8 > len(buf):
                self.at = at
                self._need(8)
                buf = self.buf
            n = struct.unpack_from("<Q", buf, at)[0]
            at += 8 + n
            if at > len(buf):
                self.at = at - n
                self._need(n)
                buf = self.buf
        self.at = at
        if self.hashing:
            self.digest.update(self.buf[start:self.at])

    def value(self, kind: int):
        """A scalar or a string."""
        if kind == _STRING:
            return self.string()
        if kind not in _SCALARS:
            raise self.bad(f"{self.where} has the unknown value type {kind}")
        return self.scalar(_SCALARS[kind])

    def array(self, depth: int = 0) -> int:
        """Skip an array (its items' type and count read first); return its length."""
        inner, count = self.scalar("<I"), self.scalar("<Q")
        if inner not in _ITEM_BYTES:
            raise self.bad(f"{self.where} is an array of the unknown value type {inner}")
        if count * _ITEM_BYTES[inner] > self.left():
            raise self.bad(f"the file ends inside its header: {self.where} claims {count:,} items, more than the "
                           f"{self.left():,} bytes left hold")
        if inner == _STRING:
            self.skip_strings(count)
        elif inner != _ARRAY:
            self.take(_ITEM_BYTES[inner] * count)
        elif depth == _NESTING:
            raise self.bad(f"{self.where} nests arrays more than {_NESTING} deep")
        else:
            for _ in range(count):
                self.array(depth + 1)
        return count


class GGUFIndex:
    """``metadata`` (scalars and strings; arrays left out, :meth:`array` reads one), ``lengths`` (each
    array's length by key), ``tensors`` by name, ``architecture``, and ``tokenizer_digest`` (a hash of
    every ``tokenizer.*`` entry but the chat template). A damaged or malformed file raises
    :class:`ModelError`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"GGUF file not found: {self.path}")
        size = os.path.getsize(self.path)
        digest = hashlib.sha256()
        cur = _Cursor(self.path, size, digest)
        if cur.take(4) != _MAGIC:
            raise cur.bad("no GGUF magic number at its start (not a GGUF file)")
        cur.where = "its version"
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise cur.bad(f"GGUF version {version} is not read here (versions 2 and 3 are)")
        cur.where = "its tensor count"
        n_tensors = cur.scalar("<Q")
        cur.where = "its metadata count"
        n_kv = cur.scalar("<Q")
        if n_kv * _KV_BYTES + n_tensors * _TENSOR_BYTES > cur.left():
            raise cur.bad(f"the file ends inside its header: its tensor count {n_tensors:,} and metadata count "
                          f"{n_kv:,} claim more than its {size:,} bytes hold")
        self.metadata: dict[str, object] = {}
        self.lengths: dict[str, int] = {}
        self._array_at: dict[str, int] = {}  # where each array's item type is, for array()
        for i in range(n_kv):
            cur.where = f"metadata entry {i}"
            key = cur.string()
            cur.where = f"metadata entry {i} ({key})"
            if key in self.metadata or key in self.lengths:
                raise cur.bad(f"{cur.where} is given twice")
            kind = cur.scalar("<I")
            cur.hashing = key.startswith("tokenizer.") and key != "tokenizer.chat_template"
            if cur.hashing:
                digest.update(key.encode())
            if kind == _ARRAY:
                self._array_at[key] = cur.at
                self.lengths[key] = cur.array()
            else:
                self.metadata[key] = cur.value(kind)
            cur.hashing = False
        infos = self._tensor_infos(cur, n_tensors)
        align = self.metadata.get("general.alignment", 32)
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise cur.bad(f"general.alignment is {align!r}, not a power of two")
        start = -(-cur.at // align) * align
        self.tensors = self._lay_out(cur, infos, start, align, size)
        self.tokenizer_digest = digest.hexdigest()

    @staticmethod
    def _tensor_infos(cur: _Cursor, n_tensors: int) -> dict[str, tuple]:
        """Each tensor's (dims, type, offset) by name, as the header gives them."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        infos = {}
        for i in range(n_tensors):
            cur.where = f"the info of tensor {i}"
            name = cur.string()
            cur.where = f"the info of tensor {i} ({name})"
            if name in infos:
                raise cur.bad(f"tensor {name} is given twice")
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise cur.bad(f"tensor {name} has {n_dims} dimensions (GGUF has 1 to {_MAX_DIMS})")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            type_id = cur.scalar("<I")
            try:
                kind = GGMLQuantizationType(type_id)
            except ValueError:
                kind = None
            if kind not in GGML_QUANT_SIZES:
                raise cur.bad(f"tensor {name} has the unknown type {type_id}")
            infos[name] = (dims, kind, cur.scalar("<Q"))
        return infos

    def _lay_out(self, cur: _Cursor, infos: dict, start: int, align: int, size: int) -> dict[str, GGUFTensor]:
        """The tensors as views of the file's mapping, once each one's shape, type and bytes are sound."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

        layout = {}  # name: (where its bytes start, rows, bytes a row)
        for name, (dims, kind, offset) in infos.items():
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if 0 in dims:
                raise cur.bad(f"tensor {name} has a zero dimension (shape {list(dims)})")
            if dims[0] % block:
                raise cur.bad(f"tensor {name}'s rows of {dims[0]:,} values are not whole {kind.name} blocks of {block}")
            if len(dims) == 1 and kind not in (T.F32, T.F16, T.BF16):
                raise cur.bad(f"tensor {name} is a vector of {kind.name} blocks (vectors are read as F32, F16 or BF16)")
            if offset % align:
                raise cur.bad(f"tensor {name}'s offset {offset:,} is not a multiple of the alignment {align}")
            rows = int(np.prod(dims[1:], dtype=object)) if len(dims) > 1 else 1  # Python ints: no wrapping
            at, row_bytes = start + offset, dims[0] // block * block_bytes
            if at + rows * row_bytes > size:
                raise cur.bad(f"tensor {name} runs past the end of the file (its {rows * row_bytes:,} bytes at "
                              f"{at:,}; the file has {size:,})")
            layout[name] = at, rows, row_bytes
        spans = sorted((at, at + rows * row_bytes, name) for name, (at, rows, row_bytes) in layout.items())
        for (_, end, first), (at, _, second) in zip(spans, spans[1:]):
            if at < end:
                raise cur.bad(f"tensors {first} and {second} overlap")
        try:
            mapped = np.memmap(self.path, dtype=np.uint8, mode="r") if layout else None
        except OSError as exc:
            raise cur.bad(f"it cannot be mapped ({exc.strerror or exc})") from None
        tensors = {}
        for name, (dims, kind, _) in infos.items():
            at, rows, row_bytes = layout[name]
            raw = mapped[at:at + rows * row_bytes]
            if raw.size != rows * row_bytes:
                raise cur.bad(f"the file got shorter while it was read, in tensor {name}")
            if kind in (T.F32, T.F16):
                data = raw.view(np.float32 if kind == T.F32 else np.float16).reshape(tuple(reversed(dims)))
            elif kind == T.BF16 and len(dims) == 1:  # bfloat16 is float32's upper half
                data = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                data = raw.reshape(rows, row_bytes)
            tensors[name] = GGUFTensor(name, dims, kind, data, at)
        return tensors

    def array(self, key: str) -> list:
        """The items of the metadata array ``key`` (strings or numbers; not arrays of arrays), read from
        the file again by the header's own cursor: the header's check already bounded its items."""
        if key not in self._array_at:
            raise KeyError(key)
        cur = _Cursor(self.path, os.path.getsize(self.path), None)
        cur.at, cur.where = self._array_at[key], f"metadata {key}"
        inner, count = cur.scalar("<I"), cur.scalar("<Q")
        if inner == _ARRAY or inner not in _ITEM_BYTES:
            raise cur.bad(f"metadata {key} is not an array of strings or numbers")
        return [cur.value(inner) for _ in range(count)]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))
