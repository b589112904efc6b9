"""Every number about an attention head, computed from a model and token ids (no files, no
text rendering: heads/ writes and draws them, cli/ prints them). Read in this order:

1. Where each head looks: `attention_maps` runs the explicit attention path and returns the
   probabilities `[layer, head, query, key]`, with the SDPA path's logits as a check.
2. What pattern that is: `score_heads` and `dominant_type` (definitions below).
3. What the head carries: `ablate_heads`, one head knocked out at a time through the forward
   pass's one intervention point (`ForwardSpec.intervention` in core/gpt.py), run by
   interp/patching.py's one sweep driver.

Circuit maths (how heads work together) is in interp/head_circuits.py and
interp/edge_graph.py, on the same intervention point.

Head scores
-----------
Attention patterns are `[..., query, key]` (TransformerLens's `[batch, head, query, key]` with
the batch dimension dropped): row `t` is query position `t`'s probability distribution over
key positions `0..t` (causal), so every row sums to 1 and the upper triangle is 0.

Head scores (each in [0, 1], one number per (layer, head); NaN when the input has no query the
score applies to, e.g. no repeated token for `induction`). `A[t, j]` is the attention from query
t to key j, T the number of tokens, `x` the token ids:
- previous: mean over t = 1..T-1 of A[t, t-1].
- induction: over queries t whose token occurred before at some s with s+1 < t, the attention
  mass on those positions s+1 (the token right after each earlier occurrence), averaged over such
  queries. On the `induction` probe (random tokens r_0..r_{n-1} repeated twice, no repeats
  within a copy) the queries are exactly the second copy and the target of query n+i is i+1.
- duplicate: over queries t whose token occurred before, the attention mass on the earlier
  occurrences s < t with x[s] == x[t], averaged over such queries.
- first (sink): mean over t = 1..T-1 of A[t, 0] (t = 0 is excluded: it can only attend to 0).
- self: mean over t = 1..T-1 of A[t, t].
- local: mean over t = W..T-1 of the mass on keys t-W..t (the query and the W tokens before it),
  W = LOCAL_WINDOW; queries t < W see nothing outside the window and are excluded.
- delimiter: over queries t that see an earlier delimiter token (whitespace-only or punctuation),
  the attention mass m_t on delimiter keys j < t in excess of a uniform head's f_t = (number of
  such keys) / (t+1): max(0, (m_t - f_t) / (1 - f_t)), averaged (needs the token strings).
- entropy: mean over t = 1..T-1 of H_t / ln(t+1), H_t = -sum_j A[t,j] ln A[t,j]: 0 = all
  attention on one key, 1 = uniform over the t+1 visible keys.

Offsets and lags (`offset_profile`, `lag_scores`, `best_lag`): what a head does at any
distance, not only at 1. K = LAG_WINDOW:
- offset profile at distance d (d = 0..K): mean over t = d..T-1 of A[t, t-d], the mean attention
  from a query to the key d positions before it (d = 0: the self score; d = 1: the previous
  score). NaN where d > T-1.
- previous at lag k (k = 1..K): attention from t to t-k, i.e. the offset profile at d = k (lag 1
  is the previous score): one number per lag, not a second definition.
- induction at lag k (k = 1..K): over queries t with an earlier occurrence s < t of their token
  (x[s] == x[t]) and s+k < t, the attention mass on those positions s+k (the token k after each
  earlier occurrence), averaged over such queries (lag 1 is the induction score). Past lag 1 a
  position s+k that is t-1 is left out: attention to the previous token is the previous-token
  score's (on a sequence repeated with period P, lag P-1 would otherwise give every
  previous-token head an induction score). A head whose
  keys read a layer-0 head that looks k back, and whose values read one that looks k-1 back,
  scores at lag k and copies the next token as an induction head does.
- best lag: the lag k with the highest score (the earliest on a tie); none when no lag applies.

Dominant type (`dominant_type`): the pattern score (induction, previous, duplicate, first, self,
delimiter) with the highest value if it is >= DOMINANT_THRESHOLD; otherwise `diffuse` if
entropy >= DIFFUSE_ENTROPY (close to uniform); otherwise `local` if the local score is
>= DOMINANT_THRESHOLD; otherwise `mixed`. Ties go to the earlier type in that list. `n/a`
when no score applies (a single token). Thresholds: DOMINANT_THRESHOLD = 0.4, DIFFUSE_ENTROPY =
0.7, LOCAL_WINDOW = 3.

Ablation
--------
What a head does, not only where it looks: knock one head out and measure what the model
loses. `ablate_heads` returns, for every head alone, the loss with that head ablated minus the
unablated loss, in nats per token: 0 = the prediction never needed it, > 0 = it carried part
of the prediction (< 0: the model does better without it on this input).

The intervention is the forward pass's one intervention point (`ForwardSpec.intervention`, at
the heads' outputs): the head's output z `[batch, head, query, d_head]` (its attention-weighted
values, before W_O mixes the heads into the residual stream) is replaced, in one layer, for one
head:

- `zero`: by zeros, so W_O receives nothing from the head (a bias of W_O stays: it belongs to
  no head);
- `mean`: by its mean over the input's positions (the same vector at every query), which
  keeps the average signal the rest of the model may rely on and removes what depends on the
  position and the tokens (Wang et al. 2022's mean ablation, averaged over this input);
- `resample`: by its output at the same positions on the same tokens in a random order (a
  seeded permutation): what the head would say about an input with the same tokens but none of
  this one's order (the resample ablation of Chan et al. 2022, with the permuted input as the
  reference distribution).

Ablating head h of layer l leaves every layer before l unchanged, so inside its layer the head
sees exactly the inputs of the unablated pass: the mean and the resampled outputs are those of
the unablated model. So the layers below l are never rerun: one clean pass keeps the residual
stream entering every layer (`GPT.residual_stream`), and the heads of layer l are ablated in one
batched pass from layer l on (`GPT.from_layer`: one row per head, plus one unablated row; in
chunks that bound the memory), the LM head only at the scored positions: interp/patching.py's
one sweep driver, which head patching and edge patching run too. Each row's effect is
measured against the unablated row of its own batch, so a head whose output is already what
replaces it gives an effect of exactly 0.

Where the loss is scored is the caller's choice (`positions`): every next-token prediction of a
text; on the induction probe only the predictions inside the second copy, where copying is
possible (heads/probes.py's `ProbeInput.scored`).
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minigpt.core.gpt import ForwardSpec, device_of, eval_mode
from minigpt.interp.modes import MODE_HELP, check_mode
from minigpt.interp.patching import HeadRows, OnProgress, make_metric, record, stage, sweep

# --------------------------------------------------------------------------------------------
# 1. Where each head looks.


@torch.no_grad()
def attention_maps(model, tokens: Sequence[int], device: torch.device | str = "cpu"
                   ) -> tuple[Tensor, float]:
    """Run `model` on `tokens` (one sequence) through the explicit attention path and the SDPA
    path. Returns (attention (n_layer, n_head, T, T) float32 CPU, max |logit difference|)."""
    with eval_mode(model):
        idx = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # (1, T)
        logits_explicit, maps = model.forward_with_attention(idx)
        logits_sdpa, _ = model(idx, attn=ForwardSpec("sdpa"))  # whatever attn_impl it trained with
    attn = torch.stack([m[0] for m in maps]).float().cpu()  # n_layer x (H, T, T)
    diff = (logits_explicit.float() - logits_sdpa.float()).abs().max().item()
    return attn, diff


# --------------------------------------------------------------------------------------------
# 2. What pattern it is: head scores.

LOCAL_WINDOW = 3
DOMINANT_THRESHOLD = 0.4
DIFFUSE_ENTROPY = 0.7
# Order matters twice: table columns, and ties in `dominant_type` go to the earlier name.
PATTERN_SCORES = ("induction", "previous", "duplicate", "first", "self", "delimiter")
SCORE_NAMES = PATTERN_SCORES + ("local", "entropy")
SCORE_HELP = {
    "induction": "attention to the token right after an earlier occurrence of the query's token",
    "previous": "attention from position t to t-1",
    "duplicate": "attention to earlier occurrences of the query's own token",
    "first": "attention to position 0 (attention sink)",
    "self": "attention to the query's own position (diagonal)",
    "delimiter": "attention to earlier whitespace/punctuation tokens beyond a uniform head's",
    "local": f"attention to the query and the {LOCAL_WINDOW} tokens before it",
    "entropy": "entropy of each query's distribution / ln(visible keys): 0 focused, 1 uniform",
}
LAG_WINDOW = 16  # offsets d = 0..LAG_WINDOW and lags k = 1..LAG_WINDOW
LAG_HELP = {
    "offsets": "mean attention from a query to the key d positions before it, d = 0..K "
               "(d = 0: self, d = 1: previous)",
    "previous_lags": "previous-token score at lag k = 1..K: attention from t to t-k (the "
                     "offset profile without d = 0)",
    "induction_lags": "induction score at lag k = 1..K: attention to the token k after an "
                      "earlier occurrence of the query's token (k = 1: the induction score)",
    "best_previous_lag": "the lag with the highest previous-token score",
    "best_induction_lag": "the lag with the highest induction score (null: none applies)",
}
_DELIMITER_CHARS = set(string.punctuation) | set(" \t\r\n\f\v")

# Scores on an attention tensor (..., T, T); leading dims are kept, e.g. (n_layer, n_head).


def _masked_mean(mass: Tensor, rows: Tensor) -> Tensor:
    """Mean of `mass[..., t]` over query positions where `rows[t]`; NaN when no row qualifies."""
    n = int(rows.sum())
    if n == 0:
        return torch.full(mass.shape[:-1], float("nan"))
    return (mass * rows).sum(-1) / n


def _checked(attn: Tensor, tokens: Sequence[int]) -> tuple[Tensor, int]:
    """`attn` (..., T, T) as float64 on the CPU, and T; ValueError unless it is square and
    matches the T tokens."""
    attn = attn.detach().to(torch.float64).cpu()
    T = attn.shape[-1]
    if attn.shape[-2] != T or len(tokens) != T:
        raise ValueError(f"attention (..., {attn.shape[-2]}, {T}) does not match "
                         f"{len(tokens)} tokens")
    return attn, T


def score_heads(attn: Tensor, tokens: Sequence[int],
                token_strs: Sequence[str] | None = None) -> dict[str, Tensor]:
    """All head scores (see the module docstring) for `attn` of shape (..., T, T), float.

    Returns {name: tensor of shape attn.shape[:-2]} for every name in SCORE_NAMES, in [0, 1] or
    NaN. `tokens` (length T) are the ids; `token_strs` (length T) enable the delimiter score."""
    attn, T = _checked(attn, tokens)
    x = torch.as_tensor(list(tokens))
    q = torch.arange(T).unsqueeze(1)   # (T, 1) query positions
    k = torch.arange(T).unsqueeze(0)   # (1, T) key positions
    after_first = torch.arange(T) >= 1  # queries t = 1..T-1
    diag = attn.diagonal(dim1=-2, dim2=-1)  # (..., T): A[t, t]
    scores: dict[str, Tensor] = {}

    # previous: A[t, t-1]; diagonal(offset=-1)[i] = A[i+1, i]
    prev = attn.diagonal(offset=-1, dim1=-2, dim2=-1)
    scores["previous"] = prev.mean(-1) if T >= 2 else torch.full(attn.shape[:-2], float("nan"))

    # same[t, j]: key j holds the query's token and lies strictly before it
    same = (x.unsqueeze(1) == x.unsqueeze(0)) & (k < q)
    scores["duplicate"] = _masked_mean((attn * same).sum(-1), same.any(-1))

    # induction targets: key j = s+1 where x[s] == x[t], s+1 < t
    ind = torch.zeros(T, T, dtype=torch.bool)
    ind[:, 1:] = same[:, :-1] & (k[:, 1:] < q)
    scores["induction"] = _masked_mean((attn * ind).sum(-1), ind.any(-1))

    scores["first"] = _masked_mean(attn[..., :, 0], after_first)
    scores["self"] = _masked_mean(diag, after_first)

    if token_strs is not None and len(token_strs) == T:
        is_delim = torch.tensor([bool(s) and set(s) <= _DELIMITER_CHARS for s in token_strs])
        delim = is_delim.unsqueeze(0) & (k < q)  # (T, T): earlier delimiter keys
        # excess over a uniform head, whose mass on them is f_t = (#earlier delimiters) / (t+1):
        # otherwise a diffuse head on whitespace-heavy text would look like a delimiter head
        f = delim.sum(-1).double() / (torch.arange(T) + 1)  # (T,), < 1 (the query is no key)
        excess = ((attn * delim).sum(-1) - f) / (1 - f)
        scores["delimiter"] = _masked_mean(excess.clamp_min(0.0), delim.any(-1))
    else:
        scores["delimiter"] = torch.full(attn.shape[:-2], float("nan"))

    window = (k <= q) & (k >= q - LOCAL_WINDOW)
    scores["local"] = _masked_mean((attn * window).sum(-1), torch.arange(T) >= LOCAL_WINDOW)

    # entropy with 0 ln 0 = 0, normalised by ln(t+1) = the entropy of a uniform row
    plogp = torch.where(attn > 0, attn * attn.clamp_min(1e-300).log(), torch.zeros(()))
    norm = torch.log(torch.arange(T, dtype=torch.float64) + 1).clamp_min(1e-12)
    scores["entropy"] = _masked_mean(-plogp.sum(-1) / norm, after_first)
    return {name: scores[name].to(torch.float32) for name in SCORE_NAMES}


def offset_profile(attn: Tensor, max_offset: int = LAG_WINDOW) -> Tensor:
    """(..., max_offset + 1) float32: the mean attention at query-key distance d = 0..max_offset
    (module docstring) of `attn` (..., T, T); NaN where d > T-1."""
    attn = attn.detach().to(torch.float64).cpu()
    T = attn.shape[-1]
    out = torch.full((*attn.shape[:-2], max_offset + 1), float("nan"), dtype=torch.float64)
    for d in range(min(max_offset, T - 1) + 1):
        out[..., d] = attn.diagonal(offset=-d, dim1=-2, dim2=-1).mean(-1)  # A[t, t-d], t >= d
    return out.to(torch.float32)


def lag_scores(attn: Tensor, tokens: Sequence[int], max_lag: int = LAG_WINDOW
               ) -> dict[str, Tensor]:
    """{"previous": (..., max_lag), "induction": (..., max_lag)} float32: the previous-token and
    induction scores of `attn` (..., T, T) at lags k = 1..max_lag (module docstring; index k-1
    holds lag k); NaN where no query applies."""
    attn, T = _checked(attn, tokens)
    x = torch.as_tensor(list(tokens))
    q, s = ((x.unsqueeze(1) == x.unsqueeze(0)).tril(-1)).nonzero(as_tuple=True)  # x[s] == x[q]
    induction = torch.full((*attn.shape[:-2], max_lag), float("nan"), dtype=torch.float64)
    for lag in range(1, max_lag + 1):
        # the target key s+lag lies strictly before the query and, past lag 1, is not the
        # query's previous token (attention there is the previous-token score's: on a
        # repeated sequence of period P, lag P-1 would score every previous-token head)
        ok = (s + lag < q) & ((s + lag != q - 1) | (lag == 1))
        t, key = q[ok], s[ok] + lag
        if not len(t):
            continue
        mass = torch.zeros(attn.shape[:-1], dtype=torch.float64)  # (..., T) per query
        mass.index_add_(mass.dim() - 1, t, attn[..., t, key])  # distinct s: distinct keys
        rows = torch.zeros(T, dtype=torch.bool)
        rows[t] = True
        induction[..., lag - 1] = _masked_mean(mass, rows)
    previous = offset_profile(attn, max_lag)[..., 1:]
    return {"previous": previous, "induction": induction.to(torch.float32)}


def best_lag(scores: Tensor) -> Tensor:
    """(...,) long: the lag (1-based) of the highest score along the last axis of `scores`
    (..., K), the earliest on a tie; 0 where no lag applies (all NaN)."""
    filled = torch.nan_to_num(scores.double(), nan=-1.0)
    best = filled.argmax(-1) + 1  # argmax returns the first maximum
    return torch.where(filled.max(-1).values < 0, torch.zeros_like(best), best)


def dominant_type(scores: dict[str, float]) -> str:
    """The head's dominant type under the rule in the module docstring."""
    def val(name: str) -> float:
        v = scores.get(name, float("nan"))
        return -1.0 if v is None or math.isnan(v) else float(v)

    if all(val(n) < 0 for n in SCORE_NAMES):
        return "n/a"  # a single token: nothing to score
    best = max(PATTERN_SCORES, key=lambda n: (val(n), -PATTERN_SCORES.index(n)))
    if val(best) >= DOMINANT_THRESHOLD:
        return best
    if val("entropy") >= DIFFUSE_ENTROPY:
        return "diffuse"
    if val("local") >= DOMINANT_THRESHOLD:
        return "local"
    return "mixed"


# --------------------------------------------------------------------------------------------
# 3. What it carries: ablation.


@dataclass
class Ablation:
    """Per-head ablation effects on one input.

    effect: (n_layer, n_head) float64: loss with that head ablated - `base_loss`, nats/token.
    base_loss: the unablated loss over the scored predictions (nats/token).
    positions: the query positions whose next-token prediction is scored."""

    mode: str
    effect: Tensor
    base_loss: float
    positions: list[int]
    scored: str  # what the scored predictions are, for people: "every next-token prediction"

    def to_json(self) -> dict:
        return {"mode": self.mode, "what": MODE_HELP[self.mode], "scored": self.scored,
                "n_scored": len(self.positions), "base_loss": round(self.base_loss, 6),
                "unit": "nats/token"}


@torch.no_grad()
def ablate_heads(model, tokens: Sequence[int], mode: str = "zero", *,
                 positions: Sequence[int] | None = None, scored: str = "every next-token "
                 "prediction", minimum: int = 2, seed: int = 0,
                 progress: OnProgress | None = None) -> Ablation:
    """Every head's ablation effect on `tokens` (one sequence within the model's block_size):
    the loss (interp.patching's `loss` metric) at `positions` (None: every prediction; an input
    shorter than `minimum` tokens has none: ArgumentError); `seed` orders the resample
    reference. The model runs in eval mode with its own attention kernel and is restored
    afterwards.

    The rows are interp.patching's `HeadRows` run by its `sweep`: one clean pass keeps the
    residual stream entering every layer; the rows ablating the heads of layer l start from
    it and run layers l.. only (`GPT.from_layer`), and the LM head runs at the scored
    positions only: about half the work of rerunning every layer for every row.
    `progress("ablating heads", done, n)` as the rows are done."""
    check_mode(mode)
    metric = make_metric(len(tokens), positions, minimum=minimum, param="ablate")
    cfg = model.cfg
    L, H = cfg.n_layer, cfg.n_head
    idx = torch.tensor([list(tokens)], dtype=torch.long, device=device_of(model))  # (1, T)
    targets = torch.tensor([metric.targets(tokens)], device=idx.device)  # (1, P)
    with eval_mode(model):
        reference = _resampled_outputs(model, idx, seed) if mode == "resample" else None

        def replace(layer: int, z: Tensor) -> Tensor:  # z: (rows, H, T, D) -> what replaces it
            if mode == "zero":
                return torch.zeros_like(z)
            if mode == "mean":
                return z.mean(dim=2, keepdim=True).expand_as(z)  # (rows, H, 1, D) at every query
            return reference[layer].expand_as(z)  # (1, H, T, D) from the permuted input

        heads = [(layer, head) for layer in range(L) for head in range(H)]
        base, losses = sweep(model, idx, metric, targets, HeadRows(heads, H, replace),
                             stage(progress, "ablating heads"))
    return Ablation(mode, (losses - base).view(L, H), float(base), list(metric.positions),
                    scored)


def _resampled_outputs(model, idx: Tensor, seed: int) -> list[Tensor]:
    """Every layer's head outputs z (1, H, T, D) on `idx` with its tokens in a seeded random
    order: the reference of resample ablation."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(idx.shape[1], generator=gen).to(idx.device)
    return record(model, idx[:, perm], logits=False)[1].z
