"""PNG pictures of how heads work together (matplotlib, headless, lazily imported):
`composition.png` (one heatmap per Q/K/V composition kind: later heads by earlier heads, with
the random-weights baseline in the title) and `circuits.png` (the layer x head tables of direct
logit attribution and activation patching, side by side, each on one fixed scale: the model's
logit for DLA, +-1 for the patching fraction)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from minigpt.display import figure_png, head_name
from minigpt.files import atomic_write_bytes
from minigpt.heads.inspection import PATCH_READING, Inspection
from minigpt.interp.head_circuits import KINDS, Composition

KIND_TITLE = {"q": "Q-composition", "k": "K-composition", "v": "V-composition"}


def composition_png(comp: Composition, title: str = "") -> bytes:
    """Three panels: rows = each head of layers 1.. (the reader), columns = each head of the
    layers before the last (the writer); blank where the writer is not in an earlier layer."""
    from matplotlib.figure import Figure

    L, H = comp.scores["q"].shape[:2]
    rows = [(la, h) for la in range(1, L) for h in range(H)]
    cols = [(la, h) for la in range(L - 1) for h in range(H)]
    top = max(float(comp.scores[k].max()) for k in KINDS) or 1.0
    side = min(12.0, 0.28 * len(cols) + 2.2)
    fig = Figure(figsize=(3 * side, min(12.0, 0.28 * len(rows) + 1.8)), layout="constrained")
    axes = fig.subplots(1, 3, squeeze=False)[0]
    for ax, kind in zip(axes, KINDS):
        s = comp.scores[kind].numpy()
        grid = np.array([[s[l1, h1, l2, h2] for l1, h1 in cols] for l2, h2 in rows])
        mask = np.array([[l1 >= l2 for l1, _ in cols] for l2, _ in rows])
        im = ax.imshow(np.ma.masked_where(mask, grid), cmap="magma", vmin=0, vmax=top,
                       interpolation="nearest", aspect="auto")
        if len(cols) <= 24:
            ax.set_xticks(range(len(cols)), [head_name(a, b) for a, b in cols], rotation=90,
                          fontsize=7)
            ax.set_yticks(range(len(rows)), [head_name(a, b) for a, b in rows], fontsize=7)
        ax.set_xlabel("earlier head (writes)")
        ax.set_ylabel("later head (reads)")
        ax.set_title(f"{KIND_TITLE[kind]} (random weights: {comp.baseline[kind]:.3f})",
                     fontsize=9)
    fig.colorbar(im, ax=axes.tolist(), shrink=0.8, label="composition score")
    if title:
        fig.suptitle(title, fontsize=10)
    return figure_png(fig)


def _table(ax, values: np.ndarray, title: str, label: str, top: float,
           cmap: str = "RdBu_r") -> None:
    """One layer x head heatmap on the symmetric scale [-top, top] (cells beyond it take the
    end colours; the colour bar's arrows say so), each cell labelled with its value."""
    im = ax.imshow(values, cmap=cmap, vmin=-top, vmax=top, interpolation="nearest",
                   aspect="auto")
    L, H = values.shape
    if L * H <= 400:
        for la in range(L):
            for h in range(H):
                v = values[la, h]
                ax.text(h, la, f"{v:+.2f}", ha="center", va="center", fontsize=7,
                        color="white" if abs(v) > 0.6 * top else "black")
    ax.set_xticks(range(H))
    ax.set_yticks(range(L))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=8, wrap=True)
    beyond = float(np.abs(values).max()) > top
    ax.figure.colorbar(im, ax=ax, shrink=0.8, label=label, extend="both" if beyond else "neither")


def dla_scale(insp: Inspection) -> float:
    """DLA's colour scale: the model's own logit (or logit difference), which the components
    add up to, or the largest head share if one is larger: a head's colour is its share."""
    d = insp.dla
    return max(abs(d.logit), float(d.heads.abs().max()), 1e-9)


PATCH_SCALE = 1.0  # patching's colour scale: a fraction of 1 is the whole clean -> corrupted change


def circuits_png(insp: Inspection) -> bytes:
    """`circuits_figure` as PNG bytes."""
    return figure_png(circuits_figure(insp))


def circuits_figure(insp: Inspection):
    """Direct logit attribution and/or patching per head (whichever were measured), each on
    one fixed scale symmetric around 0: DLA on +-the model's logit (`dla_scale`), patching on
    +-1 (the whole change), so a pale cell is a small share whatever the largest one is."""
    from matplotlib.figure import Figure

    panels = []
    if insp.dla is not None:
        top = dla_scale(insp)
        panels.append((insp.dla.heads.numpy(), f"direct logit attribution: {insp.dla.what}",
                       f"logit (scale: +-{top:.2f}, the model's value)", top))
    if insp.patch is not None:
        p = insp.patch
        title = (f"patching ({p.direction}) from {p.source}: fraction of the clean -> "
                 f"corrupted change of {p.what}")
        panels.append((p.effect.numpy(), title, "fraction (scale: +-1 = the whole change)",
                       PATCH_SCALE))
    L, H = insp.n_layer, insp.n_head
    fig = Figure(figsize=(min(30.0, (1.1 * H + 2.4) * len(panels)), min(30.0, 0.8 * L + 2.4)),
                 layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (values, title, label, top) in zip(axes, panels):
        _table(ax, values, title, label, top)
    if insp.patch is not None:
        axes[-1].set_xlabel("head\n" + "\n".join(textwrap.wrap(
            "Reading it: " + PATCH_READING, width=max(60, int(16 * (1.1 * H + 2.4))))),
            fontsize=7)
    return fig


def write_circuit_pngs(insp: Inspection, out_dir: Path) -> list[Path]:
    """`composition.png` and `circuits.png`, for what `insp` measured."""
    paths = []
    if insp.composition is not None:
        paths.append(atomic_write_bytes(out_dir / "composition.png",
                                        composition_png(insp.composition, insp.run)))
    if insp.dla is not None or insp.patch is not None:
        paths.append(atomic_write_bytes(out_dir / "circuits.png", circuits_png(insp)))
    return paths
