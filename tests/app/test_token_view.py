"""The token view's colours and the X-ray a hovered token shows."""

from __future__ import annotations

from app_window import token_format
from PySide6.QtCore import QPoint
from specplay.core.decoding.types import Fate, Rule, StepEvent, StepTiming, TokenEvent


def _step(tokens, step=3, tree=None, internals=None):
    return StepEvent(step=step, tokens=tokens, committed=[t.token_id for t in tokens if t.fate is not Fate.REJECTED],
                     text="".join(t.text for t in tokens if t.fate is not Fate.REJECTED),
                     num_drafted=sum(t.depth > 0 for t in tokens),
                     num_accepted=sum(t.fate is Fate.ACCEPTED for t in tokens), timing=StepTiming(0.01, 0.02, 0.001),
                     elapsed_s=0.5, total_new_tokens=3, tree=tree or {}, internals=internals or {})


KNOWN = [
    TokenEvent(11, "alpha", Fate.ACCEPTED, depth=1, node=0, p=0.8125, q=0.5, u=0.25, accept_prob=1.0,
               rule=Rule.SAMPLED),
    TokenEvent(12, "beta", Fate.REJECTED, depth=2, node=1, p=0.125, q=0.5, u=0.75, accept_prob=0.25,
               rule=Rule.SAMPLED),
    TokenEvent(13, "gamma", Fate.RESAMPLED, depth=0, node=-1, p=0.375),
    TokenEvent(14, "delta", Fate.BONUS, depth=0, node=-1, p=0.9),
    TokenEvent(15, "eps", Fate.TARGET, depth=0, node=-1, p=0.6),
]


def test_token_view_colours_each_fate(qtbot):
    from specplay.app.palette import FATE_STYLES
    from specplay.app.tokenview import TokenView

    view = TokenView()
    qtbot.addWidget(view)
    view.set_rejected_inline(True)
    view.append_step(_step(KNOWN))
    assert view.document().toPlainText() == "alphabetagammadeltaeps"
    for i, tok in enumerate(KNOWN):
        fmt, text = token_format(view, i)
        style = FATE_STYLES[tok.fate]
        assert text == tok.text
        assert fmt.foreground().color().name() == style.text
        assert fmt.fontStrikeOut() == (tok.fate is Fate.REJECTED)
        assert fmt.fontUnderline() == (tok.fate is Fate.RESAMPLED)
        assert fmt.fontOverline() == (tok.fate is Fate.BONUS)
        if tok.fate is not Fate.TARGET:
            assert fmt.background().color().name() in {style.background(s).name() for s in (0, 1)}
    # distinct colours for distinct fates
    assert len({s.colour for s in FATE_STYLES.values()}) == len(FATE_STYLES)
    view.set_rejected_inline(False)
    assert view.document().toPlainText() == "alpha✕gammadeltaeps"
    assert view.markers == {1: [KNOWN[1]]}
    assert "1 draft token rejected here" in view._tooltip(1) and "<code>beta</code>" in view._tooltip(1)


def test_hovering_a_token_shows_its_xray(qtbot):
    from specplay.app.tokenview import TokenView
    from specplay.app.xray import XRayPanel

    view, xray = TokenView(), XRayPanel()
    qtbot.addWidget(view)
    qtbot.addWidget(xray)
    view.sig_token_hovered.connect(xray.show_token)
    view.resize(500, 200)
    view.show()
    qtbot.waitExposed(view)
    step = _step(KNOWN, step=7)
    view.append_step(step)
    for i, tok in enumerate(KNOWN[:2]):
        rect = view.token_rect(i)
        qtbot.mouseMove(view.viewport(), rect.center())
        qtbot.waitUntil(lambda tok=tok: xray.token is tok, timeout=2000)
        v = {k: lab.text() for k, lab in xray.values.items()}
        assert v["p"] == f"{tok.p:.4f}" and v["q"] == f"{tok.q:.4f}" and v["u"] == f"{tok.u:.4f}"
        assert v["accept"] == f"{tok.accept_prob:.4f}"
        assert v["step"].startswith("7")
        assert f"draft position {tok.depth}" in v["depth"]
        assert tok.fate.value in v["fate"]
        assert v["rule"] == "min(1, p(x) / q(x))"
    assert xray.explanation.text() == "u = 0.7500 ≥ acceptance probability 0.2500: rejected."
    # nowhere near a token: no hit
    assert view.span_at(QPoint(490, 190)) is None


def test_xray_shows_the_rule_the_verifier_recorded():
    from specplay.app.xray import accept_rule, explain

    # A deterministic candidate that still carries the draft's own probability q (EAGLE, Medusa at
    # temperature > 0): the rule is p(x), not min(1, p/q).
    det = TokenEvent(5, "x", Fate.REJECTED, depth=1, node=0, p=0.2, q=0.7, u=0.9, accept_prob=0.2, rule=Rule.ONE_HOT)
    greedy = TokenEvent(5, "x", Fate.ACCEPTED, depth=1, node=0, p=0.7, q=0.6, u=None, accept_prob=1.0,
                        rule=Rule.GREEDY)
    typical = TokenEvent(5, "x", Fate.ACCEPTED, depth=1, node=0, p=0.4, u=None, accept_prob=1.0, rule=Rule.TYPICAL)
    unreached = TokenEvent(5, "x", Fate.REJECTED, depth=3, node=2)
    assert accept_rule(det).startswith("p(x)") and "0.9000 ≥" in explain(det)
    assert "greedy" in accept_rule(greedy) and "greedy choice" in explain(greedy)
    assert "LOSSY" in accept_rule(typical) and "typical-acceptance bar: accepted" in explain(typical)
    assert accept_rule(unreached) == "" and "Never checked" in explain(unreached)
