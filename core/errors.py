"""Errors that reach the user as one clear line (CLI) or a dialog (GUI).

Anything raised as a :class:`SpecPlayError` is an expected failure with a message written
for the person at the keyboard; anything else is a bug and keeps its traceback.
"""


class SpecPlayError(Exception):
    """An expected failure whose message is meant for the user."""


class ModelError(SpecPlayError):
    """A model cannot be found, verified, converted or loaded."""


class TokenizerMismatchError(ModelError):
    """The draft model does not share the target's tokenizer."""


class ConfigError(SpecPlayError, ValueError):
    """A configuration value is out of range or inconsistent."""


class Cancelled(SpecPlayError):
    """A long operation (conversion, loading, training) was cancelled by the user."""


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CPU or GPU), whatever layer raised it."""
    import torch

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
