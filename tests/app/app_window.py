"""What the window's tests share: tiny model folders, a window with them loaded, and :func:`run`.

The window's orchestration is asyncio on a qasync loop; the ``aloop`` fixture installs one
as the running loop on top of pytest-qt's application, and :func:`run` drives a coroutine
by processing Qt events until it is done (exactly as the real app's loop would).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pytestqt")
from PySide6.QtGui import QTextCursor  # noqa: E402  (PySide6 before qasync, so qasync binds to it)

qasync = pytest.importorskip("qasync")
from tiny import save_tiny_model  # noqa: E402

TIMEOUT = 30_000


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_tiny_model(root / "target", seed=0),
        "same": save_tiny_model(root / "same", seed=0),  # the target's twin: every draft token is accepted
        "other": save_tiny_model(root / "other", seed=1),  # an unrelated draft: rejections
        "alien": save_tiny_model(root / "alien", seed=0, shuffle=3),  # another vocabulary mapping
    }


def run(qtbot, coro, timeout=TIMEOUT):
    task = asyncio.ensure_future(coro)
    qtbot.waitUntil(task.done, timeout=timeout)
    return task.result()


def make_window(qtbot, history=None):
    from specplay.app.settings import AppSettings
    from specplay.app.window import MainWindow

    w = MainWindow(settings=AppSettings(), history=history)
    qtbot.addWidget(w)
    w.resize(1400, 900)
    return w


@pytest.fixture()
def window(qtbot, aloop, model_dirs):
    w = make_window(qtbot)
    loaded = run(qtbot, w.load_models(str(model_dirs["target"]), str(model_dirs["same"]), "cpu", "float32"))
    assert loaded is not None and loaded.draft is not None
    w.prompt_panel.editor.setPlainText("ab cd ab cd ab")
    w.prompt_panel.chat_template.setChecked(False)
    w.prompt_panel.max_new_tokens.setValue(16)
    # The views are tested on drafting steps: tiny models' steps take microseconds, where the
    # stand-down gate's timings are noise (it is tested in test_standdown.py and test_engine.py).
    w.prompt_panel.stand_down.setChecked(False)
    yield w
    w.close()


def token_format(view, index):
    start, end = view._spans[index][:2]
    cursor = QTextCursor(view.document())
    cursor.setPosition(start + 1)  # the format of the character after the cursor's position - 1
    return cursor.charFormat(), view.document().toPlainText()[start:end]
