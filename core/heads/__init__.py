"""Trainable draft heads (Medusa, EAGLE) and their files, used by the methods and the trainers."""

from specplay.core.heads.eagle import EagleHead, head_config
from specplay.core.heads.files import draft_lm_rows, load_heads, resolve_heads_path, save_heads, shipped_path
from specplay.core.heads.medusa import MedusaHeads

__all__ = ["EagleHead", "MedusaHeads", "draft_lm_rows", "head_config", "load_heads", "resolve_heads_path",
           "save_heads", "shipped_path"]
