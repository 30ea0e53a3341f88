import os
import sys
from pathlib import Path

import pytest
import torch

# The tests sit in folders named after the rooms they test (core's rooms, and app/); their shared
# helpers (tiny.py, stats.py, this file) at the top, and a test module may import another's helpers
# by its name, whatever folder it is in.
HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), *sorted(str(p) for p in HERE.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# Tiny models run fastest on one thread (no OpenMP hand-offs), and tests then leave the
# other cores alone; tests on the real models ask for all threads themselves.
ALL_THREADS = torch.get_num_threads()
torch.set_num_threads(1)


def require_or_skip(flag: str, reason: str) -> None:
    """Skip a test (or, at its top level, a whole module) for something this machine lacks, or fail
    it where ``flag`` is set: CI sets a ``SPECPLAY_REQUIRE_*`` flag for each thing it installs
    (.ci/run), so that a broken install fails there instead of passing with its tests skipped."""
    if os.environ.get(flag):
        pytest.fail(f"{reason} ({flag} is set)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture(scope="session")
def _measurements(tmp_path_factory):
    return tmp_path_factory.mktemp("measurements")


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch, _measurements):
    """Keep the run history and settings of tests out of the user's folders, and what tests
    measure (kernels, llama.cpp's verdicts, under simulated crashes too) out of the user's cache.

    The model cache stays shared (``SPECPLAY_CACHE_DIR`` if set) so the real models convert once;
    the measurements are shared by one session's tests (a test that needs its own sets
    ``SPECPLAY_MEASUREMENTS_DIR``).
    """
    data = tmp_path_factory.mktemp("data")
    monkeypatch.setenv("SPECPLAY_DATA_DIR", str(data))
    monkeypatch.setenv("SPECPLAY_MEASUREMENTS_DIR", str(_measurements))
    yield


@pytest.fixture(autouse=True)
def _no_recalled_gain(monkeypatch):
    """Each test's first `speculative` run with a draft reads the prompt as a first run does: what an
    earlier test's run measured of a shared draft's gain (a module's models) says nothing of this test's."""
    import weakref

    from specplay.core.methods import speculative

    monkeypatch.setattr(speculative, "_RECALL", weakref.WeakKeyDictionary())


@pytest.fixture()
def aloop(qapp):
    """A qasync event loop on the test's QApplication, for the app's coroutines (tests/app/app_window.py,
    tests/app/test_session.py); Qt is imported only by the tests that ask for it."""
    import asyncio

    import qasync

    loop = qasync.QEventLoop(qapp, already_running=True)
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.events._set_running_loop(None)
    asyncio.set_event_loop(None)
