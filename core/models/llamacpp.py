"""llama.cpp (``llama-cpp-python``, the ``peers`` extra) opened only with settings proved safe here.

A native library can kill the process that calls it: on an Intel Xeon guest whose flags list
AMX, llama.cpp moves 4-bit weights into its AMX buffer and its first ``decode`` executes an
instruction the hypervisor forbids (SIGILL). No handler survives that, so before SpecPlay's
own process uses llama.cpp, a child process opens the file with the settings meant to be used
and decodes a few tokens (:func:`probe`). The verdict and the child's measured cost per token
are kept per host, llama.cpp build, file type and settings (:func:`usable_settings`), so the
probe runs once; a transient outcome (a timeout, a kill for memory, a child that could not
start) is no verdict and is probed again next time. Both llama.cpp's extra weight buffers (repacked layouts, AMX where listed) and
plain buffers are tried, and the faster of those that survive is used.

:class:`LlamaCppSession` is a thin layer over llama.cpp's C API rather than ``llama_cpp.Llama``,
because only the C API takes ``use_extra_bufts``: append tokens after a kept prefix, read the
last token's logits.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specplay.core.errors import ModelError
from specplay.core.models.measurements import forget_host, machine_key, read_table, write_table
from specplay.core.paths import measurements_dir

log = logging.getLogger(__name__)

#: How long a probe child may take (loading a 1 GB file and decoding a few tokens takes seconds).
PROBE_TIMEOUT_S = 180
_PROBE_PROMPT = 24
_PROBE_TOKENS = 12
_FILE_ERROR = 3  # the probe child's exit code when the file itself cannot be read
#: Deaths that are verdicts on the settings (the same build, file and CPU die alike every time);
#: any other failure (killed for memory, a timeout, a child that could not start) is transient.
_DEFINITE_SIGNALS = {"SIGILL", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGABRT"}


@dataclass(frozen=True)
class LlamaSettings:
    """How llama.cpp opens a model. ``extra_buffers``: its repacked weight layouts (and AMX where
    the CPU lists it), usually faster, the part that can die by SIGILL; ``flash_attn``: its fused
    attention (a draft token a few percent faster, a long prompt's prefill about a tenth)."""

    extra_buffers: bool = True
    flash_attn: bool = True

    @property
    def label(self) -> str:
        return f"extra buffers {'on' if self.extra_buffers else 'off'}, flash attention {'on' if self.flash_attn else 'off'}"


#: The settings tried: llama.cpp's extra buffers on and off, each with and without flash attention
#: (which of the two attentions is faster differs by model and machine: a few percent either way).
CANDIDATES = tuple(LlamaSettings(extra, flash) for extra in (True, False) for flash in (True, False))


def available() -> str | None:
    """Why llama.cpp cannot run here (not installed), or None if it can be tried."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install -e \".[peers]\")"
    return None


class LlamaCppFileError(ModelError):
    """llama.cpp cannot read the model file itself (damaged, truncated, unknown): made again, not retried."""


class LlamaCppSession:
    """One llama.cpp model and context: tokens appended after a kept prefix, the last token's logits."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, settings: LlamaSettings, n_batch: int = 512):
        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # not a line per tensor
        llama_cpp.llama_backend_init()
        self.settings = settings
        self.n_ctx = n_ctx
        self._n_batch = n_batch
        if not Path(gguf).is_file():
            raise LlamaCppFileError(f"llama.cpp cannot load {gguf}: no such file")
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = settings.extra_buffers
        self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self._model:
            raise LlamaCppFileError(f"llama.cpp cannot load {gguf} (damaged, or not a model file it knows)")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            self._model = None
            raise ModelError(f"llama.cpp cannot make a context of {n_ctx} tokens for {gguf} (out of memory?)")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        self.length = 0  # tokens in the context's cache

    @property
    def description(self) -> str:
        """llama.cpp's model description, ``qwen2 1B IQ4_NL - 4.5 bpw``."""
        import llama_cpp

        desc = ctypes.create_string_buffer(128)
        llama_cpp.llama_model_desc(self._model, desc, len(desc))
        return desc.value.decode(errors="replace")

    @property
    def n_params(self) -> int:
        import llama_cpp

        return int(llama_cpp.llama_model_n_params(self._model))

    def eval(self, ids: list[int], keep: int, every_row: bool = False) -> np.ndarray:
        """Keep the first ``keep`` cached tokens, append ``ids``; the last one's logits (a view, valid
        until the next call). ``every_row``: every appended token's logits are computed, as a verifying
        pass computes them (one batch of at most ``n_batch`` tokens)."""
        import llama_cpp

        if not 0 <= keep <= self.length:
            raise ValueError(f"cannot keep {keep} of {self.length} cached tokens")
        if keep + len(ids) > self.n_ctx:
            raise ModelError(f"llama.cpp's context holds {self.n_ctx} tokens; {keep + len(ids)} were asked for")
        if every_row and len(ids) > self._n_batch:
            raise ValueError(f"a pass with every row's logits takes at most {self._n_batch} tokens")
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._ctx), 0, keep, -1)
        self.length = keep
        for lo in range(0, len(ids), self._n_batch):
            chunk = ids[lo: lo + self._n_batch]
            if every_row:
                code = self._decode_every_row(chunk)
            else:
                arr = (llama_cpp.llama_token * len(chunk))(*chunk)
                # A one-sequence batch whose positions follow the cache; only its last token's logits are kept.
                code = llama_cpp.llama_decode(self._ctx, llama_cpp.llama_batch_get_one(arr, len(chunk)))
            if code != 0:
                raise ModelError(f"llama.cpp could not decode {len(chunk)} tokens (code {code})")
            self.length += len(chunk)
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))

    def _decode_every_row(self, ids: list[int]) -> int:
        import llama_cpp

        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, self.length + i, 1, True
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(ids)
            return llama_cpp.llama_decode(self._ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)

    def close(self) -> None:
        import llama_cpp

        if self._ctx:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


# ----------------------------------------------------------------------------- the probe


@dataclass(frozen=True)
class ProbeResult:
    """What a child process found: ``ok`` with its cost per token, or the reason it failed;
    ``transient`` when that failure says nothing about the settings (then it is not kept)."""

    settings: LlamaSettings
    ok: bool
    ms_per_token: float | None = None
    reason: str = ""
    transient: bool = False

    def to_json(self) -> dict:
        return {"settings": asdict(self.settings), "ok": self.ok, "ms_per_token": self.ms_per_token,
                "reason": self.reason}

    @staticmethod
    def from_json(d) -> "ProbeResult | None":
        """The verdict kept as ``d``, or None where ``d`` is not one (a damaged or hand-edited file:
        then that setting is probed again)."""
        settings = d.get("settings") if isinstance(d, dict) else None
        if not isinstance(settings, dict) or settings.keys() != {"extra_buffers", "flash_attn"}:
            return None
        ok, ms, reason = d.get("ok"), d.get("ms_per_token"), d.get("reason", "")
        flags = (settings["extra_buffers"], settings["flash_attn"])
        if not all(isinstance(v, bool) for v in (*flags, ok)) or not isinstance(reason, str):
            return None
        if ok and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0):
            return None
        return ProbeResult(LlamaSettings(*flags), ok, float(ms) if ok else None, reason)


def _decode_timed(gguf: Path, settings: LlamaSettings, threads: int) -> float:
    """In the child: open, read a short prompt, decode greedily; the median ms per token."""
    session = LlamaCppSession(gguf, 256, threads, settings)
    logits = session.eval([(7 * i + 11) % session.n_vocab for i in range(_PROBE_PROMPT)], 0)
    times = []
    for _ in range(_PROBE_TOKENS):
        token = int(logits.argmax())
        start = time.perf_counter()
        logits = session.eval([token], session.length)
        times.append(time.perf_counter() - start)
    session.close()
    return statistics.median(times) * 1e3


def _signal_name(code: int) -> str | None:
    """The signal a child died by (its negative exit code), or None when it exited."""
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_reason(code: int) -> str:
    name = _signal_name(code)
    if name:
        what = {"SIGILL": " (an instruction this CPU or its hypervisor does not allow)",
                "SIGSEGV": " (a memory fault)", "SIGKILL": " (out of memory?)"}.get(name, "")
        return f"died by {name}{what}"
    return f"exited with code {code}"


def probe(gguf: Path, settings: LlamaSettings, threads: int, timeout: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """Open ``gguf`` with ``settings`` and decode a few tokens in a child process; never in this one."""
    cmd = _probe_command(gguf, settings, threads)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=_import_root())
    except subprocess.TimeoutExpired:
        return ProbeResult(settings, False, reason=f"did not finish within {timeout:.0f} s", transient=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode == _FILE_ERROR and lines:
        raise LlamaCppFileError(json.loads(lines[-1])["error"])  # the file, not these settings: no verdict
    if done.returncode == 0 and lines:
        try:
            return ProbeResult(settings, True, ms_per_token=float(json.loads(lines[-1])["ms_per_token"]))
        except (ValueError, KeyError, TypeError):
            pass
    tail = (done.stderr.strip().splitlines() or [""])[-1][:200]
    return ProbeResult(settings, False, reason=exit_reason(done.returncode) + (f": {tail}" if tail else ""),
                       transient=_signal_name(done.returncode) not in _DEFINITE_SIGNALS)


#: The first argument that turns the frozen app's executable into a probe child (``app.launcher``).
PROBE_ARGUMENT = "--llamacpp-probe"


def _probe_command(gguf: Path, settings: LlamaSettings, threads: int) -> list[str]:
    args = [str(gguf), str(int(settings.extra_buffers)), str(int(settings.flash_attn)), str(threads)]
    if getattr(sys, "frozen", False):  # a PyInstaller app: no ``-m``, the executable runs the child itself
        return [sys.executable, PROBE_ARGUMENT, *args]
    return [sys.executable, "-m", "specplay.core.models.llamacpp", *args]


def _import_root() -> str:
    """The folder that holds the installed ``specplay`` (or, installed editable, this checkout):
    the child's working folder, so that nothing there shadows the package it imports."""
    from specplay import core

    return str(Path(core.__file__).resolve().parent.parent)


def _probe_file() -> Path:
    return measurements_dir() / "llamacpp-probes.json"


def _read_verdicts() -> dict:
    return read_table(_probe_file())


def build_key() -> str:
    """This llama.cpp build: the package's version and its shared libraries' sizes and times."""
    import llama_cpp

    libs = sorted(p for p in Path(llama_cpp.__file__).parent.rglob("*") if p.suffix in (".so", ".dylib", ".dll"))
    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{int(p.stat().st_mtime)}" for p in libs)
    return f"{llama_cpp.__version__}:{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"


def file_type(gguf: Path) -> str:
    """The GGUF's ``general.file_type`` (the weights' quantization), which decides the kernels used.

    A file the reader cannot parse is a :class:`LlamaCppFileError` however it fails: a damaged
    header or a truncated file raises ``ValueError`` (``UnicodeDecodeError`` among them),
    ``IndexError`` or ``KeyError`` in ``gguf``'s reader.
    """
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(gguf)).fields.get("general.file_type")
        return str(int(field.parts[field.data[0]][0])) if field is not None else "unknown"
    except (OSError, ValueError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise LlamaCppFileError(f"cannot read the GGUF header of {gguf}: {type(exc).__name__}: {exc}") from None


def usable_settings(gguf: Path, threads: int, progress=None) -> tuple[LlamaSettings | None, list[ProbeResult]]:
    """The fastest of :data:`CANDIDATES` that a child decoded ``gguf`` with here, and every probe's result.

    Probed once per host, llama.cpp build, file type and thread count; later calls read the
    verdicts back (a transient outcome is not kept: probed again). ``None`` when every candidate
    failed: llama.cpp must not be used for this file.
    """
    prefix = f"{machine_key()}|{build_key()}|type {file_type(gguf)}|{threads} llama.cpp threads"
    verdicts = _read_verdicts()
    results: list[ProbeResult] = []
    for settings in CANDIDATES:
        key = f"{prefix}|{settings.label}"
        kept = ProbeResult.from_json(verdicts.get(key))
        if kept is not None and kept.settings == settings:
            results.append(kept)
            continue
        if progress:
            progress(f"Trying llama.cpp on {Path(gguf).name} ({settings.label}) in a child process (once)", None)
        result = probe(gguf, settings, threads)
        if not result.ok:
            log.warning("llama.cpp %s with %s: %s", Path(gguf).name, settings.label, result.reason)
        if not result.transient:
            verdicts[key] = result.to_json()
            write_table(_probe_file(), verdicts)
        results.append(result)
    return fastest_safe(results), results


def fastest_safe(results: list[ProbeResult], *, extra_buffers: bool = False) -> LlamaSettings | None:
    """The fastest settings a child decoded with (with ``extra_buffers``, only those with llama.cpp's
    extra buffers on), or None when none survived."""
    ok = [r for r in results if r.ok and (r.settings.extra_buffers or not extra_buffers)]
    return min(ok, key=lambda r: r.ms_per_token).settings if ok else None


def known_verdicts() -> list[str]:
    """What the probe children found on this machine, a line each (file type, settings, outcome)."""
    mine = f"{machine_key()}|"
    lines = []
    for key, verdict in sorted(_read_verdicts().items()):
        result = ProbeResult.from_json(verdict) if key.startswith(mine) else None
        what = key[len(mine):].partition("|")[2]  # past the build
        if result is not None and what:  # an entry that does not parse is probed again, not shown
            lines.append(f"{what}: " + (f"ok, {result.ms_per_token:.1f} ms/token" if result.ok else result.reason))
    return lines


def forget_verdicts() -> int:
    """Forget what the probe children found on this host: probed again on the next load."""
    return forget_host(_probe_file())


def defaults_unsafe(gguf: Path, threads: int, progress=None) -> str | None:
    """Why llama.cpp's extra buffers (which ``llama_cpp.Llama`` and its server always use) must not
    open ``gguf`` here, or None when a child decoded it with them."""
    _, results = usable_settings(gguf, threads, progress)
    failed = [r for r in results if r.settings.extra_buffers and not r.ok]
    return "; ".join(f"{r.settings.label}: {r.reason}" for r in failed) or None


def describe(results: list[ProbeResult]) -> str:
    """One line for the Models panel, the run record and the bench: what was tried and what happened."""
    return "; ".join(f"{r.settings.label}: " + (f"{r.ms_per_token:.1f} ms/token" if r.ok else r.reason)
                     for r in results)


def probe_child(argv: list[str]) -> int:
    """The probe child's body: open, decode, print the cost per token as JSON (or the file's error)."""
    gguf, extra, flash, threads = argv
    try:
        ms = _decode_timed(Path(gguf), LlamaSettings(extra == "1", flash == "1"), int(threads))
    except LlamaCppFileError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return _FILE_ERROR
    print(json.dumps({"ms_per_token": ms}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(probe_child(sys.argv[1:]))
