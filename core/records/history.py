"""The run history: every finished, cancelled or failed run, saved as soon as it ends.

One JSON line per run in the user data directory, appended, flushed and fsync'ed, so a
crash of the window or the process loses no run that had ended. A torn last line (the
process died mid-write) is skipped on reading, not fatal.

A record with its steps takes about 0.4 KB a token, so the history is never read whole to
list it: an index beside it (``history.jsonl.index``) holds one short line per run, what the
History panel shows and where the run's line starts, and a run is read in full only when it is
reopened or exported. An index that is missing or behind the history (an older SpecPlay, a
crash between the two writes) is completed from the history's unindexed tail. :meth:`History.keep_last`
drops all but the newest runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from specplay.core.atomic import replacing
from specplay.core.paths import data_dir
from specplay.core.records.runlog import dumps

log = logging.getLogger(__name__)

#: The keys of a record that its index line keeps (what the History panel lists), besides the prompt's start.
SUMMARY_KEYS = ("answer_id", "tstamp", "method", "lossy", "model_id", "new_tokens", "tokens_per_s", "mean_accepted",
                "temperature", "stop_reason", "cancelled", "speedup", "identical_to_baseline", "kind", "verdict",
                "p_value")
PROMPT_CHARS = 300


def default_path() -> Path:
    return data_dir() / "history.jsonl"


def summary_of(record: dict) -> dict:
    """What the index keeps of ``record``: :data:`SUMMARY_KEYS` and the prompt's first characters."""
    out = {k: record[k] for k in SUMMARY_KEYS if k in record}
    if isinstance(record.get("prompt"), str):
        out["prompt"] = record["prompt"][:PROMPT_CHARS]
    return out


@dataclass(frozen=True)
class Entry:
    """One run of the history: its summary, and where its line is (``offset`` None: it could not be saved,
    and ``record`` holds it for this session)."""

    summary: dict
    offset: int | None = None
    length: int = 0
    record: dict | None = None


class History:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_path()
        self.index_path = self.path.with_name(self.path.name + ".index")
        self._indexed_end: int | None = None  # where the index's last run ends, as this object last saw it

    def append(self, record: dict) -> Entry:
        """Write ``record`` to the history (on disk before this returns) and index it."""
        line = (dumps(record) + "\n").encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            offset = f.seek(0, os.SEEK_END)
            if offset and _last_byte(self.path) != b"\n":
                f.write(b"\n")  # close a torn line: it stays the only unreadable one
                offset += 1
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        entry = Entry(summary_of(record), offset, len(line))
        if self._indexed_end == offset and self._write_index([entry], known=0):
            self._indexed_end = offset + len(line)
        else:  # lines this object has not indexed (an older version's, another process's): index them all
            self.entries()
        return entry

    def entries(self) -> list[Entry]:
        """Every readable run, oldest first, from the index; the history's unindexed tail is read and indexed."""
        if not self.path.is_file():
            return []
        entries, whole = self._read_index()
        end = entries[-1].offset + entries[-1].length if entries else 0
        if end > self.path.stat().st_size:  # the history was replaced under its index
            entries, end, whole = [], 0, False
        tail = self._scan(end)
        entries += tail
        self._indexed_end = entries[-1].offset + entries[-1].length if entries else None
        if tail or not whole:
            self._write_index(entries, known=len(entries) - len(tail) if whole else None)
        return entries

    def read(self, entry: Entry) -> dict:
        """The whole record of ``entry`` (raises ``OSError`` if the history no longer holds it)."""
        if entry.record is not None or entry.offset is None:
            return entry.record or {}
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            raw = f.read(entry.length)
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or record.get("answer_id") != entry.summary.get("answer_id"):
            raise OSError(f"the history changed on disk since it was listed (reload it): {self.path}")
        return record

    def load(self) -> list[dict]:
        """All readable records, oldest first (the whole file: for exports and tools, not for listing)."""
        return [self.read(e) for e in self.entries()]

    def keep_last(self, n: int) -> int:
        """Keep only the newest ``n`` runs (the history is rewritten atomically); the number of runs dropped."""
        entries = self.entries()
        dropped = max(0, len(entries) - max(0, n))
        if not dropped:
            return 0
        kept = entries[dropped:]
        with open(self.path, "rb") as src, replacing(self.path) as tmp, open(tmp, "wb") as out:
            moved = []
            for e in kept:
                src.seek(e.offset)
                moved.append(Entry(e.summary, out.tell(), e.length))
                out.write(src.read(e.length))
        self._write_index(moved)
        self._indexed_end = None
        return dropped

    # -- the index ---------------------------------------------------------------------------
    def _read_index(self) -> tuple[list[Entry], bool]:
        """The entries the index holds, and whether it was read to its end (else it is written again)."""
        entries: list[Entry] = []
        try:
            with open(self.index_path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        item = json.loads(line)
                        entry = Entry(dict(item["summary"]), int(item["offset"]), int(item["length"]))
                    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                        return entries, False  # a torn or foreign line: the rest is indexed again
                    if entries and entry.offset < entries[-1].offset + entries[-1].length:
                        return entries, False
                    entries.append(entry)
        except FileNotFoundError:
            return [], False
        return entries, _last_byte(self.index_path) in (b"", b"\n")

    def _write_index(self, entries: list[Entry], known: int | None = None) -> bool:
        """Write the index of ``entries``; ``known``: the index holds that many of them already, the rest are added."""
        def lines(items):
            return "".join(json.dumps({"offset": e.offset, "length": e.length, "summary": e.summary}) + "\n"
                           for e in items)

        try:
            if known is not None:
                with open(self.index_path, "a", encoding="utf-8") as f:
                    f.write(lines(entries[known:]))
            else:
                with replacing(self.index_path) as tmp:
                    tmp.write_text(lines(entries), encoding="utf-8")
        except OSError as exc:  # the history itself is whole; the index is made again next time
            log.warning("cannot write the history index %s: %s", self.index_path, exc)
            self._indexed_end = None
            return False
        return True

    def _scan(self, start: int) -> list[Entry]:
        """The readable lines of the history from byte ``start`` on, as entries."""
        out = []
        with open(self.path, "rb") as f:
            f.seek(start)
            offset = start
            for raw in f:
                if raw.endswith(b"\n") and raw.strip():
                    try:
                        record = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        record = None
                    if isinstance(record, dict):
                        out.append(Entry(summary_of(record), offset, len(raw)))
                    else:
                        log.warning("%s: skipping an unreadable line at byte %d", self.path, offset)
                offset += len(raw)
        return out


def _last_byte(path: Path) -> bytes:
    """The file's last byte (b"" when it is empty)."""
    with open(path, "rb") as f:
        if not f.seek(0, os.SEEK_END):
            return b""
        f.seek(-1, os.SEEK_END)
        return f.read(1)
