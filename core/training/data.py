"""Training data from the target itself (self-distillation).

Text: Python source from the standard library (present on every machine, and code suits the
default Coder target), plus the target's own answers to instructions written from the
standard library's docstrings (so the heads also see the chat-formatted prose and code that
the target produces at inference). Nothing here reads the development prompt sets.

Features: the target runs over each sequence once; we keep, per position, the final-norm
hidden state (float16) and the target's own next-token prediction (its argmax), which is the
label the heads learn. Extraction is resumable: finished shards stay on disk.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from core.atomic import replacing
from core.errors import Cancelled

log = logging.getLogger(__name__)

Progress = Callable[[str, "float | None"], None]

_VERBS = [
    "Write a Python function `{sig}` that {doc}",
    "Implement `{sig}` in Python: {doc} Include a short docstring and an example.",
    "Explain what the Python function `{mod}.{name}` does ({doc}) and show how to use it.",
    "Write a Python function `{sig}` that {doc} Add type hints and a few tests.",
]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        parts = set(p.relative_to(root).parts)
        if parts & {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}:
            continue
        files.append(p)
    return files


def code_sequences(tokenizer, max_tokens: int, seq_len: int = 512, seed: int = 0) -> list[list[int]]:
    """Chunks of standard-library source, about ``max_tokens`` tokens in all."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    out: list[list[int]] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(0, len(ids) - 32, seq_len):
            out.append(ids[i:i + seq_len])
            total += len(out[-1])
            if total >= max_tokens:
                return out
    return out


def instruction_prompts(n: int, seed: int = 0) -> list[str]:
    """Coding instructions written from public standard-library functions and their docstrings."""
    items = []
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        mod = path.stem
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = " ".join(doc.strip().split("\n\n")[0].split())
            if not 20 <= len(first) <= 300:
                continue
            args = ", ".join(a.arg for a in node.args.args)
            items.append((mod, node.name, f"{node.name}({args})", first[0].lower() + first[1:]))
    rng = random.Random(seed)
    rng.shuffle(items)
    prompts = []
    for k, (mod, name, sig, doc) in enumerate(items[:n]):
        doc = doc if doc.endswith(".") else doc + "."
        prompts.append(_VERBS[k % len(_VERBS)].format(sig=sig, doc=doc, mod=mod, name=name))
    return prompts


def generate_responses(model_dir: Path, prompts: list[str], max_new_tokens: int, batch_size: int = 16,
                       storage: str = "int8", progress: Progress | None = None,
                       should_cancel: Callable[[], bool] = lambda: False, done: list[list[int]] | None = None,
                       on_batch: Callable[[list[list[int]]], None] | None = None) -> list[list[int]]:
    """The target's greedy answers (full chat sequences: prompt + answer), generated in batches.

    Batched generation with ``transformers`` is several times faster on a CPU than one
    sequence at a time; the exact tokens do not matter for training data. ``done`` holds
    answers from an interrupted run (they are kept, not regenerated); ``on_batch`` receives
    all answers so far after each batch, to save them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.models.loader import quantize_hf_linears

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if storage == "int8":
        quantize_hf_linears(model)
    out: list[list[int]] = list(done or [])
    for start in range(len(out), len(prompts), batch_size):
        if should_cancel():
            raise Cancelled("data generation cancelled")
        batch = prompts[start:start + batch_size]
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        pad = tok.pad_token_id
        for row, mask in zip(gen, enc["attention_mask"]):
            ids = row[int((mask == 0).sum()):].tolist()
            while ids and ids[-1] == pad:
                ids.pop()
            out.append(ids)
        if on_batch:
            on_batch(out)
        if progress:
            progress(f"Generating answers ({min(start + batch_size, len(prompts))}/{len(prompts)})",
                     min(1.0, (start + batch_size) / len(prompts)))
    return out


@dataclass
class FeatureSet:
    """Per-position target features and labels, sequences concatenated.

    ``features``: ``[T, hidden]`` float16 final-norm hidden states. ``tokens``: ``[T]`` the
    input token at each position. ``labels``: ``[T]`` the target's argmax there (its
    prediction for the next position). ``starts``: ``[S + 1]`` sequence boundaries.
    """

    features: torch.Tensor
    tokens: torch.Tensor
    labels: torch.Tensor
    starts: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def same_sequence_shift(self, k: int) -> torch.Tensor:
        """Boolean ``[T]``: position t and t + k are in the same sequence."""
        seq_id = torch.bucketize(torch.arange(self.num_tokens), self.starts[1:], right=True)
        ok = torch.zeros(self.num_tokens, dtype=torch.bool)
        if k < self.num_tokens:
            ok[: self.num_tokens - k] = seq_id[: self.num_tokens - k] == seq_id[k:]
        return ok

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        # A shard on disk counts as done (extraction resumes past it), so it must never be half written.
        with replacing(path) as tmp:
            save_file({"features": self.features.contiguous(), "tokens": self.tokens, "labels": self.labels,
                       "starts": self.starts}, str(tmp))

    @staticmethod
    def load(path: Path) -> "FeatureSet":
        from safetensors.torch import load_file

        d = load_file(str(path))
        return FeatureSet(d["features"], d["tokens"], d["labels"], d["starts"])

    @staticmethod
    def concat(parts: list["FeatureSet"]) -> "FeatureSet":
        starts = [torch.zeros(1, dtype=torch.long)]
        offset = 0
        for p in parts:
            starts.append(p.starts[1:] + offset)
            offset += p.num_tokens
        return FeatureSet(torch.cat([p.features for p in parts]), torch.cat([p.tokens for p in parts]),
                          torch.cat([p.labels for p in parts]), torch.cat(starts))


def extract_features(target, sequences: list[list[int]], shard_dir: Path, shard_size: int = 64,
                     progress: Progress | None = None, should_cancel: Callable[[], bool] = lambda: False) -> FeatureSet:
    """Run the target over ``sequences``; return features and labels. Shards on disk make it resumable."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    n_shards = (len(sequences) + shard_size - 1) // shard_size
    for s in range(n_shards):
        chunk = sequences[s * shard_size:(s + 1) * shard_size]
        key = hashlib.sha256(json.dumps(chunk).encode()).hexdigest()[:16]
        path = shard_dir / f"shard-{s:04d}-{key}.safetensors"
        if path.is_file():
            parts.append(FeatureSet.load(path))
            continue
        feats, toks, labels, starts = [], [], [], [0]
        for seq in chunk:
            if should_cancel():
                raise Cancelled("feature extraction cancelled")
            target.reset()
            out = target.forward(torch.tensor(seq), hidden=True)
            feats.append(out.hidden.to(torch.float16))
            labels.append(out.logits.argmax(-1).to(torch.int32))
            toks.append(torch.tensor(seq, dtype=torch.int32))
            starts.append(starts[-1] + len(seq))
        part = FeatureSet(torch.cat(feats), torch.cat(toks), torch.cat(labels), torch.tensor(starts))
        part.save(path)
        parts.append(part)
        if progress:
            progress(f"Extracting target features (shard {s + 1}/{n_shards})", (s + 1) / n_shards)
    target.reset()
    return FeatureSet.concat(parts)


def draft_vocabulary(labels: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent target predictions (plus ``always``), as sorted target ids.

    Drafting over this subset of the 151,936-token vocabulary makes a head's output layer
    several times cheaper; tokens outside it are simply never drafted (the target still
    verifies everything, so nothing is lost but a little acceptance).
    """
    counts = torch.bincount(labels.long().clamp_min(0))
    top = counts.argsort(descending=True)[:size]
    top = top[counts[top] > 0]
    ids = torch.unique(torch.cat([top, torch.tensor(always, dtype=torch.long)]))
    return ids.sort().values
