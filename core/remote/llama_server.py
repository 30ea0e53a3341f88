"""llama.cpp's own server, ``llama-server``: the engine a CPU user runs for speculation today (a draft
model with ``-md``, or its draftless n-gram types with ``--spec-type``), so the one to measure against.

pip keeps only llama-cpp-python's libraries, so :func:`build` compiles the ``llama-server`` target of
the llama.cpp that the ``peers`` extra's source distribution vendors (``specplay peers build-server``:
the only step that downloads, from the package registry) and puts it beside this Python's
``specplay`` command. :class:`LlamaServer` starts it as a child on a free loopback port with
settings SpecPlay's llama.cpp probe proved safe here, waits until it answers, and always stops it:
on leaving its ``with`` block however that happens, and (Linux) when this process dies first.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

from specplay.core.errors import Cancelled, ConfigError, ModelError
from specplay.core.models.llamacpp import LlamaSettings, exit_reason
from specplay.core.paths import cache_dir
from specplay.core.remote.endpoint import Endpoint, RemoteError
from specplay.core.remote.transport import http_get

#: The source the server is built from: the ``peers`` extra's pin (a test holds them equal).
SOURCE = "llama-cpp-python==0.3.36"
#: llama-server's draftless speculation types (``--spec-type``), as its ``common/speculative.cpp`` names them.
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
START_TIMEOUT_S = 300.0  # loading two GGUF files and warming up takes seconds; a first page-in of them longer
STOP_TIMEOUT_S = 15.0
CONTEXT = 8192
#: What every request sets so that the server samples as SpecPlay's methods do (temperature and
#: top-p only; llama-server's own defaults add top-k 40 and min-p 0.05) and reads each prompt afresh
#: (its default keeps the last prompt's cache: the chat template's system prompt).
REQUEST_FIELDS = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                  "frequency_penalty": 0.0, "cache_prompt": False}
#: The CMake settings of the build: the server alone, static, for this CPU, nothing fetched while building.
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_OPENSSL=OFF")


def server_path() -> Path:
    """Where the server is: ``$SPECPLAY_LLAMA_SERVER``, else beside this Python (the venv's ``bin``)."""
    env = os.environ.get("SPECPLAY_LLAMA_SERVER")
    return Path(env) if env else Path(sys.executable).parent / ("llama-server.exe" if os.name == "nt" else "llama-server")


def why_unavailable() -> str | None:
    """Why the server peers cannot run here, or None."""
    path = server_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        return (f"llama-server is not built ({path} is missing): run `specplay peers build-server` after "
                "pip install -e \".[peers]\" (it compiles llama.cpp's server, about 5 minutes on two cores)")
    return None


def build_stamp(path: Path | None = None) -> str:
    """The built server, for keys of what was measured with it: its source, size and time."""
    path = path or server_path()
    st = path.stat()
    return f"{SOURCE}:{st.st_size}:{st.st_mtime_ns}"


def server_help(path: Path | None = None) -> str:
    """The built server's ``--help`` (its options, as this build spells them)."""
    done = subprocess.run([str(path or server_path()), "--help"], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


# ----------------------------------------------------------------------------- the build
def build(jobs: int | None = None, log: Callable[[str], None] = print) -> Path:
    """Compile ``llama-server`` from :data:`SOURCE`'s source distribution and install it at
    :func:`server_path`; its work folder, in the user cache, is kept until the binary is in place, so
    an interrupted build resumes where it stopped."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"building llama-server needs {' and '.join(missing)} (cmake and a C++ compiler)")
    work = cache_dir() / "build" / "llama-server"
    work.mkdir(parents=True, exist_ok=True)
    source = _unpacked_source(work, log)
    out = work / "build"
    jobs = jobs or os.cpu_count() or 1
    log(f"compiling llama-server with {jobs} jobs (about 5 minutes on two cores; the log: {work / 'build.log'})")
    with open(work / "build.log", "ab") as build_log:
        for cmd in (["cmake", "-S", str(source), "-B", str(out), *CMAKE_OPTIONS],
                    ["cmake", "--build", str(out), "--target", "llama-server", "-j", str(jobs)]):
            done = subprocess.run(cmd, stdout=build_log, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise ModelError(f"building llama-server failed ({shlex.join(cmd[:3])} ...: {exit_reason(done.returncode)}):"
                                 f" {_tail(work / 'build.log')}")
    built = next((p for p in (out / "bin" / "llama-server", out / "bin" / "llama-server.exe") if p.is_file()), None)
    if built is None:
        raise ModelError(f"the build of llama-server made no binary in {out / 'bin'}")
    dest = server_path()
    tmp = dest.with_name(dest.name + ".part")
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)
    done = subprocess.run([str(dest), "--version"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise ModelError(f"the built llama-server does not run: {exit_reason(done.returncode)}")
    shutil.rmtree(work, ignore_errors=True)
    log(f"llama-server installed at {dest}")
    return dest


def _unpacked_source(work: Path, log: Callable[[str], None]) -> Path:
    """llama.cpp's source from :data:`SOURCE`'s source distribution, downloaded and unpacked once."""
    found = sorted((work / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[0].parent
    sdist = work / "sdist"
    archives = sorted(sdist.glob("*.tar.gz"))
    if not archives:
        log(f"downloading {SOURCE}'s source distribution from the package registry")
        done = subprocess.run([sys.executable, "-m", "pip", "download", SOURCE, "--no-deps", "--no-binary", ":all:",
                               "-d", str(sdist)], capture_output=True, text=True)
        archives = sorted(sdist.glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise ModelError(f"could not download {SOURCE}'s source: {(done.stderr.strip().splitlines() or [''])[-1]}")
    partial = work / "src.part"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archives[0]) as tar:
        tar.extractall(partial, filter="data")
    shutil.rmtree(work / "src", ignore_errors=True)
    os.replace(partial, work / "src")
    found = sorted((work / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise ModelError(f"{archives[0].name} holds no llama.cpp source at vendor/llama.cpp")
    return found[0].parent


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ----------------------------------------------------------------------------- the child
def server_args(gguf: Path, threads: int, settings: LlamaSettings, *, draft: Path | None = None,
                spec_type: str | None = None) -> list[str]:
    """The command line's options (all but the host and port): one slot, ``threads`` threads, the
    probe's ``settings``, and the draft model or the n-gram type (else no speculation)."""
    args = ["-m", str(gguf), "-c", str(CONTEXT), "-t", str(threads), "-tb", str(threads), "-np", "1",
            "-fa", "on" if settings.flash_attn else "off", "--no-webui"]
    if not settings.extra_buffers:
        args.append("--no-repack")
    if draft is not None:
        args += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-threads", str(threads),
                 "--spec-draft-threads-batch", str(threads)]
    if spec_type is not None:
        args += ["--spec-type", spec_type]
    return args


def command_line(args: list[str]) -> str:
    """The shell command that starts this server by hand (on llama-server's default port)."""
    return shlex.join([str(server_path()), *args])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dies_with_parent() -> Callable[[], None] | None:
    """A child's pre-exec step asking Linux to end it when SpecPlay ends (killed, crashed): looked up
    here, so the child only makes one system call between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LlamaServer:
    """``llama-server`` with ``args``, as a child on 127.0.0.1; ``with`` waits for it and stops it."""

    def __init__(self, args: list[str], *, timeout_s: float = START_TIMEOUT_S, path: Path | None = None):
        self.args, self.timeout_s = list(args), timeout_s
        self.path = path or server_path()
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._log_dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def log_path(self) -> Path:
        assert self._log_dir is not None
        return Path(self._log_dir.name) / "llama-server.log"

    def __enter__(self) -> "LlamaServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start the child and return once it answers ``/health``; stopped again if it does not, or
        when ``should_stop`` says so meanwhile (then :class:`~specplay.core.errors.Cancelled`)."""
        self._log_dir = tempfile.TemporaryDirectory(prefix="specplay-llama-server-")
        self.port = _free_port()
        cmd = [str(self.path), "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        try:
            with open(self.log_path, "wb") as log:  # a file, not a pipe: nobody reads it while the server runs
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             preexec_fn=_dies_with_parent())
        except OSError as exc:
            self.stop()
            raise ModelError(f"llama-server could not start: {exc}") from None
        try:
            self._wait_ready(should_stop)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, should_stop: Callable[[], bool]) -> None:
        probe = Endpoint(f"http://127.0.0.1:{self.port}", timeout_s=5.0)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if should_stop():
                raise Cancelled("llama-server's start was stopped")
            code = self.proc.poll()
            if code is not None:
                raise ModelError(f"llama-server {exit_reason(code)} while starting: {_tail(self.log_path)}")
            try:
                status, _ = http_get(probe, "/health", time.monotonic() + 5.0, absolute=True)
                if status == 200:
                    return
            except RemoteError:
                pass  # not listening yet
            time.sleep(0.2)
        raise ModelError(f"llama-server did not answer within {self.timeout_s:.0f} s: {_tail(self.log_path)}")

    def stop(self) -> None:
        """End the child (politely, then by force) and remove its log; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None
