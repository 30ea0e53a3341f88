"""Training data from the target itself (self-distillation).

Text: the target's own greedy answers to a broad pool of instructions written from the
standard library on this machine (code to write, read, test and fix; explanations; language
questions), plus a little standard-library source. Answers are what the heads draft against
at inference: chat-formatted prose and code in the target's own style. Nothing here reads
the development prompt sets.

Features: per position, the target's final-norm hidden state (float16) and its own
next-token prediction (argmax), the label the heads learn. Answers keep them as they are
generated, many sequences at a time (:func:`specplay.core.training.batched.greedy_batch`); source text
gets one pass of the target. Both are resumable: finished shards stay on disk.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

import torch

from specplay.core.atomic import replacing, write_text_atomic
from specplay.core.errors import Cancelled, ModelError, SpecPlayError
from specplay.core.paths import cache_dir
from specplay.core.progress import Progress
from specplay.core.weights.cache import read_marker
from specplay.core.weights.catalog import CATALOG, DEFAULT_TARGET
from specplay.core.weights.prepare import sha256_file

log = logging.getLogger(__name__)


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


# Instruction templates by kind of request, so the pool spans what people ask a coding
# assistant: code to write in several styles, code to read, explain, test or fix, and
# questions about the language and its library.
_FUNCTION_TASKS = [
    "Write a Python function `{sig}` that {doc}",
    "Implement `{sig}` in Python: {doc} Include a short docstring and an example.",
    "Write a Python function `{sig}` that {doc} Add type hints and a few tests.",
    "Without using the `{mod}` module, write `{sig}`, which {doc} Keep it short and readable.",
    "Explain what the Python function `{mod}.{name}` does ({doc}) and show how to use it.",
    "I need a function that {doc} Write it in modern Python and explain the edge cases it handles.",
]
_CLASS_TASKS = [
    "Implement a simplified Python class `{name}` modelled on `{mod}.{name}`: {doc} Show a short usage example.",
    "Explain the purpose of `{mod}.{name}` ({doc}) and when you would use it instead of writing your own.",
    "Write a small Python class `{name}` that does the following: {doc} Use dataclasses where they fit.",
]
_SOURCE_TASKS = [
    "Explain step by step what this Python function does:\n\n```python\n{src}\n```",
    "Add type hints and a docstring to this function:\n\n```python\n{src}\n```",
    "Write pytest unit tests for this function:\n\n```python\n{src}\n```",
    "Refactor this function to be easier to read, and explain each change:\n\n```python\n{src}\n```",
    "Which edge cases could break this function, and how would you handle them?\n\n```python\n{src}\n```",
]
_MODULE_TASKS = [
    "What is Python's `{mod}` module for? Give a short tour with examples.",
    "I need to work with {doc_lower} in Python. Which parts of the `{mod}` module should I use, and how?",
]
_TOPIC_TASKS = [
    "Explain {topic} in Python to someone who knows another language. Use examples.",
    "What are common mistakes people make with {topic} in Python, and how do you avoid them?",
    "Summarise the rules of {topic} in Python in a few bullet points, then show one example.",
]


def _first_paragraph(doc: str | None) -> str | None:
    if not doc:
        return None
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first if 20 <= len(first) <= 300 else None


def _sentence(text: str) -> str:
    text = text[0].lower() + text[1:]
    return text if text.endswith(".") else text + "."


def instruction_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` varied instructions written from the standard library on this machine.

    Sources: public functions and classes with their docstrings, short function bodies (to
    read, explain, test, fix), module docstrings, and the language reference topics that ship
    with Python (``pydoc_data``). The pool is shuffled once with ``seed``; the first ``n`` are
    returned, so a larger ``n`` extends a smaller one (an interrupted or extended generation
    reuses what is done). Nothing here reads the development prompt sets.
    """
    rng = random.Random(seed)
    pool: list[str] = []
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        mod = path.stem if path.stem != "__init__" else path.parent.name
        mdoc = _first_paragraph(ast.get_docstring(tree))
        if mdoc and not mod.startswith("_"):
            task = rng.choice(_MODULE_TASKS)
            pool.append(task.format(mod=mod, doc_lower=_sentence(mdoc).rstrip(".")))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = _first_paragraph(ast.get_docstring(node))
            if isinstance(node, ast.ClassDef):
                if doc:
                    pool.append(rng.choice(_CLASS_TASKS).format(mod=mod, name=node.name, doc=_sentence(doc)))
                continue
            if doc:
                sig = f"{node.name}({', '.join(a.arg for a in node.args.args)})"
                pool.append(rng.choice(_FUNCTION_TASKS).format(sig=sig, doc=_sentence(doc), mod=mod, name=node.name))
            src = ast.get_source_segment(text, node)
            if src and 4 <= src.count("\n") <= 30 and rng.random() < 0.5:
                pool.append(rng.choice(_SOURCE_TASKS).format(src=src))
    from pydoc_data.topics import topics

    for topic, body in topics.items():
        title = body.strip().splitlines()[0].strip()
        for task in _TOPIC_TASKS:
            pool.append(task.format(topic=title if len(title) < 60 else topic))
    rng.shuffle(pool)
    return pool[:n]


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` as one user turn in the tokenizer's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def generate_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, shard_dir: Path, *,
                     target_key: str, slots: int = 16, shard_size: int = 32,
                     corpus: dict[int, list[int]] | None = None, only: Collection[int] | None = None,
                     progress: Progress | None = None,
                     should_cancel: Callable[[], bool] = lambda: False) -> "FeatureSet":
    """The target's greedy answers to ``prompts`` (to those at the indices ``only``, where given) with
    its features, generated in batches.

    Each answer keeps the target's feature and argmax at every position, prompt included, as
    it is produced (no second pass over the text). Finished answers are saved in shards of
    ``shard_size``; a shard records the prompts it answers and the target that made it
    (``target_key``, what identifies its weights), so an interrupted run resumes with the
    prompts not yet answered (answers in flight at the interruption are redone), and answers
    of another target, or to a prompt that has since changed, are made again, never reused.

    ``corpus`` (prompt index -> prompt and answer token ids, :func:`load_corpus`) holds answers
    made earlier, perhaps on another machine: those are not generated again but read once by
    the target (teacher forcing: 160 tokens a second on two cores against ~100 generating),
    which gives their features and labels.
    """
    from specplay.core.training.batched import Generated, greedy_batch

    shard_dir.mkdir(parents=True, exist_ok=True)
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    parts, done = _answers_made(shard_dir, target_key, prompt_ids)
    todo = [(k, ids) for k, ids in enumerate(prompt_ids) if k not in done and (only is None or k in only)]
    stop = set(model.info.eos_token_ids)
    known: dict[int, tuple[list[int], int]] = {}  # key -> (corpus answer, prompt length)
    for k, ids in todo:
        seq = usable_answer(corpus[k], ids, max_new_tokens, stop) if corpus and k in corpus else None
        if seq is not None:
            known[k] = (seq, len(ids))
    todo = [(k, ids) for k, ids in todo if k not in known]
    total = len(done) + len(known) + len(todo)
    stage = "Reading answers from the corpus" if known else "Generating answers"
    pending: list[tuple[int, Generated]] = []
    counted = {"tokens": sum(p.num_tokens for p in parts)}

    def save() -> None:
        part = FeatureSet.from_sequences([g for _, g in pending])
        keys = [k for k, _ in pending]
        part.save(shard_dir / _answers_shard_name(target_key, keys), keys=keys, meta={"target": target_key})
        parts.append(part)
        pending.clear()

    def on_done(key: int, gen: Generated) -> None:
        pending.append((key, gen))
        done.add(key)
        counted["tokens"] += gen.tokens.numel()
        if len(pending) >= shard_size:
            save()
        if progress:
            progress(f"{stage} ({len(done)}/{total}, {counted['tokens']:,} tokens)", len(done) / total)

    try:
        for key, (seq, prompt_len) in known.items():
            if should_cancel():
                raise Cancelled("reading the corpus cancelled")
            features, labels = read_once(model, seq[:-1])
            on_done(key, Generated(tokens=torch.tensor(seq[:-1], dtype=torch.int32), features=features,
                                   labels=labels, prompt_len=prompt_len))
        stage = "Generating answers"
        if todo:
            greedy_batch(model, todo, max_new_tokens, model.info.eos_token_ids, on_done, slots=slots,
                         should_cancel=should_cancel)
    finally:  # answers finished before a cancel or an error are kept
        if pending:
            save()
    return FeatureSet.concat(parts) if parts else FeatureSet.empty(model.info.hidden_size)


def _answers_made(shard_dir: Path, target_key: str, prompt_ids: list[list[int]]) -> tuple[list["FeatureSet"], set[int]]:
    """The answers in ``shard_dir`` that this target made to these prompts, and their prompt indices.

    Shards of another target (or from before shards recorded theirs), and answers whose prompt
    is no longer the one at their index (the instruction pool is written from this machine's
    standard library), are left out, with a warning that counts them.
    """
    parts, done = [], set()
    foreign = changed = 0
    for path in sorted(shard_dir.glob("answers-*.safetensors")):
        made_by, keys = _shard_header(path)
        if made_by != target_key:
            foreign += len(keys)
            continue
        part = FeatureSet.load(path)
        asked = [i for i, k in enumerate(keys) if k < len(prompt_ids)]  # a larger earlier run: take its prefix
        wanted = [i for i in asked if part.sequence_starts_with(i, prompt_ids[keys[i]])]
        changed += len(asked) - len(wanted)
        parts.append(part.sequences(wanted) if len(wanted) < len(keys) else part)
        done.update(keys[i] for i in wanted)
    if foreign or changed:
        log.warning("%s: %d answers made by another target (or before answers recorded their target) and %d to "
                    "prompts that have changed are not used; they are made again", shard_dir, foreign, changed)
    return parts, done


def _shard_header(path: Path) -> tuple[str | None, list[int]]:
    """(the target a shard's answers were made by, their prompt indices), without reading its features."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("target"), f.get_tensor("keys").tolist()


def _answers_shard_name(target_key: str, keys: list[int]) -> str:
    # The digest keeps a new shard from overwriting one that starts at the same prompt: another
    # target's, or this target's from before some of its prompts changed, with answers still in use.
    digest = hashlib.sha256(json.dumps([target_key, keys]).encode()).hexdigest()[:12]
    return f"answers-{min(keys):06d}-{len(keys)}-{digest}.safetensors"


def read_once(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final-norm feature (float16) and argmax at every position of ``seq``, in one
    pass from an empty cache (the prompt path: exactness is not needed for training data)."""
    model.reset()
    out = model.forward(torch.tensor(seq), hidden=True, prefill=True)
    model.reset()
    return out.hidden.half(), out.logits.argmax(-1).to(torch.int32)


def usable_answer(seq: list[int], prompt_ids: list[int], max_new_tokens: int, stop: set[int]) -> list[int] | None:
    """``seq`` (a corpus entry) cut to ``max_new_tokens`` of answer, or None where it cannot stand in
    for generating: it answers another prompt, or it stopped short of the length asked for."""
    n = len(prompt_ids)
    if seq[:n] != list(prompt_ids) or len(seq) <= n:
        return None
    if len(seq) - n >= max_new_tokens:
        return seq[:n + max_new_tokens]
    return seq if seq[-1] in stop else None


def save_corpus(shard_dir: Path, path: Path, target: str, key: str | None = None) -> int:
    """Add the token ids of every answer target ``key`` finished in ``shard_dir`` (prompt and
    answer, no features) to the corpus at ``path``; return how many it holds. A few MB per
    million tokens: small enough to keep with the project, so the hours of generating them are
    spent once. Without ``key``: the one target whose answers ``shard_dir`` holds."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted(shard_dir.glob("answers-*.safetensors"))
    key = key or _only_target(shard_dir, shards)
    entries = load_corpus(path, target, key)
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:  # the ids only: the features are most of the file
            if (f.metadata() or {}).get("target") != key:
                continue
            keys, tokens, labels, bounds = (f.get_tensor(n).tolist() for n in ("keys", "tokens", "labels", "starts"))
        for i, k in enumerate(keys):
            s, e = bounds[i], bounds[i + 1]
            entries[k] = tokens[s:e] + [labels[e - 1]]
    keys = sorted(entries)
    lengths = [len(entries[k]) for k in keys]
    tensors = {"keys": torch.tensor(keys, dtype=torch.long),
               "tokens": torch.tensor([t for k in keys for t in entries[k]], dtype=torch.int32),
               "starts": torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        save_file(tensors, str(tmp), metadata={"target": target, "target_key": key})
    return len(keys)


def _only_target(shard_dir: Path, shards: list[Path]) -> str:
    made_by = {_shard_header(p)[0] for p in shards} - {None}  # shards from before answers recorded their target
    if not made_by:
        raise SpecPlayError(f"{shard_dir} holds no answers to keep")
    if len(made_by) > 1:
        raise SpecPlayError(f"{shard_dir} holds answers of {len(made_by)} different targets; make the answers "
                            f"to keep in a work folder of their own (--workdir)")
    return made_by.pop()


def load_corpus(path: Path, target: str, key: str) -> dict[int, list[int]]:
    """Prompt index -> token ids, from :func:`save_corpus`; empty (with a log line) when ``path``
    is missing, unreadable or made from another target than ``key`` identifies.

    A corpus from before corpora recorded their target's key is taken for the default target
    alone, loaded from the catalog (which pins its weights): the one such corpus the project keeps.
    """
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if not _corpus_fits(meta, key):
                log.info("%s holds answers of %s (weights %s), not of %s (weights %s): not used", path,
                         meta.get("target"), meta.get("target_key", "unrecorded"), target, key)
                return {}
            keys, tokens, starts = (f.get_tensor(n).tolist() for n in ("keys", "tokens", "starts"))
    except (OSError, SafetensorError, KeyError) as e:  # a corrupt file costs only the time it saves
        log.warning("cannot read the answer corpus %s (%s): answers are generated instead", path, e)
        return {}
    return {k: tokens[starts[i]:starts[i + 1]] for i, k in enumerate(keys)}


def _corpus_fits(meta: dict, key: str) -> bool:
    if "target_key" in meta:
        return meta["target_key"] == key
    return meta.get("target") == DEFAULT_TARGET and key == CATALOG[DEFAULT_TARGET].sha256


def sequence_rows(starts: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For sequences concatenated with boundaries ``starts`` (``[S + 1]``): the rows of the sequences
    at indices ``keep``, in that order, and the boundaries of those sequences taken alone."""
    bounds = starts.tolist()
    idx = [torch.arange(bounds[i], bounds[i + 1]) for i in keep]
    rows = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
    return rows, torch.tensor([0] + [bounds[i + 1] - bounds[i] for i in keep]).cumsum(0)


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

    def save(self, path: Path, keys: list[int] | None = None, meta: dict[str, str] | None = None) -> None:
        """Write atomically; ``keys`` (e.g. the prompts these sequences answer) are stored alongside,
        ``meta`` in the file's metadata."""
        from safetensors.torch import save_file

        # A shard on disk counts as done (extraction resumes past it), so it must never be half written.
        tensors = {"features": self.features.contiguous(), "tokens": self.tokens, "labels": self.labels,
                   "starts": self.starts}
        if keys is not None:
            tensors["keys"] = torch.tensor(keys, dtype=torch.long)
        with replacing(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    @staticmethod
    def load(path: Path) -> "FeatureSet":
        from safetensors.torch import load_file

        d = load_file(str(path))
        return FeatureSet(d["features"], d["tokens"], d["labels"], d["starts"])

    @staticmethod
    def from_sequences(seqs) -> "FeatureSet":
        """From sequences with ``features``, ``tokens`` and ``labels`` (e.g. generated answers)."""
        starts = torch.tensor([0] + [len(q.tokens) for q in seqs]).cumsum(0)
        return FeatureSet(torch.cat([q.features for q in seqs]), torch.cat([q.tokens.to(torch.int32) for q in seqs]),
                          torch.cat([q.labels.to(torch.int32) for q in seqs]), starts)

    @staticmethod
    def empty(hidden: int) -> "FeatureSet":
        return FeatureSet(torch.zeros(0, hidden, dtype=torch.float16), torch.zeros(0, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.long))

    def sequence_starts_with(self, index: int, prefix: list[int]) -> bool:
        start, end = int(self.starts[index]), int(self.starts[index + 1])
        return end - start >= len(prefix) and self.tokens[start:start + len(prefix)].tolist() == prefix

    def sequences(self, keep: list[int]) -> "FeatureSet":
        """The sequences at indices ``keep``, in that order."""
        rows, starts = sequence_rows(self.starts, keep)
        return FeatureSet(self.features[rows], self.tokens[rows], self.labels[rows], starts)

    @staticmethod
    def concat(parts: list["FeatureSet"]) -> "FeatureSet":
        starts = [torch.zeros(1, dtype=torch.long)]
        offset = 0
        for p in parts:
            starts.append(p.starts[1:] + offset)
            offset += p.num_tokens
        return FeatureSet(torch.cat([p.features for p in parts]), torch.cat([p.tokens for p in parts]),
                          torch.cat([p.labels for p in parts]), torch.cat(starts))


def extract_features(target, sequences: list[list[int]], shard_dir: Path, *, target_key: str, shard_size: int = 64,
                     progress: Progress | None = None, should_cancel: Callable[[], bool] = lambda: False) -> FeatureSet:
    """Run the target over ``sequences``; return features and labels. Shards on disk make it
    resumable; each is named by what it holds (the sequences, and ``target_key``: the target
    whose features they are), so a changed text or another target never reads them."""
    if not sequences:
        return FeatureSet.empty(target.info.hidden_size)
    shard_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    n_shards = (len(sequences) + shard_size - 1) // shard_size
    names = [_features_shard_name(s, target_key, sequences[s * shard_size:(s + 1) * shard_size])
             for s in range(n_shards)]
    _warn_of_other_shards(shard_dir, set(names))
    for s in range(n_shards):
        chunk = sequences[s * shard_size:(s + 1) * shard_size]
        path = shard_dir / names[s]
        if path.is_file():
            parts.append(FeatureSet.load(path))
            continue
        feats, toks, labels, starts = [], [], [], [0]
        for seq in chunk:
            if should_cancel():
                raise Cancelled("feature extraction cancelled")
            seq_features, seq_labels = read_once(target, seq)
            feats.append(seq_features)
            labels.append(seq_labels)
            toks.append(torch.tensor(seq, dtype=torch.int32))
            starts.append(starts[-1] + len(seq))
        part = FeatureSet(torch.cat(feats), torch.cat(toks), torch.cat(labels), torch.tensor(starts))
        part.save(path)
        parts.append(part)
        if progress:
            progress(f"Extracting target features (shard {s + 1}/{n_shards})", (s + 1) / n_shards)
    return FeatureSet.concat(parts)


def _features_shard_name(index: int, target_key: str, chunk: list[list[int]]) -> str:
    digest = hashlib.sha256(json.dumps([target_key, chunk]).encode()).hexdigest()[:16]
    return f"shard-{index:04d}-{digest}.safetensors"


def _warn_of_other_shards(shard_dir: Path, names: set[str]) -> None:
    others = [p for p in shard_dir.glob("shard-*.safetensors") if p.name not in names]
    if others:
        log.warning("%s: %d feature shards of another target or text (or from before shards were named by "
                    "their target) are not used", shard_dir, len(others))


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


# ---------------------------------------------------------------- where a training's data lives
_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass(frozen=True)
class DataSettings:
    code_tokens: int = 60_000
    answers: int = 64
    answer_tokens: int = 256
    seq_len: int = 512
    seed: int = 0
    slots: int = 16  # answers generated at once

    def key(self) -> str:
        return f"c{self.code_tokens}-s{self.seed}"


def answers_dir(workdir: Path, settings: DataSettings) -> Path:
    return workdir / f"answers-{settings.answer_tokens}-s{settings.seed}"


def target_key(folder: Path, progress: Progress) -> str:
    """What identifies a target's weights, so that data made by another target (one with the
    same folder name, or the same folder with other weights) is never taken for its own.

    A converted model's marker records the sha256 of the GGUF it was made from (a catalog
    model's is the catalog's); another folder is known by the sha256 of its weights files.
    """
    source = read_marker(folder).get("sha256")
    if source:
        return source
    files = sorted(p for p in folder.iterdir() if p.suffix in _WEIGHTS_SUFFIXES and p.is_file())
    if not files:
        raise ModelError(f"no weights files in {folder} to tell which model it is")
    listing = "".join(f"{p.name} {_file_sha256(p, progress)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def _file_sha256(path: Path, progress: Progress) -> str:
    """A weights file's sha256: the name of the blob a hub snapshot links it to, or else hashed
    once (seconds per GB) and remembered with the file's size and modification time."""
    real = path.resolve()
    if real.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", real.name):
        return real.name
    known_file = cache_dir() / "training" / "weights-sha256.json"
    try:
        known = json.loads(known_file.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    stat = real.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    if known.get(str(real), {}).get("stamp") == stamp:
        return known[str(real)]["sha256"]
    sha = sha256_file(real, progress)
    known = {name: seen for name, seen in known.items() if Path(name).exists()}  # not a line per deleted file
    known[str(real)] = {"stamp": stamp, "sha256": sha}
    known_file.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(known_file, json.dumps(known, indent=1) + "\n")
    return sha

