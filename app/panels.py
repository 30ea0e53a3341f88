"""The side panels: models, prompt and sampling, methods."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QFrame, QGridLayout,
                               QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar, QPushButton, QScrollArea, QSpinBox,
                               QStyle, QToolButton, QVBoxLayout, QWidget)

from specplay.app.forms import ConfigForm
from specplay.app.worker import LoadRequest, RemoteRequest, RunRequest
from specplay.core.errors import ConfigError
from specplay.core.memory import memory_text
from specplay.core.methods import METHODS, method_title
from specplay.core.models.loader import DEVICES, DTYPES
from specplay.core.weights.catalog import CATALOG
from specplay.core.weights.prepare import catalog_status

log = logging.getLogger(__name__)

NO_DRAFT = "(no draft model)"
REMOTE_WARMUP_TOKENS = 8  # an endpoint's short, unrecorded first request (a fair first-token time)
DTYPE_TIPS = {
    "auto": "bfloat16 on a GPU; int8 weights on an x86 CPU (about 7x faster than float32), else float32",
    "int8": "int8 weights with float32 compute (x86 CPUs only)",
}
DRAFT_ENGINE_TIPS = {
    "auto": "llama.cpp in 4 bits for a quantized CPU draft from a catalog model or .gguf file, where llama-cpp-python "
            "(the peers extra) is installed; else SpecPlay's own layers",
    "native": "SpecPlay's own layers (int4 or int8 on a CPU): slower drafts, same output",
    "llamacpp": "llama.cpp in 4 bits (needs the peers extra and a GGUF source): the draft's numerics never change "
                "what speculation emits",
}


def model_summary(loaded) -> str:
    info = loaded.model.info
    params = info.num_parameters
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return f"{info.device} · {info.dtype} · {info.backend} · {info.architecture}, {size} parameters"


# ------------------------------------------------------------------------------------ models
class ModelPicker(QWidget):
    """An editable combo (catalog ids, recent models, or any folder / .gguf / cached hub id) with browse buttons."""

    def __init__(self, allow_none: bool):
        super().__init__()
        self.combo = QComboBox()
        self.combo.setEditable(True)
        self.combo.setInsertPolicy(QComboBox.InsertPolicy.NoInsert)
        self.combo.setMinimumContentsLength(18)
        self.combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.combo.lineEdit().setPlaceholderText("catalog id, model folder, .gguf file or cached hub id")
        self.combo.setToolTip("A catalog model, a local Hugging Face folder, a .gguf file, or a hub id already in "
                              "the local cache (SpecPlay never downloads).")
        if allow_none:
            self.combo.addItem(NO_DRAFT, "")
        for entry in CATALOG.values():
            note = "" if catalog_status(entry) != "not installed" else "  (not installed)"
            self.combo.addItem(f"{entry.id}{note}", entry.id)
            self.combo.setItemData(self.combo.count() - 1, entry.title, Qt.ItemDataRole.ToolTipRole)
        folder = QToolButton()
        folder.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_DirOpenIcon))
        folder.setToolTip("Choose a model folder")
        folder.clicked.connect(self._browse_folder)
        gguf = QToolButton()
        gguf.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_FileIcon))
        gguf.setToolTip("Choose a .gguf file (converted once, then cached)")
        gguf.clicked.connect(self._browse_gguf)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.combo, 1)
        layout.addWidget(folder)
        layout.addWidget(gguf)

    def add_recent(self, specs: list[str]) -> None:
        for spec in specs:
            if spec and self.combo.findData(spec) < 0:
                self.combo.addItem(spec, spec)

    def model_id(self) -> str:
        text = self.combo.currentText().strip()
        i = self.combo.findText(text)
        if i >= 0 and self.combo.itemData(i) is not None:
            return self.combo.itemData(i)
        return "" if text == NO_DRAFT else text

    def set_spec(self, spec: str) -> None:
        i = self.combo.findData(spec or "")
        if i < 0 and spec:
            self.combo.addItem(spec, spec)
            i = self.combo.count() - 1
        if i >= 0:
            self.combo.setCurrentIndex(i)

    def _browse_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a model folder")
        if path:
            self.set_spec(path)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF file", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.set_spec(path)


class ModelsPanel(QWidget):
    """Pick, load and inspect the target and draft models.

    Signals:
        sig_load_requested(): the Load button.
        sig_cancel_requested(): the Cancel button (stops loading or conversion).
    """

    sig_load_requested = Signal()
    sig_cancel_requested = Signal()

    def __init__(self):
        super().__init__()
        self.target = ModelPicker(allow_none=False)
        self.draft = ModelPicker(allow_none=True)
        self.device = QComboBox()
        self.device.addItems(list(DEVICES))
        self.device.setToolTip("auto: CUDA, then Apple MPS, then the CPU")
        self.dtype = QComboBox()
        for d in DTYPES:
            self.dtype.addItem(d)
            self.dtype.setItemData(self.dtype.count() - 1, DTYPE_TIPS.get(d, d), Qt.ItemDataRole.ToolTipRole)
        self.dtype.setToolTip(DTYPE_TIPS["auto"])
        self.draft_engine = QComboBox()
        for engine, tip in DRAFT_ENGINE_TIPS.items():
            self.draft_engine.addItem(engine)
            self.draft_engine.setItemData(self.draft_engine.count() - 1, tip, Qt.ItemDataRole.ToolTipRole)
        self.draft_engine.setToolTip("The engine the draft model runs on")
        self.load_button = QPushButton("Load models")
        self.load_button.setObjectName("load_button")
        self.load_button.clicked.connect(self.sig_load_requested)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setEnabled(False)
        self.cancel_button.clicked.connect(self.sig_cancel_requested)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.progress.setTextVisible(False)
        self.stage = QLabel("")
        self.stage.setWordWrap(True)
        self.stage.setStyleSheet("QLabel { color: #444444; }")
        self.target_info = QLabel("Target: not loaded")
        self.draft_info = QLabel("Draft: not loaded")
        for lab in (self.target_info, self.draft_info):
            lab.setWordWrap(True)
            lab.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.messages = QLabel("")
        self.messages.setObjectName("model_messages")
        self.messages.setWordWrap(True)
        self.messages.setTextFormat(Qt.TextFormat.RichText)
        self.memory = QLabel(memory_text())
        self.memory.setStyleSheet("QLabel { color: #444444; }")
        self.memory.setToolTip("Resident memory of this process (and CUDA memory when a GPU is in use)")

        form = QFormLayout()
        form.addRow("Target", self.target)
        form.addRow("Draft", self.draft)
        form.addRow("Draft engine", self.draft_engine)
        dev = QHBoxLayout()
        dev.addWidget(QLabel("Device"))
        dev.addWidget(self.device, 1)
        dev.addWidget(QLabel("dtype"))
        dev.addWidget(self.dtype, 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.load_button, 1)
        buttons.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addLayout(dev)
        layout.addLayout(buttons)
        layout.addWidget(self.progress)
        layout.addWidget(self.stage)
        layout.addWidget(self.target_info)
        layout.addWidget(self.draft_info)
        layout.addWidget(self.messages)
        layout.addWidget(self.memory)
        layout.addStretch(1)

    def load_request(self, target: str | None = None, draft: str | None = None, device: str | None = None,
                     dtype: str | None = None) -> LoadRequest | None:
        """A request to load these models (by default the ones chosen here), now shown as the choice;
        None without a target (a device or dtype the lists lack is sent, not shown)."""
        target = target if target is not None else self.target.model_id()
        draft = draft if draft is not None else self.draft.model_id()
        device = device or self.device.currentText()
        dtype = dtype or self.dtype.currentText()
        if not target:
            return None
        self.target.set_spec(target)
        self.draft.set_spec(draft)
        for box, value in ((self.device, device), (self.dtype, dtype)):
            if box.findText(value) >= 0:
                box.setCurrentText(value)
        return LoadRequest(target=target, draft=draft or None, device=device, dtype=dtype,
                           draft_backend=self.draft_engine.currentText())

    def set_loading(self, loading: bool) -> None:
        self.load_button.setEnabled(not loading)
        self.cancel_button.setEnabled(loading)
        if loading:
            self.progress.setRange(0, 0)
            self.messages.setText("")
        elif self.progress.maximum() == 0:  # a load ended while its stage had no fraction
            self.progress.setRange(0, 1000)

    def set_progress(self, stage: str, fraction: float) -> None:
        self.stage.setText(stage)
        if fraction < 0:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(fraction * 1000))

    def set_loaded(self, loaded) -> None:
        """Show a :class:`specplay.app.worker.ModelsLoaded`."""
        self.progress.setRange(0, 1000)
        self.progress.setValue(1000)
        self.stage.setText("The target is ready; the draft is loading…" if loaded.draft_pending else "Ready.")
        self.target_info.setText(f"<b>Target</b> {loaded.target.model_id}<br>{model_summary(loaded.target)}")
        if loaded.draft is not None:
            self.draft_info.setText(f"<b>Draft</b> {loaded.draft.model_id}<br>{model_summary(loaded.draft)}")
        elif loaded.draft_pending:
            self.draft_info.setText("<b>Draft</b> loading… (methods without a draft can run meanwhile)")
        else:
            self.draft_info.setText("<b>Draft</b> none (methods that need one are unavailable)")
        notes = [f"<span style='color:#555'>{n}</span>" for m in (loaded.target, loaded.draft) if m is not None
                 for n in (m.notes or [])]
        warnings = [f"<span style='color:#9a5b00'>⚠ {w}</span>" for w in loaded.warnings]
        error = [f"<span style='color:#b00020'>✗ {loaded.draft_error}</span>"] if loaded.draft_error else []
        self.messages.setText("<br>".join(error + warnings + notes))

    def set_failed(self, message: str) -> None:
        self.progress.setRange(0, 1000)
        self.progress.setValue(0)
        self.stage.setText("")
        self.messages.setText(f"<span style='color:#b00020'>✗ {message}</span>")

    def refresh_memory(self) -> None:
        self.memory.setText(memory_text())


# ------------------------------------------------------------------------------------ prompt
def assets_path(*parts: str) -> Path:
    """A shipped asset; falls back to the source tree when ``assets`` is not an installed package."""
    try:
        from specplay.core.paths import assets_dir

        return assets_dir().joinpath(*parts)
    except ImportError:
        return Path(__file__).resolve().parent.parent.joinpath("assets", *parts)


def load_presets(path: Path | None = None) -> list[dict]:
    """Prompt presets from assets/prompts/presets.json (an empty list if it is missing or broken)."""
    if path is None:
        path = assets_path("prompts", "presets.json")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        presets = data.get("presets", []) if isinstance(data, dict) else data
        return [p for p in presets if isinstance(p, dict) and isinstance(p.get("prompt"), str)]
    except (OSError, ValueError) as exc:
        log.warning("cannot read prompt presets at %s: %s", path, exc)
        return []


class PromptPanel(QWidget):
    def __init__(self):
        super().__init__()
        self.presets = load_presets()
        self.preset = QComboBox()
        self.preset.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.preset.setMinimumContentsLength(14)
        self.preset.addItem("Presets…", None)
        for p in self.presets:
            self.preset.addItem(f"{p.get('category', 'prompt')}: {p.get('name', p['prompt'][:30])}", p["prompt"])
        self.preset.activated.connect(self._apply_preset)
        self.editor = QPlainTextEdit()
        self.editor.setPlaceholderText("Type a prompt…")
        self.editor.setTabChangesFocus(True)
        self.chat_template = QCheckBox("chat template")
        self.chat_template.setChecked(True)
        self.chat_template.setToolTip("Wrap the prompt in the model's chat template (instruct models expect it)")
        self.max_new_tokens = QSpinBox()
        self.max_new_tokens.setRange(1, 8192)
        self.max_new_tokens.setValue(128)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 5.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setDecimals(2)
        self.temperature.setToolTip("0 = greedy: every method must give exactly the baseline's tokens")
        self.top_p = QDoubleSpinBox()
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setDecimals(2)
        self.top_p.setValue(1.0)
        self.seed = QSpinBox()
        self.seed.setRange(0, 2**31 - 1)
        self.stand_down = QCheckBox("plain steps where drafting does not pay")
        self.stand_down.setChecked(True)
        self.stand_down.setToolTip("Stand down: while a method's drafting steps run slower than plain decoding, take "
                                   "plain steps and probe again later (backed off). Turn off to study a method as "
                                   "it drafts.")
        for box in (self.max_new_tokens, self.temperature, self.top_p, self.seed):
            box.setMinimumWidth(64)
        grid = QGridLayout()
        grid.addWidget(QLabel("Max new tokens"), 0, 0)
        grid.addWidget(self.max_new_tokens, 0, 1)
        grid.addWidget(QLabel("Seed"), 0, 2)
        grid.addWidget(self.seed, 0, 3)
        grid.addWidget(QLabel("Temperature"), 1, 0)
        grid.addWidget(self.temperature, 1, 1)
        grid.addWidget(QLabel("Top-p"), 1, 2)
        grid.addWidget(self.top_p, 1, 3)
        grid.addWidget(self.stand_down, 2, 0, 1, 4)
        top = QHBoxLayout()
        top.addWidget(self.preset, 1)
        top.addWidget(self.chat_template)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.editor, 1)
        layout.addLayout(grid)

    def _apply_preset(self, index: int) -> None:
        text = self.preset.itemData(index)
        if text:
            self.editor.setPlainText(text)
        self.preset.setCurrentIndex(0)

    def prompt(self) -> str:
        return self.editor.toPlainText()

    def generation_config(self):
        from specplay.core.decoding.types import GenerationConfig, SamplingConfig

        return GenerationConfig(max_new_tokens=self.max_new_tokens.value(), stand_down=self.stand_down.isChecked(),
                                sampling=SamplingConfig(temperature=self.temperature.value(), top_p=self.top_p.value(),
                                                        seed=self.seed.value()))

    def run_request(self, method: str, method_config, warmup_tokens: int = 0) -> RunRequest:
        """A request to run ``method`` (with its config) on this prompt; raises ConfigError for the user."""
        gen = self.generation_config()
        return RunRequest(prompt=self._prompt_to_send(), method=method, config=gen, method_config=method_config,
                          chat_template=self.chat_template.isChecked(), warmup_tokens=warmup_tokens)

    def remote_request(self, endpoint) -> RemoteRequest:
        """A request to stream this prompt from ``endpoint`` (a :class:`specplay.core.remote.endpoint.Endpoint`)."""
        gen = self.generation_config()
        s = gen.sampling
        return RemoteRequest(endpoint=endpoint, prompt=self._prompt_to_send(), max_tokens=gen.max_new_tokens,
                             temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                             chat=self.chat_template.isChecked(), warmup_tokens=REMOTE_WARMUP_TOKENS)

    def _prompt_to_send(self) -> str:
        prompt = self.prompt()
        if not prompt.strip():
            raise ConfigError("The prompt is empty.")
        return prompt


# ------------------------------------------------------------------------------------ methods
class MethodsPanel(QWidget):
    """Choose the method for a single run and edit every method's settings.

    One form per method in ``core.methods.METHODS``, built from its config dataclass.

    Signals:
        sig_method_changed(str)
    """

    sig_method_changed = Signal(str)

    def __init__(self):
        super().__init__()
        self.combo = QComboBox()
        # Every method's form, the chosen one shown. A hidden form takes no room, so the panel scrolls
        # over the chosen form only (a stacked widget is as tall as its tallest page).
        self.pages = QWidget()
        pages = QVBoxLayout(self.pages)
        pages.setContentsMargins(0, 0, 0, 0)
        self.forms: dict[str, ConfigForm] = {}
        for name, spec in METHODS.items():
            self.combo.addItem(spec.title, name)
            form = ConfigForm(spec.config_class)
            form.setVisible(False)
            self.forms[name] = form
            pages.addWidget(form)
        self.summary = QLabel("")
        self.summary.setWordWrap(True)
        self.summary.setStyleSheet("QLabel { color: #333333; }")
        self.badges = QLabel("")
        self.badges.setTextFormat(Qt.TextFormat.RichText)
        reset = QPushButton("Defaults")
        reset.setToolTip("Reset this method's settings to their defaults")
        reset.clicked.connect(lambda: self.current_form().reset())
        self.combo.currentIndexChanged.connect(self._on_changed)
        head = QHBoxLayout()
        head.addWidget(self.combo, 1)
        head.addWidget(reset)
        body = QWidget()
        inner = QVBoxLayout(body)
        inner.setContentsMargins(0, 0, 0, 0)
        inner.addWidget(self.summary)
        inner.addWidget(self.badges)
        inner.addWidget(self.pages)
        inner.addStretch(1)
        scroll = QScrollArea()  # long forms scroll instead of forcing the window taller than the screen
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(body)
        layout = QVBoxLayout(self)
        layout.addLayout(head)
        layout.addWidget(scroll, 1)
        self.draft_available = False
        self.draft_loading = False
        self._on_changed()

    def method(self) -> str:
        return self.combo.currentData()

    def set_method(self, name: str) -> None:
        i = self.combo.findData(name)
        if i >= 0:
            self.combo.setCurrentIndex(i)

    def current_form(self) -> ConfigForm:
        return self.forms[self.method()]

    def config_for(self, name: str):
        """The method's validated config; raises ConfigError naming the method."""
        try:
            return self.forms[name].config()
        except ConfigError as exc:
            raise ConfigError(f"{method_title(name)}: {exc}") from None

    def all_values(self) -> dict[str, dict]:
        out = {}
        for name, form in self.forms.items():
            try:
                out[name] = form.values()
            except ConfigError:
                continue
        return out

    def set_all_values(self, values: dict[str, dict]) -> None:
        for name, vals in (values or {}).items():
            if name in self.forms and isinstance(vals, dict):
                self.forms[name].set_values(vals)

    def run_request(self, method: str, prompt: PromptPanel, warmup_tokens: int = 0) -> RunRequest:
        """A request to run ``method`` with its settings here on ``prompt``'s prompt and sampling;
        raises ConfigError with a message for the user."""
        request = prompt.run_request(method, self.config_for(method), warmup_tokens)
        if METHODS[method].needs_draft and not self.draft_available:
            if self.draft_loading:
                raise ConfigError(f"{method_title(method)} needs the draft model, which is still loading: "
                                  "autoregressive and the methods without a draft can run meanwhile.")
            raise ConfigError(f"{method_title(method)} needs a draft model: choose one in Models and load it.")
        return request

    def set_draft_available(self, available: bool, loading: bool = False) -> None:
        """Whether drafting methods can run; ``loading``: not yet, the draft is on its way."""
        self.draft_available, self.draft_loading = available, loading
        self._on_changed()

    def _on_changed(self) -> None:
        name = self.method()
        if name is None:
            return
        spec = METHODS[name]
        for form in self.forms.values():
            form.setVisible(form is self.forms[name])
        self.summary.setText(spec.summary)
        badges = []
        if spec.needs_draft:
            colour = "#555555" if self.draft_available else "#9a5b00" if self.draft_loading else "#b00020"
            text = "needs a draft model" + ("" if self.draft_available else " — it is loading" if self.draft_loading
                                            else " — load one in Models")
            badges.append(f"<span style='color:{colour}'>● {text}</span>")
        if self.forms[name].has_lossy_options:
            badges.append("<span style='color:#D55E00'>has LOSSY options</span>")
        self.badges.setText(" &nbsp; ".join(badges))
        self.badges.setVisible(bool(badges))
        self.sig_method_changed.emit(name)
