"""`lens.png`: the logit lens (interp.lens) as a picture (matplotlib, headless, lazily imported):
the target's probability at every point and scored position, each cell naming the top token
there, beside the mean over the positions per point."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from minigpt.display import figure_png, visible_token
from minigpt.files import atomic_write_bytes
from minigpt.heads.inspection import Inspection

MAX_CELL_TEXT = 48 * 16  # cells (positions x points) up to which each names its top token


def lens_png(insp: Inspection) -> bytes:
    """Left: rows = scored positions (the query token -> the target), columns = the points
    (after the embedding, after each layer), colour = the target's probability on one fixed
    scale 0..1, text = the top token (bold where it is the target). Right: per point, the
    target's mean probability and the share of positions whose top token is the target."""
    from matplotlib.figure import Figure

    lens = insp.lens
    name = insp.token_str or str
    prob = lens.prob.numpy().T  # (P, n_points)
    P, n = prob.shape
    fig = Figure(figsize=(min(30.0, 0.75 * n + 7.5), min(40.0, 0.28 * P + 2.2)),
                 layout="constrained")
    ax, side = fig.subplots(1, 2, width_ratios=[max(4, n), 2])
    im = ax.imshow(prob, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest",
                   aspect="auto")
    if P * n <= MAX_CELL_TEXT:
        for j in range(P):
            for i in range(n):
                top, hit = int(lens.top[i, j]), int(lens.rank[i, j]) == 0
                ax.text(i, j, _short(name(top)), ha="center", va="center",
                        fontsize=6, fontweight="bold" if hit else "normal",
                        color="white" if prob[j, i] > 0.55 else "black")
    ax.set_xticks(range(n), lens.points, fontsize=7)
    ax.set_yticks(range(P), [f"{p} {_short(insp.token_strs[p])} -> {_short(name(t))}"
                             for p, t in zip(lens.positions, lens.targets)], fontsize=6)
    ax.set_xlabel("residual stream after (embed: the embeddings; Lk: layer k)")
    ax.set_ylabel("position  token -> target")
    fig.suptitle("logit lens: the residual stream read through the final norm and the "
                 "unembedding; colour = the target's probability, text = the top token there "
                 "(bold: it is the target)", fontsize=9, wrap=True)
    fig.colorbar(im, ax=ax, shrink=0.8, label="target probability")
    _summary(side, lens)
    return figure_png(fig)


def _short(s: str) -> str:
    """A token as a cell or tick label: 8 characters at most, `$` kept out of mathtext."""
    return visible_token(s, 8).replace("$", r"\$")


def _summary(ax, lens) -> None:
    """Per point: the mean target probability and the top-1 share, both on 0..1."""
    rows = lens.summary()
    x = np.arange(len(rows))
    ax.plot(x, [r["prob"] for r in rows], "o-", color="tab:blue", label="mean probability")
    ax.plot(x, [r["top_is_target"] for r in rows], "s--", color="tab:green",
            label="top token = target")
    ax.set_xticks(x, lens.points, fontsize=7)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"over the {len(lens.positions)} positions", fontsize=8)
    ax.legend(fontsize=7, loc="upper left")


def write_lens_png(insp: Inspection, out_dir: Path) -> list[Path]:
    """`lens.png` when `insp` has the logit lens."""
    if insp.lens is None:
        return []
    return [atomic_write_bytes(out_dir / "lens.png", lens_png(insp))]
