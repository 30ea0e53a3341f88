"""Which widget of the main window holds which setting: applied at start, collected at close."""

from __future__ import annotations

from PySide6.QtCore import QByteArray

from specplay.app.settings import AppSettings


def apply_to_window(window, s: AppSettings) -> None:
    """Put the saved settings into the panels (geometry and dock layout are the window's own)."""
    mp = window.models_panel
    mp.target.add_recent(s.recent_models)
    mp.draft.add_recent(s.recent_models)
    mp.target.set_spec(s.target)
    mp.draft.set_spec(s.draft)
    if mp.device.findText(s.device) >= 0:
        mp.device.setCurrentText(s.device)
    if mp.dtype.findText(s.dtype) >= 0:
        mp.dtype.setCurrentText(s.dtype)
    if mp.draft_engine.findText(s.draft_engine) >= 0:
        mp.draft_engine.setCurrentText(s.draft_engine)
    pp = window.prompt_panel
    pp.editor.setPlainText(s.prompt)
    pp.chat_template.setChecked(s.chat_template)
    pp.stand_down.setChecked(s.stand_down)
    pp.max_new_tokens.setValue(s.max_new_tokens)
    pp.temperature.setValue(s.temperature)
    pp.top_p.setValue(s.top_p)
    pp.seed.setValue(s.seed)
    window.methods_panel.set_all_values(s.method_values)
    window.methods_panel.set_method(s.method)
    window.compare.set_selected(s.compare_methods)
    window.compare.endpoints_edit.setText(s.compare_endpoints)
    window.live.rejected_inline.setChecked(s.rejected_inline)
    window.compare.rejected_inline.setChecked(s.rejected_inline)
    window.history_panel.keep.setValue(s.history_keep)


def collect_from_window(window) -> AppSettings:
    """The window's current settings, in ``window.settings``."""
    s = window.settings
    mp, pp = window.models_panel, window.prompt_panel
    s.geometry = QByteArray(window.saveGeometry())
    s.window_state = QByteArray(window.saveState())
    s.target = mp.target.model_id()
    s.draft = mp.draft.model_id()
    s.device = mp.device.currentText()
    s.dtype = mp.dtype.currentText()
    s.draft_engine = mp.draft_engine.currentText()
    s.prompt = pp.prompt()
    s.chat_template = pp.chat_template.isChecked()
    s.stand_down = pp.stand_down.isChecked()
    s.max_new_tokens = pp.max_new_tokens.value()
    s.temperature = pp.temperature.value()
    s.top_p = pp.top_p.value()
    s.seed = pp.seed.value()
    s.method = window.methods_panel.method()
    s.method_values = window.methods_panel.all_values()
    s.compare_methods = window.compare.selected()
    s.compare_endpoints = window.compare.endpoints_edit.text()
    s.rejected_inline = window.live.rejected_inline.isChecked()
    s.history_keep = window.history_panel.keep.value()
    return s
