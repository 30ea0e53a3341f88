"""Prompts in, text out: chat templates and streaming detokenization."""

from __future__ import annotations

from specplay.core.errors import ConfigError

MAX_PROMPT_CHARS = 200_000


def lone_surrogate_at(text: str) -> int | None:
    """Where ``text`` holds a lone surrogate, which no tokenizer can read (an argument that is not
    UTF-8 reaches Python so, and JSON may escape one), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def encode_prompt(tokenizer, prompt: str, chat_template: bool = True, system: str | None = None) -> list[int]:
    """Token ids for a user prompt, wrapped in the model's chat template unless disabled."""
    if prompt is None or not prompt.strip():
        raise ConfigError("the prompt is empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ConfigError(f"the prompt is {len(prompt):,} characters; the limit is {MAX_PROMPT_CHARS:,}")
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return encode_messages(tokenizer, messages)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template a conversation (ending with a user turn) and tokenize it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Detokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    Byte-level BPE tokens can end inside a multi-byte UTF-8 character; such text is held
    back until a later token completes it. Decoding looks only at a short window (the
    tokens since the last emitted text, plus a little context), so each token costs O(1).
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the context window
        self._read = 0  # first token whose text has not been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> list[str]:
        """Append tokens; return the text each one adds (possibly empty)."""
        pieces = []
        for t in token_ids:
            self.ids.append(t)
            context = self._decode(self.ids[self._prefix : self._read])
            window = self._decode(self.ids[self._prefix :])
            if window.endswith("\ufffd") or len(window) < len(context):
                pieces.append("")  # an incomplete character: wait for the next token
                continue
            piece = window[len(context) :]
            self.text += piece
            pieces.append(piece)
            self._prefix, self._read = self._read, len(self.ids)
        return pieces

    def piece(self, token_id: int) -> str:
        """Standalone text of one token (for rejected candidates that never enter the output)."""
        return self._decode([token_id])
