"""The run history: every finished, cancelled or failed run, saved as soon as it ends.

One JSON line per run in the user data directory, appended, flushed and fsync'ed, so a
crash of the window or the process loses no run that had ended. A torn last line (the
process died mid-write) is skipped on reading, not fatal.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specplay.core.paths import data_dir
from specplay.core.runlog import append_jsonl

log = logging.getLogger(__name__)


def default_path() -> Path:
    return data_dir() / "history.jsonl"


class History:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else default_path()

    def append(self, record: dict) -> None:
        append_jsonl(self.path, [record])

    def load(self) -> list[dict]:
        """All readable records, oldest first."""
        if not self.path.is_file():
            return []
        records = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    log.warning("%s: skipping unreadable line %d", self.path, n)
        return records
