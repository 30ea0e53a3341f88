"""What every exact quantized layer rests on: the CPU's feature flags (which kernels can run
here) and the check that a layer is row-exact, each row's result the same bits in a block of any
size as alone (what :mod:`specplay.core.kernels.linear`'s int8 rows and
:mod:`specplay.core.kernels.kquant`'s kernel are proved with before a target uses them).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where /proc/cpuinfo does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def rows_one_at_a_time(layer, x: torch.Tensor) -> torch.Tensor:
    """``layer`` applied to each row of ``x`` alone: what a row-exact layer must give in any block."""
    return torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])


def blocks_match(layer, x: torch.Tensor, alone: torch.Tensor) -> bool:
    """Whether every block of the first 1 .. len(x) rows gives ``alone``'s rows bit for bit."""
    return all(torch.equal(layer(x[:m]), alone[:m]) for m in range(1, x.shape[0] + 1))
