"""Position-aware edges: every edge's EAP or EAP-IG score split by the position it is read at
and the position it acts at (after Haklay et al. 2025, "Position-aware Automatic Circuit
Discovery"), from the same gradient passes as the summed scores (interp/edge_graph.py), with no
other pass. The definitions:

The positions of an edge
------------------------
A writer u adds to the residual stream at every position; a reader v reads it at every
position. An edge u -> v at (writer position i, reader position j):
- into a head's query input, an MLP's input or the logits: i = j (the residual stream is read
  where it is written);
- into a head's key or value input: the writer's output at the key position i, read by the
  query at position j >= i (the attention's query and key positions: the key and value of
  position i reach position j only through this query's attention).
Its score is the summed score's term at those positions: for a query, MLP or logits edge,
    score_t(u -> v) = (a_source(u) - a_base(u))[t] . d metric / d input(v)[t],
summed over the width (and averaged over the batch and the IG points as the summed score is);
for a key edge, with s(j, i) = scale * q_j . k_i the head's attention score,
    score_ij(u -> v) = d metric / d s(j, i) * scale * q_j . (J_k(i) (a_source(u) - a_base(u))[i]),
with J_k(i) the Jacobian of the key at position i in its input (the norm, W_K, QK-norm, RoPE)
at that pass; for a value edge, with p(j, i) the attention and z_j the head's output,
    score_ij(u -> v) = p(j, i) * d metric / d z_j . (J_v(i) (a_source(u) - a_base(u))[i]).
The key at position i reaches the metric only through the scores s(j, i) of the queries j >= i
and the value only through the outputs z_j, so the scores over j sum to the key's (value's)
term at position i, and every edge's scores over its positions sum to its summed score
exactly (in float arithmetic: within ~1e-8 of it, tests/test_edge_positions.py).

How it is computed
------------------
The summed scores dot each writer's difference with each reader's gradient, pass by pass. Here
the gradients at the readers' inputs are summed over the passes and dotted position by position
once at the end (the writers' differences are the same in every pass); for the keys and values
each pass keeps, per head, a (query, key) x d_head probe (what d metric / d s or d z, the query
and the norm's scale make of a key or value direction), and the end projects every upstream
writer's difference through the norm's gain and W_K, W_V once and meets it with the summed
probes, the norm's Jacobian applied exactly through its two rank-one terms:
    J_norm(x) d = gamma * (P d - x_hat (x_hat . d) / C) / sigma
(P the centring, x_hat = P x / sigma; RMSNorm: P = I; no norm (a compiled program): J_norm = I,
x_hat = x, sigma = 1 and no rank-one term). Position-aware EAP-IG on a
GPT-2-small-shaped model at 64 tokens costs 2.9x the summed in CPU (benchmarks/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from minigpt.core.gpt import apply_rope
from minigpt.core.kernels import linear, norm
from minigpt.interp.edge_graph import INPUTS, Graph, attribute_edges, graph_of
from minigpt.interp.patching import Metric, OnProgress


@dataclass
class PositionScores:
    """Every edge's score by position (module docstring), of a graph over `n_tokens`
    positions. `at` (U, R, T) float64: for a query, MLP or logits reader the edge's score at
    position t (writer and reader both at t); for a key or value reader the score at key
    position t summed over the queries. `kv[l]` (w, 2, H, T, T) float64, w the writers
    upstream of layer l: the key (0) and value (1) edges of layer l's heads, [writer, k|v,
    head, query position j, key position i]. Scores are 0 where the position cannot reach the
    metric (after its last scored position; the logits at unscored positions)."""

    graph: Graph
    n_tokens: int
    at: Tensor
    kv: list[Tensor]

    def summed(self) -> Tensor:
        """(U, R) float64: every edge's scores summed over its positions (NaN: no edge)."""
        return self.at.sum(-1).masked_fill(~self.graph.valid(), math.nan)

    def _kv_index(self, v: int) -> tuple[int, int, int] | None:
        """(layer, k|v, head) of reader v when it is a key or value input, else None."""
        g = self.graph
        if v == g.logits_reader:
            return None
        layer, i = divmod(v, g.per_layer)
        kind, head = divmod(i, g.n_head) if i < 3 * g.n_head else (None, None)
        return None if kind is None or INPUTS[kind] == "q" else (layer, kind - 1, head)

    def entries(self, u: int, v: int) -> list[tuple[int, int, float]]:
        """(writer position, reader position, score) of edge u -> v at every pair of positions
        whose score is not 0 (their scores sum to the edge's), reader position first."""
        where = self._kv_index(v)
        if where is None:
            row = self.at[u, v]
            return [(t, t, float(row[t])) for t in row.nonzero().flatten().tolist()]
        layer, s, h = where
        grid = self.kv[layer][u, s, h]  # (Tq, Tk)
        return [(i, j, float(grid[j, i])) for j, i in grid.nonzero().tolist()]

    def top(self, n: int) -> list[tuple[int, int, int, int, float]]:
        """The `n` position-aware edges of largest |score|: (writer, reader, writer position,
        reader position, score), strongest first (ties: reader positions, then graph order)."""
        g = self.graph
        kv_readers = torch.zeros(g.n_readers, dtype=torch.bool)
        for layer in range(g.n_layer):
            r0 = g.attn_readers(layer).start
            kv_readers[r0 + g.n_head:r0 + 3 * g.n_head] = True
        same = self.at.masked_fill(kv_readers[None, :, None], 0.0)  # (U, R, T)
        found = [(float(same[u, v, t]), u, v, t, t) for u, v, t in _largest(same, n)]
        for layer, grid in enumerate(self.kv):  # (w, 2, H, Tq, Tk)
            r0 = g.attn_readers(layer).start + g.n_head
            for u, s, h, j, i in _largest(grid, n):
                found.append((float(grid[u, s, h, j, i]), u, r0 + s * g.n_head + h, i, j))
        found.sort(key=lambda e: -abs(e[0]))
        return [(u, v, i, j, x) for x, u, v, i, j in found[:n] if x != 0.0]

    def dense(self) -> Tensor:
        """(U, R, T, T) float64, [writer, reader, reader position, writer position]: every
        edge at every pair of positions (0 where none; small models only)."""
        g, T = self.graph, self.n_tokens
        out = torch.diag_embed(self.at)  # (U, R, T, T): writer and reader at the same place
        for layer, grid in enumerate(self.kv):
            w, rows = grid.shape[0], g.attn_readers(layer)
            k_cols = slice(rows.start + g.n_head, rows.start + 3 * g.n_head)
            out[:w, k_cols] = grid.reshape(w, 2 * g.n_head, T, T)
        return out


def _largest(x: Tensor, n: int) -> list[tuple[int, ...]]:
    """The indices of the `n` entries of x of largest |value| (stable order)."""
    flat = x.abs().flatten()
    k = min(n, flat.numel())
    idx = torch.topk(flat, k).indices if k else flat.new_zeros(0, dtype=torch.long)
    return [tuple(int(c) for c in torch.unravel_index(i, x.shape)) for i in idx]


# --------------------------------------------------------------------------------------------
# The split, collected from the gradient passes.


def _norm_parts(ln: nn.Module, x: Tensor) -> tuple[Tensor | None, Tensor, bool]:
    """(x_hat, sigma, centred) of the norm `ln` at x (B, T, C): x_hat (B, T, C), sigma
    (B, T, 1) and whether it centres (LayerNorm) or not (RMSNorm), as the module docstring's
    J_norm uses them (x_hat . x_hat / C = var / (var + eps): eps stays exact); with no norm
    (nn.Identity) (None, 1, False): J_norm = I, no rank-one term."""
    if isinstance(ln, nn.Identity):
        return None, x.new_ones(*x.shape[:-1], 1), False
    centred = isinstance(ln, nn.LayerNorm)
    eps = ln.eps if ln.eps is not None else torch.finfo(x.dtype).eps
    xc = x - x.mean(-1, keepdim=True) if centred else x
    sigma = (xc.square().mean(-1, keepdim=True) + eps).sqrt()
    return xc / sigma, sigma, centred


def _kv_constant(attn, ln) -> Tensor:
    """(2A,) what the key and value projections add to W (gamma * x_hat): W beta (the norm's
    bias) plus their own bias, so that W (gamma * x_hat) = (key | value before QK-norm) minus
    this, with no second product (A = n_head * head_dim, the rows of each of W_Q, W_K, W_V)."""
    w = attn.c_attn.weight
    A = w.shape[0] // 3
    out = torch.zeros(2 * A, dtype=w.dtype, device=w.device)
    if getattr(ln, "bias", None) is not None:
        out = out + w[A:] @ ln.bias
    if attn.c_attn.bias is not None:
        out = out + attn.c_attn.bias[A:]
    return out


def _kv_weight(attn, ln) -> Tensor:
    """(2A, C) W_K | W_V times the norm's gain (its columns; no gain: W_K | W_V)."""
    w = attn.c_attn.weight
    gamma = getattr(ln, "weight", None)
    return w[w.shape[0] // 3:] * (gamma if gamma is not None else 1.0)


class _Split:
    """The Collector (interp/edge_graph.py) that splits the scores by position: each pass
    adds its readers' gradients to `grads` and its heads' key and value probes to `probes`;
    `finish` makes the PositionScores (`result`)."""

    def __init__(self, model, graph: Graph, batch: int, n_tokens: int) -> None:
        cfg = model.cfg
        self.model, self.graph, self.B, self.T = model, graph, batch, n_tokens
        self.grads = torch.zeros(graph.n_readers, batch, n_tokens, cfg.n_embd,
                                 device=next(model.parameters()).device)
        self.x: dict[int, Tensor] = {}
        self.q: dict[int, Tensor] = {}
        self.k: dict[int, Tensor] = {}
        self.probes: dict[int, dict] = {}
        self.result: PositionScores | None = None

    # What each pass hands over.

    def reader(self, x: Tensor, cols: slice) -> None:
        R = cols.stop - cols.start

        def hook(g: Tensor) -> None:
            self.grads[cols] += g.reshape(R, self.B, self.T, -1)

        x.register_hook(hook)

    def attn_in(self, layer: int, x: Tensor) -> None:
        self.x[layer] = x.detach()

    def qk(self, layer: int, q: Tensor, k: Tensor) -> None:
        self.q[layer], self.k[layer] = q.detach(), k.detach()

    def heads(self, layer: int, z: Tensor) -> None:
        z.register_hook(lambda g, layer=layer: self._probe(layer, g))

    def _probe(self, layer: int, gz: Tensor) -> None:
        """One pass's key and value probes of `layer` from its heads' output gradient gz
        (B, H, T, D): added to the layer's sums (module docstring)."""
        model, cfg = self.model, self.model.cfg
        block = model.blocks[layer]
        attn, ln = block.attn, block.ln_1
        H, D, T = cfg.n_head, cfg.head_dim, self.T
        x = self.x[layer]
        with torch.no_grad():
            xh, sigma, centred = _norm_parts(ln, x)
            pre = linear(attn.c_attn, norm(ln, x)).view(-1, T, 3, H, D)  # before QK-norm, RoPE
            v = pre[:, :, 2].transpose(1, 2)  # (B, H, T, D)
            q, k = self.q[layer], self.k[layer]
            scale = 1.0 / math.sqrt(D)
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            p = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~allowed, -math.inf)
            p = p.softmax(-1)  # (B, H, Tq, Tk), the attention as the pass computed it
            dp = gz @ v.transpose(-1, -2)  # d metric / d p
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))  # d metric / d s
            key = self._key_probe(attn, q, pre[:, :, 1].transpose(1, 2), model, T)
            key = key * (ds * scale)[..., None]  # (B, H, Tq, Tk, D)
            val = p[..., None] * gz[:, :, :, None, :]  # (B, H, Tq, Tk, D)
            inv = (1.0 / sigma)[:, None, None, :, :]  # (B, 1, 1, Tk, 1): the norm's scale at key
            key, val = key * inv, val * inv
            sums = self.probes.setdefault(layer, {"probe": [0.0, 0.0], "a": [0.0, 0.0],
                                                  "e": [], "xh": []})
            sums["probe"] = [sums["probe"][0] + key, sums["probe"][1] + val]
            if xh is not None:  # a norm's rank-one term (none without a norm)
                b = pre[:, :, 1:] - _kv_constant(attn, ln).view(2, H, D)  # W (gamma * x_hat)
                b = b.permute(2, 0, 3, 1, 4)  # (2, B, H, Tk, D)
                sums["e"].append(torch.stack([(key * b[0][:, :, None]).sum(-1),
                                              (val * b[1][:, :, None]).sum(-1)]))
                sums["xh"].append(xh)  # e: (2, B, H, Tq, Tk)
            if centred:  # the centring's term: the mean of d through W gamma
                a = _kv_weight(attn, ln).sum(1).view(2, H, D)
                sums["a"] = [sums["a"][0] + (key * a[0][:, None, None]).sum(-1),
                             sums["a"][1] + (val * a[1][:, None, None]).sum(-1)]

    @staticmethod
    def _key_probe(attn, q: Tensor, k_pre: Tensor, model, T: int) -> Tensor:
        """(B, H, Tq, Tk, D): for query j and key i, the vector r with q_j . dk_i = r . dy for
        a change dy of the key's projection before QK-norm and RoPE: RoPE's rotation at i
        moved onto q (its transpose), then QK-norm's Jacobian at the key."""
        r = q[:, :, :, None, :].expand(-1, -1, -1, T, -1)  # (B, H, Tq, Tk, D)
        if model.rotary is not None:
            cos, sin = model.rotary.tables(0, T)
            r = apply_rope(r, cos, -sin)  # the inverse rotation at each key position
        qn = attn.qk_norm
        if qn is not None:
            rho = (k_pre.square().mean(-1, keepdim=True) + qn.eps).sqrt()  # (B, H, Tk, 1)
            kh = k_pre / rho
            gk = qn.k_weight
            along = (r * (gk * kh)[:, :, None]).sum(-1, keepdim=True)  # (B, H, Tq, Tk, 1)
            r = (gk * r - along * kh[:, :, None] / k_pre.shape[-1]) / rho[:, :, None]
        return r

    # The scores, once every pass is in.

    @torch.no_grad()
    def finish(self, delta: Tensor, passes: int) -> None:
        g, B = self.graph, self.B
        at = torch.zeros(g.n_writers, g.n_readers, self.T, dtype=torch.float64)
        groups = [(g.attn_readers(la), g.head_writers(la).start) for la in range(g.n_layer)]
        if g.mlp:
            groups += [(slice(v, v + 1), g.available(v))
                       for v in (g.mlp_reader(la) for la in range(g.n_layer))]
        groups.append((slice(g.logits_reader, g.logits_reader + 1), g.n_writers))
        for cols, w in groups:
            d = delta[:w].permute(2, 0, 1, 3).reshape(self.T, w, -1)  # (T, w, B*C)
            gr = self.grads[cols].permute(2, 1, 3, 0).reshape(self.T, -1, cols.stop - cols.start)
            at[:w, cols] = torch.bmm(d, gr).permute(1, 2, 0).double().cpu() / (B * passes)
        kv = [self._kv_scores(la, delta, passes) for la in range(g.n_layer)]
        self.result = PositionScores(g, self.T, at, kv)

    def _kv_scores(self, layer: int, delta: Tensor, passes: int) -> Tensor:
        """(w, 2, H, Tq, Tk) float64: layer's key and value edges (module docstring)."""
        g, cfg = self.graph, self.model.cfg
        H, D, C, T = cfg.n_head, cfg.head_dim, cfg.n_embd, self.T
        w = g.head_writers(layer).start
        block = self.model.blocks[layer]
        sums = self.probes.get(layer)
        if sums is None:  # the layer's heads reach no scored position
            return torch.zeros(w, 2, H, T, T, dtype=torch.float64)
        d = delta[:w]  # (w, B, T, C)
        with torch.no_grad():
            wg = _kv_weight(block.attn, block.ln_1)
            proj = (d @ wg.T).view(w, -1, T, 2, H, D)  # every writer through the gain, W_K, W_V
            if sums["xh"]:
                xh = torch.stack(sums["xh"])  # (S, B, T, C)
                c = torch.einsum("sbtc,wbtc->swbt", xh, d) / C  # the rank-one term's coefficient
                e = torch.stack(sums["e"])  # (S, 2, B, H, Tq, Tk)
            out = []
            for s in range(2):  # keys, then values
                probe = sums["probe"][s]  # (B, H, Tq, Tk, D)
                part = torch.einsum("bhjid,wbihd->whji", probe, proj[:, :, :, s])
                if sums["xh"]:
                    part = part - torch.einsum("swbi,sbhji->whji", c, e[:, s])
                if torch.is_tensor(sums["a"][s]):
                    part = part - torch.einsum("wbi,bhji->whji", d.mean(-1), sums["a"][s])
                out.append(part)
        return torch.stack(out, 1).double().cpu() / (self.B * passes)


def position_split(model, batch: int, n_tokens: int) -> _Split:
    """A Collector for `attribute_edges` (or `find_circuit`'s `collect`) on `batch` pairs of
    `n_tokens` tokens: after the passes its `result` holds the PositionScores of the
    method's scores."""
    return _Split(model, graph_of(model.cfg), batch, n_tokens)


def position_cost(cfg, n_tokens: int, pairs: int, curves: bool) -> tuple[float, float, float]:
    """(passes per IG step, other passes, bytes) the split by position adds to a circuit
    search of `pairs` pairs of `n_tokens` tokens: about one more gradient pass per IG step
    (benchmarks/README.md: 2.9x in all, in CPU, on GPT-2 small's shape); with `curves`, the
    position-aware faithfulness curve's 20 patched runs, a layer run once per query position
    where a circuit splits a key (interp/position_circuits.py: counted as T + 1 half passes
    each); and the memory it holds: the readers' gradients, each layer's (query, key) x d_head
    probes, the scores by position (float64) and their lists in the JSON (~90 bytes each)."""
    g = graph_of(cfg)
    T, C, H, D, L = n_tokens, cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.n_layer
    upstream = sum(g.head_writers(la).start for la in range(L))
    entries = T * g.n_writers * g.n_readers + upstream * H * T * (T + 1)
    held = (4 * pairs * T * (g.n_readers * C + 2 * L * H * T * D)
            + 8 * T * (g.n_writers * g.n_readers + 2 * upstream * H * T) + 90 * entries)
    return 1.0, (20 * 0.5 * (T + 1) if curves else 0.0), float(held)


def attribute_positions(model, base: Tensor, source: Tensor, metric: Metric,
                        targets: Tensor | None, ig_steps: int = 1,
                        progress: OnProgress | None = None
                        ) -> tuple[Tensor, Tensor, PositionScores]:
    """`attribute_edges`' (EAP, EAP-IG) summed scores (U, R) and the position-aware scores of
    the method's (EAP-IG when ig_steps > 1, else EAP) from the same passes (module
    docstring)."""
    split = position_split(model, base.shape[0], base.shape[1])
    eap, ig = attribute_edges(model, base, source, metric, targets, ig_steps, progress,
                              collect=split)
    assert split.result is not None
    return eap, ig, split.result
