"""The k-quant kernel's library: compiled here once per compiler, kept in the user cache, loaded only while it is ours.

The library is code SpecPlay runs, so what is loaded from the cache must be what was compiled
here. Its folder (``kernels/`` in the user cache) is made for this user alone (0700) and the
library written 0700, its sha256 kept beside it; before each load the folder and the library
must belong to this user with no group or other write bit, and the library must have the bytes
it was compiled with. A library that fails any of these is compiled again into place (a folder
others could write is first made private again); a folder of another user's is refused.

The library's name, and so the kernel's proof of exactness kept under it, names the sources,
the flags and the compiler (its path and version): another compiler builds, and proves, its own.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sysconfig
import threading
from pathlib import Path

from specplay.core.atomic import replacing
from specplay.core.paths import cache_dir

log = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("blocks.c", "gemm_x86.c", "layer.c"))
#: What every source includes (its bytes are the library's too).
_HEADERS = (Path(__file__).with_name("kquant.h"),)
_FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared")
#: Tried after ``CC`` and the compiler Python was built with, in this order.
_FALLBACKS = ("cc", "gcc", "clang")
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _compiler() -> list[str] | None:
    """The C compiler's command: ``CC`` (a shell word list, such as ``ccache gcc``), then the
    compiler Python was built with, then cc, gcc, clang; the first whose program is on PATH (its
    full path), or None."""
    for named in (os.environ.get("CC"), sysconfig.get_config_var("CC"), *_FALLBACKS):
        try:
            words = shlex.split(named or "")
        except ValueError:  # unbalanced quotes: not a command
            continue
        program = shutil.which(words[0]) if words else None
        if program:
            return [program, *words[1:]]
    return None


@functools.lru_cache(maxsize=8)
def _compiler_identity(command: tuple[str, ...], program: tuple[int, int]) -> str:
    """The compiler's command (its program's full path) and the first line of its ``--version``:
    asked once per program file (``program``: its inode and modification time), not at every digest."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
        version = (done.stdout.strip().splitlines() or [""])[0]
    except (OSError, subprocess.SubprocessError):
        version = "no version"
    return f"{shlex.join(command)} {version}"


def library_digest() -> str:
    """The kernel's sources (its header too), build flags and compiler (what its proof of exactness is kept under)."""
    cc = _compiler()
    if cc:
        st = os.stat(cc[0])
        compiler = _compiler_identity(tuple(cc), (st.st_ino, st.st_mtime_ns))
    else:
        compiler = "no compiler"
    return hashlib.sha256(b"".join(s.read_bytes() for s in (*_HEADERS, *_SOURCES))
                          + f"{' '.join(_FLAGS)}|{compiler}".encode()).hexdigest()[:16]


def _library_path() -> Path:
    return cache_dir() / "kernels" / f"kquant-{library_digest()}.so"


def _checksum_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _private_folder(folder: Path) -> bool:
    """Make the kernels' folder this user's alone; whether others could write it until now (then
    nothing in it is to be trusted). Raises OSError where it belongs to another user."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid():
        raise OSError(f"the kernels folder {folder} belongs to another user (uid {st.st_uid}), "
                      f"so SpecPlay runs no code from it; remove it or set SPECPLAY_CACHE_DIR")
    if st.st_mode & _OTHERS_WRITE:
        os.chmod(folder, 0o700)
        return True
    return False


def _distrusted(lib: Path) -> str | None:
    """Why the kept library is not to be loaded as it is; None where it is a plain file of this
    user's that no one else may write, with the bytes it was compiled with."""
    try:
        st = os.lstat(lib)
    except FileNotFoundError:
        return "not compiled yet"
    if not stat.S_ISREG(st.st_mode):
        return "not a plain file"
    if st.st_uid != os.getuid():
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_mode & _OTHERS_WRITE:
        return f"others may write it (mode {stat.S_IMODE(st.st_mode):o})"
    try:
        kept = _checksum_path(lib).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "its checksum is missing"
    if hashlib.sha256(lib.read_bytes()).hexdigest() != kept:
        return "its bytes are not those it was compiled with"
    return None


#: Held while the kernel is checked or compiled: a caller waits for a compile under way in the background.
_building = threading.Lock()


def build_soon() -> None:
    """Start compiling the kernel in the background where it is not compiled yet, so that the compiler
    (6 s on two cores) runs while a first launch assembles its model files; :func:`build` waits for it.
    A failure there is left for :func:`build` to raise again."""
    if _distrusted(_library_path()) == "not compiled yet" and not _building.locked():
        threading.Thread(target=_build_quietly, name="kquant-build", daemon=True).start()


def _build_quietly() -> None:
    try:
        build()
    except OSError:  # no compiler, or it failed: said by the load that needs the kernel
        pass


def build() -> Path:
    """The compiled kernel: the kept one where it is to be trusted, else compiled here (a few
    seconds) into the user cache."""
    with _building:
        return _build()


def _build() -> Path:
    cc = _compiler()
    if cc is None:
        raise OSError(f"no C compiler on this machine (tried CC, Python's own, {', '.join(_FALLBACKS)})")
    lib = _library_path()
    why = "others could write its folder" if _private_folder(lib.parent) else _distrusted(lib)
    if why is None:
        return lib
    if why != "not compiled yet":
        log.warning("compiling the k-quant kernel %s again: %s", lib, why)
    with replacing(lib, mode=0o700) as tmp:
        done = subprocess.run([*cc, *_FLAGS, "-o", str(tmp), *map(str, _SOURCES), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"{shlex.join(cc)} could not compile the k-quant kernel: "
                          f"{(done.stderr.strip().splitlines() or [''])[-1][:200]}")
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    # Written after the library: a process stopped in between leaves a mismatch, compiled again.
    with replacing(_checksum_path(lib), mode=0o600) as tmp:
        tmp.write_text(digest + "\n", encoding="ascii")
    return lib


def load_library() -> ctypes.CDLL:
    """The kernel's library, checked (or compiled) by :func:`build` and loaded."""
    return ctypes.CDLL(str(build()))
