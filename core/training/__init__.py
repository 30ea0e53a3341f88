"""Training draft heads (Medusa, EAGLE) on the target's own features: self-distillation on CPU."""
