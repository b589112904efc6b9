"""The circuit as a graph: which edges between the embedding, the heads (through their query,
key and value inputs apart), the MLPs and the logits carry a behaviour, scored by a gradient
estimate and checked by running the model with every other edge patched. The definitions:

The graph
---------
The residual stream is a sum of what its writers add: the embedding `embed` (the token
embedding plus the position embedding where one is added), every head `L{l}.H{h}` (its output
z through its slice of W_O; the W_O bias belongs to no head and is no writer) and every MLP
`L{l}.MLP`. Its readers take it (before their norm): every head's query, key and value inputs
apart (`L{l}.H{h}` with input q, k or v), every MLP's input (`L{l}.MLP`, input mlp) and the
final norm and LM head (`logits`). An edge u -> v is a writer and a reader after it: the
writers of layers before l (and the embedding) feed layer l's heads; those and layer l's heads
feed layer l's MLP; every writer feeds the logits. Edges are over positions: an edge carries
u's contribution at every position into v at the same position (TransformerLens 4.3's graph
has one edge per position; its scores summed over positions are these). GPT-2 small has
32,491 edges. Writers are numbered embed, then per layer its heads and its MLP; readers per
layer q of every head, k of every head, v of every head, the MLP, and last the logits.

The sign convention (as `--patch-direction`)
--------------------------------------------
Of the clean and the corrupted input, one is the base run and the other the source: noising
runs the clean input and takes values from the corrupted one (what an edge destroys),
denoising runs the corrupted input and takes values from the clean one (what it restores).
Every score below is an estimate of, and every patching effect is, `metric(base run with the
edge patched from the source) - metric(base run)`, in the metric's unit.

EAP (edge attribution patching, Syed et al. 2023): the first-order estimate
    score(u -> v) = (a_source(u) - a_base(u)) . d metric / d input(v)   at the base run,
summed over positions and the width, averaged over the batch of (clean, corrupted) pairs. With
denoising this is TransformerLens 4.3's `attribution_patch(..., granularity="edge")` exactly
(its convention: the clean minus the corrupted activation, the gradient at the corrupted run);
noising is the same with the two inputs swapped. A node's score is the sum of its outgoing
edges' (TransformerLens's node aggregate; for a writer it equals its node attribution, since
every writer feeds the logits).

EAP-IG (Hanna et al. 2024, "Have Faith in Faithfulness"), `ig_steps` m: the gradient is
averaged over m points on the straight line between the two inputs' embeddings,
    x_k = x_source + (k / m) (x_base - x_source),  k = 1 .. m,
where x is the embedding writer's output (token + position embedding; RoPE's positions are
no part of it) and everything after it is recomputed from x_k; the activation difference
stays a_source - a_base of the real runs. k = m is the base run itself, so m = 1 is EAP
exactly.

Edge patching: a run of the base input in which, for every patched edge u -> v, the reader v
receives the source run's contribution of u instead of the current run's, everything else as
it was: input(v) = x_current(v) + sum over patched u of (a_source(u) - a_current(u)). Exact:
the pre-norm residual is a plain sum of the writers' contributions (and the biases, which stay).

Faithfulness of a circuit C (a set of edges; TransformerLens 4.3's `faithfulness`, "ablate
outside"): run the clean input with every edge outside C patched from the corrupted run; the
fraction recovered is (m_C - m_corrupted) / (m_clean - m_corrupted) (1: the circuit alone
does what the whole model does; 0: no more than the corrupted input). Always in this
direction, whichever direction scored the edges. With a batch of pairs each m is the mean
over the pairs (a ratio of means). All edges: exactly 1; none: exactly 0.

The circuit: the N edges of largest |score| (ties: graph order), then pruned: an edge stays
only if its writer is reached from the embedding through kept edges and its reader's node
reaches the logits through kept edges (a node that no longer connects the input to the
logits is dropped with its edges).

The faithfulness curve: the fraction recovered by the circuits of the top int(p E) edges
(pruned) for p in FRACTIONS (0.1% to 100% of the E edges), and its area: the trapezoid rule
over p on a linear axis from 0.001 to 1, as the MIB benchmark's CPR (Mueller et al. 2025;
a perfect circuit at every size scores 0.999), and the area between the curve and 1 (its
CMD: 0 is best). The baseline ranks edges by their real single-edge patching effect
(`edge_effects`, one run per edge: small models only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minigpt.core.gpt import AttnSpec, Intervention, eval_mode
from minigpt.core.patching import Metric, record, run_value, sweep
from minigpt.errors import ArgumentError, MinigptError

DIRECTIONS = ("noising", "denoising")
FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # MIB's sizes
INPUTS = ("q", "k", "v")


# --------------------------------------------------------------------------------------------
# The graph.


@dataclass(frozen=True)
class Graph:
    """The writers and readers of a model of `n_layer` layers of `n_head` heads (`mlp`: with
    an MLP per layer), numbered as the module docstring says."""

    n_layer: int
    n_head: int
    mlp: bool

    @property
    def stride(self) -> int:  # writers per layer
        return self.n_head + self.mlp

    @property
    def n_writers(self) -> int:
        return 1 + self.n_layer * self.stride

    @property
    def per_layer(self) -> int:  # readers per layer
        return 3 * self.n_head + self.mlp

    @property
    def n_readers(self) -> int:
        return self.n_layer * self.per_layer + 1

    def head_writers(self, layer: int) -> slice:
        first = 1 + layer * self.stride
        return slice(first, first + self.n_head)

    def mlp_writer(self, layer: int) -> int:
        return 1 + layer * self.stride + self.n_head

    def attn_readers(self, layer: int) -> slice:  # q of every head, k of every head, v ...
        return slice(layer * self.per_layer, layer * self.per_layer + 3 * self.n_head)

    def mlp_reader(self, layer: int) -> int:
        return layer * self.per_layer + 3 * self.n_head

    @property
    def logits_reader(self) -> int:
        return self.n_readers - 1

    def reader_layer(self, v: int) -> int:
        return v // self.per_layer  # n_layer for the logits

    def available(self, v: int) -> int:
        """How many writers (the first ones) are upstream of reader v."""
        if v == self.logits_reader:
            return self.n_writers
        layer, i = divmod(v, self.per_layer)
        return 1 + layer * self.stride + (self.n_head if i == 3 * self.n_head else 0)

    def valid(self) -> Tensor:
        """(U, R) bool: writer u is upstream of reader v (an edge)."""
        avail = torch.tensor([self.available(v) for v in range(self.n_readers)])
        return torch.arange(self.n_writers)[:, None] < avail[None, :]

    def writer_name(self, u: int) -> str:
        if u == 0:
            return "embed"
        layer, i = divmod(u - 1, self.stride)
        return f"L{layer}.MLP" if i == self.n_head else f"L{layer}.H{i}"

    def reader_name(self, v: int) -> tuple[str, str]:
        """(node name, input): ("L1.H0", "k"), ("L0.MLP", "mlp"), ("logits", "logits")."""
        if v == self.logits_reader:
            return "logits", "logits"
        layer, i = divmod(v, self.per_layer)
        if i == 3 * self.n_head:
            return f"L{layer}.MLP", "mlp"
        kind, head = divmod(i, self.n_head)
        return f"L{layer}.H{head}", INPUTS[kind]

    def node_of_reader(self, v: int) -> int | None:
        """The writer index of reader v's node (None for the logits)."""
        if v == self.logits_reader:
            return None
        layer, i = divmod(v, self.per_layer)
        return self.mlp_writer(layer) if i == 3 * self.n_head else \
            self.head_writers(layer).start + i % self.n_head


def graph_of(cfg) -> Graph:
    """The graph of a model of ModelConfig `cfg`; MinigptError when it has no heads."""
    if cfg.n_layer * cfg.n_head < 1:
        raise MinigptError(f"the model has {cfg.n_layer} layers of {cfg.n_head} heads: there "
                           "is no head for a circuit to go through")
    return Graph(cfg.n_layer, cfg.n_head, bool(cfg.mlp))


def head_contributions(model, layer: int, z: Tensor) -> Tensor:
    """Each head's output in the residual stream (H, B, T, C): z (B, H, T, D) through its
    slice of W_O (no bias)."""
    cfg = model.cfg
    w_o = model.blocks[layer].attn.c_proj.weight.view(cfg.n_embd, cfg.n_head, cfg.head_dim)
    return torch.einsum("bhtd,chd->hbtc", z, w_o)


def writer_values(model, graph: Graph, idx: Tensor) -> Tensor:
    """Every writer's contribution (U, B, T, C) float32 on idx (B, T) (one plain run)."""
    _, rec = record(model, idx)
    out = [rec.embedded[None]]
    for layer in range(graph.n_layer):
        out.append(head_contributions(model, layer, rec.z[layer]))
        if graph.mlp:
            out.append(rec.mlp[layer][None])
    return torch.cat(out).float()


# --------------------------------------------------------------------------------------------
# EAP and EAP-IG.


class _Attribute(Intervention):
    """One gradient pass of EAP-IG: the embedding at `alpha` of the way from the source's
    (`x_source`) to the base's; each reader's input a tensor of its own whose gradient, as the
    backward pass reaches it, is dotted with the activation differences `delta` (U, B, T, C)
    of the writers upstream of it and added to each of `sums` ((U, R) float64). With `fill`,
    this pass runs the base input itself (alpha 1) and subtracts its writers' outputs from
    `delta` (which then holds a_source - a_base; it held a_source)."""

    def __init__(self, model, graph: Graph, delta: Tensor, x_source: Tensor, alpha: float,
                 sums: list[Tensor], fill: bool) -> None:
        self.model, self.graph, self.delta, self.x_source = model, graph, delta, x_source
        self.alpha, self.sums, self.fill = alpha, sums, fill
        self.leaf: Tensor | None = None

    def embed(self, x: Tensor) -> Tensor:
        x = x.detach()
        if self.fill:
            self.delta[0] -= x
        if self.alpha != 1.0:
            x = self.x_source + self.alpha * (x - self.x_source)
        self.leaf = x.requires_grad_(True)
        return self.leaf

    def _reader(self, x: Tensor, cols: slice, n_writers: int) -> None:
        """Score the readers `cols`, whose input is x ((B, T, C) or (B, T, 3, H, C)), when
        the backward pass brings its gradient."""
        B = x.shape[0]

        def hook(g: Tensor) -> None:
            g = g.reshape(*g.shape[:2], -1, g.shape[-1])  # (B, T, R, C)
            part = torch.einsum("ubtc,btrc->ur", self.delta[:n_writers], g).double().cpu() / B
            for s in self.sums:
                s[:n_writers, cols] += part

        x.register_hook(hook)

    def attn_in(self, layer: int, x: Tensor) -> Tensor:
        B, T, C = x.shape
        xs = x.unsqueeze(2).unsqueeze(2).expand(B, T, 3, self.graph.n_head, C)  # one per reader
        self._reader(xs, self.graph.attn_readers(layer), self.graph.head_writers(layer).start)
        return xs

    def heads(self, layer: int, z: Tensor) -> Tensor:
        if self.fill:
            self.delta[self.graph.head_writers(layer)] -= head_contributions(
                self.model, layer, z.detach())
        return z

    def mlp_in(self, layer: int, x: Tensor) -> Tensor:
        xm = x.view_as(x)  # the MLP's own copy: its gradient is the MLP branch's alone
        v = self.graph.mlp_reader(layer)
        self._reader(xm, slice(v, v + 1), self.graph.available(v))
        return xm

    def mlp_out(self, layer: int, y: Tensor) -> Tensor:
        if self.fill:
            self.delta[self.graph.mlp_writer(layer)] -= y.detach()
        return y

    def final_in(self, x: Tensor) -> Tensor:
        xf = x.view_as(x)
        v = self.graph.logits_reader
        self._reader(xf, slice(v, v + 1), self.graph.n_writers)
        return xf


def attribute_edges(model, base: Tensor, source: Tensor, metric: Metric,
                    targets: Tensor | None, ig_steps: int = 1) -> tuple[Tensor, Tensor]:
    """(EAP, EAP-IG) scores (U, R) float64 (NaN where no edge) of every edge for the base
    run on `base` (B, T) with values from `source` (B, T) (module docstring: the estimate of
    metric(base with the edge patched from source) - metric(base)); `targets` (B, P) the
    scored tokens. ig_steps 1: both are EAP. The model's parameters get no gradient."""
    graph = graph_of(model.cfg)
    if ig_steps < 1:
        raise ArgumentError("ig_steps", f"must be at least 1, got {ig_steps}")
    U, R = graph.n_writers, graph.n_readers
    eap = torch.zeros(U, R, dtype=torch.float64)
    ig = torch.zeros(U, R, dtype=torch.float64)
    pos = list(metric.positions)
    with eval_mode(model):
        delta = writer_values(model, graph, source)  # a_source; the first pass makes it a diff
        x_source = delta[0].clone()
        for k in range(ig_steps, 0, -1):  # k = m first: the base run, which fills delta
            att = _Attribute(model, graph, delta, x_source, k / ig_steps,
                             [eap, ig] if k == ig_steps else [ig], fill=k == ig_steps)
            with torch.enable_grad():
                final = model.residual_stream(
                    base, attn=AttnSpec(model.cfg.attn_impl, intervention=att))[-1]
                m = metric.values(model.unembed(final[:, pos]), targets).sum()
                torch.autograd.grad(m, [att.leaf])
    valid = graph.valid()
    return eap.masked_fill(~valid, math.nan), (ig / ig_steps).masked_fill(~valid, math.nan)


# --------------------------------------------------------------------------------------------
# Edge patching.


class _EdgePatch(Intervention):
    """Rows of edge patching (module docstring): n rows of the base input, `batch` sequences
    each; `patched` (n, U, R) float 1 where an edge takes the source's value. `delta`
    (U, n * batch, T, C) holds a_source - a_current of every writer met so far."""

    def __init__(self, model, graph: Graph, source: Tensor, base_embed: Tensor,
                 patched: Tensor) -> None:
        self.model, self.graph, self.source, self.patched = model, graph, source, patched
        n = patched.shape[0]
        U, B, T, C = source.shape
        self.n, self.B = n, B
        self.delta = torch.empty(U, n * B, T, C, dtype=source.dtype, device=source.device)
        self._fill(slice(0, 1), base_embed[None].repeat(1, n, 1, 1))

    def _fill(self, writers: slice, current: Tensor) -> None:
        """current (k, n * B, T, C): the writers' outputs in this run."""
        k = current.shape[0]
        shape = (k, self.n, self.B, *current.shape[2:])
        self.delta[writers].view(shape).copy_(
            self.source[writers][:, None] - current.view(shape))

    def _input(self, x: Tensor, cols: slice, n_writers: int) -> Tensor:
        """Readers `cols`' inputs (n * B, T, R, C), or x (n * B, T, C) itself when every one
        of them reads the same."""
        m = self.patched[:, :n_writers, cols]  # (n, w, R)
        if not m.any():
            return x
        d = self.delta[:n_writers].view(n_writers, self.n, -1)  # (w, n, B*T*C)
        same = bool((m == m[..., :1]).all())
        m = m[..., :1] if same else m
        corr = torch.bmm(d.permute(1, 2, 0), m)  # (n, B*T*C, R'): sum of the patched deltas
        corr = corr.view(self.n * self.B, *x.shape[1:], -1).movedim(-1, 2)  # (nB, T, R', C)
        return x + corr[:, :, 0] if same else x[:, :, None] + corr

    def attn_in(self, layer: int, x: Tensor) -> Tensor:
        out = self._input(x, self.graph.attn_readers(layer),
                          self.graph.head_writers(layer).start)
        return out if out.dim() == 3 else out.unflatten(2, (3, self.graph.n_head))

    def heads(self, layer: int, z: Tensor) -> Tensor:
        self._fill(self.graph.head_writers(layer), head_contributions(self.model, layer, z))
        return z

    def mlp_in(self, layer: int, x: Tensor) -> Tensor:
        v = self.graph.mlp_reader(layer)
        out = self._input(x, slice(v, v + 1), self.graph.available(v))
        return out if out.dim() == 3 else out[:, :, 0]

    def mlp_out(self, layer: int, y: Tensor) -> Tensor:
        u = self.graph.mlp_writer(layer)
        self._fill(slice(u, u + 1), y[None])
        return y

    def final_in(self, x: Tensor) -> Tensor:
        v = self.graph.logits_reader
        out = self._input(x, slice(v, v + 1), self.graph.n_writers)
        return out if out.dim() == 3 else out[:, :, 0]


@dataclass
class EdgeRows:
    """A Plan (core.patching): row r patches the edges `patched[r]` ((n, U, R) bool) of the
    base run from the source's writer values `source` (U, B, T, C); `base_embed` (B, T, C) is
    the base run's embedding. Rows start at the embedding; no base row."""

    model: object
    graph: Graph
    source: Tensor
    base_embed: Tensor
    patched: Tensor
    base_row: bool = False

    @property
    def n(self) -> int:
        return self.patched.shape[0]

    def layer(self, row: int) -> int:
        return 0

    def row_floats(self, n_tokens: int) -> int:
        return self.graph.n_writers * n_tokens * self.model.cfg.n_embd

    def intervention(self, rows: Sequence[int], batch: int) -> Intervention:
        return _EdgePatch(self.model, self.graph, self.source, self.base_embed,
                          self.patched[list(rows)].float())


def patch_edges(model, base: Tensor, source: Tensor, metric: Metric, targets: Tensor | None,
                patched: Tensor) -> Tensor:
    """The metric (n,) float64 of the base run on `base` (B, T) with, in row r, the edges
    `patched[r]` ((n, U, R) bool) taking the source run's (`source` (B, T)) values."""
    graph = graph_of(model.cfg)
    with eval_mode(model), torch.no_grad():
        values = writer_values(model, graph, source)
        base_embed = record(model, base)[1].embedded
        plan = EdgeRows(model, graph, values, base_embed, patched & graph.valid())
        return sweep(model, base, metric, targets, plan)[1]


def edge_effects(model, base: Tensor, source: Tensor, metric: Metric, targets: Tensor | None
                 ) -> Tensor:
    """The real effect (U, R) float64 (NaN where no edge) of patching each edge alone:
    metric(base with that edge from source) - metric(base)."""
    graph = graph_of(model.cfg)
    valid = graph.valid()
    edges = valid.nonzero()
    one = torch.zeros(len(edges), *valid.shape, dtype=torch.bool)
    one[torch.arange(len(edges)), edges[:, 0], edges[:, 1]] = True
    values = patch_edges(model, base, source, metric, targets, one)
    with eval_mode(model):
        m_base = run_value(model, base, metric, targets)
    out = torch.full(valid.shape, math.nan, dtype=torch.float64)
    out[edges[:, 0], edges[:, 1]] = values - m_base
    return out


# --------------------------------------------------------------------------------------------
# Circuits and their faithfulness.


def top_edges(scores: Tensor, n: int) -> Tensor:
    """(U, R) bool: the n edges of largest |score| (NaN: no edge; ties: graph order)."""
    flat = scores.flatten()
    order = sorted((i for i in range(len(flat)) if not math.isnan(flat[i])),
                   key=lambda i: -abs(float(flat[i])))
    keep = torch.zeros(len(flat), dtype=torch.bool)
    keep[order[:n]] = True
    return keep.view(scores.shape)


def prune(graph: Graph, keep: Tensor) -> Tensor:
    """The edges of `keep` (U, R) whose writer the embedding reaches and whose reader's node
    reaches the logits, both through edges of `keep` (module docstring)."""
    U, R = keep.shape
    node = [graph.node_of_reader(v) for v in range(R)]
    reached = torch.zeros(U, dtype=torch.bool)
    reached[0] = True
    for v in range(R):  # readers in graph order: a node's readers before its own writes
        if node[v] is not None and bool((keep[:, v] & reached).any()):
            reached[node[v]] = True
    useful = torch.zeros(U, dtype=torch.bool)
    for v in reversed(range(R)):  # from the logits back
        if node[v] is None or useful[node[v]]:
            useful |= keep[:, v] & reached
    live_reader = torch.tensor([node[v] is None or bool(useful[node[v]]) for v in range(R)])
    return keep & reached[:, None] & useful[:, None] & live_reader[None, :]


@dataclass
class Faithfulness:
    """What circuits recover: `recovered[i]` of the circuit `circuits[i]` ((n, U, R) bool),
    (m - corrupted) / (clean - corrupted)."""

    clean: float
    corrupted: float
    recovered: list[float]
    sizes: list[int] = field(default_factory=list)


def faithfulness(model, clean: Tensor, corrupted: Tensor, metric: Metric,
                 targets: Tensor | None, circuits: Tensor) -> Faithfulness:
    """The fraction of the clean -> corrupted change each circuit of `circuits` (n, U, R)
    recovers (module docstring) on `clean` and `corrupted` (B, T); ArgumentError when the two
    inputs give the same metric."""
    graph = graph_of(model.cfg)
    with eval_mode(model):
        m_clean = run_value(model, clean, metric, targets)
        m_corr = run_value(model, corrupted, metric, targets)
    check_gap(m_clean, m_corr)
    values = patch_edges(model, clean, corrupted, metric, targets, graph.valid() & ~circuits)
    rec = ((values - m_corr) / (m_clean - m_corr)).tolist()
    return Faithfulness(m_clean, m_corr, rec, [int(c.sum()) for c in circuits])


def check_gap(m_clean: float, m_corr: float) -> None:
    if not math.isfinite(m_clean - m_corr) or abs(m_clean - m_corr) < 1e-9:
        raise ArgumentError("patch_from", f"leaves the metric where it was ({m_clean:.6g} on "
                            "both inputs): there is nothing for a circuit to carry; corrupt "
                            "the input where it matters")


def curve_circuits(graph: Graph, ranking: Tensor) -> tuple[list[int], Tensor]:
    """The nominal sizes int(p E) for p in FRACTIONS and their pruned circuits (10, U, R)."""
    n_edges = int(graph.valid().sum())
    sizes = [int(p * n_edges) for p in FRACTIONS]
    return sizes, torch.stack([prune(graph, top_edges(ranking, n)) for n in sizes])


def area(recovered: Sequence[float]) -> tuple[float, float]:
    """(area under the curve, area between it and 1) over FRACTIONS (module docstring)."""
    under = between = 0.0
    for i in range(len(FRACTIONS) - 1):
        dx = FRACTIONS[i + 1] - FRACTIONS[i]
        under += dx * (recovered[i] + recovered[i + 1]) / 2
        between += dx * (abs(1 - recovered[i]) + abs(1 - recovered[i + 1])) / 2
    return under, between
