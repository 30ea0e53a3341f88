"""Weights: where a model's files come from and how they are made ready on disk: the catalog of
built-in models, GGUF files read and checked, the user cache's prepared layers and their checks, and
tokenizers read from a model's files.

May import: the helpers in ``specplay.core`` and :mod:`specplay.core.kernels`.
"""
