"""`features show --format png`: the features x heads picture (which heads write each feature
shown). matplotlib's object-oriented API with the Agg canvas only, imported lazily; the file
written durably (minigpt.files)."""

from __future__ import annotations

from pathlib import Path

from minigpt.display import figure_png, head_name
from minigpt.features.show import FeaturesView
from minigpt.files import atomic_write_bytes

PNG_FILE = "features.png"


def png_bytes(view: FeaturesView) -> bytes:
    """Features (rows) x heads (columns): each feature's share of decoder norm per head."""
    from matplotlib.figure import Figure

    n = len(view.features)
    fig = Figure(figsize=(2.2 + 0.9 * view.n_head, 1.2 + 0.32 * n))
    ax = fig.add_subplot()
    data = [f.heads for f in view.features]
    im = ax.imshow(data, cmap="viridis", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(view.n_head), [head_name(view.layer, h) for h in range(view.n_head)])
    ax.set_yticks(range(n), [f"{f.index} ({f.density:.3f})" for f in view.features])
    ax.set_ylabel("feature (density)")
    ax.set_title(f"which heads write each feature (layer {view.layer})", fontsize=10)
    fig.colorbar(im, ax=ax, label="share of decoder norm")
    fig.tight_layout()
    return figure_png(fig)


def write_png(view: FeaturesView, out: Path) -> Path:
    return atomic_write_bytes(Path(out) / PNG_FILE, png_bytes(view))
