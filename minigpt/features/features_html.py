"""`features show --format html`: one offline HTML page a student reads alone (every feature
shown with its density, heads, top contexts and tokens, and how to read them), written durably
(minigpt.files)."""

from __future__ import annotations

import html
from pathlib import Path

from minigpt.display import head_name, visible_token
from minigpt.features.show import FeaturesView
from minigpt.files import atomic_write_text

HTML_FILE = "features.html"


def _tok(s: str) -> str:
    return html.escape(visible_token(s, 24))


def _feature_html(f, layer: int) -> str:
    heads = "".join(
        f'<td style="background: rgba(40, 110, 200, {v:.2f})">{v:.2f}</td>' for v in f.heads)
    ctx = "".join(
        "<li><code>" + "".join(_tok(t) for t in c["tokens"][:c["at"]])
        + f'<mark>{_tok(c["tokens"][c["at"]])}</mark></code> &rarr; <code>{_tok(c["next"])}'
        f'</code> <small>({c["act"]:.3f})</small></li>' for c in f.contexts)
    plus = ", ".join(f"<code>{_tok(t)}</code>" for t, _ in f.promoted)
    minus = ", ".join(f"<code>{_tok(t)}</code>" for t, _ in f.suppressed)
    return (f'<section><h2>feature {f.index}</h2><p>active on {100 * f.density:.2f}% of '
            f"held-out tokens</p><table><tr>"
            + "".join(f"<th>{head_name(layer, h)}</th>" for h in range(len(f.heads)))
            + f"</tr><tr>{heads}</tr></table><p>largest activations:</p><ol>{ctx}</ol>"
            f"<p>raises: {plus}<br>lowers: {minus}</p></section>")


def html_page(view: FeaturesView) -> str:
    q = view.info.get("quality", {})
    ce = view.info.get("ce") or {}
    rec = ce.get("recovered")
    intro = (
        f"<p>A sparse autoencoder (SAE) rewrites the output of layer {view.layer}'s heads, "
        "at every token, as a sum of a few <em>features</em> out of many. Each feature is one "
        "direction in the heads' concatenated outputs; the table under it says how much of "
        "that direction lies in each head's part (so which heads write it), the list shows "
        "the held-out tokens where it was most active (the marked token; after the arrow, "
        "the token that came next), and the last lines the tokens its direction, sent "
        "through the layer's output projection and the unembedding, raises and lowers "
        f"directly.</p><p>On held-out tokens: {q.get('l0', 0):.1f} features active per token "
        f"on average, {100 * q.get('variance_explained', 0):.1f}% of the variance explained, "
        f"{100 * q.get('dead_fraction', 0):.1f}% of features never active"
        + (f"; with the SAE's reconstruction in place of the heads' outputs the model keeps "
           f"{100 * rec:.1f}% of what zeroing them loses" if rec is not None else "")
        + ".</p>")
    body = "".join(_feature_html(f, view.layer) for f in view.features)
    style = ("body{font-family:sans-serif;max-width:60em;margin:auto}td,th{padding:2px 8px;"
             "border:1px solid #ccc}mark{background:#fd6}code{white-space:pre}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>SAE features, layer "
            f"{view.layer}</title><style>{style}</style></head><body><h1>Features of layer "
            f"{view.layer}'s heads</h1><p><small>{html.escape(view.sae_dir)}</small></p>"
            f"{intro}{body}</body></html>\n")


def write_html(view: FeaturesView, out: Path) -> Path:
    return atomic_write_text(Path(out) / HTML_FILE, html_page(view))
