"""How heads work together: direct logit attribution, composition scores and activation
patching (`heads.py` is what one head does; this file is how heads combine). `heads/` feeds it
inputs and `cli/` renders it.

Direct logit attribution (`direct_logit_attribution`). The logit of a token is a linear read of
the final residual stream once the final norm's per-position scale is fixed: the residual is a
sum of components (token embedding, position embedding, every head's output through its slice
of W_O, each layer's W_O bias, each MLP's output), so the logit is the sum of each component's
share. A component c at position t adds `(P c) . (gamma * u) / s_t` to the logit of the token
whose unembedding row is u: P removes the mean over the width (LayerNorm's centring; RMSNorm
has none, P = I), gamma is the final norm's gain and s_t the final norm's scale at t,
sqrt(var + eps) (RMSNorm: sqrt(mean square + eps)), taken from the unpatched run
(TransformerLens's `apply_ln_to_stack` convention). Centring each component removes exactly
what centring the sum removes, so nothing is lost: the components plus the final norm's bias
term (`beta . u`, its own row) add up to the logit (before `model.logit_softcap`, if any).

Composition scores (`composition_scores`; Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits"). For a head h1 of layer l1 and a head h2 of a later layer l2,
`||W_OV(h1) M(h2)||_F / (||W_OV(h1)||_F ||M(h2)||_F)` with the matrices acting on row vectors
of the residual stream (x -> x W): W_OV = W_V W_O (what h1 writes for what it reads); M =
W_Q W_K^T for Q-composition (h1's output moves h2's queries), W_K W_Q^T for K-composition
(its keys), W_V W_O for V-composition (its values) -- TransformerLens's `all_composition_scores`
definitions. Each norm folds into the weights what it does linearly (the gain gamma of the
norm in front of a reading matrix, LayerNorm's centring P on both the reading and the writing
side: `W_Q <- P diag(gamma) W_Q`, `W_O <- W_O P`), as TransformerLens's `fold_ln` and
`center_writing_weights` do; the per-position scale is no weight and is left out, as is RoPE's
rotation between W_Q and W_K. The baseline is the mean score of random Gaussian weights of the
same shapes (a score near it means "no more aligned than chance").

Activation patching (`patch_heads`). Two inputs of the same length, a clean one and a
corrupted one. Noising: for each head, the clean run with that head's output taken from the
corrupted run; the effect is the fraction of the way the metric moves from its clean value
towards its corrupted one (0: the head carries nothing that differs between the inputs; 1:
patching this head alone does as much as corrupting the whole input). Denoising (the other
way): the corrupted run with the head's clean output, the fraction of the clean value it
restores. The metric is the loss on the scored positions (the clean input's next tokens) or
the logit difference between two tokens at the last position. Like ablation, every head is
patched in one batched forward pass (one row per head, plus one unpatched row).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minigpt.core.gpt import device_of, eval_mode
from minigpt.core.kernels import norm
from minigpt.cost import Work
from minigpt.errors import ArgumentError, MinigptError
from minigpt.interp.edge_args import check_direction
from minigpt.interp.patching import (
    SMALL_GAP,
    HeadRows,
    Metric,
    OnProgress,
    Record,
    check_same_length,
    record,
    stage,
    sweep,
)

KINDS = ("q", "k", "v")
KIND_HELP = {"q": "the earlier head's output read by the later head's queries (W_OV W_Q W_K^T)",
             "k": "the earlier head's output read by the later head's keys (W_OV W_K W_Q^T)",
             "v": "the earlier head's output read by the later head's values (W_OV W_V W_O)"}
BASELINE_DRAWS = 16  # random heads per layer: 16 x 16 random pairs for the composition baseline


# --------------------------------------------------------------------------------------------
# Direct logit attribution.


@dataclass
class Attribution:
    """Direct logit attribution on one input, averaged over the metric's positions.

    heads: (n_layer, n_head) float64, each head's share of the logit (or logit difference).
    rows: the other components, in residual-stream order: "token embedding", "position
    embedding", "layer L attention bias", "layer L MLP", "final norm bias".
    logit: the model's own (mean) logit or logit difference, before any soft-cap; the heads
    and the rows add up to it (`total`)."""

    heads: Tensor
    rows: dict[str, float]
    logit: float
    what: str
    n_positions: int

    @property
    def total(self) -> float:
        return float(self.heads.sum()) + sum(self.rows.values())

    def to_json(self, digits: int = 6) -> dict:
        return {"what": self.what, "n_positions": self.n_positions,
                "logit": round(self.logit, digits), "sum_of_components": round(self.total, digits),
                "components": {k: round(v, digits) for k, v in self.rows.items()},
                "scale": "the final norm's scale from this run (apply_ln_to_stack convention)"}


def _final_scale(model, resid: Tensor) -> Tensor:
    """The final norm's per-position scale s (..., 1) on the residual `resid` (..., C); 1
    without a norm (model.norm none)."""
    if model.cfg.norm == "none":
        return torch.ones_like(resid[..., :1])
    eps = model.ln_f.eps  # make_norm always sets it (cfg.norm_eps)
    if model.cfg.norm == "rmsnorm":
        return (resid.square().mean(-1, keepdim=True) + eps).sqrt()
    return (resid.var(-1, unbiased=False, keepdim=True) + eps).sqrt()


def _centre(model, x: Tensor) -> Tensor:
    """LayerNorm's centring over the width (RMSNorm, no norm: none)."""
    return x - x.mean(-1, keepdim=True) if model.cfg.norm == "layernorm" else x


def _norm_params(norm, width: int) -> tuple[Tensor, Tensor]:
    """(gain, bias) of a norm as float64 vectors; ones / zeros where it has none."""
    w = norm.weight if getattr(norm, "weight", None) is not None else torch.ones(width)
    b = norm.bias if getattr(norm, "bias", None) is not None else torch.zeros(width)
    return w.detach().double().cpu(), b.detach().double().cpu()


def _w_o(model, layer: int) -> Tensor:
    """W_O of `layer` as (C, H, D) float64: column block h is head h's slice."""
    cfg = model.cfg
    return model.blocks[layer].attn.c_proj.weight.detach().double().cpu().view(
        cfg.n_embd, cfg.n_head, cfg.head_dim)


def residual_rows(model, idx: Tensor, rec: Record, pos: Sequence[int]
                  ) -> Iterator[tuple[str, Tensor]]:
    """The components of the final residual other than the heads, at the positions `pos` of
    the sequence idx (1, T), each (P, C) float64, in residual-stream order (module
    docstring), one at a time; with every layer's heads (through W_O) they add up to it."""
    cfg = model.cfg
    yield "token embedding", model.wte.weight[idx[0, pos]].detach().double().cpu()
    if model.wpe is not None:
        yield "position embedding", model.wpe.weight[pos].detach().double().cpu()
    elif cfg.pos_encoding == "sinusoidal":
        yield "position embedding", model.pe[pos].double().cpu()
    for la, block in enumerate(model.blocks):
        if block.attn.c_proj.bias is not None:
            yield (f"layer {la} attention bias",
                   block.attn.c_proj.bias.detach().double().cpu().expand(len(pos), -1))
        if la in rec.mlp:
            yield f"layer {la} MLP", rec.mlp[la][0, pos].detach().double().cpu()


def _heads_at(rec: Record, layer: int, pos: Sequence[int]) -> Tensor:
    """Layer `layer`'s head outputs z at the positions `pos`, (H, P, D) float64."""
    return rec.z[layer][0][:, pos].detach().double().cpu()


@torch.no_grad()
def direct_logit_attribution(model, tokens: Sequence[int], metric: Metric) -> Attribution:
    """Every head's (and every other component's) direct share of the metric's logit on
    `tokens`, in one forward pass (see the module docstring). Eval mode, restored after.

    The read direction is pushed back through each head's slice of W_O instead of pushing
    every head's output forward into the residual stream: a head's share is its output z at
    the scored positions dotted with W_O(h)^T (P r) / s. Beyond the forward pass's own
    recording, only (positions, width) tensors are held (GPT-2 small at 1,024 tokens: a few
    MB each; the (layers, heads, positions, width) stack this replaced was ~1 GB), and the
    LM head runs only on the rows of the tokens attributed."""
    with eval_mode(model):
        idx = torch.tensor([list(tokens)], dtype=torch.long, device=device_of(model))
        _, rec = record(model, idx, logits=False)
        pos = list(metric.positions)
        normed = norm(model.ln_f, rec.final[0, pos]).double().cpu()  # (P, C): what U reads
    L = model.cfg.n_layer
    resid = sum(r for _, r in residual_rows(model, idx, rec, pos)) + sum(  # (P, C), float64
        torch.einsum("hpd,chd->pc", _heads_at(rec, la, pos), _w_o(model, la)) for la in range(L))
    gain, bias = _norm_params(model.ln_f, model.cfg.n_embd)
    u = model.lm_head.weight.detach()  # (V, C): only the rows needed are copied
    if metric.logit_diff:
        pair = u[[metric.answer, metric.wrong]].double().cpu()  # (2, C)
        direction = (pair[0] - pair[1]).expand(len(pos), -1)  # (P, C)
    else:
        direction = u[metric.targets(tokens)].double().cpu()  # (P, C)
    # (P c) . (gain u) / s = c . read: the read direction of one unit of residual at each position
    read = _centre(model, direction * gain) / _final_scale(model, resid)  # (P, C)
    out = {name: float((r * read).sum(-1).mean())
           for name, r in residual_rows(model, idx, rec, pos)}
    out["final norm bias"] = float((direction @ bias).mean())
    head_share = torch.stack([  # each head's z . (W_O(h)^T read), mean over positions
        torch.einsum("hpd,pc,chd->h", _heads_at(rec, la, pos), read, _w_o(model, la)) / len(pos)
        for la in range(L)])  # (L, H)
    logit = float((normed * direction).sum(-1).mean())  # the model's own, before any soft-cap
    return Attribution(head_share, out, logit, metric.as_logit().describe(), len(pos))


# --------------------------------------------------------------------------------------------
# Composition scores (weights only).


@dataclass
class Composition:
    """Q-, K- and V-composition of every head with every head of an earlier layer.

    scores: kind -> (n_layer, n_head, n_layer, n_head) float64, [from_layer, from_head,
    to_layer, to_head]; 0 where to_layer <= from_layer (no composition). baseline: kind -> the
    mean score of random weights of the same shapes."""

    scores: dict[str, Tensor]
    baseline: dict[str, float]

    def records(self, digits: int = 6) -> list[dict]:
        """The JSON list: one record per (kind, earlier head, later head)."""
        out = []
        for kind in KINDS:
            s = self.scores[kind]
            L, H = s.shape[:2]
            for l1 in range(L):
                for h1 in range(H):
                    for l2 in range(l1 + 1, L):
                        for h2 in range(H):
                            out.append({"kind": kind, "from": f"L{l1}.H{h1}",
                                        "from_layer": l1, "from_index": h1,
                                        "to": f"L{l2}.H{h2}", "to_layer": l2,
                                        "to_index": h2,
                                        "score": round(float(s[l1, h1, l2, h2]), digits),
                                        "baseline": round(self.baseline[kind], digits)})
        return out

    def strongest(self, kind: str) -> tuple[int, int, int, int, float]:
        """(from_layer, from_head, to_layer, to_head, score) of the highest score of `kind`."""
        s = self.scores[kind]
        flat = int(s.flatten().argmax())
        l1, h1, l2, h2 = (int(i) for i in torch.unravel_index(torch.tensor(flat), s.shape))
        return l1, h1, l2, h2, float(s[l1, h1, l2, h2])


def head_weights(model, layers: Sequence[int] | None = None) -> dict[str, Tensor]:
    """Every head's W_Q, W_K, W_V (L, H, C, D) and W_O (L, H, D, C), float64, acting on row
    vectors of the residual stream, with each norm's linear part folded in (the module
    docstring): P diag(gamma) in front of the reading matrices, P after W_O. `layers`: only
    those (in that order; default all)."""
    cfg = model.cfg
    H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
    centred = cfg.norm == "layernorm"
    out = {n: [] for n in ("q", "k", "v", "o")}
    for la in range(cfg.n_layer) if layers is None else layers:
        attn = model.blocks[la].attn
        gain, _ = _norm_params(model.blocks[la].ln_1, C)
        w = attn.c_attn.weight.detach().double().cpu().view(3, H, D, C)  # rows Q|K|V
        for i, n in enumerate("qkv"):  # (H, D, C) -> (H, C, D): x -> x P diag(gamma) W
            out[n].append(_centred(w[i].transpose(1, 2) * gain[:, None], -2, centred))
        w_o = attn.c_proj.weight.detach().double().cpu().view(C, H, D)
        out["o"].append(_centred(w_o.permute(1, 2, 0), -1, centred))  # (H, D, C): W_O P
        if attn.qk_norm is not None:  # its gains are linear on d_head; its scale is not
            out["q"][-1] = out["q"][-1] * attn.qk_norm.q_weight.detach().double().cpu()
            out["k"][-1] = out["k"][-1] * attn.qk_norm.k_weight.detach().double().cpu()
    return {n: torch.stack(v) for n, v in out.items()}


def _centred(w: Tensor, dim: int, centred: bool) -> Tensor:
    """w with its mean over the residual-stream axis `dim` removed (P w or w P), if `centred`."""
    return w - w.mean(dim, keepdim=True) if centred else w


def _r_factor(x: Tensor) -> Tensor:
    """R (..., D, D) of x (..., C, D) = Q R: ||x y||_F = ||R y||_F for any y."""
    return torch.linalg.qr(x, mode="r").R


def composition_from_weights(w: dict[str, Tensor], progress: OnProgress | None = None
                             ) -> dict[str, Tensor]:
    """The three score tensors (L, H, L, H) of `head_weights`' matrices.

    Each W_OV = W_V W_O and each M = X Y^T is a product of thin (C, D) factors, so the
    Frobenius norms reduce to D x D matrices (`_r_factor`): ||W_V W_O M||_F = ||A B||_F with
    A = R(W_V) W_O (D, C) and B = X R(Y)^T (C, D). One matrix product per later layer, all
    three kinds at once; `progress("composition", done, L - 1)` after each."""
    q, k, v, o = w["q"], w["k"], w["v"], w["o"]
    L, H, C, D = q.shape
    left = _r_factor(v) @ o  # (L, H, D, C): W_OV of each earlier head, reduced
    rights = {"q": q @ _r_factor(k).transpose(-1, -2), "k": k @ _r_factor(q).transpose(-1, -2),
              "v": v @ _r_factor(o.transpose(-1, -2)).transpose(-1, -2)}  # each (L, H, C, D)
    left_norm = left.flatten(2).norm(dim=-1)  # (L, H) = ||W_OV||_F
    right = torch.stack([rights[kind] for kind in KINDS])  # (3, L, H, C, D)
    right_norm = right.flatten(3).norm(dim=-1)  # (3, L, H) = ||M||_F
    s = torch.zeros(len(KINDS), L, H, L, H, dtype=torch.float64)
    lhs = left.float()  # the one large product runs in float32 (as TransformerLens's does)
    for l2 in range(1, L):
        a = lhs[:l2].reshape(l2 * H * D, C)  # every earlier head's rows
        b = right[:, l2].float().permute(2, 0, 1, 3).reshape(C, len(KINDS) * H * D)
        prod = (a @ b).view(l2, H, D, len(KINDS), H, D)  # block (l1, h1, :, kind, h2, :)
        norms = prod.double().square().sum((2, 5)).sqrt().permute(2, 0, 1, 3)  # (3, l2, H, H)
        denom = left_norm[None, :l2, :, None] * right_norm[:, l2][:, None, None, :]
        s[:, :l2, :, l2] = norms / denom.clamp_min(1e-300)
        if progress is not None:
            progress("composition", l2, L - 1)
    return {kind: s[i] for i, kind in enumerate(KINDS)}


def composition_cost(cfg) -> Work:
    """What `composition_scores` of a model of `cfg` costs: one (C x C)-sized product per later
    layer, 3 C^3 FLOPs per layer pair; memory: the factored weights and products, ~60 L C^2
    bytes."""
    L, C = cfg.n_layer, cfg.n_embd
    return Work(3.0 * C ** 3 * L * (L - 1) / 2, 60.0 * L * C * C)


def composition_baseline(n_head: int, n_embd: int, head_dim: int, centred: bool,
                         draws: int = BASELINE_DRAWS, seed: int = 0) -> dict[str, float]:
    """The mean score of `draws` x `draws` pairs of heads whose weights are standard Gaussian,
    of the model's shapes (centred like a LayerNorm model's when `centred`), for each kind."""
    gen = torch.Generator().manual_seed(seed)
    C, D = n_embd, head_dim

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    # one model of two layers with `draws` random heads each: every (layer 0, layer 1) pair
    # of heads is a pair of independent random heads
    w = {n: _centred(draw(2, draws, C, D), -2, centred) for n in "qkv"}
    w["o"] = _centred(draw(2, draws, D, C), -1, centred)
    s = composition_from_weights(w)
    return {kind: float(s[kind][0, :, 1, :].mean()) for kind in KINDS}


def check_composition(cfg) -> None:
    """MinigptError unless the model (its ModelConfig) has heads in two layers."""
    if cfg.n_layer < 2:
        raise MinigptError(f"the model has {cfg.n_layer} layer: composition needs heads in two "
                           "layers (a later head reading an earlier one's output)")


@torch.no_grad()
def composition_scores(model, progress: OnProgress | None = None) -> Composition:
    """Q-, K- and V-composition of `model`'s heads from its weights alone; MinigptError when
    it has a single layer (no head has an earlier one to read from)."""
    cfg = model.cfg
    check_composition(cfg)
    scores = composition_from_weights(head_weights(model), progress)
    base = composition_baseline(cfg.n_head, cfg.n_embd, cfg.head_dim, cfg.norm == "layernorm")
    return Composition(scores, base)


def k_composition(model, earlier: tuple[int, int], later: tuple[int, int]) -> float:
    """K-composition of one pair of heads (layer, head): what the training timeline records."""
    with torch.no_grad():
        (l1, h1), (l2, h2) = earlier, later
        w = head_weights(model, [l1, l2])  # only the two layers: cheap at every measurement
        pair = {n: torch.stack([t[0, h1], t[1, h2]])[:, None] for n, t in w.items()}
        return float(composition_from_weights(pair)["k"][0, 0, 1, 0])


# --------------------------------------------------------------------------------------------
# Activation patching.


@dataclass
class Patching:
    """Per-head activation patching on a clean / corrupted pair of inputs.

    effect: (n_layer, n_head) float64, the fraction of the clean -> corrupted change of the
    metric that patching this head alone produces (noising) or undoes (denoising).
    delta: (n_layer, n_head) float64, the metric with the head patched minus without.
    clean, corrupted: the metric on the clean and on the corrupted input."""

    direction: str
    metric: str  # the metric's kind: "loss" | "logit" | "logit_diff"
    what: str
    effect: Tensor
    delta: Tensor
    clean: float
    corrupted: float
    source: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self, digits: int = 6) -> dict:
        return {"direction": self.direction, "metric": self.metric, "what": self.what,
                "clean": round(self.clean, digits), "corrupted": round(self.corrupted, digits),
                "corrupted_input": self.source, "notes": self.notes,
                "effect": "fraction of the clean -> corrupted change of the metric that "
                          + ("patching the head alone produces" if self.direction == "noising"
                             else "the head's clean output alone restores")}


@torch.no_grad()
def patch_heads(model, clean: Sequence[int], corrupted: Sequence[int], metric: Metric, *,
                direction: str = "noising", source: str = "",
                progress: OnProgress | None = None) -> Patching:
    """Every head patched alone (module docstring): one run of the input the outputs come
    from, then the input that receives them: interp.patching's `HeadRows` run by its `sweep`,
    the driver ablation runs (one clean pass keeps its residual stream, and the rows patching
    layer l's heads run layers l.. only, in batches bounded by CHUNK_FLOATS). Eval mode,
    restored after. ArgumentError for inputs of different lengths or a corrupted input that
    leaves the metric where it was (nothing to attribute). `progress("patching heads", done,
    n)` as the rows are done."""
    check_direction(direction)
    check_same_length(clean, corrupted)
    L, H = model.cfg.n_layer, model.cfg.n_head
    device = device_of(model)
    base_ids, from_ids = (clean, corrupted) if direction == "noising" else (corrupted, clean)
    base = torch.tensor([list(base_ids)], dtype=torch.long, device=device)
    targets = torch.tensor([metric.targets(clean)], device=device) if not metric.logit_diff \
        else None
    pos = list(metric.positions)
    with eval_mode(model):
        src_logits, reference = record(model, torch.tensor([list(from_ids)], device=device))
        m_source = float(metric.values(src_logits[:, pos], targets).double()[0])

        def replace(layer: int, z: Tensor) -> Tensor:  # the head's output on the other input
            return reference.z[layer].expand_as(z)

        heads = [(layer, head) for layer in range(L) for head in range(H)]
        m_base, values = sweep(model, base, metric, targets, HeadRows(heads, H, replace),
                               stage(progress, "patching heads"))
    delta = (values - m_base).view(L, H)
    gap = m_source - m_base
    if not math.isfinite(gap) or abs(gap) < 1e-9:
        raise ArgumentError("patch_from", f"leaves the metric where it was ({m_base:.6g} on "
                            "both inputs): there is no difference for a head to carry; "
                            "corrupt the input where it matters")
    clean_v, corr_v = (m_base, m_source) if direction == "noising" else (m_source, m_base)
    notes = []
    if abs(gap) < SMALL_GAP:
        notes.append(f"the corrupted input changes the metric by only {abs(gap):.2g}: each "
                     "head's fraction is a ratio of small numbers; corrupt the input where "
                     "the model's prediction depends on it")
    return Patching(direction, metric.kind, metric.describe(), delta / gap, delta,
                    clean_v, corr_v, source, notes)
