"""What an SAE's features are (`minigpt features show --sae DIR`) and which are active on one
input (`inspect-heads --features DIR`), as data; minigpt.cli.features renders it.

Per feature f:
- `density`: the fraction of held-out tokens it is active on;
- `heads`: which heads write it: its decoder row W_dec[f] (n_head * d_head) cut into one
  d_head slice per head, each slice's norm over the sum of the norms (a row of fractions);
- `contexts`: its largest activations on held-out tokens, each with the tokens before it and
  the token it fired on;
- `promoted` / `suppressed`: what it does to the next token, directly: W_dec[f] through W_O
  (the layer's output projection), the final norm's gain and the unembedding (the largest and
  smallest logits of that direction; the final norm's scale and later layers are left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from minigpt.core.gpt import flops_per_token
from minigpt.cost import Work, check_flops
from minigpt.errors import ArgumentError, MinigptError
from minigpt.features import collect
from minigpt.interp.sae import TopKSAE

CONTEXT_BEFORE = 10  # tokens shown before the one a feature fired on


@dataclass
class Feature:
    index: int
    density: float
    heads: list[float]                    # fraction written by each head
    contexts: list[dict] = field(default_factory=list)   # {"tokens", "at", "act", "next"}
    promoted: list[tuple[str, float]] = field(default_factory=list)
    suppressed: list[tuple[str, float]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"index": self.index, "density": self.density, "heads": self.heads,
                "contexts": self.contexts,
                "promoted": [{"token": t, "logit": v} for t, v in self.promoted],
                "suppressed": [{"token": t, "logit": v} for t, v in self.suppressed]}


@dataclass
class FeaturesView:
    """What `features show` prints: the SAE's numbers and the features shown."""

    sae_dir: str
    layer: int | None
    n_head: int | None
    info: dict
    features: list[Feature]

    def to_json(self) -> dict:
        keep = {k: v for k, v in self.info.items() if k != "density"}
        return {"sae": self.sae_dir, "layer": self.layer, "n_head": self.n_head, **keep,
                "features": [f.to_json() for f in self.features]}


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


def pick_features(density: Tensor, feature: int | None, top: int) -> list[int]:
    """`feature` alone, else the `top` densest features."""
    d = density.numel()
    if feature is not None:
        if not 0 <= feature < d:
            raise ArgumentError("feature", f"the SAE has {d} features (0..{d - 1}); got "
                                f"{feature}")
        return [feature]
    if top < 1:
        raise ArgumentError("top", f"must be a positive number, got {top}")
    return density.argsort(descending=True, stable=True)[:top].tolist()


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


@torch.no_grad()
def describe(loaded, sae: TopKSAE, info: dict, sae_dir: Path, *, feature: int | None = None,
             top: int = 20, contexts: int = 5, tokens: int = 16_384, seed: int = 0,
             text_file: Path | None = None, force: bool = False) -> FeaturesView:
    """The features of `sae` (module docstring) on `tokens` held-out tokens of the run's data
    (or `text_file`), drawn with `seed`; `tokens` bounded by their cost (`check_show_cost`),
    unless `force`."""
    layer = check_fits(sae, info, loaded, sae_dir)
    if tokens < 1:
        raise ArgumentError("tokens", f"must be a positive number, got {tokens}")
    check_show_cost(loaded, sae, tokens, force)
    rows = collect.draw_rows(collect.run_rows(loaded, text_file), "val", tokens, seed + 1)
    acts = sae.encode(collect.collect(loaded.model, rows, layer))  # (n * T, d_sae)
    density = (acts > 0).float().mean(0)
    chosen = pick_features(density, feature, top)
    fractions = head_fractions(sae, loaded.cfg.model.n_head)
    effects = logit_effects(loaded.model, sae, layer)
    tok, T = loaded.tokenizer, rows.shape[1] - 1
    out = []
    for f in chosen:
        feat = Feature(f, float(density[f]), [round(float(v), 4) for v in fractions[f]])
        vals, where = acts[:, f].topk(min(contexts, acts.shape[0]))
        for v, w in zip(vals.tolist(), where.tolist()):
            if v <= 0:
                break
            r, p = divmod(w, T)
            ids = rows[r, max(0, p - CONTEXT_BEFORE):p + 1].tolist()
            feat.contexts.append({"tokens": [tok.token_str(i) for i in ids],
                                  "at": len(ids) - 1, "act": round(v, 4),
                                  "next": tok.token_str(int(rows[r, p + 1]))})
        e = effects[f][:tok.n_vocab]
        k = min(5, e.numel())
        feat.promoted = [(tok.token_str(int(i)), round(float(e[i]), 4)) for i in e.topk(k)[1]]
        feat.suppressed = [(tok.token_str(int(i)), round(float(e[i]), 4))
                           for i in (-e).topk(k)[1]]
        out.append(feat)
    return FeaturesView(str(sae_dir), layer, loaded.cfg.model.n_head, info, out)


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
    from minigpt.features.store import load_sae

    sae, _, info = load_sae(sae_dir)
    return sae, check_fits(sae, info, loaded, sae_dir)
