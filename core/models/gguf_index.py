"""A GGUF file's header, read directly: its metadata and where each tensor's blocks lie.

``gguf.GGUFReader`` turns every metadata value into Python objects, the tokenizer's 151,936
tokens and 151,387 merges included: 11.5 s to open the 1.5B target on a 2-core Xeon, most of
a later start. This reads the header once, skips what it does not need, and maps the tensors'
bytes as numpy views of one memory map (the same arrays ``GGUFReader`` gives for them), in
well under a second. The tokenizer's metadata is hashed as it is read, so two files with the
same tokenizer can share one converted copy.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the row length first
    tensor_type: "object"  # gguf.GGMLQuantizationType
    data: np.ndarray  # quantized: [rows, bytes a row] of uint8; float: the values, rows first
    offset: int = 0  # where its bytes start in the file


class _Cursor:
    """Reads the header from a bytes copy of the file's start (the header is a few MB)."""

    def __init__(self, path: Path, digest):
        self.path, self.at, self.digest, self.hashing = path, 0, digest, False
        self.buf = b""
        self._more(1 << 24)

    def _more(self, size: int) -> None:
        with open(self.path, "rb") as f:
            self.buf = f.read(size)

    def _need(self, n: int) -> None:
        while self.at + n > len(self.buf):
            before = len(self.buf)
            self._more(max(2 * before, self.at + n))
            if len(self.buf) == before:
                raise ValueError("the file ends inside its header")

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
        start = self.at
        for _ in range(count):
            self._need(8)
            (n,) = struct.unpack_from("<Q", self.buf, self.at)
            self.at += 8 + n
        self._need(0)
        if self.hashing:
            self.digest.update(self.buf[start:self.at])

    def value(self, kind: int):
        """A scalar or string; an array is skipped (None)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.scalar("<I"), self.scalar("<Q")
            if inner in _SCALARS:
                self.take(struct.calcsize(_SCALARS[inner]) * count)
            elif inner == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.value(inner)
            return None
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


class GGUFIndex:
    """``metadata`` (scalars and strings; arrays left out), ``tensors`` by name, ``architecture``,
    and ``tokenizer_digest`` (a hash of every ``tokenizer.*`` entry but the chat template)."""

    def __init__(self, path: Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        digest = hashlib.sha256()
        cur = _Cursor(self.path, digest)
        if cur.take(4) != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not read here")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = cur.string()
            kind = cur.scalar("<I")
            cur.hashing = key.startswith("tokenizer.") and key != "tokenizer.chat_template"
            if cur.hashing:
                digest.update(key.encode())
            value = cur.value(kind)
            cur.hashing = False
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, dims, GGMLQuantizationType(cur.scalar("<I")), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.at // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, kind, offset in infos:
            block, size = GGML_QUANT_SIZES[kind]
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            row_bytes = dims[0] // block * size
            at = start + offset
            raw = self._map[at:at + rows * row_bytes]
            if raw.size != rows * row_bytes:
                raise ValueError(f"tensor {name} runs past the end of the file")
            if kind == GGMLQuantizationType.F32:
                data = raw.view(np.float32).reshape(tuple(reversed(dims)))
            elif kind == GGMLQuantizationType.F16:
                data = raw.view(np.float16).reshape(tuple(reversed(dims)))
            else:
                data = raw.reshape(rows, row_bytes)
            self.tensors[name] = GGUFTensor(name, dims, kind, data, at)
        self.tokenizer_digest = digest.hexdigest()

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))
