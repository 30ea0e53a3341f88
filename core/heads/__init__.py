"""Trainable draft heads (Medusa, EAGLE) and their files, used by the methods and the trainers."""

from core.heads.eagle import EagleHead, head_config
from core.heads.files import draft_lm_rows, load_heads, resolve_heads_path, save_heads, shipped_path
from core.heads.medusa import MedusaHeads

__all__ = ["EagleHead", "MedusaHeads", "draft_lm_rows", "head_config", "load_heads", "resolve_heads_path",
           "save_heads", "shipped_path"]
