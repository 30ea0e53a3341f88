"""The Method internals view: trees and lookahead state drawn robustly."""

from __future__ import annotations

import pytest

pytest.importorskip("pytestqt")
from test_token_view import KNOWN, _step  # noqa: E402


def test_internals_draw_the_tree_and_lookahead_state_robustly(qtbot):
    from specplay.app.internals import InternalsPanel

    panel = InternalsPanel(lambda t: f"<{t}>")
    qtbot.addWidget(panel)
    tree = {"tokens": [11, 12, 21], "parents": [-1, 0, -1], "fates": ["accepted", "rejected", "rejected"],
            "accepted": [0]}
    look = {"window": [[1, 2, 3], [4, 5, 6]], "pool_size": 17, "candidates": [[7, 8], [11, 12]], "won": 1,
            "hits": 4}
    panel.add_step(_step(KNOWN, tree=tree, internals=look))
    assert panel.tree_view.tree["accepted"] == [0]
    assert panel.tree_view.texts[:2] == ["alpha", "beta"] and panel.tree_view.texts[2] == "<21>"
    assert panel.tree_view.next_pos is not None  # the target's own token is drawn after the path
    assert len(panel.window_grid.rows) == 2 and "17" in panel.window_title.text()
    assert panel.candidates_grid.highlight == 1 and "#1 verified" in panel.candidates_title.text()
    assert "hits" in panel.details.text()
    # missing or malformed keys: nothing drawn, nothing raised
    for bad_tree, bad_internals in [({}, {}), ({"tokens": [1, 2], "parents": [-1]}, {"window": "x"}),
                                    ({"tokens": [1], "parents": [5]}, {"candidates": [[1], "zz"], "won": 9}),
                                    (None, None), ({"tokens": "abc", "parents": None}, {"pool_size": "many"})]:
        panel.add_step(_step(KNOWN, tree=bad_tree, internals=bad_internals))
        panel.grab()
    assert panel.tree_view.tree is None
    prompt_lookup = {"match": {"ngram": 2, "at": 5, "proposed": 4}}
    panel.add_step(_step(KNOWN, internals=prompt_lookup))
    assert "copying from position 5" in panel.details.text()
    panel.add_step(_step(KNOWN, internals={"gamma": 5, "drafted": 5, "stopped_early": False}))
    assert "gamma" in panel.details.text() and "stopped early" in panel.details.text()
