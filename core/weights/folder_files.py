"""A converted folder's small files: its config, generation config, tokenizer and marker, made from a GGUF.

:mod:`specplay.core.weights.prepare` decides when a folder is made and installs it; this writes what
goes in one. Where the GGUF's metadata gives the config and the tokenizer
(:mod:`~specplay.core.weights.gguf_config`, :mod:`~specplay.core.weights.tokenizer`) a folder without
weights is written in about a second, in the caller's process; otherwise transformers reads them in
the conversion's child. A tokenizer already cached for another model with the same one (the draft of
the target's family) is copied rather than built.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from specplay.core.progress import Progress
from specplay.core.weights.cache import read_marker, write_marker
from specplay.core.weights.gguf_config import config_from_gguf, generation_config
from specplay.core.weights.gguf_index import GGUFIndex
from specplay.core.weights.tokenizer import TEMPLATE_FILE, ChatTokenizer, from_gguf, unbuilt_reason

#: A converted folder's tokenizer, as ``save_pretrained`` and :meth:`ChatTokenizer.save` write it
#: (the chat template beside it).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_from_metadata(gguf: Path, out: Path, name: str, sha: str, root: Path, progress: Progress) -> bool:
    """Write ``out`` (a folder without weights) from the GGUF's metadata alone; False, with nothing
    written, where its architecture or its tokenizer is not a kind built so. ``root`` holds the
    converted folders whose tokenizers may be copied."""
    started = time.perf_counter()
    index = GGUFIndex(gguf)
    config = config_from_gguf(index)
    if config is None or unbuilt_reason(index) is not None:
        return False
    out.mkdir(parents=True)
    write_folder(index, out, name, sha, config, generation_config(config), gguf_tokenizer(index, out, name, root, progress),
                 started)
    return True


def gguf_tokenizer(index: GGUFIndex, out: Path, name: str, root: Path, progress: Progress) -> ChatTokenizer | None:
    """The GGUF's tokenizer to write into ``out``; None where a cached one was copied there."""
    if copy_tokenizer(index, out, root):
        return None
    progress(f"Reading the tokenizer of {name}", None)
    return from_gguf(index)


def copy_tokenizer(index: GGUFIndex, out: Path, root: Path) -> bool:
    """Copy the tokenizer of a folder in ``root`` whose GGUF holds the same one, with this file's own
    chat template; False where none is cached."""
    for folder in sorted(root.iterdir()):
        if read_marker(folder).get("tokenizer_digest") != index.tokenizer_digest:
            continue
        if not all((folder / f).is_file() for f in TOKENIZER_FILES):
            continue
        for f in TOKENIZER_FILES:
            shutil.copyfile(folder / f, out / f)
        template = index.metadata.get("tokenizer.chat_template")
        if isinstance(template, str):
            (out / TEMPLATE_FILE).write_text(template)
        return True
    return False


def write_folder(index: GGUFIndex, out: Path, name: str, sha: str, config: dict, generation: dict, tokenizer,
                 started: float) -> None:
    """The folder's config, generation config, tokenizer (None: copied there already; a
    :class:`ChatTokenizer` or transformers' one) and marker."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config.update(dtype="float32", name_or_path=name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if isinstance(tokenizer, ChatTokenizer):
        tokenizer.save(out)
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    write_marker(out, {"source": index.path.name, "sha256": sha, "name": name, "tokenizer_digest": index.tokenizer_digest,
                       "converted_in_s": round(time.perf_counter() - started, 1)})
