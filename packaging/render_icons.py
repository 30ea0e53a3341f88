"""Render assets/icons/specplay.svg to PNGs at the usual icon sizes (assets/icons/specplay-N.png).

Run after editing the SVG:  QT_QPA_PLATFORM=offscreen python packaging/render_icons.py
The PNGs are committed, so neither a wheel build nor the app needs Qt's SVG module to show the icon.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)
ICONS = Path(__file__).resolve().parent.parent / "assets" / "icons"


def render(svg: Path = ICONS / "specplay.svg", out_dir: Path = ICONS, sizes: tuple[int, ...] = SIZES) -> list[Path]:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    app = QGuiApplication.instance() or QGuiApplication([sys.argv[0]])  # noqa: F841  (QPainter needs one)
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"cannot read {svg}")
    written = []
    for size in sizes:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
        renderer.render(painter)
        painter.end()
        path = out_dir / f"specplay-{size}.png"
        if not image.save(str(path), "PNG"):
            raise SystemExit(f"cannot write {path}")
        written.append(path)
    return written


if __name__ == "__main__":
    for p in render():
        print(p)
