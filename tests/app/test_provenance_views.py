"""What the views say of a token's proposer and of a stood-down step."""

import pytest

pytest.importorskip("PySide6")

from specplay.app.charts import Series  # noqa: E402
from specplay.app.xray import tooltip_html  # noqa: E402
from specplay.core.decoding.types import Fate, StepEvent, StepTiming, TokenEvent  # noqa: E402


def _step(tokens, stood_down=None, drafted=0):
    return StepEvent(step=3, tokens=tokens, committed=[t.token_id for t in tokens], text="", num_drafted=drafted,
                     num_accepted=0, timing=StepTiming(0.01, 0.05, 0.002), elapsed_s=1.0, total_new_tokens=9,
                     stood_down=stood_down)


def test_the_xray_names_the_proposer_and_why_a_step_was_plain():
    head = TokenEvent(token_id=7, text="x", fate=Fate.ACCEPTED, depth=2, node=1, source="Medusa head 2")
    assert "offered by" in tooltip_html(head, _step([head], drafted=3)) and "Medusa head 2" in tooltip_html(head, None)
    own = TokenEvent(token_id=8, text="y", fate=Fate.TARGET, depth=0, node=-1, source="target")
    why = "drafting stood down: 10.0 tokens/s drafting against 15.0 plain; 7 plain steps before the next probe"
    html = tooltip_html(own, _step([own], stood_down=why))
    assert "This step was plain: drafting stood down" in html
    assert "stood down" not in tooltip_html(own, _step([own]))


def test_the_time_split_keeps_stood_down_steps_apart():
    s = Series()
    s.add(_step([TokenEvent(1, "a", Fate.ACCEPTED, 1, 0, source="draft model")], drafted=4))
    s.add(_step([TokenEvent(2, "b", Fate.TARGET, 0, -1, source="target")], stood_down="drafting stood down"))
    assert s.split[3] == pytest.approx(0.062) and s.split[1] == pytest.approx(0.05)
    assert s.stood == pytest.approx([0.01, 0.05, 0.002])
