"""Atomic file writes: a file is either its old self or complete, never half written.

Writers put their bytes in a temporary file in the same folder (so the final rename stays
on one file system), which is flushed to disk and then renamed over the destination. If
anything fails on the way (a full disk, a serializer error, Ctrl-C), the temporary file
is removed and any previous file is left as it was. The new file gets the permissions of the
file it replaces, or those of any new file (0666 less the umask): some serializers create
their files readable by the owner alone.
"""

from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_UMASK = os.umask(0)  # read once, at import (setting it is process-wide, so never later, beside threads)
os.umask(_UMASK)


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
        try:
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_UMASK)
        except OSError:  # a file system without Unix permissions: the bytes matter more than the mode
            pass
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
