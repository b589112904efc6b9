"""The offline HTML attention viewer: ONE self-contained file (inline CSS and JS, no network).

Safety: token text comes from the user's corpus and may contain `<script>`. The data is embedded
as JSON inside `<script type="application/json">` with `<`, `>`, `&`, U+2028 and U+2029 written as
\\uXXXX escapes (so no `</script>` can close the element early), parsed with JSON.parse, and
every token reaches the page through `textContent`, `title` or canvas `fillText`, never
innerHTML. A Content-Security-Policy allows no network access and only the one inline script
whose SHA-256 is in the policy, so even an injected script element would not run.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from minigpt.display import head_name, visible_token
from minigpt.files import atomic_write_bytes
from minigpt.heads.inspection import PATCH_READING, Inspection
from minigpt.interp.heads import LAG_WINDOW, SCORE_HELP, SCORE_NAMES

_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                 "\u2029": "\\u2029"}


def safe_json(obj) -> str:
    """JSON that is safe inside an HTML <script> element: `<`, `>`, `&`, U+2028/9 escaped.

    These characters occur only inside JSON strings, where \\uXXXX means the same character,
    so JSON.parse returns exactly `obj`."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return "".join(_JSON_ESCAPES.get(ch, ch) for ch in text)


def viewer_data(insp: Inspection, heads: Sequence[tuple[int, int]] | None = None) -> dict:
    """What the page needs. `attn[l][h]` is the lower triangle of map (l, h), row-major, rounded
    to 4 decimals: row t (query t) is entries t(t+1)/2 .. t(t+1)/2 + t (keys 0..t)."""
    T = len(insp.tokens)
    rows = insp.attention.tolist()  # (n_layer, n_head, T, T) nested lists
    attn = [[[round(v, 4) for t in range(T) for v in rows[layer][head][t][: t + 1]]
             for head in range(insp.n_head)] for layer in range(insp.n_layer)]
    scores = [insp.head_row(layer, head, digits=4)
              for layer in range(insp.n_layer) for head in range(insp.n_head)]
    first = list(insp.most_distinctive(heads))
    return {"n_layer": insp.n_layer, "n_head": insp.n_head, "T": T, "tokens": insp.tokens,
            "strs": insp.token_strs, "labels": [visible_token(s, 16) for s in insp.token_strs],
            "attn": attn, "scores": scores, "score_names": list(SCORE_NAMES),
            "score_help": SCORE_HELP, "run": insp.run, "step": insp.step,
            "source": insp.source, "parity": insp.parity_max_diff, "first": first,
            "copy_start": insp.copy_start, "glossary": glossary(),
            "ablation": insp.ablation.to_json() if insp.ablation is not None else None,
            **table_data(insp, scores), **circuit_data(insp), "lens": lens_data(insp),
            "qk": qk_data(insp)}


def qk_data(insp: Inspection) -> dict | None:
    """Each split head's grid (interp.qk) as the page draws it, by head name: the writers, the
    terms' mean margins and scores [query writer][key writer] (3 decimals), the pairs, and
    every head's name [layer][head] (None: nothing split)."""
    if insp.qk is None:
        return None
    out = {}
    for h in insp.qk:
        grid = lambda t: [[round(v, 3) for v in row] for row in t.mean(0).tolist()]
        out[h.name] = {"writers": h.writers, "margin": grid(h.margin_grid),
                       "score": grid(h.grid), "pairs": [[t, k] for _, t, k in h.pairs],
                       "mean_score": round(float(h.scores.mean()), 4),
                       "mean_margin": round(float(h.margins.mean()), 4),
                       "closure": h.closure}
    names = [[head_name(la, h) for h in range(insp.n_head)] for la in range(insp.n_layer)]
    return {"heads": out, "pairs": insp.qk_pairs, "names": names}


def table_data(insp: Inspection, rows: list[dict]) -> dict:
    """The score table's columns (every score, the best lags, then ablation, dla and patch
    when measured), their meanings and each head's cells as text, in `rows`' order."""
    measured = [n for n, on in (("ablation", insp.ablation), ("dla", insp.dla),
                                ("patch", insp.patch)) if on is not None]
    columns = [*SCORE_NAMES, "prev@k", "ind@k", *measured]
    helps = {**SCORE_HELP, **dict(glossary())}

    def cell(row: dict, name: str) -> str:
        if name in LAG_COLUMNS:
            lags = row[LAG_COLUMNS[name]]
            k = row["best_" + LAG_COLUMNS[name][:-1]]
            return "-" if k is None or lags[k - 1] is None else f"{lags[k - 1]:.3f}@{k}"
        v = row[name]
        return "-" if v is None else (f"{v:+.3f}" if name in measured else f"{v:.3f}")

    return {"columns": columns, "column_help": {n: helps.get(n, "") for n in columns},
            "cells": [[cell(r, n) for n in columns] for r in rows]}


LAG_COLUMNS = {"prev@k": "previous_lags", "ind@k": "induction_lags"}


def circuit_data(insp: Inspection) -> dict:
    """What DLA and patching measured, for the page's header (None: not measured)."""
    return {"dla": insp.dla.to_json() if insp.dla is not None else None,
            "patch": insp.patch_json() if insp.patch is not None else None}


def lens_data(insp: Inspection) -> dict | None:
    """The logit lens as the page draws it: points, positions, targets and per (point,
    position) the top token, the target's rank and probability (None: not measured)."""
    lens = insp.lens
    if lens is None:
        return None
    name = insp.token_str or str
    return {"points": lens.points, "positions": lens.positions,
            "targets": [visible_token(name(t), 12) for t in lens.targets],
            "top": [[visible_token(name(int(t)), 12) for t in row] for row in lens.top.tolist()],
            "rank": lens.rank.tolist(), "prob": [[round(p, 4) for p in row]
                                                 for row in lens.prob.tolist()],
            "logit": [[round(v, 3) for v in row] for row in lens.logit.tolist()]}


# What the page's words and glyphs mean (shown under the map; tests/test_viewer_browser.py).
TYPE_HELP = {
    "mixed": "no pattern score reaches 0.4 and the attention is not spread evenly",
    "diffuse": "attention spread almost evenly over the visible keys (entropy >= 0.7)",
    "local": "most attention on the query and the 3 tokens before it",
    "n/a": "a single token: nothing to score",
}
# A type that is also a score column is explained once, under the score's name, in the
# glossary (a browser showed "local" twice: once as the score, once as the type).
TYPE_AS_SCORE = {"local": "; as a dominant type: the local score is at least 0.4 and no "
                          "pattern score is, nor is the attention diffuse"}
GLYPHS = {
    "·": "a space inside a token",
    "↵": "a newline",
    "→": "a tab",
    "␍": "a carriage return",
    "\\xNN": "any other control byte, by its hex code (random probe ids often are)",
    "∅": "a token with no text",
    "…": "a label shortened to fit",
}


def glossary() -> list[list[str]]:
    """[term, meaning] pairs: every score column, the dominant types that are not scores, the
    glyphs token labels use (`visible_token`) and the ablation column."""
    return ([[n, SCORE_HELP[n] + TYPE_AS_SCORE.get(n, "")] for n in SCORE_NAMES]
            + [["dominant", ("the pattern score (induction .. delimiter) that is highest and "
                "at least 0.4; otherwise one of the types below, or local")]]
            + [[n, v] for n, v in TYPE_HELP.items() if n not in SCORE_HELP]
            + [["prev@k", (f"the best previous-token score over lags k = 1..{LAG_WINDOW} "
                "(attention from t to t-k), @ that lag")],
               ["ind@k", (f"the best induction score over lags k = 1..{LAG_WINDOW} (attention "
                "to the token k after an earlier occurrence of the query's token), @ that "
                "lag")]]
            + [["ablation", ("how much the loss rises (nats/token) with this head alone "
                "knocked out (--ablate)")],
               ["dla", ("direct logit attribution (--dla): the head's own share of the logit "
                "of the target, through W_O and the unembedding, scaled by the final norm")],
               ["patch", "activation patching (--patch-from): " + PATCH_READING]]
            + [[g, v] for g, v in GLYPHS.items()])


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:.2em 0}h2{font-size:1.1em;margin:1.2em 0 .4em}
#meta{color:#555;font-size:.9em;white-space:pre-wrap}
#controls{margin:.8em 0;display:flex;gap:1.2em;align-items:center}
#hover{font-family:ui-monospace,monospace;min-height:1.5em;margin:.4em 0;white-space:pre}
canvas{border:1px solid #ccc;background:#fff}
table{border-collapse:collapse;font-size:.85em}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}
th{background:#eee}tr.sel td{background:#ffe9a8}tbody tr{cursor:pointer}
#tokens{display:flex;flex-wrap:wrap;gap:4px;list-style:none;padding:0}
#tokens li{font-family:ui-monospace,monospace;background:#eef;padding:1px 4px;border-radius:3px}
#tokens li.q{background:#fc6}
#explain,.explain{max-width:60em}#mapbox{display:flex;gap:1em;align-items:flex-start}
#scalebox{font-size:.85em;text-align:center}
dl#glossary{display:grid;grid-template-columns:max-content 1fr;gap:.2em 1em;max-width:60em}
dl#glossary dt{font-family:ui-monospace,monospace;font-weight:bold}dl#glossary dd{margin:0}
"""

# Everything dynamic goes through textContent / title / fillText: never innerHTML.
_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("viewer-data").textContent);
  const $ = (id) => document.getElementById(id);
  const canvas = $("map"), ctx = canvas.getContext("2d");
  const T = D.T, LABEL = 110;
  const CELL = Math.max(3, Math.min(24, Math.floor(720 / Math.max(T, 1))));
  const VIRIDIS = [[68,1,84],[72,40,120],[62,74,137],[49,104,142],[38,130,142],[31,158,137],
                   [53,183,121],[109,205,89],[180,222,44],[253,231,37]];
  let cur = {layer: D.first[0], head: D.first[1]};

  function color(v) {
    const x = Math.min(1, Math.max(0, v)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(x)), f = x - i;
    const c = VIRIDIS[i].map((a, k) => Math.round(a + f * (VIRIDIS[i + 1][k] - a)));
    return "rgb(" + c.join(",") + ")";
  }
  function weight(t, j) {
    return j > t ? null : D.attn[cur.layer][cur.head][t * (t + 1) / 2 + j];
  }
  function text(el, s) { el.textContent = s; return el; }
  function add(parent, tag, s) {
    const el = document.createElement(tag);
    if (s !== undefined) text(el, s);
    parent.appendChild(el);
    return el;
  }

  function draw() {
    canvas.width = LABEL + T * CELL + 2;
    canvas.height = LABEL + T * CELL + 2;
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    for (let t = 0; t < T; t++) {
      for (let j = 0; j <= t; j++) {
        ctx.fillStyle = color(weight(t, j));
        ctx.fillRect(LABEL + j * CELL, LABEL + t * CELL, CELL, CELL);
      }
    }
    if (CELL >= 8) {
      ctx.fillStyle = "#222";
      ctx.font = Math.min(12, CELL - 1) + "px monospace";
      ctx.textBaseline = "middle";
      for (let t = 0; t < T; t++) {
        const s = D.labels[t].slice(0, 12);
        ctx.textAlign = "right";
        ctx.fillText(s, LABEL - 4, LABEL + t * CELL + CELL / 2);
        ctx.save();
        ctx.translate(LABEL + t * CELL + CELL / 2, LABEL - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(s, 0, 0);
        ctx.restore();
      }
    }
    if (D.copy_start !== null) {  // the induction probe: where its second copy starts
      const at = D.copy_start * CELL;
      ctx.strokeStyle = "#e0301e";
      ctx.lineWidth = 2;
      ctx.setLineDash([6, 3]);
      ctx.beginPath();
      ctx.moveTo(LABEL, LABEL + at);
      ctx.lineTo(LABEL + T * CELL, LABEL + at);
      ctx.moveTo(LABEL + at, LABEL);
      ctx.lineTo(LABEL + at, LABEL + T * CELL);
      ctx.stroke();
      ctx.setLineDash([]);
    }
    canvas.dataset.layer = cur.layer;
    canvas.dataset.head = cur.head;
    const row = D.scores.find((r) => r.layer === cur.layer && r.index === cur.head);
    text($("current"), "layer " + cur.layer + ", head " + cur.head + ": " + row.dominant +
         (D.ablation ? "; ablated, the loss rises by " + row.ablation.toFixed(4) +
          " nats/token" : "") +
         (D.dla ? "; direct share of the logit " + row.dla.toFixed(3) : "") +
         (D.patch ? "; patched, " + row.patch.toFixed(3) + " of the clean -> corrupted change"
          : ""));
    document.dispatchEvent(new CustomEvent("minigpt:head", {detail: cur}));
    document.querySelectorAll("#scores tbody tr").forEach((tr) => {
      tr.classList.toggle("sel", +tr.dataset.layer === cur.layer && +tr.dataset.head === cur.head);
    });
  }

  function select(layer, head) {
    cur = {layer: layer, head: head};
    $("layer").value = String(layer);
    $("head").value = String(head);
    draw();
  }

  function hover(ev) {
    const r = canvas.getBoundingClientRect();
    const j = Math.floor((ev.clientX - r.left - LABEL) / CELL);
    const t = Math.floor((ev.clientY - r.top - LABEL) / CELL);
    document.querySelectorAll("#tokens li.q").forEach((li) => li.classList.remove("q"));
    if (t < 0 || j < 0 || t >= T || j >= T || j > t) { text($("hover"), ""); return; }
    text($("hover"), "query " + t + " " + JSON.stringify(D.strs[t]) + "  ->  key " + j + " " +
         JSON.stringify(D.strs[j]) + ":  " + weight(t, j).toFixed(4));
    const items = $("tokens").children;
    items[t].classList.add("q");
    items[j].classList.add("q");
  }

  function scale() {  // the colour scale: weight 0 (bottom) .. 1 (top)
    const c = $("scale"), g = c.getContext("2d"), H = 200, W = 20, TOP = 8;
    c.width = 70;
    c.height = H + 2 * TOP;
    for (let y = 0; y < H; y++) {
      g.fillStyle = color(1 - y / (H - 1));
      g.fillRect(0, TOP + y, W, 1);
    }
    g.strokeStyle = "#888";
    g.strokeRect(0.5, TOP + 0.5, W, H);
    g.fillStyle = "#222";
    g.font = "12px sans-serif";
    g.textBaseline = "middle";
    [0, 0.25, 0.5, 0.75, 1].forEach((v) => {
      const y = TOP + (1 - v) * (H - 1);
      g.fillRect(W, y, 4, 1);
      g.fillText(v.toFixed(2), W + 7, y);
    });
  }

  function explain() {
    let s = "Each row is a query token and each cell the share of its attention that goes to " +
      "the key token of that column (rows sum to 1; future keys are blank). Row 0 can only " +
      "see itself, so it is always 1.0. Hover a cell for its weight; pick a head above, or " +
      "click a row of the score table below. Opened on the most distinctive head.";
    if (D.copy_start !== null) {
      s += " This is the induction probe: random tokens, then the same tokens again from " +
        "position " + D.copy_start + " (dashed red lines). An induction head attends from " +
        "each token of the second copy to the token after its first occurrence: a stripe " +
        "below the line, " + (D.copy_start - 1) + " keys left of the diagonal.";
    }
    text($("explain"), s);
  }

  function build() {
    explain();
    scale();
    D.glossary.forEach((pair) => {
      add($("glossary"), "dt", pair[0]);
      add($("glossary"), "dd", pair[1]);
    });
    text($("meta"), "run: " + (D.run || "(none)") + "   step: " + D.step + "   input: " +
         D.source + "   tokens: " + T + "   explicit vs SDPA logits max |diff|: " +
         D.parity.toExponential(2) + (D.ablation ? "\nablation (" + D.ablation.mode + "): " +
         D.ablation.what + "; loss " + D.ablation.base_loss.toFixed(4) + " nats/token over " +
         D.ablation.scored + "; the ablation column is the loss each head's ablation adds" :
         "") + (D.dla ? "\ndla: " + D.dla.what + "; the model's value " +
         D.dla.logit.toFixed(3) + ", the components add up to " +
         D.dla.sum_of_components.toFixed(3) + "; the dla column is each head's direct share" :
         "") + (D.patch ? "\npatch (" + D.patch.direction + ", from " +
         D.patch.corrupted_input + "): " + D.patch.what + "; clean " +
         D.patch.clean.toFixed(4) + ", corrupted " + D.patch.corrupted.toFixed(4) +
         ". The patch column: " + D.patch.reading : ""));
    for (let l = 0; l < D.n_layer; l++) add($("layer"), "option", String(l)).value = String(l);
    for (let h = 0; h < D.n_head; h++) add($("head"), "option", String(h)).value = String(h);
    $("layer").addEventListener("change", () => select(+$("layer").value, cur.head));
    $("head").addEventListener("change", () => select(cur.layer, +$("head").value));
    D.strs.forEach((s, i) => {
      const li = add($("tokens"), "li", D.labels[i]);
      li.title = i + ": " + JSON.stringify(s) + " (id " + D.tokens[i] + ")";
    });
    const head = add($("scores"), "thead"), hr = add(head, "tr");
    ["layer", "head", "dominant"].concat(D.columns).forEach((n) => {
      const th = add(hr, "th", n);
      if (D.column_help[n]) th.title = D.column_help[n];
      if (n === "ablation") th.title = "nats/token the loss rises by with the head " +
        D.ablation.mode + "-ablated";
    });
    const body = add($("scores"), "tbody");
    D.scores.forEach((r, i) => {
      const tr = add(body, "tr");
      tr.dataset.layer = r.layer;
      tr.dataset.head = r.index;
      add(tr, "td", String(r.layer));
      add(tr, "td", String(r.index));
      add(tr, "td", r.dominant);
      D.cells[i].forEach((c) => add(tr, "td", c));
      tr.addEventListener("click", () => select(r.layer, r.index));
    });
    canvas.addEventListener("mousemove", hover);
    select(cur.layer, cur.head);
  }
  build();
})();
"""


# Sections after the score table, each its own function of the page's data: what the current
# head does at every distance (it redraws on the main script's "minigpt:head" event) and the
# logit lens. They run before the main script, so they listen before its first draw.
_JS_OFFSETS = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("viewer-data").textContent);
  const canvas = document.getElementById("offsets"), g = canvas.getContext("2d");
  const W = 660, ROW = 100, LEFT = 40, GAP = 44, TOP = 20;
  const SLOTS = D.scores[0].offsets.length;  // distances 0..K

  function chart(y0, values, first, color, title) {
    const bw = (W - LEFT - 10) / SLOTS;
    g.font = "12px sans-serif";
    g.fillStyle = "#222";
    g.textAlign = "left";
    g.fillText(title, LEFT, y0 - 6);
    g.strokeStyle = "#999";
    g.strokeRect(LEFT + 0.5, y0 + 0.5, W - LEFT - 10, ROW);
    g.textAlign = "right";
    [0, 0.5, 1].forEach((v) => g.fillText(v.toFixed(1), LEFT - 4, y0 + ROW - v * ROW + 4));
    values.forEach((v, i) => {
      if (v === null) return;
      g.fillStyle = color;
      g.fillRect(LEFT + (first + i) * bw + 1, y0 + ROW - v * ROW, Math.max(1, bw - 2), v * ROW);
    });
    g.fillStyle = "#222";
    g.textAlign = "center";
    for (let d = 0; d < SLOTS; d++) g.fillText(String(d), LEFT + d * bw + bw / 2, y0 + ROW + 14);
  }
  function lag(k, values) {
    return k === null ? "none applies" : k + " (" + values[k - 1].toFixed(3) + ")";
  }
  function draw(cur) {
    const r = D.scores.find((x) => x.layer === cur.layer && x.index === cur.head);
    canvas.width = W;
    canvas.height = TOP + 2 * ROW + GAP + 34;
    g.fillStyle = "#fff";
    g.fillRect(0, 0, canvas.width, canvas.height);
    chart(TOP, r.offsets, 0, "#3b6ea8", "where it looks: mean attention to the key d " +
          "positions back (d = 0: itself, 1: the previous token)");
    chart(TOP + ROW + GAP, r.induction_lags, 1, "#c0392b", "induction at lag k: attention " +
          "to the token k after an earlier occurrence of the query's token");
    g.fillStyle = "#222";
    g.textAlign = "center";
    g.fillText("distance d / lag k", W / 2, canvas.height - 2);
    canvas.dataset.layer = cur.layer;
    canvas.dataset.head = cur.head;
    document.getElementById("offsets-best").textContent = "layer " + cur.layer + ", head " +
      cur.head + ": best previous-token lag " + lag(r.best_previous_lag, r.previous_lags) +
      "; best induction lag " + lag(r.best_induction_lag, r.induction_lags);
  }
  document.addEventListener("minigpt:head", (ev) => draw(ev.detail));
})();
"""

_JS_LENS = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("viewer-data").textContent);
  const L = D.lens;
  if (!L) return;
  function add(parent, tag, s) {
    const el = document.createElement(tag);
    if (s !== undefined) el.textContent = s;
    parent.appendChild(el);
    return el;
  }
  function shade(v) {  // white (0) .. dark blue (1), as the terminal table
    const c = [20, 50, 130].map((x) => Math.round(255 * (1 - v) + x * v));
    return "rgb(" + c.join(",") + ")";
  }
  document.getElementById("lens-section").hidden = false;
  const table = document.getElementById("lens");
  const hr = add(add(table, "thead"), "tr");
  ["position", "token", "target"].concat(L.points).forEach((n) => add(hr, "th", n));
  const body = add(table, "tbody");
  L.positions.forEach((p, j) => {
    const tr = add(body, "tr");
    add(tr, "td", String(p));
    add(tr, "td", D.labels[p]);
    add(tr, "td", L.targets[j]);
    L.points.forEach((point, i) => {
      const prob = L.prob[i][j], rank = L.rank[i][j];
      const td = add(tr, "td", L.top[i][j] + " #" + rank);
      td.style.background = shade(prob);
      td.style.color = prob > 0.45 ? "#fff" : "#000";
      if (rank === 0) td.style.fontWeight = "bold";
      td.title = "after " + point + ": top token " + JSON.stringify(L.top[i][j]) +
        "; the target " + JSON.stringify(L.targets[j]) + " has rank " + rank +
        ", probability " + prob.toFixed(4) + ", logit " + L.logit[i][j].toFixed(3);
    });
  });
})();
"""

_SECTIONS_HTML = (
    "<h2>At every distance</h2><p class=\"explain\">The head picked above, at every distance: "
    "how much attention goes to the key d positions before the query (the previous-token "
    "score at lag d), and its induction score at lag k (attention to the token k after an "
    "earlier occurrence of the query's token; k = 1 is the induction score). A head whose "
    "keys read a layer-0 head that looks k back scores at lag k. On the induction probe of "
    "period n, a head that looks at t-1 also scores at induction lag n-1 (that key is also "
    "the token n-1 after the earlier occurrence): read both charts together.</p>"
    "<canvas id=\"offsets\"></canvas><div id=\"offsets-best\"></div>\n"
    "<div id=\"lens-section\" hidden><h2>Logit lens</h2><p class=\"explain\">The residual "
    "stream after the embedding (embed) and after each layer (Lk) read through the final norm "
    "and the unembedding, at the scored positions: each cell is the top token there and the "
    "target's rank (#0: the target is the top token, in bold), on a background as dark as "
    "the target's probability. Hover a cell for the numbers. The last column is the model's "
    "own prediction.</p><table id=\"lens\"></table></div>\n")


_JS_QK = r"""
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("viewer-data").textContent);
  if (!D.qk) return;
  document.getElementById("qk-section").hidden = false;
  function add(parent, tag, s) {
    const el = document.createElement(tag);
    if (s !== undefined) el.textContent = s;
    parent.appendChild(el);
    return el;
  }
  function shade(v) {  // blue (< 0) .. white (0) .. red (> 0)
    const end = v >= 0 ? [180, 30, 30] : [40, 70, 170], a = Math.min(1, Math.abs(v));
    return "rgb(" + end.map((x) => Math.round(255 * (1 - a) + x * a)).join(",") + ")";
  }
  function draw(cur) {
    const name = D.qk.names[cur.layer][cur.head], Q = D.qk.heads[name];
    const table = document.getElementById("qk"), info = document.getElementById("qk-info");
    table.replaceChildren();
    table.dataset.head = name;
    if (!Q) {
      info.textContent = name + " was not split (split it with --qk " + name + "; split: " +
        Object.keys(D.qk.heads).join(", ") + ")";
      return;
    }
    info.textContent = name + ": score " + Q.mean_score.toFixed(3) + ", margin " +
      Q.mean_margin.toFixed(3) + " (means over " + Q.pairs.length + " pair(s) query:key " +
      Q.pairs.slice(0, 12).map((p) => p[0] + ":" + p[1]).join(", ") +
      (Q.pairs.length > 12 ? ", ..." : "") + "; " + D.qk.pairs + "); the terms add up " +
      "within " + Q.closure.toExponential(1) + ". Rows: query writers; columns: key writers.";
    let lim = 1e-12;
    Q.margin.forEach((row) => row.forEach((v) => { lim = Math.max(lim, Math.abs(v)); }));
    const hr = add(add(table, "thead"), "tr");
    add(hr, "th", "query \\ key");
    Q.writers.forEach((w) => add(hr, "th", w));
    const body = add(table, "tbody");
    Q.margin.forEach((row, i) => {
      const tr = add(body, "tr");
      add(tr, "th", Q.writers[i]);
      row.forEach((v, j) => {
        const td = add(tr, "td", (v >= 0 ? "+" : "") + v.toFixed(2));
        td.style.background = shade(v / lim);
        td.style.color = Math.abs(v / lim) > 0.45 ? "#fff" : "#000";
        td.title = "query " + Q.writers[i] + " x key " + Q.writers[j] + ": margin " +
          v.toFixed(3) + ", score " + Q.score[i][j].toFixed(3);
      });
    });
  }
  document.addEventListener("minigpt:head", (ev) => draw(ev.detail));
})();
"""

_QK_HTML = (
    "<div id=\"qk-section\" hidden><h2>Why it attends there</h2><p class=\"explain\">The "
    "head's attention score split exactly into (query writer x key writer) terms (--qk): each "
    "cell is a term's margin, its share of the score minus its mean over the keys the query "
    "may attend to (red: it draws the query to the chosen key rather than the others; blue: "
    "away), mean over the pairs. The norm scales are frozen at this input. Hover a cell for "
    "its score.</p><div id=\"qk-info\"></div><table id=\"qk\"></table></div>\n")


def _script() -> str:
    """The page's one inline script: the sections' listeners, then the main viewer."""
    return '"use strict";\n' + _JS_OFFSETS + _JS_LENS + _JS_QK + _JS


def render_html(insp: Inspection, heads: Sequence[tuple[int, int]] | None = None) -> str:
    """The viewer page as one string (see the module docstring for the escaping contract)."""
    script = _script()
    script_hash = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{script_hash}'; "
           "style-src 'unsafe-inline'; img-src data:")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
        "<link rel=\"icon\" href=\"data:,\">\n"
        "<title>minigpt inspect-heads</title>\n"
        f"<style>{_CSS}</style></head>\n<body>\n"
        "<h1>Attention heads</h1><div id=\"meta\"></div>\n"
        "<div id=\"controls\"><label>layer <select id=\"layer\"></select></label>"
        "<label>head <select id=\"head\"></select></label><strong id=\"current\"></strong></div>\n"
        "<p id=\"explain\"></p>\n"
        "<div id=\"mapbox\"><canvas id=\"map\"></canvas>"
        "<div id=\"scalebox\">attention<br>weight<br><canvas id=\"scale\"></canvas></div>"
        "</div><div id=\"hover\"></div>\n"
        "<h2>Tokens</h2><ol id=\"tokens\"></ol>\n"
        "<h2>Head scores</h2><table id=\"scores\"></table>\n"
        f"{_SECTIONS_HTML}{_QK_HTML}"
        "<h2>What the names and signs mean</h2><dl id=\"glossary\"></dl>\n"
        "<script type=\"application/json\" id=\"viewer-data\">"
        f"{safe_json(viewer_data(insp, heads))}</script>\n"
        f"<script>{script}</script>\n</body></html>\n"
    )


def write_html(insp: Inspection, path: Path,
               heads: Sequence[tuple[int, int]] | None = None) -> Path:
    """Write the viewer to `path` (durably); it opens on the most distinctive of `heads`
    (`Inspection.most_distinctive`; None: of all heads)."""
    return atomic_write_bytes(path, render_html(insp, heads).encode("utf-8"))


# --------------------------------------------------------------------------------------------
# The circuit page (`minigpt circuit --format html`): the same escaping contract, its own
# script (and hash). The pictures are the PNGs `minigpt circuit` draws, inlined as data: URIs
# (base64 of bytes minigpt made); every word of the data reaches the page through textContent.

CIRCUIT_TABLE_ROWS = 500  # the strongest edges listed (all of them are in circuit.json)

_CIRCUIT_JS = r"""
"use strict";
(function () {
  const D = JSON.parse(document.getElementById("circuit-data").textContent);
  const $ = (id) => document.getElementById(id);
  function add(parent, tag, s) {
    const el = document.createElement(tag);
    if (s !== undefined) el.textContent = s;
    parent.appendChild(el);
    return el;
  }
  const c = D.circuit, pct = (x) => (100 * x).toFixed(1) + "%";
  $("title").textContent = "Circuit: " + D.title;
  $("summary").textContent = c.edges + " of " + c.of + " edges recover " + pct(c.recovered) +
    " of the clean -> corrupted change of " + D.metric.what + " (clean " +
    D.clean.toFixed(4) + ", corrupted " + D.corrupted.toFixed(4) + "; " +
    D.method.toUpperCase() + (D.ig_steps > 1 ? " with " + D.ig_steps + " steps" : "") + ", " +
    D.direction + ", " + D.n_pairs + " pair(s)). An edge's score estimates what patching it " +
    "alone from the other input changes the metric by; score / gap is that as a fraction " +
    "of what patching every edge does.";
  const head = add($("edges"), "thead"), hr = add(head, "tr");
  ["#", "from", "to", "input", "score", "score / gap", "in circuit"]
    .forEach((n) => add(hr, "th", n));
  const body = add($("edges"), "tbody"), gap = D.direction === "noising" ?
    D.corrupted - D.clean : D.clean - D.corrupted;
  D.edges.slice(0, D.rows).forEach((e, i) => {
    const tr = add(body, "tr");
    [String(i + 1), e.from, e.to, e.input, e.score.toFixed(5),
     gap ? (e.score / gap).toFixed(3) : "-", e.in_circuit ? "yes" : ""]
      .forEach((s) => add(tr, "td", s));
    if (e.in_circuit) tr.className = "sel";
  });
  $("more").textContent = D.edges.length > D.rows ? "The strongest " + D.rows + " of " +
    D.edges.length + " edges; circuit.json has them all." : "";
})();
"""


def render_circuit_html(doc: dict, pictures: dict[str, bytes]) -> str:
    """The circuit page: `doc` (interp.edge_graph.Circuit.to_json plus a "title") and the PNGs
    `pictures` ({file name: bytes}), one self-contained file."""
    script_hash = base64.b64encode(hashlib.sha256(_CIRCUIT_JS.encode("utf-8")).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{script_hash}'; "
           "style-src 'unsafe-inline'; img-src data:")
    images = "".join(f"<p><img alt=\"{name}\" src=\"data:image/png;base64,"
                     f"{base64.b64encode(data).decode()}\"></p>\n"
                     for name, data in pictures.items())
    data = {**doc, "rows": CIRCUIT_TABLE_ROWS}
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
        "<link rel=\"icon\" href=\"data:,\">\n<title>minigpt circuit</title>\n"
        f"<style>{_CSS}img{{max-width:100%}}</style></head>\n<body>\n"
        "<h1 id=\"title\"></h1><p id=\"summary\"></p>\n"
        f"{images}<h2>Edges, strongest first</h2><table id=\"edges\"></table>"
        "<p id=\"more\"></p>\n"
        "<script type=\"application/json\" id=\"circuit-data\">"
        f"{safe_json(data)}</script>\n<script>{_CIRCUIT_JS}</script>\n</body></html>\n")
