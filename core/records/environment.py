"""The environment card of a run or a benchmark: the machine, its measured memory bandwidth, the
kernels and engines chosen on it, and the libraries' versions. Speed figures hold for one kind
of machine only; the card says which.
"""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata

import torch

from specplay.core.models.measurements import cpu_name, has_measured, measured

_LIBRARIES = ("torch", "transformers", "llama-cpp-python", "PySide6-Essentials", "numpy")


def _bandwidth() -> dict:
    """Reading 1 GiB of float32 (``torch.sum``), best of five: what bounds decoding on a CPU."""
    data = torch.ones(256 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return {"read_gb_per_s": round(data.numel() * 4 / best / 1e9, 1)}


def memory_bandwidth(measure: bool = True) -> float | None:
    """This machine's read bandwidth in GB/s, measured once and cached (None if not measured yet
    and ``measure`` is off: a run record never waits for it)."""
    if not measure and not has_measured("memory bandwidth"):
        return None
    return float(measured("memory bandwidth", _bandwidth)["read_gb_per_s"])


def _versions() -> dict:
    out = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _total_memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    except (ValueError, OSError, AttributeError):
        return None


def environment(target=None, draft=None, *, measure: bool = False) -> dict:
    """What a run's or a benchmark's figures depend on. ``target``/``draft`` are loaded models
    (their notes name the kernels and engines chosen for them); ``measure`` measures the memory
    bandwidth if this machine's is not known yet (the bench does; a run record does not wait)."""
    from specplay.core import __version__

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    card = {
        "specplay": __version__, "python": platform.python_version(), "platform": platform.platform(),
        "cpu": cpu_name() or platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "threads": torch.get_num_threads(), "memory_gb": _total_memory_gb(), "gpu": gpu,
        "read_gb_per_s": None if gpu else memory_bandwidth(measure),
        "quantized_engine": torch.backends.quantized.engine,
        "libraries": _versions(),
        # Kept at the top level as earlier records had them.
        "torch": torch.__version__, "transformers": _versions().get("transformers"),
    }
    if target is not None:
        card["device"], card["dtype"] = target.model.info.device, target.model.info.dtype
    for role, loaded in (("target", target), ("draft", draft)):
        if loaded is not None:
            info = loaded.model.info
            card[role] = {"name": loaded.model_id, "backend": info.backend, "dtype": info.dtype,
                          "device": info.device, "notes": list(loaded.notes)}
    return card


def format_card(card: dict) -> str:
    """The card as two or three lines above a benchmark table."""
    where = card["gpu"] or f"{card['cpu']}, {card['cores']} cores, {card['read_gb_per_s']} GB/s read"
    lines = [f"machine: {where}; int8 kernel {card['quantized_engine']}; "
             + ", ".join(f"{k} {v}" for k, v in card["libraries"].items() if v)]
    for role in ("target", "draft"):
        if role in card:
            m = card[role]
            lines.append(f"{role}: {m['name']} on {m['backend']} ({m['dtype']}, {m['device']})")
    return "\n".join(lines)
