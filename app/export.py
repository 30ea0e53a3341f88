"""Exports: run records as JSON lines or CSV, charts as PNG; every file is written atomically.

A write goes to a temporary file that replaces the target only once complete, so a
failure (permission denied, disk full) leaves any existing file as it was; the caller
shows :class:`ExportError`'s message. Nothing here touches a model, so the window may run
these functions in a helper thread.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QSaveFile
from PySide6.QtGui import QImage

from specplay.core.records.runlog import RunRecord, write_jsonl_atomic

CSV_COLUMNS = ("method", "lossy", "tokens_per_s", "speedup", "mean_accepted", "acceptance_rate", "new_tokens",
               "steps", "wall_time", "prefill_time", "identical_to_baseline", "stop_reason", "temperature", "top_p",
               "seed", "max_new_tokens", "model_id", "draft_id", "device", "dtype", "params", "prompt", "text",
               "answer_id", "tstamp")


# Spreadsheets run a cell that starts with one of these as a formula (OWASP, "CSV Injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


class ExportError(Exception):
    """A file could not be written; the message names the file and the reason."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def write_runs_jsonl(path: str | Path, records: list[dict]) -> None:
    path = Path(path)
    try:
        write_jsonl_atomic(path, records)
    except OSError as exc:
        raise ExportError(f"Could not write {path}: {_reason(exc)}. Nothing was changed there; "
                          "your runs are still in the history.") from exc


def csv_row(record: dict) -> dict:
    """A run record's CSV cells: its own keys, and its models' ids, device and dtype."""
    run = RunRecord.from_dict(record)
    row = {k: record.get(k) for k in CSV_COLUMNS}
    row["draft_id"] = (run.draft or {}).get("id")
    row["device"] = (run.target or {}).get("device")
    row["dtype"] = (run.target or {}).get("dtype")
    row["params"] = json.dumps(run.params or {}, ensure_ascii=False, sort_keys=True)
    return row


def csv_cell(value):
    """``value`` as a cell no spreadsheet runs: text that would start a formula (a prompt or an
    answer can be anything) gets a leading quote, OWASP's advice; numbers, and text that is
    only a number such as ``-1.5``, stay as they are, so they still read as numbers."""
    if value is None:
        return ""
    if isinstance(value, str) and value.startswith(_FORMULA_START) and not _NUMBER.fullmatch(value):
        return "'" + value
    return value


def runs_csv(records: list[dict]) -> str:
    buf = io.StringIO()
    # RFC 4180's line end: the writer quotes cells holding either of its characters, so an answer
    # with a lone carriage return stays one cell (with "\n" alone, it split the row for readers).
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\r\n")
    writer.writeheader()
    for r in records:
        writer.writerow({k: csv_cell(v) for k, v in csv_row(r).items()})
    return buf.getvalue()


def save_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` with QSaveFile (temporary file, then rename)."""
    f = QSaveFile(str(path))
    if not f.open(QIODevice.OpenModeFlag.WriteOnly):
        raise ExportError(f"Could not write {path}: {f.errorString()}. Nothing was changed there.")
    written = f.write(QByteArray(data))
    if written != len(data):
        reason = f.errorString()
        f.cancelWriting()
        f.commit()
        raise ExportError(f"Could not write {path}: {reason or 'the disk may be full'}. Nothing was changed there.")
    if not f.commit():
        raise ExportError(f"Could not write {path}: {f.errorString() or 'the disk may be full'}. "
                          "Nothing was changed there.")


def write_runs_csv(path: str | Path, records: list[dict]) -> None:
    save_bytes_atomic(path, runs_csv(records).encode("utf-8"))


def png_bytes(image: QImage) -> bytes:
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buf, "PNG"):
        raise ExportError("Could not encode the chart as PNG.")
    return bytes(buf.data())


def write_png(path: str | Path, image: QImage) -> None:
    save_bytes_atomic(path, png_bytes(image))
