"""The one colour scale of the terminal tables (inspect-heads' scores and attention weights, the
logit lens's probabilities): a number in [0, 1] as a background from white to dark blue."""

from __future__ import annotations

from rich.color import Color
from rich.style import Style


def shade(v: float) -> Style:
    """Background for a weight in [0, 1]: white -> dark blue; white text on dark cells."""
    v = min(1.0, max(0.0, v))
    rgb = [round(255 * (1 - v) + c * v) for c in (20, 50, 130)]
    return Style(bgcolor=Color.from_rgb(*rgb), color="white" if v > 0.45 else "black")
