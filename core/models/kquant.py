"""The exact k-quant target: a GGUF's own Q4_K and Q6_K blocks, multiplied bit-exactly at any block size.

The C kernel (``kquant.c`` beside this file) is compiled once per machine with the system's C
compiler into the user cache, and loaded with ``ctypes`` after torch, so its OpenMP threads are
torch's own. It has two paths, chosen here from the CPU's flags: AVX-512 with VNNI, and AVX2 with
FMA; both give the same bits. It is offered only after :func:`prove` has found every block of 1
to :data:`PROVED_ROWS` rows bit-identical to the rows computed one at a time, at one and two
threads, on adversarial activations; where the compiler, the instructions or the proof is
missing, :func:`unavailable` says why and the target keeps the int8 path.

A model's weights stay as the file ships them (4.5 and 6.6 bits a weight), repacked once in
memory into an order that keeps every value exactly (:class:`KQuantWeight`); activations are
quantized per row in blocks of 256, so a row's result never depends on the rows beside it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specplay.core.atomic import replacing
from specplay.core.errors import ModelError
from specplay.core.models.linear import blocks_match, cpu_flags, rows_one_at_a_time
from specplay.core.paths import cache_dir

log = logging.getLogger(__name__)

#: GGML's tensor type numbers of the block formats the kernel reads.
Q4_K, Q6_K = 12, 14
TYPES = {Q4_K: "Q4_K", Q6_K: "Q6_K"}
_RAW_BYTES = {Q4_K: 144, Q6_K: 210}
QK = 256
#: The largest verification block the methods send at their defaults (Medusa's 64-node tree and
#: its root): every block size up to it is proved.
PROVED_ROWS = 65
_SOURCE = Path(__file__).with_name("kquant.c")
_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
_AVX2 = {"avx2", "fma"}


def isa() -> int | None:
    """The kernel path this CPU runs: 3 (AVX-512 with VNNI), 2 (AVX2 with FMA), or None."""
    flags = cpu_flags()
    if _AVX512 <= flags:
        return 3
    if _AVX2 <= flags:
        return 2
    return None


def isa_name(code: int) -> str:
    return {3: "AVX-512 VNNI", 2: "AVX2"}[code]


def _compiler() -> str | None:
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    return cc if shutil.which(cc) else None


def library_digest() -> str:
    """The kernel's source and build flags (what its proof of exactness is kept under)."""
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]


def _library_path() -> Path:
    return cache_dir() / "kernels" / f"kquant-{library_digest()}.so"


def build() -> Path:
    """The compiled kernel, compiled here once (a second or two) and kept in the user cache."""
    lib = _library_path()
    if lib.is_file():
        return lib
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc) on this machine")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with replacing(lib) as tmp:
        done = subprocess.run([cc, *_FLAGS, "-o", str(tmp), str(_SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{cc} could not compile {_SOURCE.name}: {(done.stderr.strip().splitlines() or [''])[-1][:200]}")
    return lib


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    i64, vp, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.sp_repack.argtypes = [cint, vp, vp, i64, i64]
    lib.sp_dequantize_rows.argtypes = [cint, vp, i64, vp, i64, vp]
    lib.sp_quantize.argtypes = [vp, i64, i64, i64, vp]
    lib.sp_gemm.argtypes = [cint, cint, vp, i64, i64, vp, i64, vp, i64]
    return lib


@dataclass
class KQuantWeight:
    """A matrix of ``rows`` x ``cols`` in one k-quant type, repacked for the kernel (values kept exactly)."""

    type: int
    data: torch.Tensor  # uint8, rows * (cols / 256) repacked blocks
    rows: int
    cols: int

    @staticmethod
    def from_raw(type_: int, raw: np.ndarray, cols: int) -> "KQuantWeight":
        """From a GGUF tensor's raw blocks ``[rows, bytes]`` (as ``gguf.GGUFReader`` maps them)."""
        if type_ not in TYPES:
            raise ValueError(f"the exact kernel reads Q4_K and Q6_K blocks, not GGML type {type_}")
        if cols % QK:
            raise ValueError(f"k-quant rows hold multiples of {QK} values, not {cols}")
        rows, nb = raw.shape[0], cols // QK
        if raw.shape[1] != nb * _RAW_BYTES[type_]:
            raise ValueError(f"a {TYPES[type_]} row of {cols} values takes {nb * _RAW_BYTES[type_]} bytes, "
                             f"not {raw.shape[1]}")
        raw = np.ascontiguousarray(raw)
        lib = _lib()
        data = torch.empty(rows * nb * lib.sp_sizeof_block(type_), dtype=torch.uint8)
        lib.sp_repack(type_, raw.ctypes.data, data.data_ptr(), rows, nb)
        return KQuantWeight(type_, data, rows, cols)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.cols))

    def numel(self) -> int:
        return self.rows * self.cols

    def rows_float(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` (an embedding lookup), by GGUF's own dequantization."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.cols)
        _lib().sp_dequantize_rows(self.type, self.data.data_ptr(), self.cols // QK, ids.data_ptr(), ids.numel(),
                                  out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        return self.rows_float(torch.arange(self.rows))


class KQuantLinear:
    """``y = x W^T + b`` with ``W`` one or several k-quant matrices stacked by rows (fused q/k/v, gate/up).

    Bit-exact across batch sizes: activations are quantized per row, the kernel's sums are
    integers inside a block and added in one fixed order across blocks.
    """

    def __init__(self, parts: "KQuantWeight | list[KQuantWeight]", bias: torch.Tensor | None = None):
        self.parts = parts if isinstance(parts, list) else [parts]
        cols = {p.cols for p in self.parts}
        if len(cols) != 1:
            raise ValueError(f"fused k-quant matrices must share their input size, got {sorted(cols)}")
        self.in_features = cols.pop()
        self._out = sum(p.rows for p in self.parts)
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self._isa = isa()

    @property
    def out_features(self) -> int:
        return self._out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        k = self.in_features
        x2 = x.reshape(-1, k).to(torch.float32).contiguous()
        m = x2.shape[0]
        lib = _lib()
        xq = torch.empty(m * (k // QK) * lib.sp_sizeof_blockx(), dtype=torch.uint8)
        lib.sp_quantize(x2.data_ptr(), m, k, k, xq.data_ptr())
        y = torch.empty(m, self._out)
        col = 0
        for part in self.parts:
            lib.sp_gemm(self._isa, part.type, part.data.data_ptr(), part.rows, k, xq.data_ptr(), m,
                        y.data_ptr() + 4 * col, self._out)
            col += part.rows
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*shape[:-1], self._out)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def first_rows(self, rows: int) -> "KQuantLinear":
        """The layer cut to its first ``rows`` outputs (a draft vocabulary), sharing this one's blocks."""
        if len(self.parts) != 1:
            raise ValueError("only a single matrix's rows can be cut")
        w = self.parts[0]
        rows = min(rows, w.rows)
        per_row = w.data.numel() // w.rows
        cut = KQuantWeight(w.type, w.data[: rows * per_row], rows, w.cols)
        return KQuantLinear(cut, None if self.bias is None else self.bias[:rows])


def adversarial_rows(k: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Activations that stress exactness: outliers a thousand times the rest, rows of one repeated
    extreme value (every product at its largest, where 16-bit pair sums would saturate), zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[1::7, 3] = 1e3
    x[2::7] = 50.0
    x[3::7] = -50.0
    x[4::7] = 0.0
    x[5::7, ::2] *= 1e-6
    return x


def row_exact(layer: KQuantLinear, x: torch.Tensor, threads=(1, 2)) -> bool:
    """Every block of the first 1 .. len(x) rows bit-identical to the rows computed one at a time."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = rows_one_at_a_time(layer, x)
        for n in threads:
            torch.set_num_threads(n)
            if not blocks_match(layer, x, alone):
                return False
        return True
    finally:
        torch.set_num_threads(before)


def prove(weights: list[KQuantWeight]) -> bool:
    """The kernel on these (real) matrices: exact at every block of 1 .. :data:`PROVED_ROWS` rows."""
    return all(row_exact(KQuantLinear(w), adversarial_rows(w.cols, PROVED_ROWS, seed=i))
               for i, w in enumerate(weights))


def unavailable() -> str | None:
    """Why the exact k-quant kernel cannot run here, or None."""
    if isa() is None:
        return "the CPU has neither AVX2 with FMA nor AVX-512 with VNNI"
    try:
        _lib()
    except OSError as exc:
        return f"its kernel could not be built: {exc}"
    return None


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
        from gguf import GGUFReader

        try:
            self._reader = GGUFReader(str(path))
            arch = self._reader.fields["general.architecture"]
            self.architecture = bytes(arch.parts[arch.data[0]]).decode()
        except Exception as exc:  # gguf raises ValueError, IndexError, KeyError on damaged files
            raise ModelError(f"cannot read the GGUF file {path}: {exc}") from None
        self.tensors = {t.name: t for t in self._reader.tensors}
        self.path = path

    def unreadable(self) -> str | None:
        """Why the kernel cannot run this file's matrices, or None."""
        if self.architecture != "qwen2":
            return f"the exact k-quant path reads Qwen2 GGUF files, not {self.architecture}"
        other = sorted({t.tensor_type.name for t in self.tensors.values()
                        if len(t.shape) == 2 and int(t.tensor_type) not in TYPES})
        return f"its matrices include {', '.join(other)} blocks (the kernel reads Q4_K and Q6_K)" if other else None

    def get(self, hf_name: str):
        tensor = self.tensors.get(gguf_name(hf_name))
        if tensor is None:
            return None
        if len(tensor.shape) == 1:
            return torch.from_numpy(np.array(tensor.data, dtype=np.float32))
        return KQuantWeight.from_raw(int(tensor.tensor_type), tensor.data, int(tensor.shape[0]))

    def matrices(self, count: int) -> list[KQuantWeight]:
        """The first ``count`` matrices of each block type the file holds (what :func:`prove` runs on)."""
        found: dict[int, list] = {}
        for t in self.tensors.values():
            kind = int(t.tensor_type)
            if len(t.shape) == 2 and kind in TYPES and t.shape[1] <= 16384 and len(found.setdefault(kind, [])) < count:
                found[kind].append(KQuantWeight.from_raw(kind, t.data, int(t.shape[0])))
        return [w for ws in found.values() for w in ws]
