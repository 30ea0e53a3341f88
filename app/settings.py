"""Everything the window remembers between launches, read and written in this one place.

The values live in an INI file in the user data directory (``SPECPLAY_DATA_DIR`` moves
it, which keeps tests away from the user's own settings). Every value read back is
checked; anything missing or unreadable falls back to its default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings

from specplay.core.paths import data_dir
from specplay.core.weights.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

DEFAULT_PROMPT = "Write a Python function that merges two sorted lists into one sorted list."
VERSION = 1


def settings_path() -> Path:
    return data_dir() / "settings.ini"


def open_settings(path: Path | None = None) -> QSettings:
    path = Path(path) if path else settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    return QSettings(str(path), QSettings.Format.IniFormat)


@dataclass
class AppSettings:
    geometry: QByteArray | None = None
    window_state: QByteArray | None = None
    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT  # "" = no draft model
    device: str = "auto"
    dtype: str = "auto"
    draft_engine: str = "auto"
    recent_models: list[str] = field(default_factory=list)
    prompt: str = DEFAULT_PROMPT
    chat_template: bool = True
    stand_down: bool = True
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    method: str = "speculative"
    method_values: dict[str, dict] = field(default_factory=dict)
    compare_methods: list[str] = field(default_factory=lambda: ["autoregressive", "speculative", "prompt_lookup"])
    rejected_inline: bool = False
    compare_endpoints: str = ""  # remote endpoint specs, ';'-separated (never a key)
    export_dir: str = ""
    history_keep: int = 500  # the History panel's "Keep newest" count

    @classmethod
    def load(cls, qs: QSettings | None = None) -> "AppSettings":
        qs = qs or open_settings()
        s = cls()
        for f in fields(cls):
            raw = qs.value(f.name)
            if raw is None:
                continue
            current = getattr(s, f.name)
            try:
                value = _decode(raw, current, f.name)
            except (TypeError, ValueError):
                continue
            if value is not None:
                setattr(s, f.name, value)
        return s

    def save(self, qs: QSettings | None = None) -> None:
        qs = qs or open_settings()
        qs.setValue("version", VERSION)
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("geometry", "window_state"):
                if value is not None:
                    qs.setValue(f.name, value)
            elif isinstance(value, (list, dict)):
                qs.setValue(f.name, json.dumps(value))
            elif isinstance(value, bool):
                qs.setValue(f.name, "true" if value else "false")
            else:
                qs.setValue(f.name, value)
        qs.sync()

    def remember_model(self, spec: str, keep: int = 8) -> None:
        if not spec:
            return
        self.recent_models = [spec] + [m for m in self.recent_models if m != spec][: keep - 1]


def _decode(raw, current, name: str):
    """Convert an INI value back to the type of the field's default."""
    if name in ("geometry", "window_state"):
        return raw if isinstance(raw, QByteArray) else None
    if isinstance(current, bool):
        return raw if isinstance(raw, bool) else str(raw).lower() in ("true", "1", "yes")
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    if isinstance(current, (list, dict)):
        value = json.loads(raw) if isinstance(raw, str) else raw
        return value if isinstance(value, type(current)) else None
    return str(raw)
