"""Colours and marks for token fates and methods.

Fates use the Okabe-Ito palette (designed to stay distinguishable under the common forms
of colour blindness), and every fate also has a mark that does not depend on colour at
all: rejected tokens are struck through, resampled ones underlined, bonus ones overlined.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from PySide6.QtGui import QColor

from specplay.core.decoding.types import Fate


@dataclass(frozen=True)
class FateStyle:
    label: str
    colour: str  # the pure palette colour (legend chips, tree nodes, chart accents)
    text: str  # text colour in the token view
    tint_alpha: float  # background tint strength (0 = no background)
    strike: bool = False
    underline: bool = False
    overline: bool = False
    description: str = ""

    def background(self, shade: int = 0) -> QColor | None:
        """The token background; ``shade`` alternates so neighbouring tokens stay apart."""
        if self.tint_alpha <= 0:
            return None if shade == 0 else QColor(0, 0, 0, 14)
        return tint(self.colour, self.tint_alpha * (1.0 if shade == 0 else 1.45))


FATE_STYLES: dict[Fate, FateStyle] = {
    Fate.ACCEPTED: FateStyle("accepted", "#009E73", "#003d2c", 0.24,
                             description="a draft token the target verified"),
    Fate.REJECTED: FateStyle("rejected", "#D55E00", "#a0410a", 0.10, strike=True,
                             description="a draft token the target turned down (shown where it was tried)"),
    Fate.RESAMPLED: FateStyle("resampled", "#CC79A7", "#5c1f44", 0.34, underline=True,
                              description="the target's own token in place of a rejected one"),
    Fate.BONUS: FateStyle("bonus", "#0072B2", "#00304d", 0.22, overline=True,
                          description="the target's extra token after a fully accepted draft"),
    Fate.TARGET: FateStyle("target", "#777777", "#202020", 0.0,
                           description="plain step: nothing drafted, the target's own token"),
}

# Method colours for charts (Paul Tol's "bright" scheme, also colour-blind safe); the
# baseline is grey so every accelerated method stands out against it.
_METHOD_COLOURS = ["#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#332288", "#117733"]
_BASELINE = "#888888"


def tint(colour: str, alpha: float) -> QColor:
    """``colour`` blended onto white (opaque, so overlapping selections look the same)."""
    c = QColor(colour)
    a = max(0.0, min(1.0, alpha))
    return QColor(round(255 + (c.red() - 255) * a), round(255 + (c.green() - 255) * a),
                  round(255 + (c.blue() - 255) * a))


def method_colour(name: str, order: list[str]) -> str:
    """A stable colour per method: its index in ``order`` (the method registry's order)."""
    if name == "autoregressive":
        return _BASELINE
    others = [n for n in order if n != "autoregressive"]
    i = others.index(name) if name in others else zlib.crc32(name.encode())
    return _METHOD_COLOURS[i % len(_METHOD_COLOURS)]
