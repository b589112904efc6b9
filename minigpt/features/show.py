"""What an SAE's features are (`minigpt features show --sae DIR`) and which are active on one
input (`inspect-heads --features DIR`), as data; minigpt.cli.features renders it.

Per feature f, on `tokens` held-out tokens:
- `density`: the fraction of the tokens it is active on. A feature active on more than
  `dense` of them (default 0.1) is *dense*: it says little about any one token, and is left out
  of the list (counted; flagged when asked for by --feature);
- `selectivity`: how much of its activation (summed over the tokens) falls on one token id, at
  one of three places: the token before the one it fires on (`prev`), that token (`at`) or the
  one after (`next`): the largest of the three shares, with its place and token. 1 = it fires
  only around that token; features with fewer than MIN_FIRINGS firings have none (too few to
  say: `rare`). The default order of the list, the most selective first;
- `heads`: which heads write it: its decoder row W_dec[f] (n_head * d_head) cut into one
  d_head slice per head, each slice's norm over the sum of the norms (a row of fractions); a
  feature belongs to the head with the largest share (`--head L1.H2`: the features of L1.H2);
- `contexts`: its largest activations, each with the tokens before it, the token it fired on
  and the token after;
- `promoted` / `suppressed`: what it does to the next token, directly: W_dec[f] through W_O
  (the layer's output projection), the final norm's gain and the unembedding (the largest and
  smallest logits of that direction; the final norm's scale and later layers are left out),
  among the tokens the data holds (`seen`: a token the model never met in training has an
  untrained unembedding row whose logit means nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from minigpt.core.gpt import flops_per_token
from minigpt.cost import Work, check_flops
from minigpt.display import head_name
from minigpt.errors import ArgumentError, MinigptError
from minigpt.events import OnEvent, Progress
from minigpt.features import collect
from minigpt.features.show_options import ShowOptions, parse_head
from minigpt.interp.sae import TopKSAE

CONTEXT_BEFORE = 10   # tokens shown before the one a feature fired on
MIN_FIRINGS = 10      # fewer firings on the held-out tokens: no selectivity (rare)
SPOTS = ("prev", "at", "next")  # where a feature's token is: before, at, after the firing


@dataclass
class Feature:
    index: int
    density: float
    heads: list[float]                    # fraction written by each head
    contexts: list[dict] = field(default_factory=list)   # {"tokens", "at", "act", "next"}
    promoted: list[tuple[str, float]] = field(default_factory=list)
    suppressed: list[tuple[str, float]] = field(default_factory=list)
    selectivity: float | None = None      # None: rare (fewer than MIN_FIRINGS firings)
    spot: str | None = None               # prev, at or next
    token: str | None = None              # the token at `spot` that carries `selectivity`
    firings: int = 0
    dense: bool = False

    def to_json(self, layer: int | None) -> dict:
        return {"index": self.index, "density": self.density, "dense": self.dense,
                "firings": self.firings, "selectivity": self.selectivity,
                "selective_on": (None if self.spot is None else
                                 {"place": self.spot, "token": self.token}),
                "heads": [{"head": head_name(layer, h), "layer": layer, "index": h,
                           "share": v} for h, v in enumerate(self.heads)],
                "contexts": self.contexts,
                "promoted": [{"token": t, "logit": v} for t, v in self.promoted],
                "suppressed": [{"token": t, "logit": v} for t, v in self.suppressed]}


@dataclass
class FeaturesView:
    """What `features show` prints: the SAE's numbers, the features shown and why those."""

    sae_dir: str
    layer: int | None
    n_head: int | None
    info: dict
    features: list[Feature]
    options: ShowOptions = field(default_factory=ShowOptions)
    n_features: int = 0      # the SAE's
    n_dense: int = 0         # above options.dense
    n_dead: int = 0          # never active on these tokens
    n_rare: int = 0          # active, but fewer than MIN_FIRINGS times
    n_tokens: int = 0        # held-out tokens they were measured on
    unseen: int = 0          # token ids left out of promoted / suppressed (not in the data)
    n_head_features: int | None = None  # with --head: the features that head writes most
    ids: bool = False        # the tokens are synthetic ids (an induction run), shown as numbers

    def to_json(self) -> dict:
        keep = {k: v for k, v in self.info.items() if k != "density"}
        o = self.options
        return {"sae": self.sae_dir, "layer": self.layer, "n_head": self.n_head, **keep,
                "shown": {"sort": o.sort, "head": o.head, "feature": o.feature, "top": o.top,
                          "dense_above": o.dense, "tokens": self.n_tokens,
                          "features": self.n_features, "dense": self.n_dense,
                          "dead": self.n_dead, "rare": self.n_rare,
                          "unseen_tokens_left_out": self.unseen,
                          "head_features": self.n_head_features},
                "features": [f.to_json(self.layer) for f in self.features]}


def check_fits(sae: TopKSAE, info: dict, loaded, where: Path) -> int:
    """The layer of an SAE trained on z, checked against the loaded model (MinigptError when
    the SAE belongs to another model or layer); an SAE of --activations has none."""
    layer = info.get("layer")
    if layer is None:
        raise MinigptError(f"{where}: was trained on --activations, not on a model's layer; "
                           "it has no heads or tokens to show")
    m = loaded.cfg.model
    d = m.n_head * m.head_dim
    if not 0 <= int(layer) < m.n_layer or sae.d_in != d or info.get("n_head") != m.n_head:
        raise MinigptError(f"{where}: an SAE of layer {layer}'s z ({sae.d_in} wide, "
                           f"{info.get('n_head')} heads) does not fit {loaded.label} "
                           f"({m.n_layer} layers, {m.n_head} heads x {m.head_dim} = {d} wide); "
                           "give the run or model it was trained on")
    return int(layer)


def head_fractions(sae: TopKSAE, n_head: int) -> Tensor:
    """(d_sae, n_head): each feature's decoder norm per head, as fractions of their sum."""
    w = sae.W_dec.detach()
    norms = w.view(sae.d_sae, n_head, -1).norm(dim=-1)
    return norms / norms.sum(-1, keepdim=True).clamp_min(1e-12)


def logit_effects(model, sae: TopKSAE, layer: int) -> Tensor:
    """(d_sae, V): each feature's decoder direction through W_O, the final norm's gain and the
    unembedding."""
    w = sae.W_dec.detach()
    resid = w @ model.blocks[layer].attn.c_proj.weight.detach().T  # (d_sae, C)
    gain = getattr(model.ln_f, "weight", None)
    if gain is not None:
        resid = resid * gain.detach()
    return resid @ model.lm_head.weight.detach().T


@dataclass
class Selectivity:
    """Per feature (d_sae,): the share of its activation on its one token (NaN: rare), where
    (an index into SPOTS), which token id, and how many tokens it fired on."""

    share: Tensor
    spot: Tensor
    token: Tensor
    firings: Tensor


def selectivity(acts: Tensor, rows: Tensor, n_vocab: int) -> Selectivity:
    """The selectivity (module docstring) of every feature from its activations `acts`
    (n * T, d_sae) on `rows` (n, T + 1): sums over the nonzero activations only (k per token),
    so a large vocabulary costs nothing."""
    n, _T1 = rows.shape
    r, f = acts.nonzero(as_tuple=True)
    v = acts[r, f].double()
    d_sae = acts.shape[1]
    total = torch.zeros(d_sae, dtype=torch.float64).index_add_(0, f, v)
    firings = torch.bincount(f, minlength=d_sae)
    none = n_vocab  # the id of "no token" (before a row's first position)
    prev = torch.cat([torch.full((n, 1), none), rows[:, :-2]], 1).reshape(-1)
    ids = (prev, rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1))
    V = n_vocab + 1
    best = torch.full((len(SPOTS), d_sae), -1.0, dtype=torch.float64)
    best_tok = torch.full((len(SPOTS), d_sae), -1, dtype=torch.long)
    for s, tok in enumerate(ids):
        key = f * V + tok[r].clamp(0, n_vocab)
        uniq, inv = torch.unique(key, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, v)
        feat = uniq // V
        top = torch.full((d_sae,), -1.0, dtype=torch.float64).scatter_reduce(
            0, feat, sums, "amax")
        at_top = sums == top[feat]
        best[s] = top
        best_tok[s, feat[at_top]] = uniq[at_top] % V
    share, spot = (best / total.clamp_min(1e-30)).max(0)
    share[firings < MIN_FIRINGS] = math.nan
    token = best_tok.gather(0, spot[None])[0]
    token[token >= n_vocab] = -1
    return Selectivity(share.float(), spot, token, firings)


def order(density: Tensor, sel: Selectivity, options: ShowOptions) -> list[int]:
    """Every feature's index in the list's order (options.sort): the most selective first
    (rare ones after the rest, by density), the densest first, or by index."""
    d = density.numel()
    if options.sort == "index":
        return list(range(d))
    if options.sort == "density":
        return density.argsort(descending=True, stable=True).tolist()
    share = torch.nan_to_num(sel.share.double(), nan=-1.0)
    key = share * 2 + density.double()  # share in [0, 1] dominates; density breaks ties
    return key.argsort(descending=True, stable=True).tolist()


def pick_features(density: Tensor, sel: Selectivity, fractions: Tensor, options: ShowOptions,
                  head: int | None) -> tuple[list[int], int | None]:
    """The features to show and, with a head, how many that head writes most: `feature`
    alone, else the first `top` in `order` that fire (dead ones out), are not dense and (with
    a head) are written most by it."""
    d = density.numel()
    if options.feature is not None:
        if options.feature >= d:
            raise ArgumentError("feature", f"the SAE has {d} features (0..{d - 1}); got "
                                f"{options.feature}")
        return [options.feature], None
    keep = (density > 0) & (density <= options.dense)
    n_head = None
    if head is not None:
        mine = fractions.argmax(-1) == head
        n_head = int((mine & keep).sum())
        keep &= mine
    return [f for f in order(density, sel, options) if keep[f]][:options.top], n_head


def check_show_cost(loaded, sae: TopKSAE, tokens: int, force: bool = False) -> None:
    """`tokens` bounded by cost's rule (`cost.check_flops`: an hour, a share of the free
    memory; ArgumentError naming `tokens` and the largest that fits, unless `force`): a forward
    pass of the model per token (a third of core.gpt.flops_per_token) and the SAE's encoding
    (2 x d_in x d_sae FLOPs); memory: every token's z and its d_sae activations."""
    mcfg = loaded.cfg.model
    per_token = flops_per_token(mcfg, mcfg.block_size) / 3 + 2.0 * sae.d_in * sae.d_sae

    def work_of(n: int) -> Work:
        return Work(n * per_token, 4.0 * n * (sae.d_in + 2 * sae.d_sae))

    check_flops("tokens", tokens, work_of, device=loaded.device, force=force,
                what=f"{tokens:,} held-out tokens through the model and the SAE's "
                f"{sae.d_sae:,} features")


def head_of(options: ShowOptions, layer: int, n_head: int) -> int | None:
    """The index of options.head in the SAE's layer (None without one)."""
    if options.head is None:
        return None
    la, h = parse_head(options.head)
    if la != layer or h >= n_head:
        raise ArgumentError("head", f"the SAE reads layer {layer}'s heads, "
                            f"{head_name(layer, 0)}..{head_name(layer, n_head - 1)}; got "
                            f"{options.head}")
    return h


@torch.no_grad()
def describe(loaded, sae: TopKSAE, info: dict, sae_dir: Path, options: ShowOptions, *,
             force: bool = False, on_event: OnEvent | None = None) -> FeaturesView:
    """The features of `sae` (module docstring) on `options.tokens` held-out tokens of the
    run's data (or `options.text_file`), drawn with `options.seed`; the tokens bounded by
    their cost (`check_show_cost`), unless `force`. Collecting the z reports
    `events.Progress("z of val", rows done, rows)` to `on_event`."""
    options.check()
    layer = check_fits(sae, info, loaded, sae_dir)
    n_head = loaded.cfg.model.n_head
    head = head_of(options, layer, n_head)
    check_show_cost(loaded, sae, options.tokens, force)
    source = collect.run_rows(loaded, options.text_file)
    rows = collect.draw_rows(source, "val", options.tokens,
                            (options.seed + 1) % 2**64)
    report = None if on_event is None else (
        lambda done: on_event(Progress("z of val", done, rows.shape[0])))
    acts = sae.encode(collect.collect(loaded.model, rows, layer, report))  # (n * T, d_sae)
    density = (acts > 0).float().mean(0)
    tok = loaded.tokenizer
    ids = loaded.cfg.data.source == "induction" and options.text_file is None
    name = str if ids else tok.token_str
    sel = selectivity(acts, rows, tok.n_vocab)
    fractions = head_fractions(sae, n_head)
    chosen, n_mine = pick_features(density, sel, fractions, options, head)
    effects = logit_effects(loaded.model, sae, layer)[:, :tok.n_vocab]
    seen = source.seen(tok.n_vocab)
    T = rows.shape[1] - 1
    out = [_feature(f, density, sel, fractions, acts, rows, T, effects, seen, name, options)
           for f in chosen]
    share = torch.nan_to_num(sel.share, nan=-1.0)
    return FeaturesView(
        str(sae_dir), layer, n_head, info, out, options, n_features=sae.d_sae,
        n_dense=int((density > options.dense).sum()), n_dead=int((density == 0).sum()),
        n_rare=int(((share < 0) & (density > 0)).sum()), n_tokens=int(acts.shape[0]),
        unseen=int((~seen).sum()), n_head_features=n_mine, ids=ids)


def _feature(f: int, density: Tensor, sel: Selectivity, fractions: Tensor, acts: Tensor,
             rows: Tensor, T: int, effects: Tensor, seen: Tensor, name: Callable[[int], str],
             options: ShowOptions) -> Feature:
    """Feature f with its contexts and its tokens (the module docstring), each token's text
    `name(id)`."""
    share = float(sel.share[f])
    spot_tok = int(sel.token[f])
    feat = Feature(f, float(density[f]), [round(float(v), 4) for v in fractions[f]],
                   selectivity=None if math.isnan(share) else round(share, 4),
                   spot=None if math.isnan(share) else SPOTS[int(sel.spot[f])],
                   token=(None if math.isnan(share) or spot_tok < 0
                          else name(spot_tok)),
                   firings=int(sel.firings[f]), dense=float(density[f]) > options.dense)
    # rows drawn from one split can overlap: the same place in the text shown once
    vals, where = acts[:, f].topk(min(4 * options.contexts, acts.shape[0]))
    seen_here = set()
    for v, w in zip(vals.tolist(), where.tolist()):
        if v <= 0 or len(feat.contexts) == options.contexts:
            break
        r, p = divmod(w, T)
        ids = rows[r, max(0, p - CONTEXT_BEFORE):p + 2].tolist()  # and the next token
        if tuple(ids) in seen_here:
            continue
        seen_here.add(tuple(ids))
        feat.contexts.append({"tokens": [name(i) for i in ids[:-1]],
                              "at": len(ids) - 2, "act": round(v, 4), "next": name(ids[-1])})
    e = effects[f].masked_fill(~seen, math.nan)
    k = min(5, int(seen.sum()))
    up = torch.nan_to_num(e, nan=-math.inf).topk(k)[1]
    down = torch.nan_to_num(-e, nan=-math.inf).topk(k)[1]
    feat.promoted = [(name(int(i)), round(float(e[i]), 4)) for i in up]
    feat.suppressed = [(name(int(i)), round(float(e[i]), 4)) for i in down]
    return feat


@torch.no_grad()
def active_features(model, sae: TopKSAE, layer: int, tokens: list[int], top: int = 3
                    ) -> list[list[tuple[int, float]]]:
    """For each position of `tokens`, its `top` most active features (index, activation)."""
    rows = torch.tensor([tokens + [0]], dtype=torch.long)
    acts = sae.encode(collect.collect(model, rows, layer))  # (T, d_sae)
    vals, idx = acts.topk(min(top, sae.k), dim=-1)
    return [[(int(i), round(float(v), 4)) for v, i in zip(vr, ir) if v > 0]
            for vr, ir in zip(vals, idx)]


def load_for(sae_dir: Path, loaded):
    """The SAE in `sae_dir` and its layer, checked against the loaded model."""
    from minigpt.features.sae_run import read_for

    sae, info = read_for(Path(sae_dir), loaded)
    return sae, check_fits(sae, info, loaded, sae_dir)
