"""Faults: out of memory, full disks and read-only places, torn history lines; nothing earlier is lost."""

import errno
import json
import os

import pytest
import torch

from specplay.core.cli import main
from specplay.core.decoding.engine import drain, generate
from specplay.core.errors import ModelError
from specplay.core.records.history import History
from specplay.core.methods import build_method
from specplay.core.records.runlog import run_record, write_jsonl_atomic
from specplay.core.decoding.types import GenerationConfig, StopReason
from tiny import loaded, native_from_hf, save_tiny_model, tiny_hf_model

PROMPT = [4, 5, 6, 3, 7, 8]


@pytest.fixture(scope="module")
def target():
    return loaded(native_from_hf(tiny_hf_model(seed=0, dtype=torch.float32)))


def test_out_of_memory_while_generating_ends_the_run_with_what_it_made(target, monkeypatch):
    model = target.model
    real = model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    res = drain(generate(model, target.tokenizer, build_method("autoregressive", None, target), PROMPT,
                         GenerationConfig(max_new_tokens=20, stop_at_eos=False, stand_down=False)))
    assert res.stop_reason is StopReason.ERROR and "out of memory" in res.error
    assert len(res.token_ids) == 4  # prefill was call 1, then four steps succeeded
    record = run_record(res, target=target)
    assert record["error"] == res.error and record["stop_reason"] == "error"


def test_out_of_memory_while_loading_is_a_clear_error(tmp_path, monkeypatch):
    from specplay.core.models import loader, native

    folder = save_tiny_model(tmp_path / "m")

    def boom(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(native.NativeDecoder, "__init__", boom)
    with pytest.raises(ModelError, match="not enough memory to load"):
        loader.load_model(str(folder), "cpu", "float32")


def test_other_errors_are_not_disguised_as_memory_errors(target, monkeypatch):
    monkeypatch.setattr(target.model, "forward", lambda *a, **k: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        drain(generate(target.model, target.tokenizer, build_method("autoregressive", None, target), PROMPT,
                       GenerationConfig(max_new_tokens=5)))


def test_full_disk_during_export_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "runs.jsonl"
    write_jsonl_atomic(path, [{"run": 1}])
    before = path.read_text()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError, match="No space left"):
        write_jsonl_atomic(path, [{"run": 2}])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["runs.jsonl"]  # no temporary file left


def test_history_survives_a_torn_last_line_and_keeps_earlier_runs(tmp_path):
    h = History(tmp_path / "history.jsonl")
    h.append({"run": 1})
    h.append({"run": 2})
    with open(h.path, "a", encoding="utf-8") as f:
        f.write('{"run": 3, "text": "half wri')  # the process died mid-write
    assert [r["run"] for r in h.load()] == [1, 2]
    h.append({"run": 4})
    assert [r["run"] for r in h.load()] == [1, 2, 4]


def _runs(n: int) -> list[dict]:
    return [{"answer_id": f"a{i}", "method": "speculative", "prompt": "p" * 2000, "events": [{"step": k} for k in
                                                                                              range(200)]}
            for i in range(n)]


def test_the_history_is_listed_from_its_index_and_a_run_read_only_when_asked_for(tmp_path):
    h = History(tmp_path / "history.jsonl")
    for r in _runs(3):
        h.append(r)
    index = h.index_path.stat().st_size
    assert index < h.path.stat().st_size / 10  # a short line a run, the prompt's start only
    # The runs' own lines are not parsed to list them: garble the middle run's bytes in place.
    first, middle, _ = h.entries()
    raw = h.path.read_bytes()
    h.path.write_bytes(raw[:middle.offset] + b"#" * middle.length + raw[middle.offset + middle.length:])
    listed = History(h.path).entries()
    assert [e.summary["answer_id"] for e in listed] == ["a0", "a1", "a2"] and len(listed[1].summary["prompt"]) < 2000
    assert History(h.path).read(listed[0]) == _runs(1)[0]
    with pytest.raises(OSError, match="changed on disk"):
        History(h.path).read(listed[1])


def test_a_history_without_an_index_is_indexed_once_from_its_lines(tmp_path):
    """An older SpecPlay's history (or a crash between the two writes): the index catches up."""
    path = tmp_path / "history.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _runs(2)))
    h = History(path)
    assert [e.summary["answer_id"] for e in h.entries()] == ["a0", "a1"] and h.index_path.is_file()
    with open(path, "a") as f:  # a run the index missed
        f.write(json.dumps({"answer_id": "late"}) + "\n")
    h.append({"answer_id": "new"})
    assert [e.summary["answer_id"] for e in History(path).entries()] == ["a0", "a1", "late", "new"]


def test_keep_last_drops_the_oldest_runs_and_the_history_stays_whole(tmp_path):
    h = History(tmp_path / "history.jsonl")
    for r in _runs(5):
        h.append(r)
    assert h.keep_last(2) == 3 and h.keep_last(2) == 0
    assert [r["answer_id"] for r in History(h.path).load()] == ["a3", "a4"]
    h.append({"answer_id": "after"})
    assert [e.summary["answer_id"] for e in History(h.path).entries()] == ["a3", "a4", "after"]
    assert [r["answer_id"] for r in History(h.path).load()] == ["a3", "a4", "after"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.jsonl", "history.jsonl.index"]


def test_cli_log_to_an_unwritable_place_is_one_line_and_the_run_still_prints(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "m")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the log's folder should be")
    code = main(["run", "--target", str(folder), "--prompt", "ab cd", "--no-chat-template", "--max-new-tokens",
                 "4", "--json", "--log", str(blocker / "runs.jsonl")])
    out, err = capsys.readouterr()
    assert code == 1 and "cannot write the run log" in err and "Traceback" not in err
    assert json.loads(out)["new_tokens"] == 4


def test_cli_log_on_a_full_disk(tmp_path, capsys, monkeypatch):
    folder = save_tiny_model(tmp_path / "m")

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    code = main(["run", "--target", str(folder), "--prompt", "ab cd", "--no-chat-template", "--max-new-tokens", "4",
                 "--log", str(tmp_path / "runs.jsonl")])
    _, err = capsys.readouterr()
    assert code == 1 and "No space left on device" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ atomic writes
def test_a_write_that_fails_half_way_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from specplay.core.atomic import replacing

    path = tmp_path / "out.bin"
    path.write_bytes(b"old")
    with pytest.raises(ValueError, match="serializer"):
        with replacing(path) as tmp:
            tmp.write_bytes(b"half of the ne")
            raise ValueError("serializer failed")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_usual_ones(tmp_path, monkeypatch):
    """Some serializers (safetensors) create files for the owner alone; what SpecPlay writes does not."""
    from specplay.core import atomic

    monkeypatch.setattr(atomic, "_UMASK", 0o022)
    for name, before, after in [("new.bin", None, 0o644), ("shared.bin", 0o664, 0o664)]:
        path = tmp_path / name
        if before is not None:
            path.write_bytes(b"old")
            path.chmod(before)
        with atomic.replacing(path) as tmp:
            tmp.write_bytes(b"new")
            tmp.chmod(0o600)
        assert (path.stat().st_mode & 0o777, path.read_bytes()) == (after, b"new")


def _full_disk(monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)


def test_bench_outputs_on_a_full_disk_keep_the_previous_run(target, tmp_path, monkeypatch):
    from specplay.core.measure.bench import BenchSpec, run_bench
    from specplay.core.measure.prompts import Question

    spec = BenchSpec(methods=["autoregressive"], max_new_tokens=4, warmup=0, chat_template=False)
    run_bench(target, None, [Question(1, "code", ("ab",))], spec, tmp_path, log=lambda m: None)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    _full_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        run_bench(target, None, [Question(2, "code", ("cd",))], spec, tmp_path, log=lambda m: None)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_feature_shard_that_fails_half_way_is_not_left_to_look_finished(tmp_path, monkeypatch):
    import safetensors.torch

    from specplay.core.training.data import FeatureSet

    def torn(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x08\x00\x00\x00")  # the start of a safetensors header, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", torn)
    part = FeatureSet(torch.zeros(3, 4, dtype=torch.float16), torch.arange(3), torch.arange(3), torch.tensor([0, 3]))
    with pytest.raises(KeyboardInterrupt):
        part.save(tmp_path / "shard-0000.safetensors")
    assert list(tmp_path.iterdir()) == []  # extraction resumes by re-making the shard


def test_the_heads_manifest_sidecar_is_written_atomically(tmp_path, monkeypatch):
    from pathlib import Path

    from specplay.core.heads import save_heads

    path = tmp_path / "heads.safetensors"
    manifest = {"kind": "medusa", "steps": 1}
    save_heads(path, {"w": torch.ones(2, 2)}, manifest)
    sidecar = path.with_suffix(".json")
    before = sidecar.read_text()
    real = Path.write_text

    def half(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError, match="No space left"):
        save_heads(path, {"w": torch.ones(2, 2)}, {**manifest, "steps": 2})
    assert sidecar.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.json", "heads.safetensors"]


# ------------------------------------------------------------------------------ checkpoints
def _trained_pair(seed):
    torch.manual_seed(seed)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_a_checkpoint_round_trip_restores_the_training_state(tmp_path):
    from specplay.core.training.common import Checkpoint

    ck = Checkpoint(tmp_path / "ck.pt")
    module, optimizer = _trained_pair(0)
    ck.save(module, optimizer, 7, {"elapsed_s": 12.5})
    other, other_opt = _trained_pair(1)
    step, extra = ck.load(other, other_opt)
    assert step == 7 and extra == {"elapsed_s": 12.5}
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), other.state_dict().values()))
    assert other_opt.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


PLANTED = []


def _planted_code():
    PLANTED.append("ran")


class _Planted:
    def __reduce__(self):
        return _planted_code, ()


def test_a_checkpoint_holding_other_objects_is_refused_unrun(tmp_path):
    from specplay.core.errors import SpecPlayError
    from specplay.core.training.common import Checkpoint

    module, optimizer = _trained_pair(0)
    path = tmp_path / "ck.pt"
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": 3,
                "rng": torch.get_rng_state(), "extra": _Planted()}, path)
    with pytest.raises(SpecPlayError, match="more than tensors and numbers"):
        Checkpoint(path).load(module, optimizer)
    assert PLANTED == []
