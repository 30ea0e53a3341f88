"""Models: the interface speculation drives, the native decoder, the transformers fallback, loading."""

from specplay.core.models.base import CausalLM, ForwardOutput, ModelInfo
from specplay.core.models.loader import LoadedModel, check_draft_compatible, load_model

__all__ = ["CausalLM", "ForwardOutput", "ModelInfo", "LoadedModel", "check_draft_compatible", "load_model"]
