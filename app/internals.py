"""Method internals for one step: the draft tree with its accepted path, lookahead's window and
pool, and whatever else a method reports. Everything is read defensively: a missing or
malformed key draws nothing rather than failing.
"""

from __future__ import annotations

import html
from typing import Any, Callable

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import (QCheckBox, QFrame, QHBoxLayout, QLabel, QScrollArea, QSizePolicy, QSpinBox, QVBoxLayout,
                               QWidget)

from specplay.app.palette import FATE_STYLES, tint
from specplay.app.xray import visible
from specplay.core.decoding.types import Fate, StepEvent

TokenText = Callable[[int], str]


def _fate(value: Any) -> Fate | None:
    try:
        return Fate(value)
    except ValueError:
        return None


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, (list, tuple)):
        return None
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        return None


def parse_tree(tree: Any) -> dict | None:
    """A well-formed tree dict (tokens, parents, fates, accepted) or None."""
    if not isinstance(tree, dict):
        return None
    tokens, parents = _int_list(tree.get("tokens")), _int_list(tree.get("parents"))
    if not tokens or parents is None or len(parents) != len(tokens):
        return None
    if any(not (-1 <= p < i) for i, p in enumerate(parents)):
        return None
    fates = tree.get("fates") if isinstance(tree.get("fates"), (list, tuple)) else []
    fates = [(_fate(fates[i]) if i < len(fates) else None) for i in range(len(tokens))]
    accepted = [a for a in (_int_list(tree.get("accepted")) or []) if 0 <= a < len(tokens)]
    return {"tokens": tokens, "parents": parents, "fates": fates, "accepted": accepted}


class DraftTreeView(QWidget):
    """The step's draft as a left-to-right tree: root, draft nodes by depth, the target's own token.

    Accepted nodes and the edges of the accepted path are drawn strong; rejected branches
    faint. The target's token after the accepted path (bonus or resampled) ends the path.
    """

    COL_W = 92
    ROW_H = 26
    NODE_H = 20

    def __init__(self, token_text: TokenText | None = None):
        super().__init__()
        self.token_text = token_text or (lambda t: f"#{t}")
        self.tree: dict | None = None
        self.next_token: tuple[str, Fate] | None = None
        self.layout_: list[tuple[float, float]] = []
        self.next_pos: tuple[float, float] | None = None
        self.root_row = 0.0
        self.texts: list[str] = []
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(40)

    def set_step(self, step: StepEvent | None, texts: dict[int, str] | None = None) -> None:
        """Show ``step``'s tree; ``texts`` maps node index to token text where the events know it."""
        self.tree = parse_tree(step.tree) if step is not None else None
        self.next_token = None
        if step is not None:
            own = [t for t in step.tokens if t.node == -1 and t.fate is not Fate.REJECTED]
            if own:
                self.next_token = (own[-1].text, own[-1].fate)
        self._layout(texts or {})
        self.update()

    def _layout(self, texts: dict[int, str]) -> None:
        self.layout_, self.texts, self.next_pos = [], [], None
        if self.tree is None:
            self.setFixedHeight(40)
            self.setMinimumWidth(0)
            self._sync_scroll_height()
            return
        tokens, parents = self.tree["tokens"], self.tree["parents"]
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        depth = [0] * len(tokens)
        rows = [0.0] * len(tokens)
        next_row = [0]

        def place(node: int) -> float:  # depth-first: leaves take successive rows, parents centre on kids
            children = kids.get(node, [])
            if not children:
                r = float(next_row[0])
                next_row[0] += 1
                return r
            ys = []
            for c in children:
                depth[c] = (depth[node] + 1) if node >= 0 else 1
                rows[c] = place(c)
                ys.append(rows[c])
            return (min(ys) + max(ys)) / 2

        root_row = place(-1)
        self.root_row = root_row
        self.layout_ = [(float(depth[i]), rows[i]) for i in range(len(tokens))]
        for i, t in enumerate(tokens):
            text = texts.get(i)
            if text is None:
                try:
                    text = self.token_text(t)
                except Exception:  # decoding is only for display
                    text = f"#{t}"
            self.texts.append(visible(text))
        self.next_pos = None
        rows_used = max(1, next_row[0])
        if self.next_token is not None:
            acc = self.tree["accepted"]
            col = (self.layout_[acc[-1]][0] + 1) if acc else 1.0
            row = self.layout_[acc[-1]][1] if acc else root_row
            if any(abs(c - col) < 0.01 and abs(r - row) < 0.01 for c, r in self.layout_):
                row = float(rows_used)
                rows_used += 1
            self.next_pos = (col, row)
        self.setFixedHeight(int(rows_used * self.ROW_H + 16))
        self._sync_scroll_height()
        max_depth = max([d for d, _ in self.layout_] + [self.next_pos[0] if self.next_pos else 0])
        self.setMinimumWidth(int((max_depth + 2) * self.COL_W + 20))

    def _sync_scroll_height(self) -> None:
        scroll = self.parent().parent() if self.parent() is not None else None
        if isinstance(scroll, QScrollArea):  # room for the tree and a horizontal scroll bar
            scroll.setFixedHeight(self.height() + scroll.horizontalScrollBar().sizeHint().height() + 2)

    def _node_rect(self, col: float, row: float) -> QRectF:
        return QRectF(8 + col * self.COL_W, 8 + row * self.ROW_H, self.COL_W - 22, self.NODE_H)

    def paintEvent(self, event):  # noqa: N802 (Qt name)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        if self.tree is None:
            p.setPen(QColor("#777777"))
            p.drawText(self.rect().adjusted(8, 0, 0, 0), Qt.AlignmentFlag.AlignVCenter,
                       "Nothing was drafted in this step.")
            p.end()
            return
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.9))
        p.setFont(font)
        fm = QFontMetrics(font)
        parents, fates, accepted = self.tree["parents"], self.tree["fates"], set(self.tree["accepted"])
        root = self._node_rect(0, self.root_row)
        root.setWidth(self.COL_W * 0.45)

        def anchor_out(r: QRectF):
            return r.right(), r.center().y()

        def anchor_in(r: QRectF):
            return r.left(), r.center().y()

        rects = [self._node_rect(d, r) for d, r in self.layout_]
        for i, par in enumerate(parents):
            src = root if par < 0 else rects[par]
            on_path = i in accepted
            pen = QPen(QColor(FATE_STYLES[Fate.ACCEPTED].colour) if on_path else QColor("#bbbbbb"),
                       2.4 if on_path else 1.0)
            p.setPen(pen)
            (x1, y1), (x2, y2) = anchor_out(src), anchor_in(rects[i])
            p.drawLine(int(x1), int(y1), int(x2), int(y2))
        # root
        p.setPen(QPen(QColor("#555555"), 1))
        p.setBrush(QColor("#eeeeee"))
        p.drawRoundedRect(root, 4, 4)
        p.drawText(root, Qt.AlignmentFlag.AlignCenter, "root")
        for i, r in enumerate(rects):
            fate = fates[i] or Fate.REJECTED
            style = FATE_STYLES[fate]
            strong = i in accepted
            p.setPen(QPen(QColor(style.colour), 1.6 if strong else 1.0))
            p.setBrush(tint(style.colour, 0.35 if strong else 0.10))
            p.drawRoundedRect(r, 4, 4)
            p.setPen(QColor(style.text))
            f2 = QFont(font)
            f2.setStrikeOut(fate is Fate.REJECTED)
            p.setFont(f2)
            p.drawText(r.adjusted(3, 0, -3, 0), Qt.AlignmentFlag.AlignCenter,
                       fm.elidedText(self.texts[i], Qt.TextElideMode.ElideRight, int(r.width() - 6)))
            p.setFont(font)
        # the target's own token after the accepted path (below the tree if a rejected node sits there)
        if self.next_token is not None and self.next_pos is not None:
            last = self.tree["accepted"][-1] if self.tree["accepted"] else -1
            src = root if last < 0 else rects[last]
            r = self._node_rect(*self.next_pos)
            text, fate = self.next_token
            style = FATE_STYLES[fate]
            p.setPen(QPen(QColor(style.colour), 1.6, Qt.PenStyle.DashLine))
            (x1, y1), (x2, y2) = anchor_out(src), anchor_in(r)
            p.drawLine(int(x1), int(y1), int(x2), int(y2))
            p.setPen(QPen(QColor(style.colour), 1.6))
            p.setBrush(tint(style.colour, 0.45))
            p.drawRoundedRect(r, 4, 4)
            p.setPen(QColor(style.text))
            p.drawText(r.adjusted(3, 0, -3, 0), Qt.AlignmentFlag.AlignCenter,
                       fm.elidedText(visible(text), Qt.TextElideMode.ElideRight, int(r.width() - 6)))
        p.end()


class TokenGrid(QWidget):
    """Rows of token cells (lookahead's Jacobi window, or its candidate n-grams).

    ``highlight``: a row drawn as the winner.
    """

    CELL_W = 64
    CELL_H = 20

    def __init__(self, token_text: TokenText | None = None):
        super().__init__()
        self.token_text = token_text or (lambda t: f"#{t}")
        self.rows: list[list[str]] = []
        self.highlight: int | None = None
        self.row_labels: list[str] = []
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(0)

    def set_rows(self, rows: Any, highlight: Any = None, label: str = "") -> None:
        self.rows = []
        if isinstance(rows, (list, tuple)):
            for row in rows:
                ids = _int_list(row)
                if ids is None:
                    continue
                self.rows.append([self._text(t) for t in ids])
        self.highlight = highlight if isinstance(highlight, int) and 0 <= highlight < len(self.rows) else None
        self.row_labels = [f"{label}{i}" for i in range(len(self.rows))]
        width = max((len(r) for r in self.rows), default=0)
        self.setFixedHeight(len(self.rows) * (self.CELL_H + 2) + (4 if self.rows else 0))
        self.setMinimumWidth(40 + width * self.CELL_W)
        self.update()

    def _text(self, token: int) -> str:
        try:
            return visible(self.token_text(token))
        except Exception:
            return f"#{token}"

    def paintEvent(self, event):  # noqa: N802 (Qt name)
        if not self.rows:
            return
        p = QPainter(self)
        font = QFont(self.font())
        font.setPointSizeF(max(7.0, font.pointSizeF() * 0.85))
        p.setFont(font)
        fm = QFontMetrics(font)
        for r, row in enumerate(self.rows):
            y = 2 + r * (self.CELL_H + 2)
            p.setPen(QColor("#777777"))
            p.drawText(QRectF(0, y, 36, self.CELL_H), Qt.AlignmentFlag.AlignVCenter | Qt.AlignmentFlag.AlignRight,
                       self.row_labels[r])
            won = r == self.highlight
            for c, text in enumerate(row):
                cell = QRectF(40 + c * self.CELL_W, y, self.CELL_W - 3, self.CELL_H)
                colour = FATE_STYLES[Fate.ACCEPTED].colour if won else "#999999"
                p.setPen(QPen(QColor(colour), 1.4 if won else 0.8))
                p.setBrush(tint(colour, 0.3 if won else 0.08))
                p.drawRect(cell)
                p.setPen(QColor("#222222"))
                p.drawText(cell.adjusted(2, 0, -2, 0), Qt.AlignmentFlag.AlignCenter,
                           fm.elidedText(text, Qt.TextElideMode.ElideRight, int(cell.width() - 4)))
        p.end()


def describe_internals(internals: Any, drawn: set[str]) -> str:
    """Generic HTML for what a method shows of a step (its ``internals``), but for the keys in ``drawn``."""
    if not isinstance(internals, dict) or not internals:
        return ""
    rows = []
    for key, value in internals.items():
        if key in drawn:
            continue
        if key == "match":
            if value is None:
                rows.append(("n-gram match", "none: nothing proposed this step"))
                continue
            if isinstance(value, dict):
                parts = []
                if "ngram" in value:
                    parts.append(f"last {value['ngram']} token(s) seen before")
                if "at" in value:
                    parts.append(f"copying from position {value['at']}")
                if "proposed" in value:
                    parts.append(f"{value['proposed']} proposed")
                rows.append(("n-gram match", ", ".join(parts) or html.escape(str(value))))
                continue
        text = repr(value)
        if len(text) > 160:
            text = text[:157] + "…"
        rows.append((key.replace("_", " "), html.escape(text)))
    return "<table>" + "".join(f"<tr><td style='color:#555;padding-right:10px'>{html.escape(k)}</td><td>{v}</td></tr>"
                               for k, v in rows) + "</table>"


class InternalsPanel(QWidget):
    """Step picker, step summary, draft tree, lookahead window/pool and other internals."""

    def __init__(self, token_text: TokenText | None = None):
        super().__init__()
        self.steps: list[StepEvent] = []
        self.token_text = token_text or (lambda t: f"#{t}")
        self.step_box = QSpinBox()
        self.step_box.setRange(0, 0)
        self.step_box.setPrefix("step ")
        self.step_box.valueChanged.connect(self._show_selected)
        self.follow = QCheckBox("follow the run")
        self.follow.setChecked(True)
        self.follow.toggled.connect(lambda on: on and self._show_last())
        top = QHBoxLayout()
        top.addWidget(self.step_box)
        top.addWidget(self.follow)
        top.addStretch(1)
        self.summary = QLabel("No run yet.")
        self.summary.setWordWrap(True)
        self.tree_view = DraftTreeView(self._text)
        self.window_title = QLabel("")
        self.window_grid = TokenGrid(self._text)
        self.candidates_title = QLabel("")
        self.candidates_grid = TokenGrid(self._text)
        self.details = QLabel("")
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.TextFormat.RichText)
        body = QWidget()
        v = QVBoxLayout(body)
        v.setContentsMargins(4, 4, 4, 4)
        v.addWidget(self.summary)
        tree_scroll = QScrollArea()  # wide trees scroll sideways; the text around them still wraps
        tree_scroll.setWidget(self.tree_view)
        tree_scroll.setWidgetResizable(True)
        tree_scroll.setFrameShape(QFrame.Shape.NoFrame)
        tree_scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.tree_scroll = tree_scroll
        v.addWidget(tree_scroll)
        v.addWidget(self.details)
        v.addWidget(self.window_title)
        v.addWidget(self.window_grid)
        v.addWidget(self.candidates_title)
        v.addWidget(self.candidates_grid)
        v.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.addLayout(top)
        layout.addWidget(scroll, 1)

    def _text(self, token: int) -> str:
        return self.token_text(token)

    def clear(self) -> None:
        self.steps = []
        self.step_box.setRange(0, 0)
        self.show_step(None)

    def set_steps(self, steps: list[StepEvent]) -> None:
        self.steps = list(steps)
        self.step_box.setRange(0, max(0, len(self.steps) - 1))
        self._show_last() if self.follow.isChecked() else self._show_selected()

    def add_step(self, step: StepEvent) -> None:
        self.steps.append(step)
        self.step_box.blockSignals(True)
        self.step_box.setRange(0, len(self.steps) - 1)
        self.step_box.blockSignals(False)
        if self.follow.isChecked():
            self._show_last()

    def select_step(self, step: StepEvent) -> None:
        """Show a given step (a clicked token's); stops following the run."""
        self.follow.setChecked(False)
        idx = next((i for i, s in enumerate(self.steps) if s is step), None)
        if idx is None:
            idx = next((i for i, s in enumerate(self.steps) if s.step == step.step), None)
        if idx is not None:
            self.step_box.setValue(idx)
            self._show_selected()

    def _show_last(self) -> None:
        if self.steps:
            self.step_box.blockSignals(True)
            self.step_box.setValue(len(self.steps) - 1)
            self.step_box.blockSignals(False)
            self.show_step(self.steps[-1])

    def _show_selected(self) -> None:
        i = self.step_box.value()
        self.show_step(self.steps[i] if 0 <= i < len(self.steps) else None)

    def show_step(self, step: StepEvent | None) -> None:
        if step is None:
            self.summary.setText("No run yet.")
            self.tree_view.set_step(None)
            self.details.setText("")
            self._show_grids({})
            return
        t = step.timing
        self.summary.setText(
            f"<b>Step {step.step}</b>: drafted {step.num_drafted}, accepted {step.num_accepted}, "
            f"added {len(step.committed)} token(s) · draft {t.draft_s * 1e3:.1f} ms, verify {t.verify_s * 1e3:.1f} ms, "
            f"other {t.other_s * 1e3:.1f} ms")
        texts = {tok.node: tok.text for tok in step.tokens if tok.node >= 0}
        self.tree_view.set_step(step, texts)
        internals = step.internals if isinstance(step.internals, dict) else {}
        self.details.setText(describe_internals(internals, self._show_grids(internals)))

    def _show_grids(self, internals: dict) -> set[str]:
        """Draw lookahead's Jacobi window and pool candidates where a step shows them; return the keys drawn."""
        window = internals.get("window")
        pool = internals.get("pool_size")
        self.window_grid.set_rows(window, label="row ")
        title = []
        if self.window_grid.rows:
            title.append("<b>Jacobi window</b>")
        if isinstance(pool, int):
            title.append(f"n-gram pool: {pool} entries")
        self.window_title.setText(" · ".join(title))
        self.window_title.setVisible(bool(title))
        won = internals.get("won")
        self.candidates_grid.set_rows(internals.get("candidates"), won, label="#")
        if self.candidates_grid.rows:
            verdict = (f"candidate #{won} verified" if self.candidates_grid.highlight is not None
                       else "no candidate verified")
            self.candidates_title.setText(f"<b>Pool candidates</b> ({len(self.candidates_grid.rows)}) · {verdict}")
            self.candidates_title.setVisible(True)
        else:
            self.candidates_title.setVisible(False)
        # Well-formed values are this panel's to show (an empty candidate list: nothing to draw);
        # anything else falls through to the table of other keys.
        drawn = {"window"} if self.window_grid.rows else set()
        if isinstance(pool, int):
            drawn.add("pool_size")
        if isinstance(internals.get("candidates"), list):
            drawn |= {"candidates", "won"}
        return drawn
