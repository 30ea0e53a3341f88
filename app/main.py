"""Start the desktop app: a QApplication driven by qasync, and the main window."""

from __future__ import annotations

import os
import sys


def run_app(argv: list[str]) -> int:
    os.environ.setdefault("QT_API", "pyside6")
    from PySide6.QtWidgets import QApplication  # noqa: I001  (PySide6 before qasync)
    import qasync

    from app.window import MainWindow

    app = QApplication.instance() or QApplication([sys.argv[0], *argv])
    app.setApplicationName("SpecPlay")
    app.setOrganizationName("SpecPlay")
    window = MainWindow()
    window.show()
    window.start()
    loop = qasync.QEventLoop(app)
    with loop:
        return loop.run_until_complete(window.closed_future())
