"""What this process holds in memory, for the models panel and the status bar (no Qt here).

Resident memory is split into private bytes (the process's own: weights it built, caches,
activations) and file-mapped bytes (model files the kernel maps and may reclaim), so a user
sees what loading a model really costs.
"""

from __future__ import annotations

import os
import sys


def memory_split() -> tuple[int, int] | None:
    """(private, file-mapped) resident bytes on Linux: mapped model files are reclaimable."""
    try:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(rest.split()[0]) * 1024
        return fields["RssAnon"] + fields.get("RssShmem", 0), fields["RssFile"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def release_freed_memory() -> None:
    """Hand memory the allocator keeps after frees back to the system (glibc's ``malloc_trim``).

    Building a model's layers on several threads frees large temporary buffers (int8 rows
    before packing) into per-thread heaps, which keep them resident: about 0.7 GB after the
    default target's load. Elsewhere (no glibc) this does nothing.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_rss() -> int | None:
    """Resident memory of this process in bytes (None where it cannot be read)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def cuda_memory() -> tuple[int, int] | None:
    """(allocated, reserved) CUDA bytes, only if torch has already initialised CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    except Exception:
        return None
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_text(short: bool = False) -> str:
    parts = []
    rss = process_rss()
    if rss is not None:
        split = None if short else memory_split()
        extra = f" ({gib(split[0])} private, {gib(split[1])} mapped files)" if split and split[1] > 2**28 else ""
        parts.append(f"RAM {gib(rss)}{extra}")
    cuda = cuda_memory()
    if cuda is not None:
        parts.append(f"CUDA {gib(cuda[0])} (reserved {gib(cuda[1])})")
    return " · ".join(parts) or "memory: n/a"
