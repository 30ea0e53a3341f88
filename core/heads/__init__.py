"""Trainable draft heads and their files: Medusa's and Hydra's heads on the target's last hidden
state, EAGLE's and EAGLE-3's feature-predicting heads, and the heads files (weights, the manifest
of how they were trained and for which target) that the methods read and the trainers write.

May import: the helpers in ``specplay.core`` and :mod:`specplay.core.models` (layers, linear kinds).
"""

from specplay.core.heads.eagle import EagleHead, head_config
from specplay.core.heads.files import (draft_lm_rows, features_warning, heads_manifest, load_heads,
                                      read_manifest, resolve_heads_path, save_heads, shipped_path)
from specplay.core.heads.medusa import MedusaHeads

__all__ = ["EagleHead", "MedusaHeads", "draft_lm_rows", "features_warning", "head_config", "heads_manifest",
           "load_heads", "read_manifest", "resolve_heads_path", "save_heads", "shipped_path"]
