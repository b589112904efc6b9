"""PNG heatmaps of attention maps (matplotlib, headless).

matplotlib is imported lazily, and only its object-oriented API with the Agg canvas is used
(`Figure` + `FigureCanvasAgg`): no pyplot, no global backend switch, no display needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from minigpt.display import figure_png, head_name, visible_token
from minigpt.files import atomic_write_bytes
from minigpt.heads.inspection import Inspection

CMAP = "viridis"
MAX_LABELS = 64  # more tokens than this: label every k-th token so the text stays legible


def _masked(attn_map) -> np.ma.MaskedArray:
    """(T, T) map with the causal upper triangle masked (drawn blank, not as 0)."""
    a = np.asarray(attn_map, dtype=np.float32)
    return np.ma.masked_where(np.triu(np.ones_like(a, dtype=bool), k=1), a)


def _label(s: str) -> str:
    # `$` would switch matplotlib into mathtext; the rest is plain text (no markup)
    return visible_token(s, 12).replace("$", r"\$")


def _cmap():
    import matplotlib

    return matplotlib.colormaps[CMAP].with_extremes(bad="white")


def grid_png(insp: Inspection) -> bytes:
    """`grid_figure` as PNG bytes."""
    return figure_png(grid_figure(insp))


def grid_figure(insp: Inspection):
    """All layers (rows) x heads (columns), each titled with its dominant type; token positions
    on the outer axes, one colour bar for all maps, and the induction probe's copy boundary."""
    from matplotlib.figure import Figure

    L, H, T = insp.n_layer, insp.n_head, len(insp.tokens)
    fig = Figure(figsize=(2.2 * H + 1.4, 2.3 * L + 1.0), layout="constrained")
    axes = fig.subplots(L, H, squeeze=False, sharex=True, sharey=True)
    cmap = _cmap()
    ticks = _position_ticks(T)
    im = None
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            im = ax.imshow(_masked(insp.attention[layer, head]), cmap=cmap, vmin=0.0, vmax=1.0,
                           interpolation="nearest")
            ax.set_title(f"{head_name(layer, head)}: {insp.dominant(layer, head)}", fontsize=9)
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.tick_params(labelsize=7)
            _mark_copy(ax, insp)
        axes[layer][0].set_ylabel(f"layer {layer}\nquery position", fontsize=8)
    for head in range(H):
        axes[-1][head].set_xlabel("key position", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")
    copy = ("" if insp.copy_start is None else
            f"; red lines: the probe's second copy starts at position {insp.copy_start}")
    fig.suptitle(f"attention, {T} tokens ({insp.source}); rows = queries, columns = keys"
                 f"{copy}", fontsize=10)
    return fig


def _position_ticks(T: int) -> list[int]:
    """About five round token positions from 0 to T-1, for small maps."""
    step = max(1, math.ceil(T / 5 / 4) * 4) if T > 8 else 1
    return list(range(0, T, step))


def _mark_copy(ax, insp: Inspection) -> None:
    """Thin red lines where the induction probe's second copy starts (rows and columns)."""
    if insp.copy_start is not None:
        at = insp.copy_start - 0.5
        ax.axhline(at, color="red", linewidth=0.8, alpha=0.8)
        ax.axvline(at, color="red", linewidth=0.8, alpha=0.8)


SCORES_PER_TITLE_LINE = 3  # "induction 0.97, previous 0.12, duplicate 0.30" ~ 3.5 in at 9 pt


def head_title(insp: Inspection, layer: int, head: int) -> str:
    """The per-head title: the dominant type, then the applicable scores a few per line (one
    line of all eight ran off the right edge of a small figure)."""
    s = insp.head_scores(layer, head)
    shown = [f"{n} {v:.2f}" for n, v in s.items() if not math.isnan(v)]
    rows = [", ".join(shown[i:i + SCORES_PER_TITLE_LINE])
            for i in range(0, len(shown), SCORES_PER_TITLE_LINE)]
    return "\n".join([f"layer {layer} head {head}: {insp.dominant(layer, head)}", *rows])


def head_figure(insp: Inspection, layer: int, head: int):
    """One head's T x T map with token labels on both axes, a colour bar and the title: a
    matplotlib Figure (Agg canvas attached), sized so its text lies inside it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    T = len(insp.tokens)
    side = min(30.0, max(5.0, 0.2 * T + 2.0))
    fig = Figure(figsize=(side + 1.2, side), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    im = ax.imshow(_masked(insp.attention[layer, head]), cmap=_cmap(), vmin=0.0, vmax=1.0,
                   interpolation="nearest")
    step = max(1, math.ceil(T / MAX_LABELS))
    ticks = list(range(0, T, step))
    labels = [_label(insp.token_strs[i]) for i in ticks]
    ax.set_xticks(ticks, labels, rotation=90, fontsize=7)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(head_title(insp, layer, head), fontsize=9)
    _mark_copy(ax, insp)
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention weight")
    return fig


def head_png(insp: Inspection, layer: int, head: int) -> bytes:
    """`head_figure` as PNG bytes."""
    return figure_png(head_figure(insp, layer, head))


def ablation_png(insp: Inspection) -> bytes:
    """The layer x head table of ablation effects (nats/token the loss rises by with the head
    ablated), on a diverging colour scale centred at 0, each cell labelled with its effect and
    the head's dominant type: what each head carries beside where it looks."""
    from matplotlib.figure import Figure

    ab = insp.ablation
    L, H = insp.n_layer, insp.n_head
    effect = ab.effect.numpy()  # (L, H)
    top = max(float(np.abs(effect).max()), 1e-9)
    fig = Figure(figsize=(min(30.0, 1.1 * H + 2.0), min(30.0, 0.8 * L + 1.6)),
                 layout="constrained")
    ax = fig.subplots()
    im = ax.imshow(effect, cmap="RdBu_r", vmin=-top, vmax=top, interpolation="nearest",
                   aspect="auto")
    if L * H <= 400:  # numbers stay legible
        for layer in range(L):
            for head in range(H):
                v = effect[layer, head]
                ax.text(head, layer, f"{v:+.2f}\n{insp.dominant(layer, head)}", ha="center",
                        va="center", fontsize=7, color="white" if abs(v) > 0.6 * top else "black")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"{ab.mode} ablation: loss {ab.base_loss:.3f} nats/token over {ab.scored}; "
                 "cell = loss ADDED when that head alone is ablated (red: the head helps)",
                 fontsize=8, wrap=True)
    fig.colorbar(im, ax=ax, shrink=0.8, label="loss added (nats/token)")
    return figure_png(fig)


def write_pngs(insp: Inspection, out_dir: Path, heads: Sequence[tuple[int, int]]) -> list[Path]:
    """Write `attention_grid.png`, `attention_L{layer}_H{head}.png` for each selected head and,
    with an ablation, `ablation.png`."""
    paths = [atomic_write_bytes(out_dir / "attention_grid.png", grid_png(insp))]
    if insp.ablation is not None:
        paths.append(atomic_write_bytes(out_dir / "ablation.png", ablation_png(insp)))
    for layer, head in heads:
        paths.append(atomic_write_bytes(out_dir / f"attention_L{layer}_H{head}.png",
                                        head_png(insp, layer, head)))
    return paths
