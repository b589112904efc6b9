"""Untrusted text made safe to show: the one list of characters that must never reach a
terminal (or a label) raw, and the two ways minigpt shows them.

Text from elsewhere (run and file names, error messages quoting them, generated samples, token
strings) may hold characters that a terminal obeys instead of showing: C0 controls (ESC starts
an escape sequence that moves the cursor or recolours the screen, CR overwrites a line), DEL,
C1 controls (U+009B is a one-character CSI on many terminals), the line and paragraph
separators, and the bidirectional marks, embeddings, overrides and isolates (which reorder
what is shown, so a line can read differently from what it holds). Each is shown escaped,
`\\xNN` below U+0100 and `\\uNNNN` above.

- `printable(text, keep="")`: every such character escaped except those in `keep` (a sample's
  newlines and tabs, say, which are its layout, not a command).
- `head_name(layer, head)` and `mlp_name(layer)`: a head as every table, log line, picture,
  JSON and circuit node names it, `L1.H2`, and an MLP node, `L0.MLP` (the analyses in
  minigpt.interp name their nodes with them too).
- `visible_token(s, max_len)`: a token's text for labels: whitespace made visible (space ·,
  newline ↵, tab →, CR ␍), every other such character escaped.
- `duration(seconds)` and `size(n_bytes)`: the one spelling of a time (an elapsed time, an
  ETA, a run's wall time, a cost estimate: `42s`, `3m05s`, `2h10m`, `9d`) and of a number of
  bytes (a file limit, a memory estimate, an export: `16 MiB`, `5.8 GiB`).
- `figure_png(fig)`: a matplotlib figure as PNG bytes, the one way every picture minigpt
  draws (curves, heads, circuits, features) becomes bytes to write.
"""

from __future__ import annotations

CONTROLS = frozenset([*range(0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, 0x2028, 0x2029,
                      *range(0x202A, 0x202F), *range(0x2066, 0x206A)])
_ESCAPED = {c: (f"\\x{c:02x}" if c < 256 else f"\\u{c:04x}") for c in CONTROLS}
_VISIBLE_WHITESPACE = {ord(" "): "·", ord("\n"): "↵", ord("\t"): "→", ord("\r"): "␍"}


def printable(text: object, keep: str = "") -> str:
    """`str(text)` with every character of CONTROLS escaped, except those in `keep`."""
    table = _ESCAPED if not keep else {c: e for c, e in _ESCAPED.items() if chr(c) not in keep}
    return str(text).translate(table)


def visible_token(s: str, max_len: int = 0) -> str:
    """A token's text for labels: whitespace made visible (space ·, newline ↵, tab →, CR ␍),
    every other control escaped, shortened to `max_len` characters with … (0 = no limit);
    the empty string is ∅."""
    text = s.translate(_VISIBLE_WHITESPACE).translate(_ESCAPED) or "∅"
    if max_len and len(text) > max_len:
        text = text[: max_len - 1] + "…"
    return text


def head_name(layer: int, head: int) -> str:
    """The one spelling of a head: `L{layer}.H{head}`, e.g. L1.H2."""
    return f"L{layer}.H{head}"


def mlp_name(layer: int) -> str:
    """The one spelling of a layer's MLP as a node of a circuit: `L{layer}.MLP`, e.g. L0.MLP."""
    return f"L{layer}.MLP"


def duration(seconds: float) -> str:
    """'0.4s', '42s', '3m05s', '2h10m', '9d', '3.17e+13 years' (seconds below 10 to a tenth;
    days from two days on, years from two years on)."""
    s = max(float(seconds), 0.0)
    if s < 9.95:
        return f"{s:.1f}s"
    if s >= 2 * YEAR:
        return f"{s / YEAR:.3g} years"
    r = round(s)
    if r < 60:
        return f"{r}s"
    if r < 3600:
        return f"{r // 60}m{r % 60:02d}s"
    if r < 2 * 86400:
        return f"{r // 3600}h{r % 3600 // 60:02d}m"
    return f"{round(s / 86400)}d"


YEAR = 365 * 86400.0


def size(n_bytes: float) -> str:
    """'512 bytes', '4 KiB', '16 MiB', '5.8 GiB', '1.1e+04 TiB' (binary units, 3 figures)."""
    n = max(float(n_bytes), 0.0)
    for unit, scale in (("TiB", 2.0 ** 40), ("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20),
                        ("KiB", 2.0 ** 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} bytes"


def figure_png(fig, dpi: int = 100) -> bytes:
    """The PNG bytes of a matplotlib `Figure`, drawn on the Agg canvas (headless; matplotlib is
    imported here, lazily). Glyphs missing from the font (CJK, emoji in a token or run name)
    are drawn as boxes without a warning."""
    import io
    import warnings

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
