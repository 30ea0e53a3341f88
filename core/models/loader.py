"""Load what the user named (catalog id, folder, ``.gguf`` file, cached hub id) for decoding.

:func:`load_model` reads top-down in steps. It plans what to load (:class:`LoadPlan`: the device, and the
storage the weights run in) from the user's choice and this machine's measurements; makes every file the plan
needs ready once, through :mod:`specplay.core.weights.prepare` (the converted folder, then the weights the build
reads); builds the model from them, on the native decoder for the architectures it implements, else through
``transformers`` behind the same interface (the load notes say so); and last keeps in the cache what the build
made that the next load can map instead. The build never calls back into preparing, so each file is made ready
once, before the model is built. A draft may run on llama.cpp instead, chosen once its folder is ready and
before its native weights are made.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from specplay.core.errors import ConfigError, ModelError, TokenizerMismatchError, is_out_of_memory
from specplay.core.kernels import kquant
from specplay.core.kernels.kernel_build import build_soon
from specplay.core.kernels.linear import (EXACT_QUANTIZED, KQUANT_STORAGES, Storage, has_bf16_units,
                                          int8_supported)
from specplay.core.memory import release_freed_memory
from specplay.core.models.base import CausalLM
from specplay.core.progress import Progress, ShouldCancel, counting_down, log_progress, never
from specplay.core.weights import gguf_blocks
from specplay.core.weights.cache import (INT4_WEIGHTS, INT8_WEIGHTS, KQUANT_DRAFT_WEIGHTS, KQUANT_WEIGHTS, MARKER,
                                         OLD_MADE_FILES, CachedWeightsReader, check_weights, read_marker)
from specplay.core.weights.gguf_check import check_gguf
from specplay.core.weights.gguf_config import read_config
from specplay.core.weights.prepare import (float_weights_dir, has_gguf_source, resolve, source_gguf, store_int4_layers,
                                           store_kquant_blocks)
from specplay.core.weights.tokenizer import read_tokenizer

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64", Storage.INT8, Storage.GGUF)
DEVICES = ("auto", "cpu", "cuda", "mps")
BACKENDS = ("auto", "native", "transformers", "llamacpp")


@dataclass
class LoadedModel:
    """A model ready to decode, with its tokenizer and how it was loaded."""

    model: CausalLM
    tokenizer: object
    model_id: str  # what the user named: a catalog id, a folder, a .gguf file or a hub id
    path: Path
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.model_id


def pick_device(device: str = "auto") -> str:
    """``auto`` picks CUDA, then Apple MPS, then the CPU."""
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ConfigError(f"unknown device '{device}' (choose from {', '.join(DEVICES)})")
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but no CUDA GPU is available")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("device 'mps' was asked for but Apple MPS is not available")
    return device


def pick_dtype(dtype: str, device: str) -> tuple[torch.dtype, Storage]:
    """Return (compute dtype, weight storage).

    ``auto``: bfloat16 on a GPU; on a CPU, row-exact int8 where the x86 int8 kernel exists, else
    float32. That is the storage of a model without a GGUF source: :func:`load_model` puts a CPU
    target with one on that file's own blocks (``gguf``) where the exact k-quant kernel runs here,
    and a draft on its fastest layers (:func:`draft_storage`).
    """
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    if dtype == "auto":
        if device != "cpu":
            return torch.bfloat16, Storage.FLOAT
        return (torch.float32, Storage.INT8) if int8_supported() else (torch.float32, Storage.FLOAT)
    if dtype == Storage.GGUF:
        if device != "cpu":
            raise ConfigError("gguf storage (the file's own k-quant blocks) is a CPU option; on a GPU use bfloat16")
        return torch.float32, Storage.GGUF
    if dtype == Storage.INT8:
        if device != "cpu":
            raise ConfigError("int8 storage is a CPU option; on a GPU use bfloat16 or float16")
        if not int8_supported():
            raise ConfigError("int8 storage needs torch's x86 quantized engine (fbgemm), absent on this machine")
        return torch.float32, Storage.INT8
    return getattr(torch, dtype), Storage.FLOAT


class _SafetensorsReader:
    """Fetch tensors by name from one or several safetensors files, one at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            made = (INT8_WEIGHTS, INT4_WEIGHTS, *OLD_MADE_FILES)
            files = [p.name for p in sorted(folder.glob("*.safetensors")) if p.name not in made]
        if not files:
            raise FileNotFoundError("no .safetensors weights")
        self._handles = []
        self._where = {}
        for name in files:
            try:
                handle = safe_open(str(folder / name), framework="pt")
            except Exception as exc:
                raise ModelError(f"weights file {folder / name} is unreadable or truncated: {exc}") from exc
            self._handles.append(handle)
            for key in handle.keys():
                self._where[key] = handle

    def get(self, key: str):
        handle = self._where.get(key)
        if handle is None:
            return None
        try:
            return handle.get_tensor(key)
        except Exception as exc:
            raise ModelError(f"weight '{key}' cannot be read (file truncated or corrupt?): {exc}") from exc


def _eos_ids(path: Path, config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []

    def add(v):
        if v is None:
            return
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))

    gen = path / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return tuple(ids)


ROLES = ("target", "draft")


def draft_storage(model_id: str) -> Storage:
    """How a draft model stores quantized weights, none of them row-pinned (only a target's
    exactness needs that): on the k-quant kernel where it builds here and the model has a GGUF
    source (its Q4_K/Q6_K blocks kept, its other matrices fitted into Q4_K: about 4.6 bits a
    weight), else int4 where the CPU has bfloat16 units, else int8."""
    if has_gguf_source(model_id) and kquant.unavailable() is None:
        return Storage.KQUANT_DRAFT
    return Storage.INT4_DRAFT if has_bf16_units() else Storage.INT8_DRAFT


@dataclass(frozen=True)
class LoadPlan:
    """What a load runs and which files it needs, decided from the user's choice and this machine's
    measurements before any file of the model is converted (:func:`_plan`)."""

    model_id: str
    role: str  # target or draft
    backend: str  # as asked: auto, native, transformers or llamacpp
    dtype: str  # as asked, which the errors name
    device: str
    compute_dtype: torch.dtype
    storage: Storage
    source: gguf_blocks.GGUFBlocksReader | None = None  # the GGUF a target runs on, proved exact here
    notes: tuple[str, ...] = ()

    @property
    def weights(self) -> str:
        """What the converted folder holds for the storage (:func:`resolve`'s ``weights``): nothing for the
        k-quant storages, which read the GGUF itself (the folder gives the config and tokenizer); the cache's
        int8 rows for the other quantized ones, an int4 draft's packed layers too once made; float32 for floats."""
        return {Storage.FLOAT: "float32", Storage.INT4_DRAFT: Storage.INT4_DRAFT, Storage.GGUF: "none",
                Storage.KQUANT_DRAFT: "none"}.get(self.storage, Storage.INT8)


@dataclass(frozen=True)
class LoadFiles:
    """What a build reads, each file made ready once: the converted folder with its config, tokenizer and
    end-of-text ids (:func:`_prepare_folder`), then the weights (:func:`_prepare_weights`): the native
    decoder's ``reader``, or None where ``transformers`` reads the float weights at ``path``."""

    path: Path
    config: object
    tokenizer: object
    eos: tuple[int, ...]
    reader: object | None = None


def load_model(model_id: str, device: str = "auto", dtype: str = "auto", *, backend: str = "auto", role: str = "target",
               progress: Progress = log_progress, should_cancel: ShouldCancel = never,
               compare: bool = False) -> LoadedModel:
    """Load ``model_id`` for decoding on ``device`` with ``dtype`` (see :func:`pick_dtype`).

    A ``draft`` model's numerics never affect losslessness (the verifier sees the q that was
    sampled), so in int8 it takes the faster, not batch-invariant, draft layers
    (:func:`draft_storage`), or runs on llama.cpp in 4 bits where it can
    (:mod:`specplay.core.models.llamacpp_draft`; ``backend="native"`` keeps it in SpecPlay's layers).
    A k-quant draft runs without trying llama.cpp unless llama.cpp was timed faster here before,
    or ``compare`` asks to time it now (:func:`compare_draft_engines`).
    A ``.gguf`` file is checked first, whatever it is loaded as (:func:`check_gguf`): a malformed
    header, or metadata that disagrees with the tensors, is refused before any weight is read.
    """
    plan = _plan(model_id, device, dtype, backend, role, progress)
    files = _prepare_folder(plan, progress, should_cancel)
    notes = list(plan.notes)
    on_llamacpp = _llamacpp_draft(plan, files, compare, notes, progress)
    if on_llamacpp is not None:
        progress(f"{model_id} loaded", 1.0)
        return LoadedModel(model=on_llamacpp, tokenizer=files.tokenizer, model_id=model_id, path=files.path,
                           notes=notes)
    model, files = _make(plan, files, notes, progress, should_cancel)
    if plan.compute_dtype in (torch.bfloat16, torch.float16):
        notes.append(f"{str(plan.compute_dtype).removeprefix('torch.')}: a verified block can round unlike a "
                     "single token, so methods may differ from autoregressive at near-ties (Compare shows it); "
                     "float32 is exact")
    release_freed_memory()
    progress(f"{model_id} loaded", 1.0)
    return LoadedModel(model=model, tokenizer=files.tokenizer, model_id=model_id, path=files.path, notes=notes)


def _plan(model_id: str, device: str, dtype: str, backend: str, role: str, progress: Progress) -> LoadPlan:
    """What to load: the device, the compute dtype and the storage this machine runs the model in. A CPU target
    with a GGUF source runs on that file's own blocks once the k-quant kernel is proved exact on them here
    (:func:`_exact_gguf_reader`: the one file a plan makes ready, assembled for a catalog model), a target's int8
    only on a row-exact kernel (:func:`_exact_quant_engine`), a draft on its fastest layers (:func:`draft_storage`)."""
    if role not in ROLES:
        raise ConfigError(f"unknown model role '{role}' (choose from {', '.join(ROLES)})")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend '{backend}' (choose from {', '.join(BACKENDS)})")
    if backend == "llamacpp" and role != "draft":
        raise ModelError("llama.cpp runs draft models only: its batched logits differ from its one-token logits, "
                         "so it cannot verify exactly")
    dev = pick_device(device)
    compute_dtype, storage = pick_dtype(dtype, dev)
    if model_id.lower().endswith(".gguf"):  # a catalog model's file is the catalog's, checked by its sha256
        from specplay.core.models.layers import NATIVE_ARCHITECTURES

        check_gguf(Path(model_id).expanduser(), NATIVE_ARCHITECTURES)
    if torch.device(dev).type == "cpu" and has_gguf_source(model_id) and kquant.isa() is not None:
        build_soon()  # the kernel compiles while the model's file is assembled
    if role == "draft" and storage in EXACT_QUANTIZED:
        storage = draft_storage(model_id)  # a draft's numerics never decide a token: its fastest layers
    notes: list[str] = []
    source = None
    auto_gguf = (dtype == "auto" and torch.device(dev).type == "cpu" and role == "target"
                 and backend in ("auto", "native") and has_gguf_source(model_id))
    if storage == Storage.GGUF or auto_gguf:
        source, why = _exact_gguf_reader(model_id, progress)
        if source is not None:
            storage = Storage.GGUF
            notes.append(f"weights: the GGUF's own Q4_K/Q6_K blocks, exact k-quant kernel "
                         f"({kquant.isa_name(kquant.isa())}, proved 1-{kquant.PROVED_ROWS} rows)")
        elif storage == Storage.GGUF:
            raise ModelError(f"{model_id}: gguf storage is unavailable: {why}; use --dtype int8")
        else:
            notes.append(f"not on the GGUF's own blocks: {why}")
    if storage not in (Storage.FLOAT, *KQUANT_STORAGES) and torch.device(dev).type == "cpu":
        storage = _exact_quant_engine(model_id, dtype, storage, notes, progress)  # before any int8 layer is packed
    return LoadPlan(model_id=model_id, role=role, backend=backend, dtype=dtype, device=dev,
                    compute_dtype=compute_dtype, storage=storage, source=source, notes=tuple(notes))


def _exact_quant_engine(model_id: str, dtype: str, storage: Storage, notes: list[str], progress) -> Storage:
    """Set torch's int8 kernel to the fastest proved row-exact here, and the storage to load in.

    A target's int8 (``storage == Storage.INT8``) is exact only on such a kernel: without one it loads
    in float32 (exact, slower), said in the notes, or, with int8 asked for by name, not at all.
    A draft's int8 or int4 never decides a token and keeps torch's kernel then.
    """
    from specplay.core.models.measurements import describe_quant_engine, use_fastest_quant_engine, why_no_exact_engine

    engine = use_fastest_quant_engine(progress)
    if storage != Storage.INT8:
        return storage
    if engine is not None:
        notes.append(describe_quant_engine())  # what the target's decoding and verification cost depend on
        return storage
    why = why_no_exact_engine()
    if dtype == Storage.INT8:
        raise ModelError(f"{model_id}: {why}, so int8 would not be exact here; use --dtype float32")
    notes.append(f"{why}: {model_id} runs in float32 storage (exact, slower)")
    log.warning("%s: %s; loading in float32 storage", model_id, why)
    return Storage.FLOAT


def _exact_gguf_reader(model_id: str, progress):
    """(the reader, None) of the GGUF file whose own blocks a target runs on, once the exact k-quant
    kernel is built here, reads every matrix of the file and was proved exact on its real matrices
    and, as the C layer runs them, its real decoder layers (:mod:`specplay.core.models.layer_proof`);
    else (None, why not)."""
    from specplay.core.kernels.kernel_build import library_digest
    from specplay.core.models import layer_proof
    from specplay.core.models.measurements import measured

    if not has_gguf_source(model_id):
        return None, "it runs a GGUF file's own blocks; name a catalog id or a .gguf file"
    source = source_gguf(model_id, progress)
    if not source.is_file():
        raise ModelError(f"GGUF file not found: {source}")
    why = kquant.unavailable()
    reader = gguf_blocks.GGUFBlocksReader(source) if why is None else None
    why = why or reader.unreadable()
    if why is None:
        def measure() -> dict:
            progress("Proving the exact k-quant kernel on real layers (once)", None)
            return {"exact": kquant.prove(reader.matrices(1))
                    and layer_proof.prove_layers(*layer_proof.proof_layers(reader))}

        # "and its layers": a verdict kept before the C layer was proved is proved again.
        if not measured(f"kquant exact {library_digest()} {reader.path.name} and its layers", measure).get("exact"):
            why = f"the k-quant kernel was not bit-exact across 1-{kquant.PROVED_ROWS} rows on this machine"
    return (None, why) if why else (reader, None)


def _prepare_folder(plan: LoadPlan, progress: Progress, should_cancel: ShouldCancel) -> LoadFiles:
    """The converted folder with the weights the plan names (:func:`resolve`), its config, tokenizer and
    end-of-text ids: what every engine reads, llama.cpp's included."""
    path = resolve(plan.model_id, progress, should_cancel, plan.weights)
    progress(f"Loading {plan.model_id}", None)
    config, tokenizer = _config_and_tokenizer(plan.model_id, path)
    return LoadFiles(path=path, config=config, tokenizer=tokenizer, eos=_eos_ids(path, config, tokenizer))


def _config_and_tokenizer(model_id: str, path: Path):
    """A folder's config and tokenizer: a converted folder's without transformers (its config as
    attributes, its tokenizer on ``tokenizers`` where :mod:`specplay.core.weights.tokenizer` reads
    its kind), any other folder's through transformers."""
    converted = (path / MARKER).is_file()
    try:
        config = read_config(path) if converted else None
        tokenizer = read_tokenizer(path, read_marker(path).get("tokenizer_digest")) if converted else None
        if config is None or tokenizer is None:
            from transformers import AutoConfig, AutoTokenizer

            config = config or AutoConfig.from_pretrained(str(path))
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(path))
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot read the config or tokenizer of {model_id} at {path}: {exc}") from exc
    return config, tokenizer


def _llamacpp_draft(plan: LoadPlan, files: LoadFiles, compare: bool, notes: list[str], progress: Progress):
    """A draft on llama.cpp (:func:`_draft_on_llamacpp`), or None where SpecPlay's own layers run it: chosen
    once the folder is ready and before the native weights are made, since llama.cpp reads a file of its own."""
    model_id, backend, storage = plan.model_id, plan.backend, plan.storage
    if plan.role != "draft" or backend not in ("auto", "llamacpp"):
        return None
    why_not = _llamacpp_draft_unavailable(model_id, plan.device, storage)
    if (why_not is None and backend == "auto" and storage == Storage.KQUANT_DRAFT and not compare
            and not _llamacpp_draft_won(model_id)):
        # The kernel's draft reads as many bytes a token as llama.cpp's 4-bit file, with no file to
        # make and no child process to probe: it runs first; `specplay models measure` compares them.
        notes.append("draft engine native kquant-draft (llama.cpp's is timed against it by "
                     "`specplay models measure`)")
    elif why_not is None:
        return _draft_on_llamacpp(model_id, files.path, files.config, files.eos, storage, backend, notes, progress)
    elif backend == "llamacpp":
        raise ModelError(f"{model_id}: the llama.cpp draft is unavailable: {why_not}")
    return None


def _draft_on_llamacpp(model_id, path, config, eos, storage, backend, notes, progress):
    """The draft on llama.cpp, or None (with a note saying why) when the native draft is to run.

    llama.cpp runs only with settings a child process survived on this machine. With ``auto``
    it must also be measured faster per token than the native draft, which is then built once
    to be timed (cached per machine, so later loads only read the two figures back).
    """
    from specplay.core.models.llamacpp import describe
    from specplay.core.models.llamacpp_draft import load_llamacpp_draft
    from specplay.core.models.measurements import measured

    model, probes = load_llamacpp_draft(model_id, path, config, eos, progress)
    if model is None:
        why = f"llama.cpp is unsafe on this CPU ({describe(probes)})"
        if backend == "llamacpp":
            raise ModelError(f"{model_id}: {why}")
        notes.append(f"{why}: the draft runs on SpecPlay's own {storage} layers")
        log.warning("%s: %s", model_id, why)
        return None
    llama_ms = min(p.ms_per_token for p in probes if p.ok)
    if backend == "llamacpp":
        notes.append(f"draft engine llama.cpp, {model.settings.label} ({describe(probes)})")
        return model
    native_ms = _native_draft_ms(model_id, path, config, eos, storage, progress)
    measured(_draft_choice_key(model_id), lambda: {"llamacpp_won": llama_ms <= native_ms, "storage": storage})
    if native_ms < llama_ms:
        model.close()
        notes.append(f"draft engine native {storage}: {native_ms:.1f} ms/token against llama.cpp's "
                     f"{llama_ms:.1f} ({describe(probes)}), measured on this machine")
        return None
    notes.append(f"draft engine llama.cpp, {model.settings.label}: {llama_ms:.1f} ms/token against native "
                 f"{storage}'s {native_ms:.1f} ({describe(probes)}), measured on this machine")
    return model


def _draft_choice_key(model_id: str) -> str:
    return f"draft engine {model_id}"


def _llamacpp_draft_won(model_id: str) -> bool:
    """Whether llama.cpp's draft was timed faster than the k-quant draft on this machine."""
    from specplay.core.models.measurements import kept_measurement

    return bool((kept_measurement(_draft_choice_key(model_id)) or {}).get("llamacpp_won"))


def compare_draft_engines(model_id: str, progress: Progress = log_progress) -> list[str]:
    """Time llama.cpp's draft against the native one (what ``auto`` skips on a first load where the
    k-quant draft runs) and keep the winner for later loads; the load's notes say which won."""
    loaded = load_model(model_id, dtype=Storage.INT8, backend="auto", role="draft", progress=progress, compare=True)
    close = getattr(loaded.model, "close", None)
    if close:
        close()
    return loaded.notes


def _native_draft_ms(model_id, path, config, eos, storage, progress) -> float:
    """The native draft's cost per token here, measured once (the same protocol as llama.cpp's probe)."""
    from specplay.core.models.measurements import measured

    def measure() -> dict:
        progress(f"Timing the native {storage} draft of {model_id} (once)", None)
        plan = LoadPlan(model_id=model_id, role="draft", backend="native", dtype=Storage.INT8, device="cpu",
                        compute_dtype=torch.float32, storage=storage)
        model, _ = _make(plan, LoadFiles(path, config, None, eos), [], progress, never)
        return {"ms_per_token": time_decoding(model)}

    return float(measured(f"native draft {model_id} {storage}", measure)["ms_per_token"])


def time_decoding(model: CausalLM, prompt: int = 24, tokens: int = 12) -> float:
    """Median ms of one greedy token after a short prompt (how the llama.cpp probe measures too)."""
    import statistics
    import time

    vocab = model.info.vocab_size
    with torch.inference_mode():
        logits = model.forward_chain([(7 * i + 11) % vocab for i in range(prompt)]).logits[-1]
        times = []
        for _ in range(tokens):
            start = time.perf_counter()
            logits = model.forward_chain([int(logits.argmax())]).logits[-1]
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _llamacpp_draft_unavailable(model_id: str, dev, storage: str) -> str | None:
    """Why a draft cannot run on llama.cpp (a quantized CPU draft from a GGUF source), or None."""
    from specplay.core.models.llamacpp import available

    if torch.device(dev).type != "cpu" or storage == Storage.FLOAT:
        return "it runs quantized drafts on the CPU only"
    if not has_gguf_source(model_id):
        return "it needs a GGUF source (a catalog id or a .gguf file)"
    return available()


def _make(plan: LoadPlan, files: LoadFiles, notes: list[str], progress: Progress,
          should_cancel: ShouldCancel) -> tuple[CausalLM, LoadFiles]:
    """The model on SpecPlay's side of a load: its weights made ready (:func:`_prepare_weights`), the model
    built from them (:func:`_build`) and what the build made kept (:func:`_keep`); with the files it read."""
    files = _prepare_weights(plan, files, notes, progress, should_cancel)
    with _out_of_memory_said(plan):
        model = _build(plan, files)
        _keep(plan, files, model, progress)
    return model, files


def _prepare_weights(plan: LoadPlan, files: LoadFiles, notes: list[str], progress: Progress,
                     should_cancel: ShouldCancel) -> LoadFiles:
    """``files`` with the weights the build reads made ready: the native decoder's reader where it implements
    the architecture (:func:`_weights_reader`, :func:`_target_blocks_reader`), else float weights for
    ``transformers`` (:func:`float_weights_dir`), which also runs a model whose folder has no ``.safetensors``."""
    from specplay.core.models.layers import unsupported_reason

    model_id, backend = plan.model_id, plan.backend
    reason = unsupported_reason(files.config)
    use_native = backend == "native" or (backend == "auto" and reason is None)
    if backend == "native" and reason:
        raise ModelError(f"{model_id}: {reason}")
    if plan.storage == Storage.GGUF and not use_native:
        raise ModelError(f"{model_id}: gguf storage runs on the native decoder only ({reason})")
    if use_native:
        try:
            if plan.source is not None:
                return replace(files, reader=_target_blocks_reader(model_id, files.path, plan.source, progress))
            return replace(files, reader=_weights_reader(model_id, files.path, plan.storage, progress))
        except FileNotFoundError:
            if backend == "native":
                raise ModelError(f"{model_id}: the native path needs .safetensors weights") from None
            reason = "no .safetensors weights"
    _check_fallback_storage(model_id, plan.dtype, plan.storage, reason, notes)
    path = float_weights_dir(model_id, files.path, progress, should_cancel)  # transformers reads float weights
    notes.append(f"native path unavailable ({reason}); using transformers")
    log.warning("%s: native path unavailable (%s); using transformers", model_id, reason)
    return replace(files, path=path)


def _weights_reader(model_id: str, path: Path, storage: str, progress: Progress):
    """The reader of the weights a model in ``storage`` is built from: a k-quant draft's GGUF, an
    int4 draft's packed layers when the cache has them (checked), the cache's int8 rows, or the
    folder's safetensors."""
    if storage == Storage.KQUANT_DRAFT:
        status = check_weights(path, Storage.KQUANT_DRAFT)
        if status == "ok":
            return gguf_blocks.BlocksFileReader(path / KQUANT_DRAFT_WEIGHTS)
        if status != "missing":
            log.warning("%s: the cached k-quant draft blocks are %s; fitting them again", path.name, status)
        fitting = counting_down(progress, f"Fitting {model_id}'s matrices into k-quant blocks (once)")
        fitting(0.0)
        reader = gguf_blocks.GGUFDraftReader(source_gguf(model_id, progress))
        return gguf_blocks.KeptBlocks(gguf_blocks.CountedReads(reader, fitting))
    if storage == Storage.FLOAT or not (path / INT8_WEIGHTS).is_file():
        return _SafetensorsReader(path)
    if storage == Storage.INT4_DRAFT:
        status = check_weights(path, Storage.INT4_DRAFT)
        if status == "ok":
            return CachedWeightsReader(path / INT4_WEIGHTS)
        if status != "missing":
            log.warning("%s: the cached int4 draft layers are %s; packing them again", path.name, status)
            progress(f"The cached int4 layers of {path.name} are {status}: packing them again", None)
    return CachedWeightsReader(path / INT8_WEIGHTS)


def _target_blocks_reader(model_id: str, path: Path, gguf_reader, progress: Progress):
    """A target's matrices on the GGUF's own blocks: mapped from the cache where this kernel's repack
    of them is kept there (checked), the embedding by rows from the GGUF; else repacked from the GGUF,
    each kept to be stored."""
    status = check_weights(path, "kquant")
    if status == "ok":
        return gguf_blocks.FirstOf(gguf_blocks.BlocksFileReader(path / KQUANT_WEIGHTS), gguf_reader)
    if status != "missing":
        log.warning("%s: the kept repacked blocks are %s; repacking them again", path.name, status)
    repacking = counting_down(progress, f"Repacking {model_id}'s blocks")
    return gguf_blocks.KeptBlocks(gguf_blocks.CountedReads(gguf_reader, repacking))


def _check_fallback_storage(model_id: str, dtype: str, storage: str, reason: str | None, notes: list[str]) -> None:
    """The ``transformers`` fallback keeps float weights: it has no row-exact int8 path.

    Its attention runs in float over int8 linears, so a verified block and a single token
    can round differently and flip near-ties: int8 there would break exactness. Under
    ``auto`` it runs in float32 (and says so); an explicit int8 is refused.
    """
    if storage == Storage.FLOAT:
        return
    if dtype == Storage.INT8:
        raise ModelError(f"{model_id}: int8 storage is exact only on the native decoder, which cannot run this model "
                         f"({reason}); use --dtype auto or float32")
    notes.append("float32 weights: int8 is exact only on the native decoder")


def _build(plan: LoadPlan, files: LoadFiles) -> CausalLM:
    """The model from the files made ready: on the native decoder from their reader, else on ``transformers``.
    It writes no file: what it made that the next load can map instead is kept after it (:func:`_keep`)."""
    from specplay.core.models.layers import DecoderConfig
    from specplay.core.models.native import NativeDecoder

    if files.reader is None:
        return _load_hf(files.path, plan.model_id, plan.device, plan.compute_dtype, files.eos)
    try:
        return NativeDecoder(DecoderConfig.from_hf(files.config), files.reader.get, name=plan.model_id,
                             device=plan.device, dtype=plan.compute_dtype, storage=plan.storage,
                             eos_token_ids=files.eos)
    except KeyError as exc:
        raise ModelError(f"{plan.model_id}: {exc.args[0]} (is the weights file complete?)") from None


@contextmanager
def _out_of_memory_said(plan: LoadPlan) -> Iterator[None]:
    """A build, and the keeping of what it made, that runs out of memory raises what to do about it."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise ModelError(f"not enough memory to load {plan.model_id} on {plan.device} ({plan.dtype}); close other "
                         "programs, or on a CPU use --dtype int8 (int8 rows with a scale each, embedding included: "
                         "about 30% of float32's memory for a 1.5B model)") from None


def _load_hf(path: Path, model_id: str, device: str, dtype: torch.dtype, eos) -> CausalLM:
    from transformers import AutoModelForCausalLM

    from specplay.core.models.hf_backend import HFCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:
        raise ModelError(f"cannot load {model_id} with transformers: {exc}") from exc
    hf.to(device)
    return HFCausalLM(hf, name=model_id, eos_token_ids=eos)


#: A target's matrices not kept with its repacked blocks: the output head is a fifth of their bytes
#: (191 MB of Q6_K for the 1.5B) and repacks in 0.2 s, which keeps the default pair's cache under 3 GB.
_UNKEPT = ("lm_head.weight",)


def _keep(plan: LoadPlan, files: LoadFiles, model: CausalLM, progress: Progress) -> None:
    """Store in the cache what the build made that the next load maps instead of making again: an int4
    draft's layers packed from int8 rows, a k-quant draft's fitted blocks, a target's repacked ones."""
    reader, path = files.reader, files.path
    if plan.storage == Storage.INT4_DRAFT and getattr(reader, "path", None) == path / INT8_WEIGHTS:
        store_int4_layers(model, reader, path, progress)
    if plan.storage == Storage.KQUANT_DRAFT and hasattr(reader, "kept"):
        store_kquant_blocks(reader.kept, path, progress)
    if plan.storage == Storage.GGUF and hasattr(reader, "kept"):
        store_kquant_blocks({name: value for name, value in reader.kept.items() if name not in _UNKEPT
                             and not isinstance(value, kquant.MappedRows)}, path, progress, "kquant")


def quantize_hf_linears(hf_model) -> None:
    """Swap a transformers model's ``nn.Linear`` layers for SpecPlay's row-exact int8 layers.

    This gives the ``transformers`` peers in benchmarks the same weights and kernels as the
    native path, so comparisons measure the decoding method, not the storage.
    """
    from specplay.core.kernels.linear import Int8RowExactLinear

    class _Int8(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear):
            super().__init__()
            self.inner = Int8RowExactLinear(linear.weight.data, None if linear.bias is None else linear.bias.data)
            self.in_features, self.out_features = linear.in_features, linear.out_features

        def forward(self, x):
            return self.inner(x).to(x.dtype)

    for parent in list(hf_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, _Int8(child))


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> list[str]:
    """Raise if the draft's tokenizer maps text to ids differently; return warnings."""
    backend = getattr(target.tokenizer, "backend", None)
    # One tokenizer read for both (the same GGUF tokenizer, by its digest): nothing to compare.
    shared = backend is not None and backend is getattr(draft.tokenizer, "backend", None)
    tv, dv = ({}, {}) if shared else (target.tokenizer.get_vocab(), draft.tokenizer.get_vocab())
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise TokenizerMismatchError(
            f"draft '{draft.model_id}' does not share the tokenizer of target '{target.model_id}' "
            f"({len(dv)} vs {len(tv)} tokens, {only_t} target entries differ); "
            "speculative decoding needs the same vocabulary"
        )
    warnings = []
    t_rows, d_rows = target.model.info.vocab_size, draft.model.info.vocab_size
    if t_rows != d_rows:
        warnings.append(
            f"draft '{draft.model_id}' has {d_rows:,} vocabulary rows and target '{target.model_id}' {t_rows:,} (the same "
            f"tokenizer, padded differently): drafts are aligned to the target's rows, still lossless"
        )
    if draft.model.info.num_parameters >= target.model.info.num_parameters:
        warnings.append(
            f"draft '{draft.model_id}' ({draft.model.info.num_parameters / 1e9:.2f}B parameters) is not smaller than "
            f"target '{target.model_id}' ({target.model.info.num_parameters / 1e9:.2f}B): drafting will cost more than it saves"
        )
    return warnings
