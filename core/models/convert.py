"""The former home of model conversion, now :mod:`specplay.core.models.prepare`.

Kept only while core/cli.py, core/bench.py, app/panels.py, tests/test_remote.py and
tests/test_real_models.py import these names from here; delete it once they import prepare.
"""

from specplay.core.models.prepare import (cached_entries, catalog_gguf, catalog_status, models_root,
                                          prepare_catalog_model, prune)

__all__ = ["cached_entries", "catalog_gguf", "catalog_status", "models_root", "prepare_catalog_model", "prune"]
