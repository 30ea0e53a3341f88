"""Where SpecPlay keeps things: the user cache (converted models), user data (run history)."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """Converted models live here; ``SPECPLAY_CACHE_DIR`` overrides (tests, CI, portable installs)."""
    env = os.environ.get("SPECPLAY_CACHE_DIR")
    return Path(env) if env else Path(platformdirs.user_cache_dir("specplay"))


def measurements_dir() -> Path:
    """What was measured on this machine (its kernels, llama.cpp's verdicts) lives here: in the
    cache unless ``SPECPLAY_MEASUREMENTS_DIR`` overrides (tests keep theirs out of a shared cache)."""
    env = os.environ.get("SPECPLAY_MEASUREMENTS_DIR")
    return Path(env) if env else cache_dir()


def data_dir() -> Path:
    """The run history lives here; ``SPECPLAY_DATA_DIR`` overrides."""
    env = os.environ.get("SPECPLAY_DATA_DIR")
    return Path(env) if env else Path(platformdirs.user_data_dir("specplay"))


def assets_dir() -> Path:
    """The shipped assets (trained heads, the answers they were trained on, prompt sets, icons)."""
    from specplay import assets
    return Path(assets.__file__).resolve().parent


def shipped_corpus(target_spec: str) -> Path:
    """Where the project keeps the token ids of the target's answers made so far (the training's
    ``save_corpus``; the speculative draft ranks its vocabulary by them)."""
    return assets_dir() / "training" / f"answers-{Path(target_spec).name}.safetensors"
