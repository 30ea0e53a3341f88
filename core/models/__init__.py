"""Models: the interface speculation drives (:class:`CausalLM`), the native decoder and its layers,
the exact k-quant kernel and the other linear kinds, the transformers fallback, llama.cpp's engine,
and loading a model by name or path (its weights made ready on disk and cached once).

May import: the helpers in ``specplay.core`` only (the bottom room of the house).
"""

from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo
from specplay.core.models.loader import LoadedModel, check_draft_compatible, load_model

__all__ = ["CausalLM", "ForwardOutput", "ModelInfo", "LoadedModel", "check_draft_compatible", "load_model"]
