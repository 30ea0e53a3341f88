"""This machine's measurements: which kernels run what here, chosen by measurement, once per machine, kept.

Cost curves differ from one CPU to another (``docs/benchmarks.md`` has them by machine), so nothing
is chosen by what is installed or by vendor. What is measured is kept in the user's measurements
table, keyed by the host, the CPU's model name and feature flags and the library versions that ran
it (``specplay models measure`` forgets them). Two choices are made here:

- the **quantized engine** of the row-exact int8 layer (torch's ``x86``, ``fbgemm``, ``onednn``):
  a candidate is first proved bit-exact for every block of 1 to :data:`VERIFY_ROWS` rows (the
  row pinning's promise, up to the largest block a verification uses), then the fastest wins;
  where none is proved, :func:`quant_engine` says so and a target does not run in int8;
- the **draft engine** (llama.cpp with the settings a child process survived, or SpecPlay's own
  int4/int8 layers) by its measured cost per draft token (:func:`measured`, the loader's caller).
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from pathlib import Path
from typing import Callable

import torch

from specplay.core.atomic import locked, write_text_atomic
from specplay.core.paths import measurements_dir

log = logging.getLogger(__name__)

#: torch's quantized engines that run the x86 dynamic int8 linear, in the order tried.
QUANT_ENGINES = ("x86", "fbgemm", "onednn")
#: The largest block a verification reads at the methods' default settings: Medusa's auto or
#: dynamic tree of up to 64 nodes and its root (EAGLE's tree: 33 rows; lookahead's: 31).
VERIFY_ROWS = 65
_TIMED_ROWS = (1, 8, 16)  # the decode row and two verify blocks: what the layer spends its time on
_DEFAULT_ENGINE = torch.backends.quantized.engine  # torch's own choice, read before anything changes it
#: The measurement's key: it names the rows proved, so a report that proved fewer is measured again.
#: The layers (out, in) an engine is proved on: the 1.5B target's two input sizes, and a small one
#: like a tiny model's (torch's onednn engine was exact on the first and not on 96 x 64 here).
PROVED_SHAPES = ((8960, 1536), (1536, 8960), (96, 64))
QUANT_KEY = f"quantized engine, rows 1-{VERIFY_ROWS} proved on {len(PROVED_SHAPES)} shapes"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _host_id() -> str:
    """A digest of the host name and machine id: a home directory copied to another host, whose
    hypervisor may forbid what this one allows, carries no verdict or measurement there."""
    try:
        machine_id = Path("/etc/machine-id").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        machine_id = ""
    return hashlib.sha256(f"{socket.gethostname()}|{machine_id}".encode()).hexdigest()[:12]


def host_key() -> str:
    """This host and CPU: its model name, a digest of its feature flags (what decides which
    kernels run) and :func:`_host_id`."""
    from specplay.core.kernels.exactness import cpu_flags

    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_name() or 'unknown CPU'} [{flags}] host {_host_id()}"


def machine_key() -> str:
    """:func:`host_key` and what runs the kernels here: torch's version and thread count."""
    return f"{host_key()} torch {torch.__version__} {torch.get_num_threads()} threads"


def forget_host(path) -> int:
    """Drop this host's entries (any thread count, any library version) from the table at ``path``;
    how many were dropped."""
    with locked(path):
        table = read_table(path)
        kept = {key: value for key, value in table.items() if not key.startswith(f"{host_key()} ")}
        if len(kept) < len(table):
            write_table(path, kept)
    return len(table) - len(kept)


def forget_measurements() -> int:
    """Forget what was measured on this host (kernels, draft engines, bandwidth): measured again when next needed."""
    _unsaved.pop(_file(), None)
    return forget_host(_file())


def _file():
    return measurements_dir() / "engines.json"


def read_table(path) -> dict:
    """A JSON object kept in the user cache; empty when missing or unreadable (then measured again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_table(path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(table, indent=1))


#: What a full or read-only cache could not keep, by file: this process remembers it instead.
_unsaved: dict[Path, dict] = {}


def _read() -> dict:
    return {**read_table(_file()), **_unsaved.get(_file(), {})}


def has_measured(key: str) -> bool:
    return f"{machine_key()}|{key}" in _read()


def kept_measurement(key: str) -> dict | None:
    """What :func:`measured` keeps for ``key`` on this machine, without measuring; None if nothing."""
    kept = _read().get(f"{machine_key()}|{key}")
    return kept if isinstance(kept, dict) else None


def measured(key: str, measure: Callable[[], dict], valid: Callable[[dict], bool] = lambda kept: True) -> dict:
    """``measure()``'s result for ``key`` on this machine: measured once, then read back; measured
    again where what is kept is not a JSON object or not ``valid`` (a damaged or hand-edited file).
    Where the cache cannot keep it (full, read-only), this process does, with one warning a file."""
    key = f"{machine_key()}|{key}"
    kept = _read().get(key)
    if isinstance(kept, dict) and valid(kept):
        return kept
    result = measure()  # unlocked: it may take seconds, and measure what it needs in turn
    path = _file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):  # read again, so that what another writer kept meanwhile is kept too
            write_table(path, {**read_table(path), key: result})
    except OSError as exc:
        if path not in _unsaved:
            log.warning("cannot keep what was measured in %s (%s): it is measured again in each process "
                        "until it can be", path, exc)
        _unsaved.setdefault(path, {})[key] = result
    return result


def _engine_report(progress=None) -> dict:
    """Each candidate engine's exactness on :data:`PROVED_SHAPES` and fastest time per block size
    on the first (a 1536 x 8960 layer)."""
    from specplay.core.kernels.exactness import blocks_match, rows_one_at_a_time
    from specplay.core.kernels.linear import Int8RowExactLinear, QuantizedWeight

    if progress:
        progress("Measuring this machine's int8 kernels (once)", None)
    gen = torch.Generator().manual_seed(0)
    weights = [QuantizedWeight.quantize(torch.randn(n, k, generator=gen) * 0.02) for n, k in PROVED_SHAPES]
    inputs = [torch.randn(VERIFY_ROWS, k, generator=gen) for _, k in PROVED_SHAPES]
    x = inputs[0]  # the timed layer's
    before = torch.backends.quantized.engine
    layers, report = {}, {}
    try:
        for engine in QUANT_ENGINES:
            if engine not in torch.backends.quantized.supported_engines:
                continue
            torch.backends.quantized.engine = engine
            try:
                shaped = [Int8RowExactLinear(w) for w in weights]
                exact = all(blocks_match(lin, xs, rows_one_at_a_time(lin, xs)) for lin, xs in zip(shaped, inputs))
                layer = shaped[0]
            except RuntimeError as exc:  # an engine without this kernel (or its reduced range) here
                report[engine] = {"exact": False, "ms": {}, "error": str(exc).splitlines()[0][:200]}
                continue
            report[engine] = {"exact": exact, "ms": {}}
            if exact:
                layers[engine] = layer
        # Candidates take turns, each keeping its fastest pass: a slow spell of a busy machine
        # then inflates no one engine's figure.
        for _ in range(7):
            for engine, layer in layers.items():
                torch.backends.quantized.engine = engine
                for m in _TIMED_ROWS:
                    start = time.perf_counter()
                    for _ in range(3):
                        layer(x[:m])
                    ms = (time.perf_counter() - start) / 3 * 1e3
                    best = report[engine]["ms"].get(str(m))
                    report[engine]["ms"][str(m)] = round(ms if best is None else min(best, ms), 4)
    finally:
        torch.backends.quantized.engine = before
    return report


#: Another engine replaces torch's default only when it is this much faster: a tie measured on a
#: shared machine is noise, not a reason to leave the default.
_MARGIN = 0.95


def _valid_report(report: dict) -> bool:
    """Each engine's entry as :func:`_engine_report` writes it: exact or not, times of the timed rows."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    return all(isinstance(r, dict) and isinstance(r.get("exact"), bool) and isinstance(r.get("ms"), dict)
               and all(number(r["ms"].get(str(m))) for m in _TIMED_ROWS if r["ms"] or r["exact"])
               for r in report.values())


def _report(progress=None) -> dict:
    return measured(QUANT_KEY, lambda: _engine_report(progress), _valid_report)


def quant_engine(progress=None) -> str | None:
    """The fastest quantized engine proved row-exact here (measured once), torch's default when
    it is not clearly beaten; None when no engine is proved row-exact (:func:`why_no_exact_engine`)."""
    report = _report(progress)
    exact = {e: sum(r["ms"].values()) for e, r in report.items() if r.get("exact") and r.get("ms")}
    if not exact:
        return None
    best = min(exact, key=exact.get)
    default = exact.get(_DEFAULT_ENGINE)
    return _DEFAULT_ENGINE if default is not None and exact[best] > _MARGIN * default else best


def why_no_exact_engine() -> str:
    """What each engine's proof found, where none is row-exact (the reason int8 is not used)."""
    found = "; ".join(f"{e}: {r.get('error') or 'not row-exact'}" for e, r in _report().items())
    return f"no int8 kernel here is row-exact for blocks of 1 to {VERIFY_ROWS} rows ({found or 'none installed'})"


def use_fastest_quant_engine(progress=None) -> str | None:
    """Set torch's quantized engine to :func:`quant_engine` (before int8 layers are packed: a
    packed weight belongs to the engine that packed it) and return it; None, leaving torch's
    engine as it is, where no engine is proved row-exact."""
    engine = quant_engine(progress)
    if engine is not None and torch.backends.quantized.engine != engine:
        log.info("quantized engine: %s (measured fastest and bit-exact here)", engine)
        torch.backends.quantized.engine = engine
    return engine


def describe_quant_engine() -> str:
    """One line for the Models panel, the Why view and the bench: the engine and what it beat."""
    report = _report()
    chosen = quant_engine()
    parts = []
    for engine, r in report.items():
        times = "/".join(f"{r['ms'][str(m)]:.2f}" for m in _TIMED_ROWS) if r.get("ms") else ""
        parts.append(f"{engine} {times} ms" if r.get("exact") else f"{engine} not row-exact")
    return f"int8 kernel {chosen or 'none row-exact'} (1/8/16 rows: {', '.join(parts)})"
