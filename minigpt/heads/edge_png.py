"""The pictures of `minigpt circuit` (matplotlib, headless, lazily imported): `circuit.png`
(the circuit as a graph: nodes in rows by layer, the embedding at the bottom and the logits on
top, each kept edge drawn with its width by |score| and its colour by sign, the input it goes
into (q, k, v) named where it enters a head, the recovered fraction in the title) and
`faithfulness.png` (the fraction recovered against the fraction of edges kept, one line per
ranking, with each curve's area)."""

from __future__ import annotations

from minigpt.display import figure_png, head_name, mlp_name
from minigpt.interp.edge_graph import FRACTIONS, Circuit

BEND = {"q": 0.25, "k": 0.0, "v": -0.25}  # the curvature of an edge into each input
RANKING_LABEL = {"eap": "EAP", "eap-ig": "EAP-IG", "patching": "real single-edge patching",
                 "eap@positions": "EAP by position (as many positions)",
                 "eap-ig@positions": "EAP-IG by position (as many positions)"}


def _positions(result: Circuit) -> dict[str, tuple[float, float]]:
    """Every node's (x, y): rows bottom to top: embed, then per layer its heads and its MLP
    (a row above the heads), then the logits; each row centred."""
    g = result.graph
    pos = {"embed": ((g.n_head - 1) / 2, 0.0)}
    y = 1.0
    for layer in range(g.n_layer):
        for h in range(g.n_head):
            pos[head_name(layer, h)] = (float(h), y)
        if g.mlp:
            pos[mlp_name(layer)] = ((g.n_head - 1) / 2, y + 1)
        y += 2 if g.mlp else 1
    pos["logits"] = ((g.n_head - 1) / 2, y)
    return pos


def node_size(label: str, fontsize: float) -> float:
    """The marker area (points^2) of a node whose `label` (lines split at newlines) must fit
    inside its circle at `fontsize`: the widest line (~0.62 em a character) plus a margin is
    the diameter; at least the 420 of a head's node."""
    wide = max(len(line) for line in label.split("\n")) * 0.62 * fontsize
    return max(420.0, (wide + 7.0) ** 2)


def _bezier(p0, p1, rad: float, t: float) -> tuple[float, float]:
    """The point at `t` of matplotlib's arc3 curve from p0 to p1 with curvature `rad`."""
    (x0, y0), (x1, y1) = p0, p1
    cx, cy = (x0 + x1) / 2 + rad * (y1 - y0), (y0 + y1) / 2 - rad * (x1 - x0)
    return ((1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t ** 2 * x1,
            (1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t ** 2 * y1)


CLEAR = 0.3  # an edge passes no other node closer than this (data units; rows are 1 apart)


def route(p0, p1, rad: float, others) -> float:
    """The curvature of the edge p0 -> p1: `rad` (its input's BEND) if its curve passes no
    node of `others` within CLEAR, else the nearest curvature in steps of 0.1 either way that
    does (an edge through a node would read as that node's edge); `rad` if none does."""
    def clear(r: float) -> bool:
        curve = [_bezier(p0, p1, r, t / 40) for t in range(4, 37)]  # the ends are the nodes'
        return all((cx - x) ** 2 + (cy - y) ** 2 >= CLEAR ** 2
                   for x, y in others for cx, cy in curve)

    tries = [rad] + [rad + s * d / 10 for d in range(1, 21) for s in (1, -1)]
    return next((r for r in tries if clear(r)), rad)


def circuit_png(result: Circuit, title: str = "") -> bytes:
    """The circuit (module docstring): red edges push the metric the way patching the whole
    input does (score / gap > 0), blue ones against it."""
    from matplotlib.figure import Figure

    g, pos = result.graph, _positions(result)
    kept = [e for e in result.edges() if e["in_circuit"]]
    top = max((abs(e["score"]) for e in kept), default=1.0) or 1.0
    rows = max(y for _, y in pos.values()) + 1
    fig = Figure(figsize=(min(16.0, 1.0 * g.n_head + 3.0), min(18.0, 0.9 * rows + 1.6)),
                 layout="constrained")
    ax = fig.subplots()
    used = {e["from"] for e in kept} | {e["to"] for e in kept}
    for name, (x, y) in pos.items():
        on = name in used
        label, size = name.replace(".", "\n"), 6 if on else 5
        ax.scatter([x], [y], s=node_size(label, size) if on else 160, zorder=3,
                   edgecolors="black", color="#ffd27a" if on else "#eeeeee",
                   linewidths=1.0 if on else 0.4)
        ax.text(x, y, label, ha="center", va="center", fontsize=size, zorder=4,
                color="black" if on else "#999999")
    for e in sorted(kept, key=lambda e: abs(e["score"])):
        (x0, y0), (x1, y1) = pos[e["from"]], pos[e["to"]]
        frac = e["score"] / result.gap if result.gap else e["score"]
        others = [p for n, p in pos.items() if n not in (e["from"], e["to"])]
        rad = route((x0, y0), (x1, y1), BEND.get(e["input"], 0.08), others)  # q, k, v: apart
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=2, arrowprops={
            "arrowstyle": "-|>", "lw": 0.6 + 5.0 * abs(e["score"]) / top, "alpha": 0.8,
            "color": "tab:red" if frac > 0 else "tab:blue", "shrinkA": 9, "shrinkB": 9,
            "connectionstyle": f"arc3,rad={rad}"})
        if e["input"] in ("q", "k", "v"):  # on the curve (its control point, in data units)
            ax.text(*_bezier((x0, y0), (x1, y1), rad, 0.78), e["input"],
                    fontsize=8, fontweight="bold", ha="center", va="center", zorder=5,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none"})
    ax.set_xlim(-1, g.n_head)
    ax.set_ylim(-0.7, rows - 0.3)
    ax.axis("off")
    ax.set_title(_title(result, title), fontsize=9, wrap=True)
    return figure_png(fig)


def _title(result: Circuit, title: str) -> str:
    n = int(result.circuit.sum())
    steps = f", {result.ig_steps} steps" if result.ig_steps > 1 else ""
    return (f"{title + ': ' if title else ''}{n} of {result.n_edges} edges recover "
            f"{100 * result.recovered:.1f}% of the clean -> corrupted change "
            f"({result.method.upper()}{steps}, {result.direction}); red: the edge moves the "
            "metric the way the whole corruption does, blue: against it; width: |score|")


def faithfulness_png(result: Circuit, title: str = "") -> bytes:
    """The faithfulness curves: recovered against the fraction of edges, log axis."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.subplots()
    areas = result.areas()
    for name, pts in result.curves.items():
        if name.endswith("@summed"):  # the summed curve again, counted in positions: JSON only
            continue
        ax.plot(FRACTIONS, [f for _, f in pts], "-o", markersize=3,
                label=f"{RANKING_LABEL.get(name, name)} (area {areas[name][0]:.3f})")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel(f"fraction of the {result.n_edges} edges kept (top by |score|, then pruned)")
    ax.set_ylabel("fraction recovered")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title((f"{title}: " if title else "") + "faithfulness: (m_circuit - m_corrupted) / "
                 "(m_clean - m_corrupted); area: trapezoids over the fraction of edges, "
                 "0.001..1 (MIB's CPR, best 0.999)", fontsize=8, wrap=True)
    return figure_png(fig)
