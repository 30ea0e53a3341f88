"""The kernel's compiled library is code SpecPlay runs: it is compiled by a compiler found where it
is, kept for this user alone, and loaded only while it is this user's and has the bytes it was
compiled with; otherwise it is compiled again (or refused, in another user's folder).

The tests compile a kernel of one function (a blink) in place of the real one (many seconds)."""

import hashlib
import os
import shutil
import stat
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conftest import require_or_skip
from specplay.core import atomic
from specplay.core.kernels import kernel_build

_CC = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    """The library's path, with a kernel whose ``sp_answer`` returns 42, in a cache of the test's own."""
    if _CC is None:
        require_or_skip("SPECPLAY_REQUIRE_KERNEL", "no C compiler on this machine")
    source = tmp_path / "tiny.c"
    source.write_text("int sp_answer(void) { return 42; }\n")
    monkeypatch.setattr(kernel_build, "_SOURCES", (source,))
    monkeypatch.setenv("SPECPLAY_CACHE_DIR", str(tmp_path / "cache"))
    return kernel_build._library_path()


def _plant(lib: Path, answer: int, mode: int) -> None:
    """Another library in ``lib``'s place (its ``sp_answer`` returns ``answer``), its checksum beside it."""
    source = lib.parent.parent / f"planted-{answer}.c"
    source.write_text(f"int sp_answer(void) {{ return {answer}; }}\n")
    subprocess.run([_CC, "-shared", "-fPIC", "-o", str(lib), str(source)], check=True)
    lib.chmod(mode)
    lib.with_name(lib.name + ".sha256").write_text(hashlib.sha256(lib.read_bytes()).hexdigest() + "\n")


def _owned_by_another_user(monkeypatch, path: Path) -> None:
    """``os.stat`` and ``os.lstat`` say another user owns ``path`` (the tests may run as root, or not)."""
    def forged(real):
        def stat_(p, *args, **kwargs):
            st = real(p, *args, **kwargs)
            if isinstance(p, (str, os.PathLike)) and os.fspath(p) == str(path):
                return os.stat_result((*st[:4], st.st_uid + 1, *st[5:]))
            return st
        return stat_

    monkeypatch.setattr(os, "stat", forged(os.stat))
    monkeypatch.setattr(os, "lstat", forged(os.lstat))


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_the_library_and_its_folder_are_the_users_alone_under_a_sharing_umask(tiny, monkeypatch):
    monkeypatch.setattr(atomic, "_UMASK", 0o002)
    before = os.umask(0o002)
    try:
        lib = kernel_build.build()
    finally:
        os.umask(before)
    assert lib == tiny and lib.stat().st_uid == os.getuid()
    assert (stat.S_IMODE(lib.parent.stat().st_mode), stat.S_IMODE(lib.stat().st_mode)) == (0o700, 0o700)
    assert kernel_build.load_library().sp_answer() == 42


def test_a_library_others_could_write_is_compiled_again_not_loaded(tiny):
    _plant(kernel_build.build(), 666, mode=0o775)
    assert kernel_build.load_library().sp_answer() == 42
    assert stat.S_IMODE(tiny.stat().st_mode) == 0o700


def test_a_library_in_a_folder_others_could_write_is_compiled_again_and_the_folder_made_private(tiny):
    _plant(kernel_build.build(), 666, mode=0o700)  # private and checksummed: only its folder gives it away
    tiny.parent.chmod(0o777)
    assert kernel_build.load_library().sp_answer() == 42
    assert stat.S_IMODE(tiny.parent.stat().st_mode) == 0o700


def test_a_library_of_another_user_is_compiled_again(tiny, monkeypatch):
    _plant(kernel_build.build(), 666, mode=0o700)
    _owned_by_another_user(monkeypatch, tiny)
    assert kernel_build.load_library().sp_answer() == 42


def test_a_kernels_folder_of_another_user_is_refused_with_the_reason(tiny, monkeypatch):
    kernel_build.build()
    _owned_by_another_user(monkeypatch, tiny.parent)
    with pytest.raises(OSError, match=f"kernels folder {tiny.parent} belongs to another user"):
        kernel_build.build()


def test_a_corrupt_library_is_compiled_again(tiny):
    good = kernel_build.build().read_bytes()
    corrupt = bytearray(good)
    corrupt[len(corrupt) // 2] ^= 0xFF
    tiny.write_bytes(bytes(corrupt))
    assert kernel_build.build() == tiny and tiny.read_bytes() == good


def test_the_librarys_name_follows_the_compilers_path_and_version(tmp_path, monkeypatch):
    """A compiler upgraded (a new file in its place, as a package manager puts it) or another one
    builds, and proves, a library of its own."""
    monkeypatch.setenv("PATH", str(tmp_path / "one"))
    monkeypatch.setenv("CC", "fakecc")
    _script(tmp_path / "one" / "fakecc", 'echo "fakecc 1.0"')
    first = kernel_build.library_digest()
    os.replace(_script(tmp_path / "fakecc.new", 'echo "fakecc 2.0"'), tmp_path / "one" / "fakecc")
    upgraded = kernel_build.library_digest()
    _script(tmp_path / "two" / "fakecc", 'echo "fakecc 2.0"')
    monkeypatch.setenv("PATH", str(tmp_path / "two"))
    assert len({first, upgraded, kernel_build.library_digest()}) == 3


def test_cc_is_a_shell_word_list(tiny, tmp_path, monkeypatch):
    """``CC="ccache gcc"`` compiles with gcc through ccache (whose first argument is the compiler)."""
    ccache = _script(tmp_path / "bin" / "ccache", f'echo "$1" >> {tmp_path}/used; exec "$@"')
    monkeypatch.setenv("PATH", f"{ccache.parent}{os.pathsep}{Path(_CC).parent}")
    monkeypatch.setenv("CC", f"ccache {Path(_CC).name}")
    assert kernel_build._compiler() == [str(ccache), Path(_CC).name]
    assert kernel_build.load_library().sp_answer() == 42
    assert Path(_CC).name in (tmp_path / "used").read_text().split()


def test_a_compiler_that_is_not_installed_falls_back_to_one_on_the_path(tmp_path, monkeypatch):
    """A conda Python's build compiler, or a ``CC`` naming a missing program: cc, gcc, clang are tried next."""
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: "x86_64-conda-linux-gnu-cc -pthread" if name == "CC" else real(name))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    assert kernel_build._compiler() is None
    clang = _script(tmp_path / "clang", "exit 0")
    assert kernel_build._compiler() == [str(clang)]
    gcc = _script(tmp_path / "gcc", "exit 0")
    monkeypatch.setenv("CC", "no-such-cc -O2")
    assert kernel_build._compiler() == [str(gcc)]
    monkeypatch.setenv("CC", "gcc -m64")
    assert kernel_build._compiler() == [str(gcc), "-m64"]


def test_a_compile_started_in_the_background_is_waited_for_and_never_run_twice(tiny, tmp_path, monkeypatch):
    """``build_soon`` compiles while the caller goes on (a first launch assembles its models meanwhile);
    ``build`` then waits for that compile instead of starting its own, and a kept library starts none."""
    gate = tmp_path / "go"
    slow = _script(tmp_path / "bin" / "slowcc", f'case "$*" in *" -o "*) echo compiling >> {tmp_path}/runs; '
                                               f'while [ ! -e {gate} ]; do sleep 0.05; done;; esac; exec {_CC} "$@"')
    monkeypatch.setenv("CC", str(slow))
    tiny = kernel_build._library_path()  # the slow compiler's own library
    kernel_build.build_soon()
    assert kernel_build._building.locked()  # compiling, and the caller not held up
    gate.touch()
    assert kernel_build.load_library().sp_answer() == 42
    kernel_build.build_soon()
    assert not kernel_build._building.locked() and kernel_build.build() == tiny
    assert (tmp_path / "runs").read_text().splitlines() == ["compiling"]
