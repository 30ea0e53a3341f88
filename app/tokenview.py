"""The live token view: generated text, every token coloured by its fate, with an X-ray on hover."""

from __future__ import annotations

import bisect
import html

from PySide6.QtCore import QPointF, QRect, Qt, Signal
from PySide6.QtGui import QColor, QFontDatabase, QTextCharFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import QHBoxLayout, QLabel, QTextEdit, QToolTip, QWidget

from specplay.app.palette import FATE_STYLES
from specplay.app.xray import tooltip_html
from specplay.core.decoding.types import Fate, StepEvent, TokenEvent


def display_text(token: TokenEvent) -> str:
    """What the view shows for a token: the real text, with line breaks marked on coloured tokens."""
    text = token.text
    if token.fate is Fate.REJECTED:
        # Rejected tokens never enter the output; show them on one line, whitespace visible.
        return (text.replace("\n", "↵").replace("\t", "⇥") or "∅")
    if token.fate is not Fate.TARGET and "\n" in text:
        return text.replace("\n", "↵\n")
    return text


REJECTED_INLINE_TIP = ("Show rejected draft tokens in full, struck through, where the verifier tried them "
                       "(otherwise a ✕ marks the spot: hover it to see them)")


def marker_text(rejected: list[TokenEvent]) -> str:
    """The mark left where rejected drafts were tried: a cross, with their count when more than one."""
    return "✕" if len(rejected) == 1 else f"✕{len(rejected)}"


class TokenView(QTextEdit):
    """Read-only text of a run, built step by step from :class:`~specplay.core.decoding.types.StepEvent` objects.

    The committed text reads as text, each token tinted by its fate. Draft tokens the verifier
    turned down leave a small raised mark (✕, with their count) where they were tried; hovering
    it lists them, clicking it opens the first in the X-ray. With ``rejected_inline`` they are
    shown in full instead, struck through. Neighbouring tokens alternate between two shades so
    token boundaries stay visible.

    Signals:
        sig_token_hovered(object, object): the ``TokenEvent`` under the mouse and its ``StepEvent``.
        sig_token_clicked(object, object): the same, for a click.
    """

    sig_token_hovered = Signal(object, object)
    sig_token_clicked = Signal(object, object)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setReadOnly(True)
        self.setUndoRedoEnabled(False)
        self.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.setLineWrapMode(QTextEdit.LineWrapMode.WidgetWidth)
        self.viewport().setMouseTracking(True)
        self.setPlaceholderText("Generated tokens appear here, coloured by their fate.")
        self.steps: list[StepEvent] = []
        self.rejected_inline = False
        self.markers: dict[int, list[TokenEvent]] = {}  # span index of a mark -> the rejected drafts it stands for
        self._starts: list[int] = []  # document position of each shown token (sorted)
        self._index: dict[tuple[int, int], int] = {}  # (step index, token index) -> span index
        self._spans: list[tuple[int, int, int, int]] = []  # (start, end, step index, token index)
        self._shade = 0
        self._formats: dict[object, QTextCharFormat] = {}  # (fate, shade) or "marker"
        self._hovered: tuple[int, int] | None = None
        self._pinned: tuple[int, int] | None = None

    # -- content -----------------------------------------------------------------------------------

    def clear_run(self) -> None:
        self.steps = []
        self._starts, self._spans, self._index = [], [], {}
        self.markers = {}
        self._shade = 0
        self._hovered = self._pinned = None
        self.setExtraSelections([])
        self.clear()

    def set_steps(self, steps: list[StepEvent]) -> None:
        """Show a whole run at once (a reopened run, or after toggling rejected tokens)."""
        self.setUpdatesEnabled(False)
        try:
            self.clear_run()
            for e in steps:
                self.append_step(e, follow=False)
        finally:
            self.setUpdatesEnabled(True)
        self.moveCursor(QTextCursor.MoveOperation.Start)

    def set_rejected_inline(self, inline: bool) -> None:
        if inline != self.rejected_inline:
            self.rejected_inline = inline
            steps = list(self.steps)
            bar = self.verticalScrollBar()
            frac = bar.value() / bar.maximum() if bar.maximum() else 1.0
            self.set_steps(steps)
            bar.setValue(round(frac * bar.maximum()))

    def append_step(self, event: StepEvent, follow: bool = True) -> None:
        bar = self.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        si = len(self.steps)
        self.steps.append(event)
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        tokens = event.tokens
        ti = 0
        while ti < len(tokens):
            tok = tokens[ti]
            if tok.fate is Fate.REJECTED and not self.rejected_inline:
                run_end = ti
                while run_end < len(tokens) and tokens[run_end].fate is Fate.REJECTED:
                    run_end += 1
                rejected = list(tokens[ti:run_end])
                self._add_span(cursor, marker_text(rejected), self._marker_format(), si, ti)
                self.markers[len(self._spans) - 1] = rejected
                ti = run_end
                continue
            text = display_text(tok)
            if text:  # empty: an incomplete UTF-8 character, whose text arrives with the next token
                self._add_span(cursor, text, self._format(tok.fate), si, ti)
            ti += 1
        if follow and at_end:
            bar.setValue(bar.maximum())

    def _add_span(self, cursor: QTextCursor, text: str, fmt: QTextCharFormat, si: int, ti: int) -> None:
        start = cursor.position()
        cursor.insertText(text, fmt)
        self._index[(si, ti)] = len(self._spans)
        self._starts.append(start)
        self._spans.append((start, cursor.position(), si, ti))

    def _marker_format(self) -> QTextCharFormat:
        fmt = self._formats.get("marker")
        if fmt is None:
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(FATE_STYLES[Fate.REJECTED].colour))
            fmt.setVerticalAlignment(QTextCharFormat.VerticalAlignment.AlignSuperScript)
            self._formats["marker"] = fmt
        return fmt

    def _format(self, fate: Fate) -> QTextCharFormat:
        self._shade ^= 1
        key = (fate, self._shade)
        fmt = self._formats.get(key)
        if fmt is None:
            style = FATE_STYLES[fate]
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(style.text))
            bg = style.background(self._shade)
            if bg is not None:
                fmt.setBackground(bg)
            fmt.setFontStrikeOut(style.strike)
            fmt.setFontUnderline(style.underline)
            fmt.setFontOverline(style.overline)
            self._formats[key] = fmt
        return fmt

    def committed_text(self) -> str:
        """The run's output text (rejected candidates left out, line marks removed)."""
        return "".join(e.text for e in self.steps)

    def shown_tokens(self) -> list[TokenEvent]:
        return [self.steps[si].tokens[ti] for _, _, si, ti in self._spans]

    # -- hit testing and the X-ray -----------------------------------------------------------------

    def span_at(self, viewport_pos) -> int | None:
        """Index into the shown tokens of the token under a viewport position, or None."""
        offset = QPointF(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        pos = self.document().documentLayout().hitTest(QPointF(viewport_pos) + offset,
                                                       Qt.HitTestAccuracy.ExactHit)
        if pos < 0:
            return None
        i = bisect.bisect_right(self._starts, pos) - 1
        if i < 0 or not (self._spans[i][0] <= pos < self._spans[i][1]):
            return None
        return i

    def token_rect(self, index: int) -> QRect:
        """Viewport rectangle of the first character of shown token ``index`` (for tests and tours)."""
        start = self._spans[index][0]
        cursor = QTextCursor(self.document())
        cursor.setPosition(start)
        left = self.cursorRect(cursor)
        cursor.setPosition(start + 1)
        right = self.cursorRect(cursor)
        width = max(2, right.left() - left.left()) if right.top() == left.top() else 6
        return QRect(left.left(), left.top(), width, left.height())

    def token(self, index: int) -> tuple[TokenEvent, StepEvent]:
        _, _, si, ti = self._spans[index]
        return self.steps[si].tokens[ti], self.steps[si]

    def mouseMoveEvent(self, event):  # noqa: N802 (Qt name)
        super().mouseMoveEvent(event)
        i = self.span_at(event.position().toPoint())
        key = None if i is None else self._spans[i][2:]
        if key != self._hovered:
            self._hovered = key
            self._highlight()
            if i is None:
                QToolTip.hideText()
            else:
                token, step = self.token(i)
                self.sig_token_hovered.emit(token, step)
                QToolTip.showText(event.globalPosition().toPoint(), self._tooltip(i), self.viewport())

    def _tooltip(self, i: int) -> str:
        token, step = self.token(i)
        rejected = self.markers.get(i)
        if not rejected:
            return tooltip_html(token, step)
        tried = ", ".join(f"<code>{html.escape(display_text(t))}</code>" for t in rejected[:12])
        more = f" and {len(rejected) - 12} more" if len(rejected) > 12 else ""
        head = (f"<b>{len(rejected)} draft token{'s' if len(rejected) > 1 else ''} rejected here:</b> {tried}{more}"
                "<br>(click for the first in the X-ray)<hr>")
        return head + tooltip_html(token, step)

    def mousePressEvent(self, event):  # noqa: N802 (Qt name)
        super().mousePressEvent(event)
        i = self.span_at(event.position().toPoint())
        if i is not None:
            self._pinned = self._spans[i][2:]
            self._highlight()
            self.sig_token_clicked.emit(*self.token(i))

    def leaveEvent(self, event):  # noqa: N802 (Qt name)
        super().leaveEvent(event)
        QToolTip.hideText()
        if self._hovered is not None:
            self._hovered = None
            self._highlight()

    def _highlight(self) -> None:
        selections = []
        for key, colour in ((self._pinned, "#222222"), (self._hovered, "#444444")):
            if key is None:
                continue
            i = self._index.get(key)
            if i is None:
                continue
            sel = QTextEdit.ExtraSelection()
            cursor = QTextCursor(self.document())
            cursor.setPosition(self._spans[i][0])
            cursor.setPosition(self._spans[i][1], QTextCursor.MoveMode.KeepAnchor)
            sel.cursor = cursor
            fmt = QTextCharFormat()
            fmt.setProperty(QTextFormat.Property.OutlinePen, QColor(colour))
            fmt.setFontUnderline(True)
            fmt.setUnderlineColor(QColor(colour))
            fmt.setUnderlineStyle(QTextCharFormat.UnderlineStyle.SingleUnderline)
            sel.format = fmt
            selections.append(sel)
        self.setExtraSelections(selections)


class FateLegend(QWidget):
    """Chips explaining the colours and marks, in the palette's order."""

    def __init__(self, parent=None):
        super().__init__(parent)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(10)
        for fate, style in FATE_STYLES.items():
            chip = _Chip(fate)
            chip.setToolTip(style.description)
            layout.addWidget(chip)
        layout.addStretch(1)


class _Chip(QLabel):
    def __init__(self, fate: Fate):
        style = FATE_STYLES[fate]
        super().__init__(style.label)
        self.fate = fate
        bg = style.background(1) if style.tint_alpha > 0 else None
        deco = ("line-through" if style.strike else "underline" if style.underline else
                "overline" if style.overline else "none")
        css = f"color:{style.text}; text-decoration:{deco}; padding:1px 6px; border-radius:3px;"
        css += f"background:{bg.name()};" if bg is not None else "background:#ffffff; border:1px solid #cccccc;"
        self.setStyleSheet(f"QLabel {{ {css} }}")
