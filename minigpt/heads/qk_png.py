"""`qk_L{l}_H{h}.png`: one head's scores split by writer (interp.qk) as a picture (matplotlib,
headless, lazily imported): a query-writer x key-writer heatmap of the terms' margins (means
over the pairs), names on both axes, the head and its pairs in the title."""

from __future__ import annotations

from pathlib import Path

from minigpt.display import figure_png
from minigpt.files import atomic_write_bytes
from minigpt.interp.qk import QKHead

MAX_CELL_TEXT = 16 * 16  # writers x writers up to which each cell prints its number
PAIRS_SHOWN = 12  # pairs named in the title (their count is always given)


def qk_file(h: QKHead) -> str:
    return f"qk_L{h.layer}_H{h.head}.png"


def pairs_text(h: QKHead) -> str:
    """The pairs as `query:key`, the first PAIRS_SHOWN of them, and how many there are."""
    shown = ", ".join(f"{t}:{s}" for _, t, s in h.pairs[:PAIRS_SHOWN])
    more = f", ... ({len(h.pairs)} pairs)" if len(h.pairs) > PAIRS_SHOWN else ""
    return shown + more


def qk_png(h: QKHead, pairs_what: str = "") -> bytes:
    """Rows = query writers, columns = key writers, colour = the term's mean margin on a scale
    symmetric around 0 (red: the term favours the chosen key over the query's other keys)."""
    from matplotlib.figure import Figure

    grid = h.margin_grid.mean(0).numpy()  # (W, W)
    W = grid.shape[0]
    side = min(40.0, 0.32 * W + 3.5)
    fig = Figure(figsize=(side + 1.5, side), layout="constrained")
    ax = fig.subplots()
    lim = max(float(abs(grid).max()), 1e-12)
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
    if W * W <= MAX_CELL_TEXT:
        for i in range(W):
            for j in range(W):
                ax.text(j, i, f"{grid[i, j]:+.2f}", ha="center", va="center", fontsize=7,
                        color="white" if abs(grid[i, j]) > 0.6 * lim else "black")
    size = 8 if W <= 24 else 5
    ax.set_xticks(range(W), h.writers, rotation=90, fontsize=size)
    ax.set_yticks(range(W), h.writers, fontsize=size)
    ax.set_xlabel("key writer")
    ax.set_ylabel("query writer")
    fig.suptitle(f"{h.name}: margin of each (query writer x key writer) term, mean over the "
                 f"pairs (query:key) {pairs_text(h)}; score {float(h.scores.mean()):+.3f}, "
                 f"margin {float(h.margins.mean()):+.3f}, closure {h.closure:.1e}"
                 + (f"\npairs: {pairs_what}" if pairs_what else ""), fontsize=8, wrap=True)
    fig.colorbar(im, ax=ax, shrink=0.8, label="margin (score minus its mean over the keys)")
    return figure_png(fig)


def write_qk_pngs(heads: list[QKHead] | None, out: Path, pairs_what: str = "") -> list[Path]:
    """One PNG per head (none when nothing was split)."""
    return [atomic_write_bytes(out / qk_file(h), qk_png(h, pairs_what)) for h in heads or []]
