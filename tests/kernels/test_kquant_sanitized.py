"""The k-quant kernel's C entries under AddressSanitizer and UndefinedBehaviorSanitizer.

``tests/fixtures/kquant_driver.c`` calls every entry of the kernel (``core/kernels/kquant.h``) with edge
shapes (one row, a block's tail, the largest ids) and with arguments that disagree (ids past the
matrix, a layer whose output projection has more rows than its hidden size, more key/value heads than
heads, ...), each buffer at its exact size. Built here with the sanitizers (unoptimised, so that it
compiles in seconds) and run as a child process: every call must return its status, and the
sanitizers must report nothing.
"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "core" / "kernels"
SOURCES = [KERNELS / "blocks.c", KERNELS / "gemm_x86.c", KERNELS / "layer.c",
           ROOT / "tests" / "fixtures" / "kquant_driver.c"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
FLAGS = ["-O0", "-g", "-fopenmp", "-ffp-contract=off", *SANITIZE]
#: Reports end the run (UBSan's would go on), and the fit that cannot have its memory gets a null, not an abort.
SANITIZER_ENV = {"ASAN_OPTIONS": "allocator_may_return_null=1:max_allocation_size_mb=1024:detect_leaks=1",
                 "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1", "OMP_NUM_THREADS": "2"}


def _compiler() -> str:
    return os.environ.get("CC", "cc").split()[0]


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sanitized")
    probe = folder / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    tried = subprocess.run([_compiler(), *SANITIZE, "-o", str(folder / "probe"), str(probe)], capture_output=True,
                           text=True)
    if tried.returncode != 0 or subprocess.run([str(folder / "probe")], capture_output=True).returncode != 0:
        pytest.skip(f"{_compiler()} cannot build with -fsanitize=address,undefined: "
                    f"{(tried.stderr.strip().splitlines() or ['its program does not run'])[-1][:200]}")
    exe = folder / "driver"
    built = subprocess.run([_compiler(), *FLAGS, f"-I{KERNELS}", "-o", str(exe), *map(str, SOURCES), "-lm"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    return exe


def test_every_c_entry_returns_its_status_and_the_sanitizers_report_nothing(driver):
    done = subprocess.run([str(driver)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **SANITIZER_ENV})
    reports = [line for line in done.stderr.splitlines()
               if "ERROR: AddressSanitizer" in line or "ERROR: LeakSanitizer" in line or "runtime error:" in line]
    assert done.returncode == 0 and not reports, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    assert "all cases returned their status" in done.stdout
