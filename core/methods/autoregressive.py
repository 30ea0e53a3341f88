"""Plain decoding: one target token per step, the baseline every method is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from specplay.core.decoding.method import Method, MethodConfig
from specplay.core.decoding.types import Draft


@dataclass(frozen=True)
class AutoregressiveConfig(MethodConfig):
    pass


class Autoregressive(Method):
    name = "autoregressive"

    def propose(self, ctx, budget: int) -> Draft:
        return Draft()
