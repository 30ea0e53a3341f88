"""The Live tab: the run's title and stats, an error banner, the token view and the fate legend."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QStyle, QToolButton, QVBoxLayout, QWidget

from specplay.app.tokenview import REJECTED_INLINE_TIP, FateLegend, TokenView


class LiveView(QWidget):
    """The central view of a single run: header, error banner, legend and the token view."""

    def __init__(self):
        super().__init__()
        self.title = QLabel("<b>No run yet</b>")
        self.stats = QLabel("")
        self.stats.setWordWrap(True)
        self.stats.setStyleSheet("QLabel { color: #444444; }")
        self.rejected_inline = QCheckBox("rejected drafts inline")
        self.rejected_inline.setChecked(False)
        self.rejected_inline.setToolTip(REJECTED_INLINE_TIP)
        self.banner = QLabel("")
        self.banner.setObjectName("error_banner")
        self.banner.setWordWrap(True)
        self.banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.banner.setStyleSheet("QLabel { background: #fde8e8; color: #8a0016; border: 1px solid #e5a5ad; "
                                  "border-radius: 3px; padding: 6px; }")
        close = QToolButton()
        close.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_TitleBarCloseButton))
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.clear_error)
        self.banner_box = QWidget()
        b = QHBoxLayout(self.banner_box)
        b.setContentsMargins(0, 0, 0, 0)
        b.addWidget(self.banner, 1)
        b.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.banner_box.setVisible(False)
        self.view = TokenView()
        self.legend = FateLegend()
        head = QHBoxLayout()
        head.addWidget(self.title)
        head.addStretch(1)
        head.addWidget(self.rejected_inline)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addLayout(head)
        layout.addWidget(self.stats)
        layout.addWidget(self.banner_box)
        layout.addWidget(self.view, 1)
        layout.addWidget(self.legend)
        self.rejected_inline.toggled.connect(self.view.set_rejected_inline)

    def show_error(self, message: str) -> None:
        self.banner.setText(message)
        self.banner_box.setVisible(True)

    def clear_error(self) -> None:
        self.banner.setText("")
        self.banner_box.setVisible(False)
