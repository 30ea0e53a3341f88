"""Start the desktop app: a QApplication driven by qasync, and the main window."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys


def run_app(argv: list[str]) -> int:
    os.environ.setdefault("QT_API", "pyside6")
    from specplay.app import preload
    from specplay.app.settings import AppSettings

    settings = AppSettings.load()
    if settings.target:  # loaded beside the window's imports and construction, taken over by its first load
        keys = [("target", settings.target, settings.device, settings.dtype, "auto")]
        if settings.draft:
            keys.append(("draft", settings.draft, settings.device, settings.dtype, settings.draft_engine))
        for key in keys:
            preload.start(key, functools.partial(_load, key))
    from PySide6.QtWidgets import QApplication  # noqa: I001  (PySide6 before qasync)
    import qasync

    from specplay.app.window import MainWindow

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app = QApplication.instance() or QApplication([sys.argv[0], *argv])
    app.setApplicationName("SpecPlay")
    app.setOrganizationName("SpecPlay")
    app.setApplicationDisplayName("SpecPlay")
    app.setDesktopFileName("specplay")  # matches packaging/specplay.desktop (Wayland uses it for the icon)
    from PySide6.QtGui import QIcon

    from specplay.core.paths import assets_dir

    icons = assets_dir() / "icons"
    icon = QIcon()
    for png in sorted(icons.glob("specplay-*.png")):
        icon.addFile(str(png))
    app.setWindowIcon(icon)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    with loop:
        window = MainWindow(settings)
        closed = window.closed_future()
        window.show()
        loop.call_soon(window.start)  # load history and models once the loop runs
        return loop.run_until_complete(closed)


def _load(key: tuple, progress, should_cancel):
    """The model a preload ``key`` names (role, spec, device, dtype, backend: the worker's cache key)."""
    from specplay.core.models import load_model

    role, spec, device, dtype, backend = key
    return load_model(spec, device, dtype, backend=backend, role=role, progress=progress, should_cancel=should_cancel)
