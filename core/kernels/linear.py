"""Linear layers for the native decoder: plain floating point, and row-exact int8.

Why a custom int8 layer. On a CPU, decoding is bound by reading weights, so int8 storage is
about 4x faster than float32 per token, and its integer GEMM makes verifying 8 tokens cost
little more than 1 (see ``docs/benchmarks.md``). The fast x86 kernel (fbgemm's dynamic
quantized linear) quantizes the *whole* input block with one scale taken from its min and
max, so a token's logits would depend on which other tokens share its forward pass: a
verified token could then differ from the one plain decoding emits.

The fix keeps the kernel and removes the dependence. Each row is divided by its own
max-abs ``s`` so that it lies in [-1, 1], and two constant input columns (+1, -1), multiplied
by zero weight columns, pin the block's min and max to exactly -1 and +1 whatever the other
rows hold. The kernel's scale and zero point are therefore the same for every block, each
row is quantized on its own, the int32 accumulation is exact, and multiplying the output
row by ``s`` is elementwise: the result for a row is bit-identical whether it is computed
alone or in a block of 64 (``tests/kernels/test_linear.py``).
"""

from __future__ import annotations

import enum
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specplay.core.errors import ConfigError
from specplay.core.kernels.exactness import cpu_flags


class FloatLinear:
    """``y = x W^T + b`` in the weight's floating dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight
        self.bias = bias

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float()


@functools.lru_cache(maxsize=1)
def int8_supported() -> bool:
    """Whether this machine has torch's x86 quantized engine (fbgemm)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def _has_vnni() -> bool:
    """AVX-512 VNNI multiplies u8 x s8 into int32 without 16-bit saturation."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


def has_bf16_units() -> bool:
    """bfloat16 matmuls are fast only with hardware support (AVX-512 BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def drafter_dtype(device: "torch.device | str") -> torch.dtype:
    """The floating dtype a drafter's own small float matrices (EAGLE-3's fuse, Medusa's and Hydra's
    blocks) run in: bfloat16 on a CPU that multiplies it natively, reading half the bytes of float32
    (a drafter's numerics only change its drafts, never what the verifier accepts); float32 elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cpu" and has_bf16_units() else torch.float32


@dataclass
class QuantizedWeight:
    """A matrix as int8 rows with one float32 scale per row (output channel): ``w ≈ q * scale``.

    What int8 storage keeps and the model cache stores; the int8 layers pack it for the kernel.
    Rows quantize independently, so the rows of concatenated matrices (q, k and v projections)
    are the same whether quantized before or after concatenation.
    """

    q: torch.Tensor  # int8 [rows, columns]
    scale: torch.Tensor  # float32 [rows]

    @staticmethod
    def quantize(weight: torch.Tensor) -> "QuantizedWeight":
        w = weight.detach().to(torch.float32)
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        return QuantizedWeight(q.int_repr(), scale)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def numel(self) -> int:
        return self.q.numel()

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``ids`` (an embedding lookup)."""
        return self.q[ids].float() * self.scale[ids, None]

    def packed(self, extra_zero_columns: int = 0):
        """The kernel's prepacked weight, optionally with zero columns appended."""
        q = self.q
        if extra_zero_columns:
            q = torch.cat([q, torch.zeros(q.shape[0], extra_zero_columns, dtype=torch.int8)], dim=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(q, self.scale.double(),
                                                               torch.zeros(q.shape[0], dtype=torch.long), 0)
            return torch.ops.quantized.linear_prepack(qweight, None)


def _quantized(weight) -> QuantizedWeight:
    if not int8_supported():
        raise ConfigError("int8 storage needs torch's x86 quantized engine (fbgemm), absent on this machine")
    return weight if isinstance(weight, QuantizedWeight) else QuantizedWeight.quantize(weight)


#: The two pinning input columns of :class:`Int8RowExactLinear`.
_PINS = torch.tensor([1.0, -1.0])


class Int8RowExactLinear:
    """Per-output-channel int8 weights, per-row int8 activations, bit-exact across batch sizes."""

    def __init__(self, weight: "torch.Tensor | QuantizedWeight", bias: torch.Tensor | None = None):
        qw = _quantized(weight)
        n, k = qw.shape
        # Two zero weight columns for the two pinning input columns (+1, -1).
        self._packed = qw.packed(extra_zero_columns=2)
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self._out = n
        # Without VNNI the AVX2 kernel sums pairs of u8*s8 products in 16 bits; 7-bit
        # activations keep those sums from saturating.
        self._reduce_range = not _has_vnni()

    @property
    def out_features(self) -> int:
        return self._out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        k = shape[-1]
        x2 = x.reshape(-1, k).to(torch.float32)
        s = torch.linalg.vector_norm(x2, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30)
        # Written in place into one buffer (no abs copy, no concatenation): over a prompt's
        # thousand rows the copies took a fifth of the layers' time.
        pinned = torch.empty(x2.shape[0], k + 2)
        torch.div(x2, s, out=pinned[:, :k])
        pinned[:, k:] = _PINS
        y = torch.ops.quantized.linear_dynamic(pinned, self._packed, self._reduce_range).mul_(s)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*shape[:-1], self._out)


    def dequantized_weight(self) -> torch.Tensor:
        """The weight as float32 ``[out, in]``, as the kernel sees it (without the pinning columns)."""
        with torch.no_grad():
            qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
            return qweight.dequantize()[:, :-2].contiguous()


class Int8DraftLinear:
    """Per-output-channel int8 weights and the kernel's own per-block activation scale.

    For a draft model only: a row's result then depends on the other rows of its block, which
    would break exact verification in a target, but a draft's numerics never affect
    losslessness (the verifier sees the q that was actually sampled). It skips the row
    pinning's per-call work, which matters at a draft's one row per call.
    """

    def __init__(self, weight: "torch.Tensor | QuantizedWeight", bias: torch.Tensor | None = None):
        qw = _quantized(weight)
        n, k = qw.shape
        self._packed = qw.packed()
        self.bias = None if bias is None else bias.detach().to(torch.float32)
        self._out = n
        self._reduce_range = not _has_vnni()

    @property
    def out_features(self) -> int:
        return self._out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.to(torch.float32), self._packed, self._reduce_range)
        return y if self.bias is None else y + self.bias


    def dequantized_weight(self) -> torch.Tensor:
        with torch.no_grad():
            qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
            return qweight.dequantize()


@dataclass
class Int4Packed:
    """A matrix in the int4 kernel's own layout, as :class:`Int4DraftLinear` runs it and the cache stores it.

    ``packed`` is ``torch._convert_weight_to_int4pack_for_cpu``'s uint8 output (rows padded to
    a multiple of 16, kept in blocks of 64), ``scales`` the bfloat16 (scale, offset) of each
    group of 32 columns; ``rows`` is the matrix's real row count.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    rows: int

    def numel(self) -> int:
        return self.rows * self.packed.shape[1] * 2  # two int4 columns per byte


class Int4DraftLinear:
    """Int4 weights in groups of 32 columns (a bfloat16 scale and offset each), bfloat16 activations.

    For a draft model only, on CPUs with bfloat16 units: half the bytes of int8, and a draft
    token is bound by reading its weights, so it costs about a third less; the coarser weights
    lower acceptance a little, never losslessness (the verifier sees the q that was sampled).
    The kernel is ``torch._weight_int4pack_mm_for_cpu``.
    """

    GROUP = 32
    _ROW_BLOCK = 64  # the kernel's packed layout keeps rows in blocks of 64

    def __init__(self, weight: "torch.Tensor | QuantizedWeight | Int4Packed", bias: torch.Tensor | None = None):
        self.weight = weight if isinstance(weight, Int4Packed) else self.pack(weight)
        self.bias = None if bias is None else bias.detach().to(torch.float32)

    @classmethod
    def pack(cls, weight: "torch.Tensor | QuantizedWeight") -> Int4Packed:
        """Quantize a matrix to int4 groups and pack it for the kernel."""
        n, k = weight.shape
        if k % cls.GROUP:
            raise ConfigError(f"int4 storage needs input sizes divisible by {cls.GROUP}, got {k}")
        pad = -n % 16  # the kernel packs rows in sixteens: zero rows, cut from the output
        q = torch.zeros(n + pad, k, dtype=torch.int32)
        scale = torch.zeros(n + pad, k // cls.GROUP)
        offset = torch.zeros(n + pad, k // cls.GROUP)
        # In slices of rows, so that quantizing a large matrix (an LM head) needs little memory.
        for lo in range(0, n, 4096):
            hi = min(n, lo + 4096)
            rows = weight.q[lo:hi].float() * weight.scale[lo:hi, None] if isinstance(weight, QuantizedWeight) \
                else weight[lo:hi].detach().float()
            groups = rows.reshape(hi - lo, -1, cls.GROUP)
            low = groups.amin(-1, keepdim=True)
            step = ((groups.amax(-1, keepdim=True) - low) / 15).clamp_min(1e-12)
            q[lo:hi] = torch.round((groups - low) / step).clamp(0, 15).to(torch.int32).reshape(hi - lo, k)
            scale[lo:hi] = step.squeeze(-1)
            # The kernel computes (q - 8) * scale + offset, so the offset is the group's low end + 8 steps.
            offset[lo:hi] = (low + 8 * step).squeeze(-1)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
        scales = torch.stack([scale.t(), offset.t()], dim=-1).to(torch.bfloat16).contiguous()
        return Int4Packed(packed, scales, n)

    @property
    def out_features(self) -> int:
        return self.weight.rows

    def first_rows(self, rows: int) -> "Int4DraftLinear":
        """The layer cut to its first ``rows`` outputs (a draft vocabulary), sharing this one's storage."""
        w = self.weight
        keep = min(w.packed.shape[0], -(-rows // self._ROW_BLOCK) * self._ROW_BLOCK)
        cut = Int4Packed(w.packed[:keep], w.scales[:, :keep], min(rows, w.rows))
        return Int4DraftLinear(cut, None if self.bias is None else self.bias[:rows])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        w = self.weight
        y = torch._weight_int4pack_mm_for_cpu(x2, w.packed, self.GROUP, w.scales)[:, : w.rows].float()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], w.rows)


class Storage(enum.StrEnum):
    """How a model's linear layers keep their weights. The values are what a model's ``storage``,
    the command line's ``--dtype`` (``int8``, ``gguf``) and a heads manifest say; a member equals its
    value as a string."""

    FLOAT = "float"  # the compute dtype's floats
    INT8 = "int8"  # row-exact int8 rows: exact at every block size (a target's)
    GGUF = "gguf"  # the GGUF's own Q4_K/Q6_K blocks on the k-quant kernel: exact (a target's)
    INT8_DRAFT = "int8-draft"  # int8 rows without the pinning (a draft's: faster, not batch-invariant)
    INT4_DRAFT = "int4-draft"  # int4 layers packed for torch's kernel (a draft's)
    KQUANT_DRAFT = "kquant-draft"  # Q4_K blocks fitted to a draft's weights, on the k-quant kernel


#: The quantized storages whose results are bit-exact across block sizes (a target's).
EXACT_QUANTIZED = (Storage.INT8, Storage.GGUF)
#: The storages the k-quant kernel runs (:mod:`specplay.core.kernels.kquant`).
KQUANT_STORAGES = (Storage.GGUF, Storage.KQUANT_DRAFT)


def storage_of(info) -> Storage:
    """The storage kind for a drafting head's layers made to match a loaded target's (``ModelInfo``)
    weights: int8 rows beside an int8 target, Q4_K blocks fitted to the head beside a target on the
    GGUF's own blocks, whose kernel then runs the head too, floats else. A head only drafts, so its
    numerics never decide a token."""
    return {Storage.INT8: Storage.INT8, Storage.GGUF: Storage.KQUANT_DRAFT}.get(info.dtype, Storage.FLOAT)


def make_linear(weight: "torch.Tensor | QuantizedWeight | Int4Packed", bias: torch.Tensor | None, storage: Storage):
    """Build the linear layer for a storage kind.

    Quantized kinds take a :class:`QuantizedWeight` too, int4 an :class:`Int4Packed`, and the
    k-quant kinds a k-quant matrix or a list of them (fused); a k-quant draft also a float matrix,
    fitted into Q4_K blocks here.
    """
    storage = Storage(storage)
    if storage in KQUANT_STORAGES:
        from specplay.core.kernels.kquant import KQuantLinear, KQuantWeight

        if storage == Storage.KQUANT_DRAFT and isinstance(weight, torch.Tensor):
            weight = KQuantWeight.quantize(weight.detach().float().cpu())
        return KQuantLinear(weight, bias)
    kinds = {Storage.INT8: Int8RowExactLinear, Storage.INT8_DRAFT: Int8DraftLinear,
             Storage.INT4_DRAFT: Int4DraftLinear, Storage.FLOAT: FloatLinear}
    return kinds[storage](weight, bias)
