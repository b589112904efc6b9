"""Heads forming while a model trains: every head's scores on the built-in probes at a step,
the first time a head crosses FORMED, and `heads.png` (per layer, the best induction and
previous-token score against step, so a phase change is visible).

The trainer calls `HeadWatch.measure(step)` every `train.head_scores_interval` steps and
emits the HeadScoresEvent it returns (metrics.jsonl records it as `{"kind": "heads", "step",
"seconds", "scores": {name: [[layer][head]]}, "circuit": {...}}`); `draw_timeline` renders
those records.

`circuit` (models of two layers or more, `circuit_record`): the best induction head of the
layers after the first, the best previous-token head of the layers before it, the
K-composition of the two (how much the induction head's keys read what the previous-token head
writes: interp.head_circuits) beside the score of random weights, and the head with the largest
direct logit attribution on the induction probe's second copy: the circuit forming, not only
the patterns.
`circuit["edges"]` (`edge_record`): the EAP score (interp/edge_graph.py, one step, noising;
the metric is the logit of the next token inside the second copy, which unlike the loss does not
flatten once the model copies) of the strongest edges of the model's graph on the induction probe
against the same probe with its FIRST copy's tokens replaced (nothing to copy, and the
previous-token head's output at the keys changed): the edges of the induction circuit seen
appearing at the phase change (`heads.png`'s edge panel).
`circuit["qk"]` (`qk_record`): why the induction head attends where it does (interp/qk.py), at
the probe's induction targets: the margin of the term (the query's embedding x the key's
previous-token head: `embed`, or `embed.tok` where positions are added to the stream, x that
head), the key composition forming, and the head's largest-margin term (`heads.png`'s last
panel).
Measuring reads the model only: eval mode, no gradients into the weights, no random numbers
drawn from the global generators, so a run with head scores trains exactly like one without.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch

from minigpt.core.gpt import device_of, eval_mode
from minigpt.display import figure_png, head_name
from minigpt.events import FORMED, HeadFormedEvent, HeadScoresEvent, circuit_check
from minigpt.heads.probes import corrupt_copy, probe_pool, probe_tokens
from minigpt.interp.edge_graph import attribute_edges, graph_of
from minigpt.interp.head_circuits import (
    composition_baseline,
    direct_logit_attribution,
    k_composition,
)
from minigpt.interp.heads import score_heads
from minigpt.interp.patching import make_metric, run_value
from minigpt.interp.qk import induction_pairs, qk_attribution

# Which probe each timeline score is measured on: induction, previous-token and first-token
# attention on random tokens repeated twice; duplicate-token attention on tokens from 8 ids.
TIMELINE_SCORES = {"induction": "induction", "previous": "induction", "first": "induction",
                   "duplicate": "duplicate"}
MAX_PROBE_TOKENS = 256  # the explicit path is O(T^2) in memory: cap long contexts
KIND_NAMES = {"induction": "an induction head", "previous": "a previous-token head",
              "duplicate": "a duplicate-token head", "first": "a first-token (sink) head"}


@torch.no_grad()
def probe_scores(model: torch.nn.Module, cfg, tokenizer, seed: int = 0) -> dict[str, list]:
    """{score: n_layer x n_head nested lists} on the built-in probes of min(block_size, 256)
    tokens, through the explicit attention path. The model's train/eval mode is restored."""
    length = min(cfg.model.block_size, MAX_PROBE_TOKENS)
    pool = probe_pool(cfg, tokenizer)
    device = device_of(model)
    with eval_mode(model):
        out: dict[str, list] = {}
        for probe in dict.fromkeys(TIMELINE_SCORES.values()):
            ids = probe_tokens(probe, length, pool, seed)
            idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
            _, maps = model.forward_with_attention(idx)  # n_layer x (1, H, T, T)
            attn = torch.stack([m[0] for m in maps]).float().cpu()  # (L, H, T, T)
            scores = score_heads(attn, ids)
            for name, p in TIMELINE_SCORES.items():
                if p == probe:
                    out[name] = [[round(float(v), 6) for v in row] for row in scores[name]]
        return out


def formed_heads(scores: dict[str, list]) -> set[tuple[int, int, str]]:
    """(layer, head, kind) of every head whose score reaches FORMED."""
    return {(la, h, kind) for kind, rows in scores.items() for la, row in enumerate(rows)
            for h, v in enumerate(row) if v is not None and v >= FORMED}


def all_formed(scores: dict[str, list], kinds: Sequence[str]) -> bool:
    """Whether `scores` (one measurement) has, for every kind in `kinds`, a head >= FORMED.
    Induction and previous named together mean the circuit (`events.circuit_check`): the
    previous-token head in a layer below the induction head's, which its keys can read; a
    layer-1 head attending to the previous token does not count for it."""
    found = {kind for _, _, kind in formed_heads(scores)}
    pair = {"induction", "previous"} <= set(kinds)
    check = circuit_check(0, scores) if pair else None
    if check is not None and not check.formed:
        return False
    return all(kind in found for kind in kinds)


@functools.lru_cache(maxsize=8)
def _k_baseline(n_head: int, n_embd: int, head_dim: int, centred: bool) -> float:
    """Random weights' K-composition for these shapes (seeded: computed once per shape)."""
    return composition_baseline(n_head, n_embd, head_dim, centred)["k"]


def circuit_record(model: torch.nn.Module, cfg, tokenizer, scores: dict[str, list],
                   seed: int = 0) -> dict | None:
    """The induction circuit at this step (module docstring); None for a one-layer model."""
    ind, prev = scores["induction"], scores["previous"]
    if len(ind) < 2:
        return None
    m = cfg.model
    baseline = _k_baseline(m.n_head, m.n_embd, m.head_dim, m.norm == "layernorm")

    def best(rows, layers):
        return max(((la, h) for la in layers for h in range(len(rows[la]))),
                   key=lambda lh: rows[lh[0]][lh[1]] if rows[lh[0]][lh[1]] is not None else -1)

    li, hi = best(ind, range(1, len(ind)))
    lp, hp = best(prev, range(li))
    length = min(cfg.model.block_size, MAX_PROBE_TOKENS) // 2 * 2
    ids = probe_tokens("induction", length, probe_pool(cfg, tokenizer), seed)
    dla = direct_logit_attribution(model, ids, make_metric(len(ids), range(length // 2,
                                                                          length - 1)))
    flat = int(dla.heads.flatten().argmax())
    ld, hd = divmod(flat, dla.heads.shape[1])
    return {"previous_head": [lp, hp], "induction_head": [li, hi],
            "k_composition": round(k_composition(model, (lp, hp), (li, hi)), 6),
            "k_baseline": round(baseline, 6), "dla_head": [ld, hd],
            "dla": round(float(dla.heads[ld, hd]), 6),
            "qk": qk_record(model, ids, (li, hi), (lp, hp))}


def qk_record(model: torch.nn.Module, ids: Sequence[int], induction: tuple[int, int],
              previous: tuple[int, int]) -> dict:
    """The induction head's score split at the induction targets of the probe `ids` (two
    copies): {"term": [query writer, key writer] of the textbook term, "margin": its mean
    margin, "top": [query writer, key writer, mean margin] of the largest-margin term}."""
    idx = torch.tensor([list(ids)], dtype=torch.long, device=device_of(model))
    h = qk_attribution(model, idx, [induction], induction_pairs(ids, len(ids) // 2))[0]
    query = "embed" if "embed" in h.writers else "embed.tok"
    key = head_name(*previous)
    q, k, _, margin = h.terms()[0]
    return {"term": [query, key], "margin": round(h.term_margin(query, key), 6),
            "top": [q, k, round(margin, 6)]}


EDGE_RECORD_TOP = 12  # edges kept per measurement: the strongest by |EAP score|


def edge_key(graph, u: int, v: int) -> str:
    """An edge as one string: "L0.H2->L1.H0:k"."""
    node, inp = graph.reader_name(v)
    return f"{graph.writer_name(u)}->{node}:{inp}"


def edge_record(model: torch.nn.Module, cfg, tokenizer, seed: int = 0) -> dict | None:
    """The EDGE_RECORD_TOP strongest edges' EAP scores (module docstring) {"edges": {key:
    score}, "clean": the mean logit of the next token inside the second copy, "corrupted":
    the same with the first copy replaced}; None when the pool has no token to corrupt
    with."""
    length = min(cfg.model.block_size, MAX_PROBE_TOKENS) // 2 * 2
    pool = probe_pool(cfg, tokenizer)
    ids = probe_tokens("induction", length, pool, seed)
    if not [t for t in pool if t not in set(ids)]:
        return None
    device = device_of(model)
    clean = torch.tensor([ids], device=device)
    bad = torch.tensor([corrupt_copy(ids, 0, pool, seed, copy=1)], device=device)
    metric = make_metric(length, range(length // 2, length - 1), kind="logit")
    targets = torch.tensor([metric.targets(ids)], device=device)
    eap, _ = attribute_edges(model, clean, bad, metric, targets, ig_steps=1)
    flat = eap.abs().nan_to_num(-1.0).flatten()  # no edge: -1, after every edge
    graph = graph_of(model.cfg)
    n = min(EDGE_RECORD_TOP, int(graph.valid().sum()))
    top = flat.topk(n).indices.tolist()
    with eval_mode(model):
        m_clean, m_bad = (run_value(model, x, metric, targets) for x in (clean, bad))
    return {"edges": {edge_key(graph, *divmod(i, eap.shape[1])): round(float(eap.flatten()[i]),
                                                                        6) for i in top},
            "clean": round(m_clean, 6), "corrupted": round(m_bad, 6)}


class HeadWatch:
    """Measures a model's heads during training and reports each head that forms, once.
    `earlier` holds the run's records from before a resume (what formed then, and the last
    measurement); `last` is the latest measurement (None before the first)."""

    def __init__(self, model: torch.nn.Module, cfg, tokenizer,
                 earlier: Sequence[dict] = ()) -> None:
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.formed: set[tuple[int, int, str]] = set()
        self.last: HeadScoresEvent | None = None
        for rec in earlier:
            if rec.get("kind") == "heads" and isinstance(rec.get("scores"), dict):
                self.formed |= formed_heads(rec["scores"])
                self.last = HeadScoresEvent(rec["step"], rec.get("seconds", 0.0),
                                            rec["scores"], rec.get("circuit"))

    def measure(self, step: int) -> tuple[HeadScoresEvent, list[HeadFormedEvent]]:
        """Every head's scores at `step` and the heads that formed since the last measure."""
        t0 = time.perf_counter()
        scores = probe_scores(self.model, self.cfg, self.tokenizer)
        circuit = circuit_record(self.model, self.cfg, self.tokenizer, scores)
        if circuit is not None:
            circuit["edges"] = edge_record(self.model, self.cfg, self.tokenizer)
        new = sorted(formed_heads(scores) - self.formed)
        self.formed |= set(new)
        formed = [HeadFormedEvent(step, la, h, kind, KIND_NAMES[kind], scores[kind][la][h])
                  for la, h, kind in new]
        self.last = HeadScoresEvent(step, round(time.perf_counter() - t0, 4), scores, circuit)
        return self.last, formed


def draw_timeline(records: Sequence[dict], title: str = "") -> bytes | None:
    """PNG bytes of `timeline_figure`; None without records."""
    fig = timeline_figure(records, title)
    return None if fig is None else figure_png(fig)


def timeline_figure(records: Sequence[dict], title: str = ""):
    """The figure of heads.png: one panel per layer, the best induction and previous-token
    score (and the best duplicate-token score, dashed) of that layer against step, and, when
    the records have them, panels for the circuit (`_draw_circuit`), its edges and the QK term;
    every legend beside its panel, outside the plot, and no label written among the points;
    None without records."""
    recs = sorted((r for r in records if r.get("kind") == "heads"), key=lambda r: r["step"])
    if not recs:
        return None
    from matplotlib.figure import Figure

    n_layer = len(recs[-1]["scores"]["induction"])
    steps = [r["step"] for r in recs]
    circuit = any(r.get("circuit") for r in recs)
    edges = any((r.get("circuit") or {}).get("edges") for r in recs)
    qk = any((r.get("circuit") or {}).get("qk") for r in recs)
    panels = n_layer + circuit + edges + qk
    fig = Figure(figsize=(10.5, 1.9 * panels + 0.8), layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False, sharex=True)
    styles = (("induction", "-", "tab:red"), ("previous", "-", "tab:blue"),
              ("duplicate", "--", "tab:green"))
    for la in range(n_layer):
        ax = axes[la][0]
        for kind, ls, color in styles:
            best = [max((v for v in r["scores"][kind][la] if v is not None), default=float("nan"))
                    for r in recs]
            # markers: one measurement is a point (a line through one point draws nothing)
            ax.plot(steps, best, ls, color=color, label=f"best {kind}", linewidth=1.5,
                    marker="o" if len(steps) <= 40 else None, markersize=3)
        ax.axhline(FORMED, color="grey", linewidth=0.8, linestyle=":")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel(f"layer {la}")
        ax.grid(alpha=0.3)
    if circuit:
        _draw_circuit(axes[n_layer][0], recs)
    if edges:
        _draw_edges(axes[n_layer + circuit][0], recs)
    if qk:
        _draw_qk(axes[-1][0], recs)
    fig.suptitle(title or "head scores on the built-in probes", fontsize=10)
    beside(axes[0][0], title=f"each layer's best\n(dotted: {FORMED}, formed)")
    axes[-1][0].set_xlabel("step")
    return fig


LEGEND_WIDTH = 24  # characters a legend entry may take beside its panel


def beside(ax, handles=None, labels=None, title: str | None = None) -> None:
    """The panel's legend beside it, on the right, outside the plot (never over a line)."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    labels = [lb if len(lb) <= LEGEND_WIDTH else lb[:LEGEND_WIDTH - 1] + "…" for lb in labels]
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.09, 1.0), fontsize=7,
              title=title, title_fontsize=7, frameon=False, borderaxespad=0.0)


def _draw_circuit(ax, recs: Sequence[dict]) -> None:
    """The K-composition of the best previous-token head into the best induction head at each
    measurement, against step: the pair can change from one measurement to the next, so each
    point is coloured by the pair it measures (named in the legend; filled: both heads formed,
    hollow: not), random weights' score dotted; on a second axis the largest direct logit
    attribution of one head, named where that head changes."""
    pts = [(r["step"], r["circuit"], r["scores"]) for r in recs if r.get("circuit")]
    steps = [s for s, _, _ in pts]
    ax.plot(steps, [c["k_composition"] for _, c, _ in pts], "-", color="0.75", linewidth=1.0,
            zorder=1)
    _pair_points(ax, pts)
    ax.plot(steps, [c["k_baseline"] for _, c, _ in pts], ":", color="tab:purple",
            linewidth=1.0, label="random weights")
    ax.set_ylabel("K-comp")
    ax.set_ylim(0, max(0.5, *(c["k_composition"] for _, c, _ in pts)) * 1.15)
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(steps, [c["dla"] for _, c, _ in pts], "--", color="tab:orange", linewidth=1.2)
    _marked_by(twin, [(s, head_name(*c["dla_head"]), c["dla"]) for s, c, _ in pts],
               "best DLA: ", colour="tab:orange")
    twin.set_ylabel("best DLA (logit)", color="tab:orange", fontsize=8)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = twin.get_legend_handles_labels()
    beside(ax, h1 + h2, l1 + l2, title="K-comp of the pair\n(filled: both formed)")
    ax.set_title(f"circuit at each measurement: K-composition of the best previous-token head "
                 f"into the best induction head (at the end {_pair_title(pts[-1][1], pts[-1][2])}"
                 f"); dashed orange: the largest direct logit attribution of one head",
                 fontsize=7, wrap=True)


MAX_PAIRS = 8  # pairs named in the legend; the rest are drawn grey as "other pairs"
# not the red, blue and green of the score panels above
PAIR_COLOURS = ("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black",
                "tab:gray", "gold")


def _pair_of(c: dict) -> str:
    (lp, hp), (li, hi) = c["previous_head"], c["induction_head"]
    return f"{head_name(lp, hp)} -> {head_name(li, hi)}"


def _both_formed(c: dict, scores: dict) -> bool:
    (lp, hp), (li, hi) = c["previous_head"], c["induction_head"]
    prev, ind = scores["previous"][lp][hp], scores["induction"][li][hi]
    return prev is not None and ind is not None and prev >= FORMED and ind >= FORMED


def _pair_points(ax, pts) -> None:
    """One marker per measurement, coloured by the pair it measures (the most frequent
    MAX_PAIRS pairs named, in order of first appearance), filled when both heads formed."""
    counts: dict[str, int] = {}
    for _, c, _ in pts:
        counts[_pair_of(c)] = counts.get(_pair_of(c), 0) + 1
    named = sorted(counts, key=lambda p: -counts[p])[:MAX_PAIRS]
    order = [p for p in dict.fromkeys(_pair_of(c) for _, c, _ in pts) if p in named]
    colour = {p: PAIR_COLOURS[i] for i, p in enumerate(order)}
    for pair in [*order, None]:
        mine = [(s, c, sc) for s, c, sc in pts if (colour.get(_pair_of(c)) and
                                                   _pair_of(c) == pair) or
                (pair is None and _pair_of(c) not in colour)]
        if not mine:
            continue
        col = colour.get(pair, "0.5")
        for formed in (True, False):
            group = [(s, c) for s, c, sc in mine if _both_formed(c, sc) == formed]
            if group:
                ax.scatter([s for s, _ in group], [c["k_composition"] for _, c in group],
                           s=22, color=col, facecolors=col if formed else "none", zorder=3,
                           label=(pair or "other pairs") if formed or not any(
                               _both_formed(c, sc) for _, c, sc in mine) else None)


def _pair_title(c: dict, scores: dict) -> str:
    """The last pair, each head called what it is only when it has formed."""
    (lp, hp), (li, hi) = c["previous_head"], c["induction_head"]
    return (f"{head_name(lp, hp)} {_formed_label('previous', scores['previous'][lp][hp])} -> "
            f"{head_name(li, hi)} {_formed_label('induction', scores['induction'][li][hi])}")


def _formed_label(kind: str, score: float | None) -> str:
    """`(previous 0.92)` for a head that reached FORMED, `(best previous 0.17, not formed)`
    otherwise."""
    if score is not None and score >= FORMED:
        return f"({kind} {score:.2f})"
    shown = "-" if score is None else f"{score:.2f}"
    return f"(best {kind} {shown}, not formed)"


MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")  # one per name; the rest: "other"


def _marked_by(ax, pts: Sequence[tuple[int, str, float]], prefix: str, colour: str) -> None:
    """One marker shape per name (a head, a term) at each point, named in the legend (the most
    frequent first; beyond len(MARKERS) names, "other"): what was written beside the points,
    where labels overlapped, now sits in the legend beside the panel."""
    counts: dict[str, int] = {}
    for _, name, _ in pts:
        counts[name] = counts.get(name, 0) + 1
    named = sorted(counts, key=lambda n: -counts[n])[:len(MARKERS) - 1]
    for i, name in enumerate([*named, None]):
        mine = [(s, v) for s, n, v in pts if n == name or (name is None and n not in named)]
        if mine:
            ax.scatter([s for s, _ in mine], [v for _, v in mine], s=18, color=colour,
                       marker=MARKERS[i], zorder=3,
                       label=prefix + (name if name is not None else "other"))


EDGES_DRAWN = 6  # the edges drawn against step: the strongest over the run


def _draw_edges(ax, recs: Sequence[dict], n: int = EDGES_DRAWN) -> None:
    """The EAP score against step of the `n` edges strongest over the run (by the sum of
    their |score| over the measurements, so an edge that stays strong outranks one spike; a
    gap where an edge was not among the EDGE_RECORD_TOP strongest at that step)."""
    pts = [(r["step"], r["circuit"]["edges"]) for r in recs
           if (r.get("circuit") or {}).get("edges")]
    total: dict[str, float] = {}
    for _, e in pts:
        for key, v in e["edges"].items():
            total[key] = total.get(key, 0.0) + abs(v)
    for key in sorted(total, key=lambda k: -total[k])[:n]:
        ax.plot([s for s, _ in pts], [e["edges"].get(key, float("nan")) for _, e in pts],
                "-o", markersize=2.5, linewidth=1.3, label=key.replace(":", " "))
    ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_ylabel("EAP score")
    ax.grid(alpha=0.3)
    beside(ax, title="edges")
    ax.set_title(f"edges (EAP: what the edge alone, taking its value from the probe with its "
                 f"first copy replaced, changes the next token's logit by; gaps: not among the "
                 f"{EDGE_RECORD_TOP} strongest then)", fontsize=7, wrap=True)


def _draw_qk(ax, recs: Sequence[dict]) -> None:
    """The margin of the induction head's (query embedding x key previous-token head) term at
    each measurement, against step, and that of its largest-margin term (dashed; the term
    named where it changes)."""
    pts = [(r["step"], r["circuit"]["qk"]) for r in recs if (r.get("circuit") or {}).get("qk")]
    steps = [s for s, _ in pts]
    ax.plot(steps, [q["margin"] for _, q in pts], "-o", markersize=2.5, linewidth=1.4,
            color="tab:red", label="embed x previous-token")
    ax.plot(steps, [q["top"][2] for _, q in pts], "--", linewidth=1.0, color="0.4")
    _marked_by(ax, [(s, f"{q['top'][0]} x {q['top'][1]}", q["top"][2]) for s, q in pts],
               "largest: ", colour="0.35")
    ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_ylabel("QK margin")
    ax.grid(alpha=0.3)
    beside(ax, title="terms (query x key)")
    ax.set_title("why the induction head attends to the key after the earlier copy: the margin "
                 "of the term query embedding x key previous-token head (red) and of the "
                 "largest term (dashed), means over the induction targets (inspect-heads --qk)",
                 fontsize=7, wrap=True)
