"""Why a head attends where it does: its attention score split exactly into (query writer x
key writer) terms. `heads/` feeds it inputs and pairs, `cli/` renders it.

The score. Head (l, h) scores query t against key s as the model computes it:
    score(t, s) = scale * q_t . k_s,   scale = 1/sqrt(d_head) (SDPA's),
with q_t = RoPE_t(QKnorm(W_Q^h ln(x_t) + b_Q^h)) and k_s likewise (W_K^h, b_K^h, RoPE_s), x the
residual stream entering layer l and ln its norm (ln_1). A score exists where the query may
attend to the key: s <= t (the causal mask; this model has no attention window).

The writers. x is a sum of what writes to the residual stream (the graph's nodes, as
`minigpt circuit` names them): `embed` (split into `embed.tok`, the token embedding, and
`embed.pos`, the position embedding, where the model adds positions to the stream: learned or
sinusoidal), every head `L{l'}.H{h'}` of an earlier layer (its output z through its slice of
W_O) and every earlier MLP `L{l'}.MLP` (its output, its c_proj bias included), plus the W_O
biases of the earlier layers, which are constant. Each writer is split out of the score by
freezing what is not linear at its value on this input (the usual linearisation, as direct
logit attribution freezes the final norm's scale):
- the norm's scale: LayerNorm(x) = P x / sigma * gamma + beta, with P the centring (subtract
  the mean over the width: linear) and sigma = sqrt(var(x) + eps) of the real stream, frozen;
  RMSNorm: P = I, sigma = sqrt(mean(x^2) + eps). So ln(x) = sum_i P x_i / sigma * gamma +
  (P c / sigma * gamma + beta), c the constant W_O biases;
- QK-norm's scale likewise: q = sum_i q_i / rho * g, rho = sqrt(mean over d_head of
  q^2 + eps) of the real query (the key: its own rho and gain);
- RoPE is a rotation at the query's (key's) position: linear, each writer's part is rotated
  exactly.
Writer i's query part q_i(t) is then its normed share through W_Q^h (no bias), QK-normed with the
frozen rho and rotated; the `bias` writer takes every constant: the norm's beta, the W_O
biases in the stream (through the frozen sigma) and b_Q (b_K). Since q_t = sum_i q_i(t) and
k_s = sum_j k_j(s),
    score(t, s) = sum_{i, j} term_ij(t, s),   term_ij(t, s) = scale * q_i(t) . k_j(s):
the grid [query writer, key writer] sums to the score exactly (`closure`: the largest
|sum of terms - the model's own score| over the pairs, from the queries and keys the forward
pass computed; ~1e-6 in float32, ~1e-12 in float64).

The margin. Softmax is unchanged by a constant added to every key of a query, so a term that
adds the same to every key moves no attention. The margin of (t, s) is the score minus its
mean over the keys the query may attend to:
    margin(t, s) = score(t, s) - mean_{s' <= t} score(t, s'),
and per term margin_ij(t, s) = scale * q_i(t) . (k_j(s) - mean_{s' <= t} k_j(s')); the terms'
margins sum to the margin (the same closure). Terms are ranked by margin: the largest is what
makes this key, rather than the others, attractive to this query.

A head's figures over several (query, key) pairs are means over the pairs (`terms`).

Speed: for every layer, every writer's output is normed and projected through W_Q and W_K of
every requested head of that layer in one matrix product ((writers, B, T, C) @ (C, 2 H D)),
then each pair's grid is one small product (writers x d_head x writers): every head of a
GPT-2-small-shaped model at 64 tokens takes seconds (benchmarks/README.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minigpt.core.gpt import ForwardSpec, apply_rope, device_of, eval_mode
from minigpt.cost import Work
from minigpt.display import head_name, mlp_name
from minigpt.errors import ArgumentError
from minigpt.interp.edge_graph import graph_of, layer_head
from minigpt.interp.patching import OnProgress, Record

BIAS = "bias"  # the writer of every constant (norm and projection biases)
PREVIOUS_TERM = ("embed", "previous")  # the textbook induction term: (query, key) writers


@dataclass
class QKHead:
    """One head's scores split into (query writer, key writer) terms at its pairs.

    writers: the names of the writers (the same list on the query and the key side).
    pairs: (batch, query, key) of each pair.
    scores, margins: (P,) float64, the model's own score and margin of each pair.
    grid, margin_grid: (P, W, W) float64, [pair, query writer, key writer]."""

    layer: int
    head: int
    writers: list[str]
    pairs: list[tuple[int, int, int]]
    scores: Tensor
    margins: Tensor
    grid: Tensor
    margin_grid: Tensor

    @property
    def name(self) -> str:
        return head_name(self.layer, self.head)

    @property
    def closure(self) -> float:
        """The largest |sum of the terms - the model's own value| over the pairs, of the scores
        and of the margins."""
        score = (self.grid.sum((1, 2)) - self.scores).abs().max()
        margin = (self.margin_grid.sum((1, 2)) - self.margins).abs().max()
        return float(torch.maximum(score, margin))

    def terms(self) -> list[tuple[str, str, float, float]]:
        """(query writer, key writer, mean score, mean margin) of every term, the largest mean
        margin first."""
        s, m = self.grid.mean(0), self.margin_grid.mean(0)
        order = m.flatten().argsort(descending=True, stable=True).tolist()
        W = len(self.writers)
        return [(self.writers[i // W], self.writers[i % W], float(s.flatten()[i]),
                 float(m.flatten()[i])) for i in order]

    def term_margin(self, query: str, key: str) -> float:
        """The mean margin of the term (query writer, key writer)."""
        i, j = self.writers.index(query), self.writers.index(key)
        return float(self.margin_grid[:, i, j].mean())

    def to_json(self, digits: int = 6) -> dict:
        """`--json`'s entry: the pairs with their scores and margins, every term (means over
        the pairs, the largest margin first) and the closure."""
        r = lambda v: round(float(v), digits)
        return {"head": self.name, "layer": self.layer, "index": self.head,
                "writers": self.writers, "closure": self.closure,
                "pairs": [{"batch": b, "query": t, "key": s, "score": r(self.scores[p]),
                           "margin": r(self.margins[p])}
                          for p, (b, t, s) in enumerate(self.pairs)],
                "score": r(self.scores.mean()), "margin": r(self.margins.mean()),
                "terms": [{"query": q, "key": k, "score": r(s), "margin": r(m)}
                          for q, k, s, m in self.terms()]}


# --------------------------------------------------------------------------------------------
# What to split: heads and pairs, checked.


def resolve_heads(cfg, names: Sequence[str]) -> list[tuple[int, int]]:
    """(layer, head) of each `--qk` name: a head's node name as `minigpt circuit` prints it
    (`L1.H2`; the graph's own names, interp/edge_graph.py), or `all`; in order, each once; a
    blank item (two commas in a row) skipped. ArgumentError (`qk`) for any other name."""
    graph = graph_of(cfg)
    heads = [graph.writer_name(u) for la in range(graph.n_layer)
             for u in range(graph.head_writers(la).start, graph.head_writers(la).stop)]
    out: list[tuple[int, int]] = []
    for name in names:
        if not name:
            continue  # `L0.H0,,L1.H1`: an empty item between commas
        chosen = heads if name.lower() == "all" else [name]
        for n in chosen:
            if n not in heads:
                raise ArgumentError("qk", f"'{name}' is not a head of this model: heads are "
                                    f"named as `minigpt circuit` prints them, L0.H0 .. "
                                    f"{heads[-1]} ({cfg.n_layer} layers of {cfg.n_head} "
                                    "heads), or all")
            pair = layer_head(n)
            if pair not in out:
                out.append(pair)
    if not out:
        raise ArgumentError("qk", "names no head; give e.g. L0.H0, or all")
    return out


_PAIR = re.compile(r"\s*(\d{1,9})\s*:\s*(\d{1,9})\s*")
INDUCTION = "induction"  # --qk-pairs induction: the induction probe's targets


def parse_pairs(items: Sequence[str], n_tokens: int) -> list[tuple[int, int, int]]:
    """(batch 0, query, key) of each `--qk-pairs` item `QUERY:KEY` (a blank item skipped, each
    pair once, in order): positions of the input, the key at or before the query (the causal
    mask). ArgumentError (`qk_pairs`) otherwise."""
    out: dict[tuple[int, int, int], None] = {}
    for part in items:
        if not part.strip():
            continue
        m = _PAIR.fullmatch(part)
        if m is None:
            item = part.strip()
            item = item if len(item) <= 40 else item[:37] + "..."
            raise ArgumentError("qk_pairs", f"'{item}' is not QUERY:KEY (two positions of at "
                                "most 9 digits, e.g. 7:3), nor `induction`")
        t, s = int(m.group(1)), int(m.group(2))
        if t >= n_tokens:
            raise ArgumentError("qk_pairs", f"{t}:{s}: query {t} is past the input's last "
                                f"position {n_tokens - 1}")
        if s > t:
            raise ArgumentError("qk_pairs", f"{t}:{s}: key {s} is after query {t}; the "
                                "causal mask lets a query attend to keys 0..query only")
        out[(0, t, s)] = None
    if not out:
        raise ArgumentError("qk_pairs", "names no pair; give e.g. 7:3, or induction")
    return list(out)


def check_tokens(n_tokens: int) -> None:
    """A score split needs a query with a choice of keys: two tokens at least."""
    if n_tokens < 2:
        raise ArgumentError("qk", f"the input has {n_tokens} token: a query needs at least one "
                            "earlier key to choose from; give a text of two tokens or more")


def induction_pairs(tokens: Sequence[int], first: int) -> list[tuple[int, int, int]]:
    """The induction targets from position `first` (the second copy's start) on: (0, t, s + 1)
    with s the latest earlier position holding the token at t."""
    out = []
    for t in range(first, len(tokens)):
        earlier = [s for s in range(t) if tokens[s] == tokens[t] and s + 1 <= t]
        if earlier:
            out.append((0, t, earlier[-1] + 1))
    return out


# --------------------------------------------------------------------------------------------
# The split.


class _QKRecord(Record):
    """A Record that also keeps the queries and keys of the layers asked for."""

    def __init__(self, layers: set[int]) -> None:
        super().__init__()
        self.layers, self.q, self.k = layers, {}, {}

    def qk(self, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if layer in self.layers:
            self.q[layer], self.k[layer] = q, k
        return q, k


def writer_count(cfg, layer: int) -> int:
    """How many writers the stream entering `layer` of a model of `cfg` (a ModelConfig) is
    split into: the embedding (token and position apart where positions are added: learned,
    sinusoidal), each earlier layer's heads and MLP, and the constant of the biases."""
    embed = 2 if cfg.pos_encoding in ("learned", "sinusoidal") else 1
    return embed + layer * (cfg.n_head + bool(cfg.mlp)) + 1


def qk_cost(cfg, n_tokens: int, heads: Sequence[tuple[int, int]], pairs: int) -> Work:
    """What `qk_attribution` of `heads` on `n_tokens` tokens and `pairs` pairs (each given pair
    counts: a head's grids are as many as its pairs) costs: every writer projected through each
    head's layer (4 W T C D FLOPs a head), each pair's grid (4 W^2 D); memory: every writer's
    output (float64, W x T x C; the biases are one constant), two float64 grids (pairs x W x W)
    per head, and while a head is split its writers' query, key and mean-key parts at its
    pairs (three pairs x W x D float64)."""
    T, C, D, L = n_tokens, cfg.n_embd, cfg.head_dim, cfg.n_layer
    flops = sum(4 * writer_count(cfg, la) * T * C * D + 4 * pairs * writer_count(cfg, la) ** 2
                * D for la, _ in heads)
    held = (8.0 * (writer_count(cfg, L) - 1) * T * C
            + sum(16.0 * pairs * writer_count(cfg, la) ** 2 for la, _ in heads)
            + max(24.0 * pairs * writer_count(cfg, la) * D for la, _ in heads))
    return Work(flops, held)


@torch.no_grad()
def qk_attribution(model, idx: Tensor, heads: Sequence[tuple[int, int]],
                   pairs: Sequence[tuple[int, int, int]] | None = None,
                   progress: OnProgress | None = None,
                   queries: Sequence[int] | None = None) -> list[QKHead]:
    """Each head of `heads` ((layer, head)) split at `pairs` ((batch, query, key)) of the
    input idx (B, T) (None: each head at its own most attended key of each query of `queries`,
    default 1..T-1); one forward pass, then per layer one projection of every writer (module
    docstring); `progress("splitting qk", done, len(heads))` after each head. Eval mode,
    restored after."""
    check_tokens(idx.shape[1])
    layers = sorted({la for la, _ in heads})
    with eval_mode(model):
        rec = _QKRecord(set(layers))
        idx = idx.to(device_of(model))
        stream = model.residual_stream(idx, attn=ForwardSpec(model.cfg.attn_impl,
                                                          intervention=rec))
        writers = _Writers(model, idx, rec)
        out = {}
        for la in layers:
            hs = [h for layer, h in heads if layer == la]
            names, rows, const = writers.upto(la)
            q_parts, k_parts = _project(model, la, stream[la].double(), rows, const, hs)
            for j, h in enumerate(hs):
                out[(la, h)] = _head_split(model, rec, la, h, names, q_parts[:, :, j],
                                           k_parts[:, :, j], pairs, queries)
                if progress is not None:
                    progress("splitting qk", len(out), len(heads))
    return [out[h] for h in heads]


def _head_split(model, rec: _QKRecord, layer: int, h: int, names: list[str], Q: Tensor,
                K: Tensor, pairs, queries: Sequence[int] | None = None) -> QKHead:
    """Head h of `layer` from its writers' query and key parts Q, K (R, B, T, D), at `pairs`
    (None: its most attended key of each query of `queries`, default 1..T-1)."""
    scale = 1.0 / math.sqrt(model.cfg.head_dim)
    q, k = rec.q[layer][:, h].double(), rec.k[layer][:, h].double()  # (B, T, D)
    T, dev = q.shape[1], q.device
    real = (q @ k.transpose(-1, -2)) * scale  # (B, T, T), the model's own scores
    allowed = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    mean = (real * allowed).sum(-1) / allowed.sum(-1)  # (B, T), over the keys s <= t
    if pairs is None:  # each query's most attended key (the largest score)
        best = real.masked_fill(~allowed, -math.inf).argmax(-1)  # (B, T)
        qs = range(1, T) if queries is None else queries
        pairs = [(b, t, int(best[b, t])) for b in range(real.shape[0]) for t in qs]
    b_, t_, s_ = (torch.tensor([p[i] for p in pairs], device=dev) for i in range(3))
    counts = torch.arange(1, T + 1, dtype=K.dtype, device=dev)[:, None]
    qp, kp = Q[:, b_, t_], K[:, b_, s_]  # (R, P, D)
    km = (K.cumsum(2) / counts)[:, b_, t_]  # each key writer's mean over the keys 0..t
    grid = torch.einsum("ipd,jpd->pij", qp, kp) * scale
    margin_grid = torch.einsum("ipd,jpd->pij", qp, kp - km) * scale
    chosen = real[b_, t_, s_]
    return QKHead(layer, h, names, [tuple(p) for p in pairs], chosen.cpu(),
                  (chosen - mean[b_, t_]).cpu(), grid.cpu(), margin_grid.cpu())


class _Writers:
    """The writers' outputs, centred (LayerNorm's P; RMSNorm: as they are), float64, in one
    (writers, B, T, C) buffer filled layer by layer, so each is computed once: `upto(l)` gives
    the names, the rows of the writers of the stream entering layer l (a view) and the
    constant in it (C,): the W_O biases of the layers before l."""

    def __init__(self, model, idx: Tensor, rec: Record) -> None:
        cfg = model.cfg
        self.model, self.rec, self.centred = model, rec, cfg.norm == "layernorm"
        B, T = idx.shape
        n = writer_count(cfg, cfg.n_layer) - 1  # every writer but the biases' constant
        self.buf = torch.empty(n, B, T, cfg.n_embd, dtype=torch.float64, device=idx.device)
        self.names: list[str] = []
        if model.wpe is not None or cfg.pos_encoding == "sinusoidal":
            table = model.wpe.weight if model.wpe is not None else model.pe
            self._add("embed.tok", model.wte.weight[idx])
            self._add("embed.pos", table[:T].expand(B, T, -1))
        else:
            self._add("embed", rec.embedded)
        self.layers = 0  # the layers whose writers are in
        self.const = torch.zeros(cfg.n_embd, dtype=torch.float64, device=idx.device)

    def _add(self, name: str, x: Tensor) -> None:
        x = x.double()
        self.buf[len(self.names)] = x - x.mean(-1, keepdim=True) if self.centred else x
        self.names.append(name)

    def upto(self, layer: int) -> tuple[list[str], Tensor, Tensor]:
        cfg = self.model.cfg
        while self.layers < layer:
            la = self.layers
            c_proj = self.model.blocks[la].attn.c_proj
            w_o = c_proj.weight.double().view(cfg.n_embd, cfg.n_head, cfg.head_dim)
            z = self.rec.z[la].double()  # (B, H, T, D)
            for h in range(cfg.n_head):
                self._add(head_name(la, h), z[:, h] @ w_o[:, h].T)  # (B, T, D) @ (D, C)
            if c_proj.bias is not None:
                self.const = self.const + c_proj.bias.double()
            if la in self.rec.mlp:
                self._add(mlp_name(la), self.rec.mlp[la])
            self.layers += 1
        n = len(self.names)
        return [*self.names, BIAS], self.buf[:n], self.const


def _frozen_scale(norm: str, ln, x: Tensor) -> Tensor | float:
    """The norm's scale sigma (B, T, 1) of the stream x entering the layer, frozen: LayerNorm's
    sqrt(var + eps), RMSNorm's sqrt(mean square + eps); 1 without a norm (model.norm none)."""
    if norm == "none":
        return 1.0
    eps = ln.eps if ln.eps is not None else torch.finfo(x.dtype).eps
    spread = x.square().mean(-1, keepdim=True) if norm == "rmsnorm" else \
        x.var(-1, unbiased=False, keepdim=True)
    return (spread + eps).sqrt()


def _project(model, layer: int, x: Tensor, rows: Tensor, const: Tensor, hs: list[int]
             ) -> tuple[Tensor, Tensor]:
    """Every writer's query and key parts for the heads `hs` of `layer`: two
    (R, B, len(hs), T, D) float64 tensors (R = the writers `rows` (W, B, T, C), centred, and
    last the bias), through the frozen norm scale of x (B, T, C), the stream entering the
    layer, W_Q and W_K (one product), the frozen QK-norm and RoPE."""
    cfg = model.cfg
    block, C, D = model.blocks[layer], cfg.n_embd, cfg.head_dim
    ln, attn = block.ln_1, block.attn
    sigma, rms = _frozen_scale(cfg.norm, ln, x), cfg.norm != "layernorm"
    sel = torch.tensor([s * cfg.n_head * D + h * D + d for s in (0, 1) for h in hs
                        for d in range(D)], device=x.device)
    w = attn.c_attn.weight.double()[sel]  # (2 h D, C): the heads' rows of W_Q, W_K
    if getattr(ln, "weight", None) is not None:
        w = w * ln.weight.double()  # the norm's gain, folded: (P x / sigma * g) W^T
    W, B, T = rows.shape[:3]
    proj = (rows.reshape(W * B * T, C) @ w.T).view(W, B, T, -1) / sigma  # one product
    centred = const if rms else const - const.mean()
    bias = (centred.expand(B, T, C) / sigma) @ w.T  # the constant W_O biases, (B, T, 2hD)
    if getattr(ln, "bias", None) is not None:
        bias = bias + attn.c_attn.weight.double()[sel] @ ln.bias.double()
    if attn.c_attn.bias is not None:
        bias = bias + attn.c_attn.bias.double()[sel]
    proj = torch.cat([proj, bias[None]])  # (R, B, T, 2hD)
    qk = proj.view(W + 1, B, T, 2, len(hs), D).permute(3, 0, 1, 4, 2, 5)  # (2, R, B, h, T, D)
    if attn.qk_norm is not None:  # frozen at the real query's (key's) rms
        total = qk.sum(1, keepdim=True)
        rho = (total.square().mean(-1, keepdim=True) + attn.qk_norm.eps).sqrt()
        gains = torch.stack((attn.qk_norm.q_weight, attn.qk_norm.k_weight)).double()
        qk = qk / rho * gains.view(2, 1, 1, 1, 1, D)
    if model.rotary is not None:
        cos, sin = model.rotary.tables(0, T)
        qk = apply_rope(qk, cos.double(), sin.double())
    return qk[0], qk[1]
