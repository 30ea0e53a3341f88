"""A model's tokenizer and chat template without transformers: built from a GGUF's metadata, kept as a
``tokenizer.json`` and read back by the ``tokenizers`` library alone.

transformers' GGUF conversion took 17-37 s of a first launch (it turns the 151,936 tokens and 151,387
merges into Python objects, in a child process), and loading its tokenizer 0.9 s of every later start
(transformers' import, then its tokenizer class rebuilding the pipeline). A byte-level BPE tokenizer
is four facts a GGUF states: the vocabulary, the merges, which tokens are control tokens, and the
pre-tokenizer's name; this builds the same pipeline transformers' ``Qwen2Tokenizer`` runs (NFC, the
Qwen2 split, byte-level bytes, byte-level decoding; control tokens special, user-defined tokens
matched whole but not special) and renders chat templates in a sandbox set up as transformers sets
its own (trimmed blocks, loop controls, a ``tojson`` that keeps non-ASCII text). A kind it does not
build (another tokenizer model or pre-tokenizer) returns None and keeps transformers' path.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from specplay.core.errors import ModelError

#: Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits,
#: punctuation runs, newlines, spaces (llama.cpp's ``qwen2`` pre-type).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: GGUF token types (llama.cpp's ``llama_token_type``): a control token is special, a user-defined
#: one is matched whole in text but is not special (Qwen's ``<tool_call>``).
_CONTROL, _USER_DEFINED = 3, 4
#: The transformers class a folder's ``tokenizer_config.json`` names for a tokenizer this module reads.
TOKENIZER_CLASS = "Qwen2Tokenizer"
TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTokenizer:
    """Text to token ids and back, and a conversation through the model's chat template: the part of a
    transformers tokenizer SpecPlay calls, on a ``tokenizers.Tokenizer``."""

    def __init__(self, backend, specials: dict[str, str | None], chat_template: str | None):
        self.backend = backend
        self.specials = dict(specials)
        self.chat_template = chat_template
        self._template = None

    def _id(self, name: str) -> int | None:
        token = self.specials.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        # A byte-level BPE's text is its bytes: transformers skips the clean-up for BPE too.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False):
        if not self.chat_template:
            raise ModelError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                                     tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                                     **{k: v for k, v in self.specials.items() if v is not None})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save(self, folder: Path) -> None:
        """Write the tokenizer as transformers' ``save_pretrained`` lays it out, so either library reads it."""
        self.backend.save(str(folder / TOKENIZER_FILE))
        config = {"tokenizer_class": TOKENIZER_CLASS, "backend": "tokenizers", **self.specials}
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        if self.chat_template:
            (folder / TEMPLATE_FILE).write_text(self.chat_template)


def _compile(source: str):
    """The chat template in a sandbox (templates are a model file's code), with transformers' settings."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ModelError(f"the model's chat template cannot be read: {exc}") from None


def unbuilt_reason(index) -> str | None:
    """Why :func:`from_gguf` does not build this GGUF's tokenizer (transformers' conversion does), or None."""
    meta = index.metadata
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if model != "gpt2" or pre != "qwen2":
        return f"its tokenizer is {model!r} with the {pre!r} pre-tokenizer (built here: 'gpt2' with 'qwen2')"
    if meta.get("tokenizer.ggml.add_bos_token") or meta.get("tokenizer.ggml.add_eos_token"):
        return "its tokenizer adds a begin or end token"
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
        if key not in index.lengths:
            return f"it has no {key}"
    return None


def from_gguf(index) -> ChatTokenizer | None:
    """The tokenizer a GGUF's metadata describes, or None where it is not a kind built here
    (:func:`unbuilt_reason`). A vocabulary that contradicts itself is a :class:`ModelError`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if unbuilt_reason(index) is not None:
        return None
    tokens = index.array("tokenizer.ggml.tokens")
    kinds = index.array("tokenizer.ggml.token_type")
    merges = index.array("tokenizer.ggml.merges")
    where = index.path.name
    if len(kinds) != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise ModelError(f"{where}: its token types ({len(kinds):,}) do not match its tokens ({len(tokens):,})")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelError(f"{where}: its vocabulary lists a token twice")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab or left + right not in vocab:
            raise ModelError(f"{where}: its merge {merge!r} joins tokens its vocabulary does not have")
        pairs.append((left, right))
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(tokens[i], special=kinds[i] == _CONTROL, normalized=False)
                        for i in range(len(tokens)) if kinds[i] in (_CONTROL, _USER_DEFINED)])

    def token(key: str) -> str | None:
        i = index.metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    specials = {"bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
                "unk_token": token("unknown")}
    template = index.metadata.get("tokenizer.chat_template")
    return ChatTokenizer(backend, specials, template if isinstance(template, str) else None)


#: The tokenizers read so far, by the digest of the GGUF metadata they were made from: a draft of the
#: target's family shares the target's (0.3 s a start saved).
_READ: dict[str, object] = {}


def read_tokenizer(folder: Path, digest: str | None = None) -> ChatTokenizer | None:
    """A converted folder's tokenizer where it is one this module reads (its config names
    :data:`TOKENIZER_CLASS`), else None (transformers reads it). ``digest``: the folder's record of
    the GGUF tokenizer it was made from, under which one read is shared."""
    from tokenizers import Tokenizer, normalizers

    config_file, tokenizer_file = folder / CONFIG_FILE, folder / TOKENIZER_FILE
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return None
    try:
        config = json.loads(config_file.read_text())
        if config.get("tokenizer_class") != TOKENIZER_CLASS:
            return None
        backend = _READ.get(digest) if digest else None
        if backend is None:
            backend = Tokenizer.from_file(str(tokenizer_file))
            backend.normalizer = normalizers.NFC()  # as transformers' Qwen2 tokenizer sets on loading
            if digest:
                _READ[digest] = backend
    except Exception as exc:  # a damaged file: tokenizers' own exception, JSON's, the disk's
        raise ModelError(f"the tokenizer in {folder} cannot be read ({exc}); `specplay models prune` "
                         "and a new start remake it") from None
    template_file = folder / TEMPLATE_FILE
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    return ChatTokenizer(backend, {k: _content(config.get(k)) for k in _SPECIAL_NAMES}, template)


def _content(token) -> str | None:
    """A special token as a tokenizer config names it (a string, or transformers' dict of one)."""
    return token.get("content") if isinstance(token, dict) else token
