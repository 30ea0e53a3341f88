"""Saving and loading trained draft heads (Medusa, EAGLE): safetensors plus a JSON manifest.

A heads file holds the trainable weights (matrices in int8 with a float16 scale per row,
which halves the file at no measurable cost in acceptance, but for :data:`FLOAT16_MATRICES`;
vectors in float16) and, in its metadata, the manifest:
which target it was trained for (hidden size, vocabulary size), how (command, data,
steps) and how well (measured accuracies). Loading checks the file against the target and
says clearly what does not match.
"""

from __future__ import annotations

import json
import time
import weakref
from pathlib import Path

import torch

from specplay.core.atomic import replacing, write_text_atomic
from specplay.core.errors import ModelError
from specplay.core.paths import assets_dir


_SCALE = ":row_scale"  # a matrix stored in int8 has its per-row scales under this suffix
#: Matrices kept in float16, not int8 rows: EAGLE-3's fuse reads the target's raw layer outputs, whose few
#: huge activations (thousands, against units) multiply its rounding: int8 rows' worth of it cost the
#: shipped head half a point of held-out top-1 at its first level (float16 keeps each value's own exponent;
#: the method runs the fuse in bfloat16 on a CPU with the units).
FLOAT16_MATRICES = ("fuse.weight",)


#: Heads that ship beside the default ones under a name (``--heads classic``): the seed's residual
#: Medusa heads, kept selectable where a newer recipe's heads won
SHIPPED_VARIANTS = ("classic",)


def shipped_path(kind: str, target_spec: str, variant: str = "") -> Path:
    """The heads shipped for a target: the default ones, or a named ``variant`` (:data:`SHIPPED_VARIANTS`)."""
    name = f"{kind}-{variant}-" if variant else f"{kind}-"
    return assets_dir() / "heads" / f"{name}{Path(target_spec).name}.safetensors"


def heads_manifest(kind: str, recipe: str, *, target: str, model, vocab_ids: torch.Tensor, coverage: float,
                   command: str, data: dict, settings: dict, **fields) -> dict:
    """The manifest of a heads file, whichever trainer made it: the heads' kind and recipe, the
    target they fit (``model``: the :class:`~specplay.core.models.base.CausalLM` whose features they
    learnt, its storage and :func:`feature_fingerprint`), the draft vocabulary and its held-out
    coverage, how they were trained (command, data, settings) and the trainer's own ``fields`` (the
    heads' sizes, accuracy, τ, steps, time)."""
    info = model.info
    return {"kind": kind, "recipe": recipe, "target": target, "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size, "draft_vocab": int(vocab_ids.numel()), "draft_vocab_coverage": coverage,
            "command": command, "data": data, "settings": settings, "feature_dtype": info.dtype,
            "features": feature_fingerprint(model), "date": time.strftime("%Y-%m-%d"), **fields}


#: The tokens (ids modulo the vocabulary) whose features :func:`feature_fingerprint` reads: any fixed
#: sequence does, since it is compared with the same model's.
_FINGERPRINT_IDS = (3, 1000, 17, 9001, 256, 42, 7777, 128, 5, 31415, 271, 828, 1828, 4590, 45, 2)
#: How many of the last position's hidden values it keeps (evenly spaced over the hidden size).
FINGERPRINT_VALUES = 32
#: The relative distance between two fingerprints past which features differ. The same storage moves
#: them too, by more than its rounding: a row's activations are rounded to integers at every layer, and
#: a last bit that crosses a rounding carries on. On the 1.5B target, an exponential changed in its last
#: bits (the C layers' e^x, within 1 ulp) moved them by 2.8%; the same weights in int8 rows differ from
#: its GGUF blocks by 11%.
FINGERPRINT_TOLERANCE = 0.05
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def feature_fingerprint(model) -> dict:
    """What a target's features are, as a heads file keeps it: its storage, and the final hidden state
    at the last of a fixed sequence of tokens, :data:`FINGERPRINT_VALUES` evenly spaced values of it.
    Read once per loaded model (its cache is emptied after)."""
    kept = _FINGERPRINTS.get(model)
    if kept is None:
        info = model.info
        ids = torch.tensor([i % info.vocab_size for i in _FINGERPRINT_IDS])
        model.reset()
        try:
            hidden = model.forward(ids, hidden=True, logit_rows=[]).hidden[-1].float().cpu()
        finally:
            model.reset()
        step = max(1, hidden.numel() // FINGERPRINT_VALUES)
        kept = _FINGERPRINTS[model] = {"storage": info.dtype,
                                       "values": [float(v) for v in hidden[::step][:FINGERPRINT_VALUES]]}
    return dict(kept)


def features_warning(manifest: dict, target, path: Path) -> str | None:
    """Why heads learnt on other features than ``target``'s may draft at a loss, or None: their
    manifest's fingerprint (:func:`feature_fingerprint`) is not the target's, or, for a file without
    one, the storage it names is not the target's. Their drafts are checked as any (lossless)."""
    storage = target.info.dtype
    trained = manifest.get("features")
    retrain = f"retrain them on this target (`specplay train {manifest.get('kind')}`)"
    if isinstance(trained, dict) and isinstance(trained.get("values"), list):
        was = torch.tensor([float(v) for v in trained["values"]])
        now = torch.tensor(feature_fingerprint(target)["values"])
        distance = float((was - now).norm() / now.norm().clamp_min(1e-12)) if was.shape == now.shape else 1.0
        if distance <= FINGERPRINT_TOLERANCE:
            return None
        return (f"{path.name} learnt the features of a target stored as {trained.get('storage', '?')}; this "
                f"target's ({storage}) differ from them by {distance:.1%}: its drafts may be accepted less often "
                f"(never wrongly); {retrain}")
    was = manifest.get("feature_dtype")
    if was and was != storage:
        return (f"{path.name} learnt the features of the target stored as {was}; this one runs on {storage}, whose "
                f"features differ: its drafts may be accepted less often (never wrongly); {retrain}")
    return None


def save_heads(path: Path, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = {}
    for k, v in tensors.items():
        if not v.is_floating_point():
            stored[k] = v.to(torch.int32)
        elif v.dim() == 2 and k not in FLOAT16_MATRICES:
            scale = (v.detach().abs().amax(dim=1, keepdim=True).float() / 127).clamp_min(1e-12).to(torch.float16)
            stored[k] = torch.round(v.detach().float() / scale.float()).clamp(-127, 127).to(torch.int8)
            stored[k + _SCALE] = scale
        else:
            stored[k] = v.detach().to(torch.float16)
    stored = {k: v.contiguous() for k, v in stored.items()}
    with replacing(path) as tmp:
        save_file(stored, str(tmp), metadata={"specplay": json.dumps(manifest)})
    write_text_atomic(path.with_suffix(".json"), json.dumps(manifest, indent=2) + "\n")


def read_manifest(path: Path, kind: str | None = None) -> dict:
    """A heads file's manifest, read from its metadata without its tensors; ``kind`` ("medusa" or
    "eagle"), where given, is the kind it must hold. A missing, unreadable or unmanifested file, or one of
    another kind, raises :class:`ModelError` saying which."""
    path = Path(path)
    meta, _ = _read(path, kind, tensors=False)
    return _manifest(meta, path, kind)


def _read(path: Path, kind: str | None, tensors: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """A heads file's safetensors metadata and, where asked, its tensors."""
    from safetensors import safe_open

    if not path.is_file():
        raise ModelError(f"{kind or 'the'} heads file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, ({k: f.get_tensor(k) for k in f.keys()} if tensors else {})
    except Exception as exc:
        raise ModelError(f"{path} is not a readable heads file (corrupt or truncated?): {exc}") from None


def _manifest(meta: dict, path: Path, kind: str | None) -> dict:
    """The manifest in a heads file's safetensors metadata, checked to be of ``kind`` where that is given."""
    try:
        manifest = json.loads(meta["specplay"])
    except (KeyError, json.JSONDecodeError):
        raise ModelError(f"{path} has no SpecPlay manifest; is it a {kind or 'Medusa or EAGLE'} heads file trained "
                         f"by SpecPlay?") from None
    if not isinstance(manifest, dict) or manifest.get("kind") not in ("medusa", "eagle"):
        found = manifest.get("kind", "unknown") if isinstance(manifest, dict) else "unknown"
        raise ModelError(f"{path} holds {found} heads, not {kind or 'Medusa or EAGLE'} heads")
    if kind is not None and manifest["kind"] != kind:
        raise ModelError(f"{path} holds {manifest['kind']} heads, not {kind} heads")
    return manifest


def load_heads(path: Path, kind: str, target) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a heads file of ``kind`` ("medusa" or "eagle") and check it fits ``target`` (a CausalLM)."""
    path = Path(path)
    meta, tensors = _read(path, kind, tensors=True)
    manifest = _manifest(meta, path, kind)
    info = target.info
    if manifest.get("hidden_size") != info.hidden_size:
        raise ModelError(f"{path} was trained for hidden size {manifest.get('hidden_size')} "
                         f"({manifest.get('target')}), but the target '{info.name}' has {info.hidden_size}")
    if manifest.get("vocab_size") != info.vocab_size:
        raise ModelError(f"{path} was trained for a {manifest.get('vocab_size')}-token vocabulary "
                         f"({manifest.get('target')}), but the target '{info.name}' has {info.vocab_size}")
    if "vocab_ids" not in tensors:  # the methods draft over it: without it the file is of no use
        raise ModelError(f"{path} has no draft vocabulary (vocab_ids); is it a complete {kind} heads file "
                         f"trained by SpecPlay?")
    weights = {}
    for k, v in tensors.items():
        if k.endswith(_SCALE):
            continue
        if v.dtype == torch.int8:
            scale = tensors.get(k + _SCALE)
            if scale is None:
                raise ModelError(f"{path} is not a readable heads file: int8 tensor {k} has no row scales")
            weights[k] = v.float() * scale.float()
        else:
            weights[k] = v.float() if v.is_floating_point() else v.long()
    return weights, manifest


def resolve_heads_path(given: str, kind: str, target_spec: str) -> Path:
    """A heads file's path from what a user gave: empty for the heads shipped for the target, a
    shipped variant's name (``classic``), or a file."""
    variant = given if given in SHIPPED_VARIANTS and not Path(given).is_file() else ""
    if given and not variant:
        return Path(given).expanduser()
    path = shipped_path(kind, target_spec, variant)
    if not path.is_file():
        what = f"{variant} {kind} heads" if variant else f"{kind} heads"
        raise ModelError(f"no {what} ship for '{target_spec}'; train them with `specplay train {kind} "
                         f"--target {target_spec}` and pass the file")
    return path


def draft_lm_rows(target, vocab_ids: torch.Tensor, path: Path):
    """The target's frozen LM head restricted to a heads file's draft vocabulary, in the heads' storage
    (:func:`~specplay.core.kernels.linear.storage_of`): on the GGUF's blocks, the target's own rows of them."""
    from specplay.core.kernels.linear import Storage, make_linear, storage_of

    _check_vocab_ids(vocab_ids, target.info.vocab_size, path)
    storage = storage_of(target.info)
    if storage == Storage.KQUANT_DRAFT:
        return target.head_rows(vocab_ids.tolist())
    return make_linear(target.lm_head_weight()[vocab_ids], None, storage)


def _check_vocab_ids(vocab_ids: torch.Tensor, vocab_size: int, path: Path) -> None:
    """A draft vocabulary must be distinct target ids: a negative id would index the LM head from
    its end and come out as a negative token, a repeated one would be drafted twice over with its
    probability counted twice."""
    if vocab_ids.dim() != 1 or vocab_ids.numel() == 0 or vocab_ids.is_floating_point():
        raise ModelError(f"{path}: the draft vocabulary must be a non-empty list of token ids "
                         f"(found {vocab_ids.dtype} of shape {tuple(vocab_ids.shape)})")
    low, high = int(vocab_ids.min()), int(vocab_ids.max())
    if low < 0 or high >= vocab_size:
        raise ModelError(f"{path}: the draft vocabulary has ids outside the target's {vocab_size} tokens "
                         f"(from {low} to {high})")
    if vocab_ids.unique().numel() != vocab_ids.numel():
        raise ModelError(f"{path}: the draft vocabulary lists some token ids more than once")
