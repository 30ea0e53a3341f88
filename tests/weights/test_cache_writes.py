"""Writes to the user cache under a full disk and beside other writers: a measurement is kept in
memory where it cannot be written, and two writers of one file neither tear it nor drop each
other's entries."""

import errno
import logging
import os
import threading
import time

from specplay.core.atomic import replacing
from specplay.core.models import measurements


def test_a_measurement_a_full_or_read_only_cache_cannot_keep_is_kept_in_memory_with_one_warning(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path / "measured"))

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    calls = []
    with caplog.at_level(logging.WARNING, logger=measurements.__name__):
        for _ in range(2):
            assert measurements.measured("memory bandwidth", lambda: calls.append(1) or {"read_gb_per_s": 9.0}) \
                == {"read_gb_per_s": 9.0}
        assert measurements.measured("native draft", lambda: {"ms_per_token": 3.0}) == {"ms_per_token": 3.0}
    assert len(calls) == 1 and measurements.has_measured("memory bandwidth")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
    assert os.listdir(tmp_path / "measured") in ([], [".engines.json.lock"])  # no temporary left behind


def test_two_threads_measuring_different_things_keep_both(tmp_path, monkeypatch):
    """Each has read the table before either writes it back (the CLI and the app, the draft's thread
    and the first run's)."""
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(tmp_path))
    both_read = threading.Barrier(2, timeout=10)
    errors = []

    def measure(key):
        def timed():
            both_read.wait()
            return {"by": key}

        try:
            measurements.measured(key, timed)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=measure, args=(key,)) for key in ("cost curve", "native draft")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert errors == []
    assert {key.split("|", 1)[1]: value for key, value in measurements.read_table(measurements._file()).items()} \
        == {"cost curve": {"by": "cost curve"}, "native draft": {"by": "native draft"}}


def test_two_threads_replacing_one_file_never_tear_it(tmp_path):
    """Written a chunk at a time, as the serializers do; hammered for about a second."""
    path = tmp_path / "measurements.json"
    texts = {"long": "a" * 200_000, "short": "b" * 30_000}
    path.write_text(texts["long"])
    deadline = time.monotonic() + 1.0
    errors, torn = [], []

    def write(text):
        for _ in range(300):
            if time.monotonic() > deadline:
                return
            try:
                with replacing(path) as tmp, open(tmp, "w") as f:
                    for start in range(0, len(text), 8192):
                        f.write(text[start:start + 8192])
                        f.flush()
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

    writers = [threading.Thread(target=write, args=(text,)) for text in texts.values()]
    for t in writers:
        t.start()
    while any(t.is_alive() for t in writers):
        if (read := path.read_text()) not in texts.values():
            torn.append(len(read))
    assert errors == [] and torn == []
    assert path.read_text() in texts.values() and [p.name for p in tmp_path.iterdir()] == ["measurements.json"]
