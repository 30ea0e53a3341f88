"""The exact k-quant target: a GGUF's own Q4_K and Q6_K blocks, multiplied bit-exactly at any block size.

The C kernel (``kquant.h`` and its sources beside this file) is compiled once per machine with the system's C
compiler into the user cache (:mod:`specplay.core.kernels.kernel_build`, which loads it only while
it is this user's), and loaded with ``ctypes`` after torch, so its OpenMP threads are torch's own.
It has two paths, chosen here from the CPU's flags: AVX-512 with VNNI, and AVX2 with
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
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specplay.core.errors import ModelError
from specplay.core.kernels.exactness import blocks_match, cpu_flags, rows_one_at_a_time
from specplay.core.kernels.kernel_build import load_library

log = logging.getLogger(__name__)

#: GGML's tensor type numbers of the block formats the kernel reads.
Q4_K, Q6_K = 12, 14
TYPES = {Q4_K: "Q4_K", Q6_K: "Q6_K"}
_RAW_BYTES = {Q4_K: 144, Q6_K: 210}
_Q5_0, _Q8_0 = 6, 8  # the 32-value blocks a draft's other matrices ship in, fitted into Q4_K
QK = 256
#: The largest verification block the methods send at their defaults (Medusa's 64-node tree and
#: its root): every block size up to it is proved.
PROVED_ROWS = 65
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


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = load_library()
    i64, vp, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.sp_repack.argtypes = [cint, vp, vp, i64, i64]
    lib.sp_dequantize_rows.argtypes = [cint, vp, i64, i64, vp, i64, vp]
    lib.sp_quantize_q4k.argtypes = [vp, i64, i64, i64, vp]
    lib.sp_fit_q4k_from.argtypes = [cint, vp, i64, i64, i64, vp]
    lib.sp_linear.argtypes = [cint, vp, vp, i64, i64, vp, vp, i64]
    lib.sp_layers_scratch.argtypes = [vp, i64, i64]
    lib.sp_layers_scratch.restype = i64
    lib.sp_layers.argtypes = [cint, vp, i64, vp, i64, vp, vp, vp, i64, i64, vp, cint, vp]
    return lib


#: What the kernel's entries return besides 0 (``kquant.h``): their outputs are then thrown away.
_BAD_ARGUMENTS, _OUT_OF_MEMORY, _ID_OUT_OF_RANGE = -1, -2, -3


def _checked(status: int, call: str) -> None:
    """Raise for a kernel entry's non-zero status; ``call`` says what it was asked to do."""
    if status == _OUT_OF_MEMORY:
        raise MemoryError(f"out of memory in the k-quant kernel ({call})")
    if status == _ID_OUT_OF_RANGE:
        raise IndexError(f"the k-quant kernel was asked for rows its matrix does not have ({call})")
    if status != 0:
        raise ModelError(f"the k-quant kernel refused to {call}: its sizes disagree (status {status})")


class _Matrix:
    """What a matrix of ``rows`` x ``width`` values says of its size."""

    rows: int
    width: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.width))

    def numel(self) -> int:
        return self.rows * self.width


@dataclass
class KQuantWeight(_Matrix):
    """A matrix of ``rows`` x ``cols`` in one k-quant type, repacked for the kernel (values kept exactly)."""

    type: int
    data: torch.Tensor  # uint8, rows * (cols / 256) repacked blocks
    rows: int
    cols: int  # values stored a row: a multiple of 256
    width: int = 0  # the matrix's own input size: cols, or fewer (the rest zeros up to a whole block)

    def __post_init__(self):
        self.width = self.width or self.cols
        # What the kernel is told of the blocks (rows, a row's blocks) must be what ``data`` holds.
        if (self.type not in TYPES or self.cols % QK or not 0 < self.width <= self.cols
                or self.data.numel() != self.rows * (self.cols // QK) * _lib().sp_sizeof_block(self.type)):
            raise ValueError(f"{self.data.numel():,} bytes are not a {self.rows} x {self.cols} matrix of "
                             f"{TYPES.get(self.type, f'GGML type {self.type}')} blocks (rows of {self.width} values)")

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
        _checked(lib.sp_repack(type_, raw.ctypes.data, data.data_ptr(), rows, nb), f"repack {rows} {TYPES[type_]} rows")
        return KQuantWeight(type_, data, rows, cols)

    @staticmethod
    def quantize(w: torch.Tensor, chunk: int = 8192) -> "KQuantWeight":
        """A float matrix ``[rows, width]`` in Q4_K blocks fitted here, each row zero-padded to whole
        blocks: for a draft model's matrices (its numerics never decide a token), a chunk of rows at a time."""
        rows, width = w.shape
        cols = -(-width // QK) * QK
        lib = _lib()
        per_row = cols // QK * lib.sp_sizeof_block(Q4_K)
        data = torch.empty(rows * per_row, dtype=torch.uint8)
        for start in range(0, rows, chunk):
            part = torch.zeros(min(chunk, rows - start), cols)
            part[:, :width] = w[start:start + chunk]
            _checked(lib.sp_quantize_q4k(part.data_ptr(), part.shape[0], cols, cols, data.data_ptr() + start * per_row),
                     f"fit a {rows} x {width} matrix into Q4_K blocks")
        return KQuantWeight(Q4_K, data, rows, cols, width)

    @staticmethod
    def fit_blocks(type_: int, raw: np.ndarray, width: int) -> "KQuantWeight | None":
        """A GGUF matrix in Q8_0 or Q5_0 blocks (``raw``: ``[rows, bytes]``) fitted into Q4_K like
        :meth:`quantize`, straight from its blocks (no float copy); None for another type. Raises where
        the fit fails (out of memory): no block of a failed fit is ever kept."""
        if type_ not in (_Q8_0, _Q5_0) or width % 32:
            return None
        rows, cols = raw.shape[0], -(-width // QK) * QK
        if raw.shape[1] != width // 32 * (34 if type_ == _Q8_0 else 22):
            raise ValueError(f"a row of {width} values in GGML type {type_} blocks does not take {raw.shape[1]} bytes")
        lib = _lib()
        data = torch.empty(rows * cols // QK * lib.sp_sizeof_block(Q4_K), dtype=torch.uint8)
        raw = np.ascontiguousarray(raw)
        _checked(lib.sp_fit_q4k_from(type_, raw.ctypes.data, rows, width, cols, data.data_ptr()),
                 f"fit a {rows} x {width} matrix into Q4_K blocks")
        return KQuantWeight(Q4_K, data, rows, cols, width)

    def rows_float(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` (an embedding lookup: ``ids``' shape plus the width), by GGUF's own
        dequantization. An id outside the matrix's rows raises ``IndexError``."""
        shape = ids.shape
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        _check_ids(ids, self.rows)
        out = torch.empty(ids.numel(), self.cols)
        _checked(_lib().sp_dequantize_rows(self.type, self.data.data_ptr(), self.rows, self.cols // QK, ids.data_ptr(),
                                           ids.numel(), out.data_ptr()), f"read {ids.numel()} embedding rows")
        return (out if self.width == self.cols else out[:, :self.width]).reshape(*shape, self.width)

    def dequantize(self) -> torch.Tensor:
        return self.rows_float(torch.arange(self.rows))


def _check_ids(ids: torch.Tensor, rows: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        bad = ids[(ids < 0) | (ids >= rows)]
        raise IndexError(f"token id {int(bad[0])} is outside the embedding's {rows} rows")


class MappedRows(_Matrix):
    """A GGUF matrix read a few rows at a time from its file: an embedding, of which a step needs only
    its tokens' rows. Only the rows used are read (through the file's reclaimable page cache) instead
    of the whole matrix repacked: 131 MB of the 1.5B target's 1.16 GB. The rows are repacked and
    dequantized as :class:`KQuantWeight` does, so their values are the same.

    They are read with ``os.preadv`` on a descriptor held open, never through a mapping kept for the
    app's lifetime: a file overwritten or cut while the app runs (a re-download, ``cp``) then ends in a
    short read, an error, where a mapping's vanished page kills the process (SIGBUS)."""

    def __init__(self, type_: int, path: Path, offset: int, rows: int, cols: int):
        if type_ not in TYPES:
            raise ValueError(f"the exact kernel reads Q4_K and Q6_K blocks, not GGML type {type_}")
        if cols % QK:
            raise ValueError(f"k-quant rows hold multiples of {QK} values, not {cols}")
        self.type, self.path, self.rows, self.cols, self.width = type_, path, rows, cols, cols
        self._offset, self._row_bytes = offset, cols // QK * _RAW_BYTES[type_]
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def rows_float(self, ids: torch.Tensor) -> torch.Tensor:
        """As :meth:`KQuantWeight.rows_float`."""
        shape = ids.shape
        ids = ids.reshape(-1).to(torch.int64).cpu()
        _check_ids(ids, self.rows)
        raw = np.empty((ids.numel(), self._row_bytes), dtype=np.uint8)
        for i, row in enumerate(ids.tolist()):
            if os.preadv(self._fd, [raw[i]], self._offset + row * self._row_bytes) != self._row_bytes:
                raise ModelError(f"{self.path} changed on disk while in use: row {row} of its token embedding "
                                 "is cut short (was it overwritten? load it again)")
        picked = KQuantWeight.from_raw(self.type, raw, self.cols)
        return picked.rows_float(torch.arange(ids.numel()).reshape(shape))


class KQuantLinear:
    """``y = x W^T + b`` with ``W`` one or several k-quant matrices stacked by rows (fused q/k/v, gate/up).

    Bit-exact across batch sizes: activations are quantized per row, the kernel's sums are
    integers inside a block and added in one fixed order across blocks.
    """

    def __init__(self, parts: "KQuantWeight | list[KQuantWeight]", bias: torch.Tensor | None = None):
        self.parts = parts if isinstance(parts, list) else [parts]
        sizes = {(p.width, p.cols) for p in self.parts}
        if len(sizes) != 1:
            raise ValueError(f"fused k-quant matrices must share their input size, got {sorted(sizes)}")
        self.in_features, self._cols = sizes.pop()
        self._out = sum(p.rows for p in self.parts)
        if len(self.parts) > 3:
            raise ValueError(f"the kernel fuses at most 3 matrices into one projection, got {len(self.parts)}")
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        if self.bias is not None and self.bias.numel() != self._out:
            raise ValueError(f"a bias of {self.bias.numel()} values for a layer of {self._out} outputs")
        self._isa = isa()
        self.projection = _Projection.of(self)  # the kernel's description of this layer, made once

    @property
    def out_features(self) -> int:
        return self._out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        m = x2.shape[0]
        lib = _lib()
        xq = torch.empty(m * (self._cols // QK) * lib.sp_sizeof_blockx(), dtype=torch.uint8)
        y = torch.empty(m, self._out)
        _checked(lib.sp_linear(self._isa, ctypes.byref(self.projection), x2.data_ptr(), m, self.in_features,
                               xq.data_ptr(), y.data_ptr(), self._out),
                 f"multiply {m} rows by a {self._out} x {self.in_features} matrix")
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
        cut = KQuantWeight(w.type, w.data[: rows * per_row], rows, w.cols, w.width)
        return KQuantLinear(cut, None if self.bias is None else self.bias[:rows])

    def chosen_rows(self, ids) -> "KQuantLinear":
        """The layer's outputs ``ids``, in that order (a ranked draft vocabulary): their blocks copied."""
        if len(self.parts) != 1:
            raise ValueError("only a single matrix's rows can be chosen")
        w = self.parts[0]
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        _check_ids(ids, w.rows)
        picked = w.data.view(w.rows, -1)[ids].reshape(-1).contiguous()
        chosen = KQuantWeight(w.type, picked, int(ids.numel()), w.cols, w.width)
        return KQuantLinear(chosen, None if self.bias is None else self.bias[ids])


class _Projection(ctypes.Structure):  # kquant.h's sp_linear_t
    _fields_ = [("parts", ctypes.c_int32), ("types", ctypes.c_int32 * 3), ("ws", ctypes.c_void_p * 3),
                ("ns", ctypes.c_int64 * 3), ("k", ctypes.c_int64), ("width", ctypes.c_int64), ("out", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]

    @classmethod
    def of(cls, layer: "KQuantLinear") -> "_Projection":
        """A k-quant layer as the kernel takes it: its matrices side by side, then its bias (the
        layer keeps the tensors alive)."""
        parts = layer.parts
        return cls(len(parts), (ctypes.c_int32 * 3)(*[p.type for p in parts]),
                   (ctypes.c_void_p * 3)(*[p.data.data_ptr() for p in parts]),
                   (ctypes.c_int64 * 3)(*[p.rows for p in parts]), layer._cols, layer.in_features,
                   layer.out_features, None if layer.bias is None else layer.bias.data_ptr())


class _Layer(ctypes.Structure):  # kquant.h's sp_layer_t
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64), ("eps", ctypes.c_float),
                ("unused", ctypes.c_int32), ("ln_in", ctypes.c_void_p), ("ln_post", ctypes.c_void_p),
                ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection)]


_PROJECTIONS = {"qkv": "q/k/v projection", "o": "attention output", "gate_up": "gate/up projection",
                "down": "down projection"}


def check_shapes(cfg, layers: list, head: KQuantLinear, name: str) -> None:
    """Raise :class:`ModelError` naming ``name`` and the disagreement where a k-quant model's matrices
    disagree with its config (the head counts and sizes a file's metadata states) or with each other.
    Checked at load, before any layer runs: the C layer would refuse such sizes at the first decode
    (``sp_layers`` checks them again), torch's layers fail on them with a shape error."""
    heads, kv, d, hidden, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size

    def disagree(what: str) -> ModelError:
        return ModelError(f"{name}: its metadata disagrees with its tensors: {what}")

    if heads < 1 or kv < 1 or heads % kv:
        raise disagree(f"{heads} attention heads cannot share {kv} key/value heads evenly")
    if min(d, hidden, inter) < 1:
        raise disagree(f"a head size of {d}, a hidden size of {hidden}, an intermediate size of {inter}")
    want = {"qkv": ((heads * d, kv * d, kv * d), hidden, f"{heads} heads and {kv} key/value heads of {d} values"),
            "o": ((hidden,), heads * d, f"{heads} heads of {d} values"),
            "gate_up": ((inter, inter), hidden, f"an intermediate size of {inter}"),
            "down": ((hidden,), inter, f"an intermediate size of {inter}")}
    for i, layer in enumerate(layers):
        for part, (rows, width, why) in want.items():
            got = getattr(layer, part)
            have = tuple(p.rows for p in got.parts)
            if have != rows or got.in_features != width:
                raise disagree(f"layer {i}'s {_PROJECTIONS[part]} is {'+'.join(map(str, have))} x {got.in_features} "
                               f"(rows x inputs), where {why} and a hidden size of {hidden} make it "
                               f"{'+'.join(map(str, rows))} x {width}")
        for norm in (layer.ln_in, layer.ln_post):
            if norm.numel() != hidden:
                raise disagree(f"layer {i}'s norm has {norm.numel()} values for a hidden size of {hidden}")
    if head.in_features != hidden:
        raise disagree(f"the output head takes {head.in_features} inputs for a hidden size of {hidden}")


class FusedLayers:
    """A decoder's layers on the kernel as one C call (``layer.c``): norm, projections, RoPE, cache
    write, attention and MLP of every layer in one parallel region, without torch's per-operation cost
    (a third of a small model's token) or a region's start a layer. Row-invariant like the kernel, so a
    target may decode and verify on it alike."""

    def __init__(self, cfg, layers: list):
        self._norms = [(l.ln_in.float().contiguous(), l.ln_post.float().contiguous()) for l in layers]
        self._layers = (_Layer * len(layers))(*[
            _Layer(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.rms_norm_eps, 0, ln_in.data_ptr(), ln_post.data_ptr(), l.qkv.projection, l.o.projection,
                   l.gate_up.projection, l.down.projection)
            for l, (ln_in, ln_post) in zip(layers, self._norms)])
        self._isa = isa()

    @staticmethod
    def fits(cfg, layers: list) -> bool:
        """Whether the C layer runs this model, whose shapes :func:`check_shapes` found consistent: every
        projection on the kernel in at most three matrices, heads of at most 256 values, sizes in
        multiples of 8 (the torch layers run the others)."""
        projections = [p for l in layers for p in (l.qkv, l.o, l.gate_up, l.down)]
        return (cfg.head_dim <= 256 and cfg.head_dim % 8 == 0 and cfg.hidden_size % 8 == 0
                and all(isinstance(p, KQuantLinear) and len(p.parts) <= 3 for p in projections))

    def run(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, base: int,
            mask: torch.Tensor | None, causal: bool) -> None:
        """Layer ``i`` over rows ``x`` (float32 ``[m, hidden]``, contiguous, updated in place), their keys
        and values written into ``kv`` (float32 ``[2, kv_heads, capacity, head_dim]``) from slot ``base``;
        a row sees the slots ``mask`` (``[m, base + m]``) allows, else its own and those before it
        (``causal``) or all."""
        self.run_span(i, i + 1, x, cos, sin, kv[None], base, mask, causal)

    def run_span(self, start: int, stop: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kvs: torch.Tensor, base: int, mask: torch.Tensor | None, causal: bool) -> None:
        """Layers ``start`` .. ``stop - 1`` one after another, as :meth:`run` of each in turn, in one call:
        layer i's keys and values go into ``kvs[i - start]`` (contiguous)."""
        lib, n, m = _lib(), stop - start, x.shape[0]
        layers = ctypes.byref(self._layers, start * ctypes.sizeof(_Layer))
        what = f"run layer {start}" if n == 1 else f"run layers {start}-{stop - 1}"
        size = lib.sp_layers_scratch(layers, n, m)
        if size < 0:
            _checked(size, what)
        scratch = torch.empty(size, dtype=torch.uint8)
        caches = (ctypes.c_void_p * n)(*[kvs[i].data_ptr() for i in range(n)])
        mask_bytes = None if mask is None else mask.to(torch.uint8).contiguous()
        _checked(lib.sp_layers(self._isa, layers, n, x.data_ptr(), m, cos.data_ptr(), sin.data_ptr(), caches,
                               kvs.shape[-2], base, None if mask_bytes is None else mask_bytes.data_ptr(),
                               int(causal), scratch.data_ptr()), f"{what} over {m} rows")


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


def kernel_threads() -> int:
    """The threads the kernel's parallel regions run in this thread: its OpenMP runtime's count, asked
    through the kernel's library (where torch loaded its OpenMP first, as here, the library binds to
    that one, and ``torch.set_num_threads`` sets it; a thread torch has not yet run a parallel
    operation in keeps OpenMP's default)."""
    return _lib().omp_get_max_threads()


def use_threads(n: int) -> bool:
    """Torch's threads set to ``n``; whether the kernel runs ``n`` too (else a proof at ``n`` is none)."""
    torch.set_num_threads(n)
    return kernel_threads() == n


def row_exact(layer: KQuantLinear, x: torch.Tensor, threads=(1, 2)) -> bool:
    """Every block of the first 1 .. len(x) rows bit-identical to the rows computed one at a time, at
    each of ``threads``."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = rows_one_at_a_time(layer, x)
        return all(use_threads(n) and blocks_match(layer, x, alone) for n in threads)
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
