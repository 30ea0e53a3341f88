"""The desktop app, offscreen, on a tiny model folder."""

import pytest

pytest.importorskip("pytestqt")

from tiny import save_tiny_model  # noqa: E402


@pytest.fixture()
def window(qtbot, tmp_path):
    from app.window import MainWindow

    folder = save_tiny_model(tmp_path / "tiny")
    w = MainWindow()
    qtbot.addWidget(w)
    with qtbot.waitSignal(w.worker.sig_models_loaded, timeout=30_000):
        w.sig_load.emit(str(folder), "cpu", "float32")
    yield w
    w.close()


def test_run_streams_tokens_into_the_window(window, qtbot):
    window.prompt.setPlainText("ab cd ab")
    window.max_tokens.setValue(12)
    with qtbot.waitSignal(window.worker.sig_run_finished, timeout=30_000) as blocker:
        window.run_button.click()
    result = blocker.args[0]
    assert len(result.token_ids) == 12
    assert window.output.toPlainText() == result.text
    assert "tok/s" in window.status.text()
