"""How the terminal tables look: the one colour scale (inspect-heads' scores and attention
weights, the logit lens's probabilities: a number in [0, 1] as a background from white to dark
blue), and the one way a table carries its words (`worded`: its title above and its caption
below as lines of their own, as wide as the terminal and wrapped at words, never squeezed into
the table's own width, where a piped 80-column table broke `closure 1.4e-06` apart)."""

from __future__ import annotations

from rich.color import Color
from rich.style import Style


def worded(table, title: str | None = None, caption: str | None = None):
    """`table` with `title` above it and `caption` below it, each a left-aligned line wrapped
    at words to the terminal (rich Text: never markup), as one renderable."""
    from rich.console import Group
    from rich.text import Text

    parts = ([Text(title, style="table.title")] if title else []) + [table]
    if caption:
        parts.append(Text(caption, style="table.caption"))
    return Group(*parts)


def shade(v: float) -> Style:
    """Background for a weight in [0, 1]: white -> dark blue; white text on dark cells."""
    v = min(1.0, max(0.0, v))
    rgb = [round(255 * (1 - v) + c * v) for c in (20, 50, 130)]
    return Style(bgcolor=Color.from_rgb(*rgb), color="white" if v > 0.45 else "black")
