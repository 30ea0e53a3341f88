"""Atomic file writes: a file is either its old self or complete, never half written.

Writers put their bytes in a temporary file in the same folder (so the final rename stays
on one file system), which is flushed to disk and then renamed over the destination. If
anything fails on the way (a full disk, a serializer error, Ctrl-C), the temporary file
is removed and any previous file is left as it was.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write; on a clean exit it replaces ``path``, otherwise it is removed.

    Serializers that only accept a file name (``torch.save``, ``safetensors``) write to the
    yielded path; the file is synced here, after they have closed it.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        # Sync before the rename, or a crash could leave the new name pointing at unwritten blocks.
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
