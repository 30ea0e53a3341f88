"""Atomic file writes: a file is either its old self or complete, never half written.

Writers put their bytes in a temporary file in the same folder (so the final rename stays
on one file system), named for this writer alone (two threads of one process may write one
file at once), which is flushed to disk and then renamed over the destination. If anything
fails on the way (a full disk, a serializer error, Ctrl-C), the temporary file is removed and
any previous file is left as it was. The new file gets the permissions of the file it
replaces, or those of any new file (0666 less the umask): some serializers create their files
readable by the owner alone.

A read-modify-write of a file shared by processes (a table of measurements) holds
:func:`locked` around it, so that neither writer drops the other's change.
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, writers may then drop each other's changes
    fcntl = None

_UMASK = os.umask(0)  # read once, at import (setting it is process-wide, so never later, beside threads)
os.umask(_UMASK)


@contextmanager
def replacing(path: str | Path, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path to write; on a clean exit it replaces ``path``, otherwise it is removed.

    Serializers that only accept a file name (``torch.save``, ``safetensors``) write to the
    yielded path; the file is synced here, after they have closed it. ``mode``, where given, is
    the new file's permissions whatever the old one's were.
    """
    path = Path(path)
    # The process id stays last but one (``.NAME.RANDOM.PID.tmp``): a prune of the cache tells a
    # killed writer's leftover by it.
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{os.getpid()}.tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        # Sync before the rename, or a crash could leave the new name pointing at unwritten blocks.
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        try:
            if mode is None:
                mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_UMASK
            os.chmod(tmp, mode)
        except OSError:  # a file system without Unix permissions: the bytes matter more than the mode
            pass
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock for ``path`` (on ``.NAME.lock`` beside it) while the block runs: one
    reader-and-writer at a time, across threads and processes."""
    path = Path(path)
    try:
        f = open(path.with_name(f".{path.name}.lock"), "a")
    except OSError:  # a missing or read-only folder: the block writes nothing there either
        f = None
    try:
        if f is not None and fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        if f is not None:
            f.close()  # which releases the lock
