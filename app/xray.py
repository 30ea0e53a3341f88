"""The verification X-ray: a token's p, q, u, acceptance probability and why it met its fate."""

from __future__ import annotations

import html

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QFormLayout, QFrame, QLabel, QSizePolicy, QVBoxLayout, QWidget

from specplay.app.palette import FATE_STYLES, tint
from specplay.core.decoding.types import Fate, Rule, StepEvent, TokenEvent


def fmt_prob(x: float | None) -> str:
    if x is None:
        return "–"
    if x != 0 and abs(x) < 1e-3:
        return f"{x:.2e}"
    return f"{x:.4f}"


def visible(text: str) -> str:
    """A token's text with whitespace made visible (for labels, never for the output)."""
    if text == "":
        return "∅"
    return text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")


#: How each rule the verifier records decides a draft token, for the X-ray.
RULE_TEXT = {
    Rule.GREEDY: "greedy: accepted iff it is the target's argmax",
    Rule.SAMPLED: "min(1, p(x) / q(x))",
    Rule.ONE_HOT: "p(x)  (deterministic draft, one-hot q)",
    Rule.TYPICAL: "typical acceptance (LOSSY): p(x) > min(threshold, α·exp(−H(p)))",
}


def accept_rule(token: TokenEvent) -> str:
    """The acceptance rule the verifier applied to this token ("" where it applied none)."""
    return "" if token.rule is None else RULE_TEXT[token.rule]


def explain(token: TokenEvent) -> str:
    """One sentence on why the token met its fate, in terms of the numbers shown."""
    f = token.fate
    if f is Fate.TARGET:
        return "Plain step: nothing was drafted, so this is the target's own token."
    if f is Fate.BONUS:
        return "Every draft token of the step was accepted, so the target's pass yields this extra token for free."
    if f is Fate.RESAMPLED:
        return ("The draft token here was rejected; the target chose this token instead "
                "(at temperature > 0, sampled from the residual norm(max(0, p − q))).")
    if f is Fate.ACCEPTED:
        if token.rule is Rule.GREEDY:
            return "The target's greedy choice at this position equals the draft token: accepted."
        if token.rule is Rule.TYPICAL:
            return f"p(x) = {fmt_prob(token.p)} clears the typical-acceptance bar: accepted (lossy)."
        return f"u = {fmt_prob(token.u)} < acceptance probability {fmt_prob(token.accept_prob)}: accepted."
    # rejected
    if token.rule is None:
        return "Never checked: an earlier draft token of this step was rejected."
    if token.rule is Rule.GREEDY:
        return "Not the target's greedy choice at this position: rejected."
    if token.rule is Rule.TYPICAL:
        return f"p(x) = {fmt_prob(token.p)} is below the typical-acceptance bar: rejected."
    return f"u = {fmt_prob(token.u)} ≥ acceptance probability {fmt_prob(token.accept_prob)}: rejected."


def depth_text(token: TokenEvent) -> str:
    if token.depth == 0:
        return "target's own token"
    return f"draft position {token.depth}" + (f" (tree node {token.node})" if token.node >= 0 else "")


def tooltip_html(token: TokenEvent, step: StepEvent | None) -> str:
    style = FATE_STYLES[token.fate]
    rows = [("token", f"{html.escape(visible(token.text))}  <span style='color:#777'>#{token.token_id}</span>"),
            ("fate", f"<b style='color:{style.colour}'>{style.label}</b>"),
            ("step", str(step.step) if step is not None else "–"),
            ("depth", depth_text(token)),
            ("offered by", html.escape(token.source or "–")),
            ("p (target)", fmt_prob(token.p)), ("q (draft)", fmt_prob(token.q)), ("u (draw)", fmt_prob(token.u)),
            ("accept prob", fmt_prob(token.accept_prob))]
    body = "".join(f"<tr><td style='color:#555;padding-right:8px'>{k}</td><td>{v}</td></tr>" for k, v in rows)
    why = explain(token)
    if step is not None and step.stood_down:
        why += f" This step was plain: {step.stood_down}."
    return f"<table>{body}</table><p style='max-width:320px'>{html.escape(why)}</p>"


class AcceptBar(QWidget):
    """0..1 scale with the acceptance probability filled and the draw u marked.

    u < acceptance probability means accepted: the marker falls inside the green part.
    """

    def __init__(self):
        super().__init__()
        self.accept: float | None = None
        self.u: float | None = None
        self.setMinimumHeight(30)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_values(self, accept: float | None, u: float | None) -> None:
        self.accept, self.u = accept, u
        self.update()

    def paintEvent(self, event):  # noqa: N802 (Qt name)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(4, 6, self.width() - 8, 12)
        p.setPen(QPen(QColor("#999999"), 1))
        # the reject zone is tinted only when there is an acceptance probability to compare with
        p.setBrush(tint(FATE_STYLES[Fate.REJECTED].colour, 0.25) if self.accept is not None else QColor("#f4f4f4"))
        p.drawRect(r)
        if self.accept is not None:
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(tint(FATE_STYLES[Fate.ACCEPTED].colour, 0.75))
            p.drawRect(QRectF(r.left() + 0.5, r.top() + 0.5, (r.width() - 1) * max(0.0, min(1.0, self.accept)),
                              r.height() - 1))
        small = QFont(self.font())
        small.setPointSizeF(max(6.0, small.pointSizeF() * 0.8))
        p.setFont(small)
        p.setPen(QColor("#555555"))
        p.drawText(QRectF(r.left(), r.bottom() + 1, 30, 12), Qt.AlignmentFlag.AlignLeft, "0")
        p.drawText(QRectF(r.right() - 30, r.bottom() + 1, 30, 12), Qt.AlignmentFlag.AlignRight, "1")
        if self.u is not None:
            x = r.left() + r.width() * max(0.0, min(1.0, self.u))
            p.setPen(QPen(QColor("#111111"), 2))
            p.drawLine(int(x), int(r.top() - 4), int(x), int(r.bottom() + 4))
            p.drawText(QRectF(x - 20, r.bottom() + 1, 40, 12), Qt.AlignmentFlag.AlignHCenter, "u")
        p.end()


class XRayPanel(QWidget):
    """Shows the numbers behind one token (the one under the mouse, or the last clicked)."""

    FIELDS = ("token", "fate", "step", "depth", "p", "q", "u", "accept", "rule")
    LABELS = {"token": "Token", "fate": "Fate", "step": "Step", "depth": "Position", "p": "p (target)",
              "q": "q (draft)", "u": "u (random draw)", "accept": "Accept probability", "rule": "Rule"}
    TIPS = {"p": "The target's probability of this token at this position (after temperature and top-p).",
            "q": "The draft's probability of this token (the draft model's, or 1 for copied n-grams).",
            "u": "The uniform random number drawn by the verifier (none at temperature 0).",
            "accept": "The probability of accepting this draft token: min(1, p/q), or p for deterministic drafts."}

    def __init__(self):
        super().__init__()
        self.token: TokenEvent | None = None
        self.step: StepEvent | None = None
        self.values: dict[str, QLabel] = {}
        form = QFormLayout()
        form.setLabelAlignment(Qt.AlignmentFlag.AlignRight)
        mono = QFont("monospace")
        mono.setStyleHint(QFont.StyleHint.Monospace)
        for key in self.FIELDS:
            value = QLabel("–")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            value.setWordWrap(key in ("fate", "depth", "rule", "step", "token"))
            value.setMinimumWidth(60)
            if key in ("p", "q", "u", "accept", "token"):
                value.setFont(mono)
            label = QLabel(self.LABELS[key])
            label.setToolTip(self.TIPS.get(key, ""))
            value.setToolTip(self.TIPS.get(key, ""))
            form.addRow(label, value)
            self.values[key] = value
        self.bar = AcceptBar()
        self.bar.setToolTip("Green: the acceptance probability. The draw u lands in it → accepted.")
        self.explanation = QLabel("Hover a token in the output to see how the verifier decided it.")
        self.explanation.setWordWrap(True)
        self.explanation.setFrameShape(QFrame.Shape.StyledPanel)
        self.explanation.setStyleSheet("QLabel { padding: 6px; background: #fafafa; }")
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.bar)
        layout.addWidget(self.explanation)
        layout.addStretch(1)

    def show_token(self, token: TokenEvent | None, step: StepEvent | None) -> None:
        self.token, self.step = token, step
        if token is None:
            for v in self.values.values():
                v.setText("–")
            self.bar.set_values(None, None)
            self.explanation.setText("Hover a token in the output to see how the verifier decided it.")
            return
        style = FATE_STYLES[token.fate]
        self.values["token"].setText(f"{visible(token.text)}   (id {token.token_id})")
        self.values["fate"].setText(f"<b style='color:{style.colour}'>{style.label}</b> — {style.description}")
        self.values["step"].setText("–" if step is None else f"{step.step}  (drafted {step.num_drafted}, "
                                                              f"accepted {step.num_accepted})")
        self.values["depth"].setText(depth_text(token))
        self.values["p"].setText(fmt_prob(token.p))
        self.values["q"].setText(fmt_prob(token.q))
        self.values["u"].setText(fmt_prob(token.u))
        self.values["accept"].setText(fmt_prob(token.accept_prob))
        self.values["rule"].setText(accept_rule(token) or "–")
        self.bar.set_values(token.accept_prob if token.depth > 0 else None, token.u)
        self.explanation.setText(explain(token))
