"""Forms built from a method's typed configuration dataclass, so new methods need no GUI code.

Each field's metadata (see :func:`specplay.core.decoding.method.param`) gives its label, help, range,
choices, whether it is lossy and whether it names a file; the field's type (int, float,
bool, str, possibly Optional) picks the editor. The dataclass validates itself on
construction; its :class:`~specplay.core.errors.ConfigError` message is shown under the form.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout, QLabel,
                               QLineEdit, QSpinBox, QToolButton, QVBoxLayout, QWidget)

from specplay.core.errors import ConfigError
from specplay.core.decoding.method import field_type

_INT_LIMIT = 2**31 - 1
LOSSY_CSS = "QLabel { color: white; background: #D55E00; border-radius: 3px; padding: 0 4px; font-weight: bold; }"


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


class FieldEditor(QWidget):
    """One field's editor; ``value()`` returns a Python value of the field's type (or None)."""

    sig_changed = Signal()

    def __init__(self, cls: type, f: dataclasses.Field):
        super().__init__()
        self.name = f.name
        meta = dict(f.metadata)
        self.meta = meta
        self.base, self.optional = field_type(cls, f)
        self.default = field_default(f)
        self.lossy = bool(meta.get("lossy"))
        self.label = meta.get("label") or f.name.replace("_", " ")
        lo, hi, choices = meta.get("min"), meta.get("max"), meta.get("choices")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        self.enable: QCheckBox | None = None
        if self.optional and self.base in (int, float) and not choices:
            self.enable = QCheckBox()
            self.enable.setToolTip("Unchecked: not set (None)")
            self.enable.toggled.connect(self._on_enable)
            layout.addWidget(self.enable)
        self.kind = "text"
        if choices:
            self.kind = "choice"
            self.editor = QComboBox()
            if self.optional:
                self.editor.addItem("(none)", None)
            for c in choices:
                self.editor.addItem(str(c), c)
            self.editor.currentIndexChanged.connect(self.sig_changed)
        elif self.base is bool:
            self.kind = "bool"
            self.editor = QCheckBox()
            self.editor.toggled.connect(self.sig_changed)
        elif self.base is int:
            self.kind = "int"
            self.editor = QSpinBox()
            self.editor.setRange(int(lo) if lo is not None else -_INT_LIMIT,
                                 int(hi) if hi is not None else _INT_LIMIT)
            self.editor.valueChanged.connect(self.sig_changed)
        elif self.base is float:
            self.kind = "float"
            self.editor = QDoubleSpinBox()
            self.editor.setDecimals(4)
            self.editor.setRange(float(lo) if lo is not None else -1e9, float(hi) if hi is not None else 1e9)
            span = (hi if hi is not None else 10.0) - (lo if lo is not None else 0.0)
            self.editor.setSingleStep(0.05 if span <= 2 else 0.5)
            self.editor.valueChanged.connect(self.sig_changed)
        else:
            self.kind = "file" if meta.get("kind") == "file" else ("text" if self.base is str else "literal")
            self.editor = QLineEdit()
            self.editor.setClearButtonEnabled(True)
            if self.optional:
                self.editor.setPlaceholderText("(none)")
            self.editor.textChanged.connect(self.sig_changed)
        self.editor.setObjectName(f"field_{f.name}")
        layout.addWidget(self.editor, 1)
        if self.kind == "file":
            browse = QToolButton(text="…")
            browse.setToolTip("Choose a file")
            browse.clicked.connect(self._browse)
            layout.addWidget(browse)
        if self.lossy:
            badge = QLabel("LOSSY")
            badge.setStyleSheet(LOSSY_CSS)
            badge.setToolTip("This option gives up the target's exact output distribution.")
            layout.addWidget(badge)
        tip = meta.get("help") or ""
        if meta.get("cli"):
            tip += f"\nCommand line: {meta['cli']}"
        self.setToolTip(tip.strip())
        self.set_value(self.default)

    def _on_enable(self, on: bool) -> None:
        self.editor.setEnabled(on)
        self.sig_changed.emit()

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, f"Choose {self.label}", self.editor.text())
        if path:
            self.editor.setText(path)

    def value(self) -> Any:
        if self.enable is not None and not self.enable.isChecked():
            return None
        e = self.editor
        if self.kind == "choice":
            return e.currentData()
        if self.kind == "bool":
            return e.isChecked()
        if self.kind == "int":
            return e.value()
        if self.kind == "float":
            return float(e.value())
        text = e.text()
        if text == "" and (self.optional or self.default is None):
            return None
        if self.kind == "literal":
            try:
                return ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ConfigError(f"{self.label}: cannot read {text!r}") from None
        return text

    def set_value(self, value: Any) -> None:
        """Show ``value``; a value the editor cannot hold leaves it unchanged."""
        e = self.editor
        if self.enable is not None:
            self.enable.setChecked(value is not None)
            e.setEnabled(value is not None)
            if value is None:
                return
        try:
            if self.kind == "choice":
                i = e.findData(value)
                if i >= 0:
                    e.setCurrentIndex(i)
            elif self.kind == "bool":
                e.setChecked(bool(value))
            elif self.kind == "int" and value is not None:
                e.setValue(int(value))
            elif self.kind == "float" and value is not None:
                e.setValue(float(value))
            elif self.kind in ("text", "file"):
                e.setText("" if value is None else str(value))
            elif self.kind == "literal":
                e.setText("" if value is None else repr(value))
        except (TypeError, ValueError):
            pass


class ConfigForm(QWidget):
    """The form of one method's configuration class.

    Signals:
        sig_changed(): a value changed (the error label is already updated).
    """

    sig_changed = Signal()

    def __init__(self, config_class: type):
        super().__init__()
        self.config_class = config_class
        self.editors: dict[str, FieldEditor] = {}
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        form = QFormLayout()
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        fields = dataclasses.fields(config_class) if dataclasses.is_dataclass(config_class) else ()
        for f in fields:
            if not f.init:
                continue
            editor = FieldEditor(config_class, f)
            editor.sig_changed.connect(self._changed)
            label = QLabel(editor.label)
            label.setToolTip(editor.toolTip())
            help_text = f.metadata.get("help")
            if help_text:
                box = QWidget()
                v = QVBoxLayout(box)
                v.setContentsMargins(0, 0, 0, 0)
                v.setSpacing(1)
                v.addWidget(editor)
                hint = QLabel(help_text)
                hint.setWordWrap(True)
                hint.setStyleSheet("QLabel { color: #666666; font-size: 8.5pt; }")
                v.addWidget(hint)
                form.addRow(label, box)
            else:
                form.addRow(label, editor)
            self.editors[f.name] = editor
        if not self.editors:
            none = QLabel("No settings.")
            none.setStyleSheet("QLabel { color: #666666; }")
            form.addRow(none)
        outer.addLayout(form)
        self.error = QLabel("")
        self.error.setObjectName("config_error")
        self.error.setWordWrap(True)
        self.error.setStyleSheet("QLabel { color: #b00020; }")
        self.error.setVisible(False)
        outer.addWidget(self.error)

    @property
    def has_lossy_options(self) -> bool:
        return any(e.lossy for e in self.editors.values())

    def values(self) -> dict[str, Any]:
        return {name: e.value() for name, e in self.editors.items()}

    def set_values(self, values: dict[str, Any]) -> None:
        for name, v in (values or {}).items():
            if name in self.editors:
                self.editors[name].set_value(v)
        self._changed()

    def reset(self) -> None:
        for e in self.editors.values():
            e.set_value(e.default)
        self._changed()

    def config(self):
        """The validated configuration object; raises ConfigError with a message for the user."""
        try:
            return self.config_class(**self.values())
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc

    def validate(self) -> str | None:
        try:
            self.config()
        except ConfigError as exc:
            self.error.setText(str(exc))
            self.error.setVisible(True)
            return str(exc)
        self.error.setText("")
        self.error.setVisible(False)
        return None

    def _changed(self) -> None:
        self.validate()
        self.sig_changed.emit()


__all__ = ["ConfigForm", "FieldEditor"]
