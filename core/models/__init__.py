"""Models: the interface speculation drives (:class:`CausalLM`), the native decoder and its layers,
the transformers fallback, llama.cpp's engine, this machine's measurements of them, and loading a
model by name or path.

May import: the helpers in ``specplay.core``, :mod:`specplay.core.kernels` and :mod:`specplay.core.weights`.
"""

from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo
from specplay.core.models.loader import LoadedModel, check_draft_compatible, load_model

__all__ = ["CausalLM", "ForwardOutput", "ModelInfo", "LoadedModel", "check_draft_compatible", "load_model"]
