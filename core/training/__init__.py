"""Training draft heads (Medusa, Hydra, EAGLE, EAGLE-3) on the target's own features:
self-distillation on CPU, its data (the target's answers and features, cached and resumable),
the recipes and their comparison, and τ measured on held-out answers for the manifest.

May import: the helpers, :mod:`specplay.core.models`, :mod:`specplay.core.heads`,
:mod:`specplay.core.decoding` and :mod:`specplay.core.methods` (τ is measured with EAGLE's tree).
"""
