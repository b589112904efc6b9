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


PLACES = {"prev": "where the token before is", "at": "on the token",
          "next": "where the next token is"}


def _selective(f) -> str:
    if f.selectivity is None:
        return f"active on {f.firings} tokens only: too few to say which token it is about"
    token = "-" if f.token is None else f"<code>{_tok(f.token)}</code>"
    return f"{100 * f.selectivity:.0f}% of its activation {PLACES[f.spot]} {token}"


def _feature_html(f, layer: int, ids: bool) -> str:
    sep = " " if ids else ""
    heads = "".join(
        f'<td style="background: rgba(40, 110, 200, {v:.2f})">{v:.2f}</td>' for v in f.heads)
    ctx = "".join(
        "<li><code>" + sep.join(_tok(t) for t in c["tokens"][:c["at"]]) + sep
        + f'<mark>{_tok(c["tokens"][c["at"]])}</mark>{sep}<span class="next">{_tok(c["next"])}'
        f'</span></code> <small>(activation {c["act"]:.3f})</small></li>' for c in f.contexts)
    plus = ", ".join(f"<code>{_tok(t)}</code>" for t, _ in f.promoted)
    minus = ", ".join(f"<code>{_tok(t)}</code>" for t, _ in f.suppressed)
    dense = ' <strong class="dense">dense</strong>' if f.dense else ""
    return (f'<section><h2>feature {f.index}</h2><p>active on {100 * f.density:.2f}% of '
            f"the held-out tokens{dense}; {_selective(f)}</p><table><tr>"
            + "".join(f"<th>{head_name(layer, h)}</th>" for h in range(len(f.heads)))
            + f"</tr><tr>{heads}</tr></table><p>largest activations:</p><ol>{ctx}</ol>"
            f"<p>raises: {plus}<br>lowers: {minus}</p></section>")


def _glossary(view: FeaturesView) -> str:
    """The words and signs the page uses, each said once."""
    o = view.options
    terms = [
        ("feature", ("one direction in the heads' concatenated outputs z; the SAE writes z at "
         "every token as a sum of a few features times their activations")),
        ("active on", ("the share of the held-out tokens where the feature's activation is above "
         "0 (its density)")),
        ("dense", (f"active on more than {100 * o.dense:g}% of the tokens: it says little about "
         f"any one token; left out of the list ({view.n_dense} of {view.n_features}) unless "
         "asked for by number")),
        ("% of its activation", ("how much of the feature's activation, summed over the tokens, "
         "falls on one token id: on the token where it fires, the token before it, or the token "
         "after it (the largest of the three). Near 100%: the feature is about that token. The "
         "list shows the most selective features first")),
        ("the heads' table", ("how much of the feature's decoder direction lies in each head's "
         "part of z: which heads write it")),
        ("largest activations", ("the held-out tokens where it was most active: the tokens before, "
         "the token it fired on (highlighted), then the next token (grey)")),
        ("raises / lowers", "the tokens whose logits its direction, sent through the layer's "
         "output projection W_O, the final norm's gain and the unembedding, raises and lowers "
         "most directly" + (f", among the tokens the data holds ({view.unseen} never occur in "
                            "it: their logits mean nothing)" if view.unseen else "")),
    ]
    if not view.ids:
        terms.append(("token signs", ("· a space, ↵ a newline, → a tab, ␍ a carriage return, "
                      "\\xNN a byte that is not text on its own, ∅ the empty token")))
    else:
        terms.append(("tokens", "synthetic ids, shown as numbers"))
    return "<h2>Glossary</h2><dl>" + "".join(
        f"<dt>{html.escape(t)}</dt><dd>{html.escape(d)}</dd>" for t, d in terms) + "</dl>"


def html_page(view: FeaturesView) -> str:
    q = view.info.get("quality") or {}
    ce = view.info.get("ce") or {}
    rec = ce.get("recovered")
    intro = (
        f"<p>A sparse autoencoder (SAE) rewrites the output of layer {view.layer}'s heads, "
        "at every token, as a sum of a few <em>features</em> out of many. Each feature below "
        "comes with how often it is active, the token it is most about, which heads write it, "
        "the held-out tokens where it was most active and the tokens it raises and lowers "
        "directly; the glossary at the end says what each means.</p>"
        + (f"<p>On held-out tokens: {q.get('l0') or 0:.1f} features active per token "
           f"on average, {100 * (q.get('variance_explained') or 0):.1f}% of the variance "
           f"explained, {100 * (q.get('dead_fraction') or 0):.1f}% of features never active"
           + (f"; with the SAE's reconstruction in place of the heads' outputs the model keeps "
              f"{100 * rec:.1f}% of what zeroing them loses" if rec is not None else "")
           + ".</p>" if q else ""))
    body = "".join(_feature_html(f, view.layer, view.ids) for f in view.features)
    style = ("body{font-family:sans-serif;max-width:60em;margin:auto}td,th{padding:2px 8px;"
             "border:1px solid #ccc}mark{background:#fd6}code{white-space:pre}"
             ".next{color:#888}.dense{color:#a33}dt{font-weight:bold;margin-top:.5em}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>SAE features, layer "
            f"{view.layer}</title><style>{style}</style></head><body><h1>Features of layer "
            f"{view.layer}'s heads</h1><p><small>{html.escape(view.sae_dir)}</small></p>"
            f"{intro}{body}{_glossary(view)}</body></html>\n")


def write_html(view: FeaturesView, out: Path) -> Path:
    return atomic_write_text(Path(out) / HTML_FILE, html_page(view))
