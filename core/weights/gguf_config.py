"""A model's config from its GGUF's metadata, in transformers' ``config.json`` layout, without transformers.

transformers' ``AutoConfig`` reads a GGUF through ``gguf.GGUFReader``, which turns the tokenizer's
300,000 strings into Python objects first: 10-23 s of a first launch, in a child process, for the
dozen numbers a decoder's shape is. :class:`GGUFIndex` has them in its metadata already. Built here:
the ``qwen2`` architecture with plain RoPE (the default models', whose configs a test holds equal to
transformers' reading); any other kind returns None and keeps transformers' reading.
"""

from __future__ import annotations

import types
from pathlib import Path

#: GGUF architecture name: transformers' ``model_type``.
_ARCHITECTURES = {"qwen2": "qwen2"}


def config_from_gguf(index) -> dict | None:
    """The config transformers would read from this GGUF, as a dict for ``config.json``; None where
    the architecture or its RoPE is not one built here."""
    arch = index.architecture
    meta = index.metadata
    if arch not in _ARCHITECTURES or any(k.startswith(f"{arch}.rope.scaling") for k in meta):
        return None

    def value(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = value("attention.head_count")
    hidden = value("embedding_length")
    needed = (value("block_count"), hidden, value("feed_forward_length"), heads)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in needed):
        return None
    vocab = value("vocab_size") or index.lengths.get("tokenizer.ggml.tokens")
    config = {
        "model_type": _ARCHITECTURES[arch],
        "architectures": None,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": value("feed_forward_length"),
        "num_hidden_layers": value("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": value("attention.head_count_kv", heads),
        "hidden_act": "silu",
        "max_position_embeddings": value("context_length", 32768),
        "rms_norm_eps": value("attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in index.tensors,
        "rope_parameters": {"rope_theta": float(value("rope.freq_base", 10000.0)), "rope_type": "default"},
        "use_cache": True,
        "dtype": "float32",
    }
    key_length = value("attention.key_length")
    if isinstance(key_length, int) and key_length != hidden // heads:
        config["head_dim"] = key_length
    config.update(use_sliding_window=False, sliding_window=None)  # GGUF has no sliding window
    for name, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        token = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(token, int):
            config[name] = token
    return config


def generation_config(config: dict) -> dict:
    """The generation config transformers derives from a model config: its special token ids."""
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


def read_config(folder: Path):
    """A converted folder's ``config.json`` as attributes (what the native decoder and the llama.cpp
    draft read of a config), without transformers."""
    import json

    return types.SimpleNamespace(**json.loads((folder / "config.json").read_text()))
