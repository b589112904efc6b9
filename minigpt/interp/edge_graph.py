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

The source: a corrupted input, or an ablation (`--patch-from zero` / `mean`)
------------------------------------------------------------------------
The values an edge is patched to are the source's: each writer's output on the corrupted input
(`source` (B, T) ids), or, for an ablation, no input at all: `zero` (every writer's output
replaced by zero) or `mean` (by its mean over the base input's sequences and every position).
A corrupted input of the same distribution keeps what depends only on positions as it was, so
no edge that carries only positions can show under it; an ablation changes those too. With an
ablation, "the source run" is the base run with every edge patched, and only noising applies.

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
no part of it; an ablation's: zero or the mean embedding) and everything after it is
recomputed from x_k; the activation difference stays a_source - a_base of the real runs.
k = m is the base run itself, so m = 1 is EAP exactly.

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
from typing import Protocol

import torch
from torch import Tensor

from minigpt.core.gpt import ForwardSpec, Intervention, eval_mode
from minigpt.cost import Cost
from minigpt.display import head_name, mlp_name
from minigpt.errors import ArgumentError, MinigptError
from minigpt.interp.edge_args import (
    ABLATIONS,
    DEFAULT_RECOVER,
    check_ablation,
    check_ig_steps,
    check_search,
)
from minigpt.interp.patching import SMALL_GAP, Metric, OnProgress, record, run_value, sweep

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
        return mlp_name(layer) if i == self.n_head else head_name(layer, i)

    def reader_name(self, v: int) -> tuple[str, str]:
        """(node name, input): ("L1.H0", "k"), ("L0.MLP", "mlp"), ("logits", "logits")."""
        if v == self.logits_reader:
            return "logits", "logits"
        layer, i = divmod(v, self.per_layer)
        if i == 3 * self.n_head:
            return mlp_name(layer), "mlp"
        kind, head = divmod(i, self.n_head)
        return head_name(layer, head), INPUTS[kind]

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
    _, rec = record(model, idx, logits=False)
    out = [rec.embedded[None]]
    for layer in range(graph.n_layer):
        out.append(head_contributions(model, layer, rec.z[layer]))
        if graph.mlp:
            out.append(rec.mlp[layer][None])
    return torch.cat(out).float()


Source = Tensor | str  # corrupted token ids (B, T), or an ablation: one of ABLATIONS


def source_values(model, graph: Graph, base: Tensor, source: Source) -> Tensor:
    """Every writer's source value (U, B, T, C) float32 (module docstring): its output on the
    corrupted ids `source`, or zero, or its mean over the base's sequences and positions."""
    if not isinstance(source, str):
        return writer_values(model, graph, source)
    assert source in ABLATIONS, source
    values = writer_values(model, graph, base)
    if source == "zero":
        return torch.zeros_like(values)
    return values.mean(dim=(1, 2), keepdim=True).expand_as(values).clone()


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
                 sums: list[Tensor], fill: bool, collect: Collector | None = None) -> None:
        self.model, self.graph, self.delta, self.x_source = model, graph, delta, x_source
        self.alpha, self.sums, self.fill, self.collect = alpha, sums, fill, collect
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
        """Score the readers `cols`, whose input is x ((B, T, C), or (3, H, B, T, C): one
        (B, T, C) per reader), when the backward pass brings its gradient."""
        B, R = self.delta.shape[1], cols.stop - cols.start

        def hook(g: Tensor) -> None:
            by_reader = g.reshape(R, -1)  # (R, B*T*C)
            d = self.delta[:n_writers].reshape(n_writers, -1)  # (w, B*T*C), a view
            part = (d @ by_reader.T).double().cpu() / B  # (w, R): one matrix product
            for s in self.sums:
                s[:n_writers, cols] += part

        x.register_hook(hook)
        if self.collect is not None:
            self.collect.reader(x, cols)

    def attn_in(self, layer: int, x: Tensor) -> Tensor:
        if self.collect is not None:
            self.collect.attn_in(layer, x)
        xs = x.expand(3, self.graph.n_head, *x.shape)  # (3, H, B, T, C): one per reader
        self._reader(xs, self.graph.attn_readers(layer), self.graph.head_writers(layer).start)
        return xs

    def qk(self, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        if self.collect is not None:
            self.collect.qk(layer, q, k)
        return q, k

    def heads(self, layer: int, z: Tensor) -> Tensor:
        if self.fill:
            self.delta[self.graph.head_writers(layer)] -= head_contributions(
                self.model, layer, z.detach())
        if self.collect is not None:
            self.collect.heads(layer, z)
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


class Collector(Protocol):
    """What else a gradient pass of `attribute_edges` hands to whoever asks (`collect`;
    interp/edge_positions.py splits the scores by position with it): each reader's input as
    it is made (`reader`: x, whose gradient a hook may take, and its readers' columns), the
    stream a layer's heads read (`attn_in`), their queries and keys as the scores read them
    (`qk`), their outputs z (`heads`); and, after the last pass, the writers' activation
    differences (U, B, T, C) and the pass count (`finish`)."""

    def reader(self, x: Tensor, cols: slice) -> None: ...

    def attn_in(self, layer: int, x: Tensor) -> None: ...

    def qk(self, layer: int, q: Tensor, k: Tensor) -> None: ...

    def heads(self, layer: int, z: Tensor) -> None: ...

    def finish(self, delta: Tensor, passes: int) -> None: ...


def attribute_edges(model, base: Tensor, source: Source, metric: Metric,
                    targets: Tensor | None, ig_steps: int = 1,
                    progress: OnProgress | None = None,
                    collect: Collector | None = None) -> tuple[Tensor, Tensor]:
    """(EAP, EAP-IG) scores (U, R) float64 (NaN where no edge) of every edge for the base
    run on `base` (B, T) with values from `source` (B, T) ids or an ablation (module
    docstring: the estimate of
    metric(base with the edge patched from source) - metric(base)); `targets` (B, P) the
    scored tokens. ig_steps 1: both are EAP. The model's parameters get no gradient.
    `progress("scoring edges", done, ig_steps)` after each gradient pass; `collect` sees
    every pass (Collector)."""
    graph = graph_of(model.cfg)
    check_ig_steps(ig_steps)
    U, R = graph.n_writers, graph.n_readers
    eap = torch.zeros(U, R, dtype=torch.float64)
    ig = torch.zeros(U, R, dtype=torch.float64)
    pos = list(metric.positions)
    with eval_mode(model):
        delta = source_values(model, graph, base, source)  # the first pass makes it a diff
        x_source = delta[0].clone()
        for k in range(ig_steps, 0, -1):  # k = m first: the base run, which fills delta
            att = _Attribute(model, graph, delta, x_source, k / ig_steps,
                             [eap, ig] if k == ig_steps else [ig], fill=k == ig_steps,
                             collect=collect)
            with torch.enable_grad():
                final = model.residual_stream(
                    base, attn=ForwardSpec(model.cfg.attn_impl, intervention=att))[-1]
                m = metric.values(model.unembed(final[:, pos]), targets).sum()
                torch.autograd.grad(m, [att.leaf])
            if progress is not None:
                progress("scoring edges", ig_steps - k + 1, ig_steps)
        if collect is not None:
            collect.finish(delta, ig_steps)
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
        """Readers `cols`' inputs (R, n * B, T, C), or x (n * B, T, C) itself when every one
        of them reads the same."""
        m = self.patched[:, :n_writers, cols]  # (n, w, R)
        if not m.any():
            return x
        d = self.delta[:n_writers].view(n_writers, self.n, -1)  # (w, n, B*T*C)
        same = bool((m == m[..., :1]).all())
        m = m[..., :1] if same else m
        corr = torch.bmm(m.transpose(1, 2), d.transpose(0, 1))  # (n, R', B*T*C): patched sum
        corr = corr.transpose(0, 1).reshape(-1, *x.shape)  # (R', n * B, T, C)
        return x + corr[0] if same else x[None] + corr

    def attn_in(self, layer: int, x: Tensor) -> Tensor:
        out = self._input(x, self.graph.attn_readers(layer),
                          self.graph.head_writers(layer).start)
        return out if out.dim() == 3 else out.unflatten(0, (3, self.graph.n_head))

    def heads(self, layer: int, z: Tensor) -> Tensor:
        self._fill(self.graph.head_writers(layer), head_contributions(self.model, layer, z))
        return z

    def mlp_in(self, layer: int, x: Tensor) -> Tensor:
        v = self.graph.mlp_reader(layer)
        out = self._input(x, slice(v, v + 1), self.graph.available(v))
        return out if out.dim() == 3 else out[0]

    def mlp_out(self, layer: int, y: Tensor) -> Tensor:
        u = self.graph.mlp_writer(layer)
        self._fill(slice(u, u + 1), y[None])
        return y

    def final_in(self, x: Tensor) -> Tensor:
        v = self.graph.logits_reader
        out = self._input(x, slice(v, v + 1), self.graph.n_writers)
        return out if out.dim() == 3 else out[0]


@dataclass
class EdgeRows:
    """A Plan (interp.patching): row r patches the edges `patched[r]` ((n, U, R) bool) of the
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


class Patcher:
    """Edge patching of one (base, source) pair of batches (B, T), what every run shares done
    once: the source's writer values, the base's embedding and the metric of both inputs."""

    def __init__(self, model, base: Tensor, source: Source, metric: Metric,
                 targets: Tensor | None) -> None:
        self.model, self.base, self.metric, self.targets = model, base, metric, targets
        self.graph = graph_of(model.cfg)
        with eval_mode(model), torch.no_grad():
            self.values = source_values(model, self.graph, base, source)
            self.base_embed = record(model, base, logits=False)[1].embedded
            self.m_base = run_value(model, base, metric, targets)
            if isinstance(source, str):  # an ablation: the base run with every edge patched
                self.m_source = float(self.run(self.graph.valid()[None])[0])
            else:
                self.m_source = run_value(model, source, metric, targets)

    def run(self, patched: Tensor) -> Tensor:
        """The metric (n,) float64 of the base run with, in row r, the edges `patched[r]`
        ((n, U, R) bool) taking the source's values."""
        plan = EdgeRows(self.model, self.graph, self.values, self.base_embed,
                        patched & self.graph.valid())
        with eval_mode(self.model):
            return sweep(self.model, self.base, self.metric, self.targets, plan)[1]


def patch_edges(model, base: Tensor, source: Source, metric: Metric, targets: Tensor | None,
                patched: Tensor) -> Tensor:
    """The metric (n,) float64 of the base run on `base` (B, T) with, in row r, the edges
    `patched[r]` ((n, U, R) bool) taking the source run's (`source` (B, T)) values."""
    return Patcher(model, base, source, metric, targets).run(patched)


def edge_effects(model, base: Tensor, source: Source, metric: Metric, targets: Tensor | None
                 ) -> Tensor:
    """The real effect (U, R) float64 (NaN where no edge) of patching each edge alone:
    metric(base with that edge from source) - metric(base)."""
    patcher = Patcher(model, base, source, metric, targets)
    valid = patcher.graph.valid()
    edges = valid.nonzero()
    one = torch.zeros(len(edges), *valid.shape, dtype=torch.bool)
    one[torch.arange(len(edges)), edges[:, 0], edges[:, 1]] = True
    out = torch.full(valid.shape, math.nan, dtype=torch.float64)
    out[edges[:, 0], edges[:, 1]] = patcher.run(one) - patcher.m_base
    return out


# --------------------------------------------------------------------------------------------
# Circuits and their faithfulness.


def top_edges(scores: Tensor, n: int) -> Tensor:
    """(U, R) bool: the n edges of largest |score| (NaN: no edge; ties: graph order)."""
    flat = scores.flatten()
    edge = ~torch.isnan(flat)
    key = torch.where(edge, -flat.abs(), torch.full_like(flat, math.inf))  # no edge: last
    order = torch.argsort(key, stable=True)[:int(edge.sum())]  # one sort, ties in graph order
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
    return recovered(Patcher(model, clean, corrupted, metric, targets), circuits)


def recovered(patcher: Patcher, circuits: Tensor) -> Faithfulness:
    """`faithfulness` with a Patcher whose base is the clean input and source the corrupted."""
    m_clean, m_corr = patcher.m_base, patcher.m_source
    check_gap(m_clean, m_corr)
    values = patcher.run(patcher.graph.valid() & ~circuits)
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


# --------------------------------------------------------------------------------------------
# Finding the circuit: scores, the circuit checked by running it, the curves.

BASELINE_MAX_EDGES = 2000  # the real single-edge baseline: one run per edge, small models only


@dataclass
class Circuit:
    """What `find_circuit` found on a batch of (clean, corrupted) pairs. `scores` (U, R)
    float64 (NaN: no edge) are the method's (eap or eap-ig) in `direction`; `circuit` (U, R)
    bool the pruned circuit of the top `requested` edges, which recovers `recovered` (the
    faithfulness fraction); `curves`: ranking name ("eap", "eap-ig", "patching") ->
    [(edges kept after pruning, recovered)] at the sizes `sizes` (int(p E), p in FRACTIONS)."""

    graph: Graph
    method: str
    ig_steps: int
    direction: str
    metric: Metric
    n_pairs: int
    clean: float
    corrupted: float
    scores: Tensor
    circuit: Tensor
    requested: int
    recovered: float
    sizes: list[int] = field(default_factory=list)
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    target: float | None = None  # the fraction asked for (--recover), if one was
    notes: list[str] = field(default_factory=list)
    rankings: dict[str, Tensor] = field(default_factory=dict)  # every ranking computed
    positions: object | None = None  # the scores by position (edge_positions.PositionScores)

    @property
    def n_edges(self) -> int:
        return int(self.graph.valid().sum())

    @property
    def gap(self) -> float:
        """metric(source) - metric(base): what patching every edge does; an edge's score over
        it is the fraction of that the edge alone is estimated to do."""
        noising = self.direction == "noising"
        return (self.corrupted - self.clean) if noising else (self.clean - self.corrupted)

    def to_json(self, digits: int = 6, lens: list | None = None) -> dict:
        """The JSON document of `minigpt circuit --json` (docs/cli.md); `lens` its place for
        a logit lens, when one was asked for."""
        def r(x):
            return None if x is None else round(float(x), digits)
        doc = {"method": self.method, "ig_steps": self.ig_steps, "direction": self.direction,
               "metric": self.metric.to_json(), "n_pairs": self.n_pairs,
               "clean": r(self.clean), "corrupted": r(self.corrupted),
               "nodes": [{**n, "score": r(n["score"])} for n in self.nodes()],
               "edges": [{**e, "score": r(e["score"])} for e in self.edges()],
               "circuit": {"edges": int(self.circuit.sum()), "requested": self.requested,
                           "recovered": r(self.recovered), "target": self.target,
                           "of": self.n_edges},
               "faithfulness": self._curve_json(self.method, r),
               "curves": {name: self._curve_json(name, r) for name in self.curves},
               "area": {name: {"under": r(a), "from_1": r(b)}
                        for name, (a, b) in self.areas().items()}, "notes": self.notes}
        if lens is not None:
            doc["lens"] = lens
        return doc

    def _curve_json(self, name: str, r) -> list[dict]:
        return [{"fraction": p, "size": n, "edges": kept, "recovered": r(f)}
                for p, n, (kept, f) in zip(FRACTIONS, self.sizes, self.curves.get(name, []))]

    def areas(self) -> dict[str, tuple[float, float]]:
        return {name: area([r for _, r in pts]) for name, pts in self.curves.items()}

    def edges(self) -> list[dict]:
        """Every edge, strongest |score| first (ties: graph order)."""
        out = []
        for u, v in self.graph.valid().nonzero().tolist():
            node, inp = self.graph.reader_name(v)
            out.append({"from": self.graph.writer_name(u), "to": node, "input": inp,
                        "score": float(self.scores[u, v]), "in_circuit": bool(self.circuit[u, v])})
            if self.positions is not None:  # 8 significant digits: the list sums to the score
                out[-1]["positions"] = [{"from_pos": i, "to_pos": j, "score": float(f"{x:.8g}")}
                                        for i, j, x in self.positions.entries(u, v)]
        return sorted(out, key=lambda e: -abs(e["score"]))

    def nodes(self) -> list[dict]:
        """Every node: its score (a writer: the sum of its outgoing edges' scores; the
        logits: of its incoming ones) and whether the circuit goes through it."""
        g, s = self.graph, self.scores.nan_to_num()
        used = self.circuit.any(1)
        out = []
        for u in range(g.n_writers):
            name = g.writer_name(u)
            layer, head = layer_head(name)
            out.append({"name": name, "head": name if head is not None else None,
                        "layer": layer, "index": head, "score": float(s[u].sum()),
                        "in_circuit": bool(used[u])})
        out.append({"name": "logits", "head": None, "layer": None, "index": None,
                    "score": float(s[:, g.logits_reader].sum()),
                    "in_circuit": bool(self.circuit[:, g.logits_reader].any())})
        return out


def layer_head(name: str) -> tuple[int | None, int | None]:
    """(layer, head) of a node name of the graph (`Graph.writer_name`): `L1.H2` -> (1, 2),
    `L1.MLP` -> (1, None), `embed` -> (None, None). The one reader of these names: whoever
    takes a name from a user checks it is one of the graph's first (interp/qk.py)."""
    if name == "embed":
        return None, None
    layer, rest = name[1:].split(".")
    return int(layer), (None if rest == "MLP" else int(rest[1:]))


def find_circuit(model, clean: Tensor, corrupted: Source, metric: Metric,
                 targets: Tensor | None, *, direction: str = "noising", ig_steps: int = 5,
                 edges: int | None = None, recover: float | None = None, curves: bool = True,
                 baseline: bool | None = None, progress: OnProgress | None = None,
                 collect: Collector | None = None) -> Circuit:
    """Score every edge on the pairs (clean, corrupted) (B, T) (`corrupted` may be an
    ablation: zero or mean; module docstring) (EAP, or EAP-IG when
    `ig_steps` > 1, in `direction`), keep the circuit of the top `edges` (or the smallest top-N
    that recovers `recover`; neither: DEFAULT_RECOVER), prune it, and measure what it
    recovers by running it; with `curves`, the faithfulness curve of each ranking (EAP, EAP-IG
    and, when `baseline` (None: models of at most BASELINE_MAX_EDGES edges), the real
    single-edge patching effects). ArgumentError for a bad request or inputs whose metric
    does not differ. `progress(stage, done, total)` as each part ends (attribute_edges's
    passes, then the search and each faithfulness curve: `circuit_stages`); `collect` sees
    the scoring passes (attribute_edges)."""
    check_search(edges, recover, ig_steps, direction)
    if isinstance(corrupted, str):
        check_ablation(corrupted, direction)
    say = progress or (lambda stage, done, total: None)
    graph = graph_of(model.cfg)
    faith = Patcher(model, clean, corrupted, metric, targets)  # base clean: faithfulness
    check_gap(faith.m_base, faith.m_source)
    base, source = (clean, corrupted) if direction == "noising" else (corrupted, clean)
    eap, ig = attribute_edges(model, base, source, metric, targets, ig_steps, progress, collect)
    scores = ig if ig_steps > 1 else eap
    n_edges = int(graph.valid().sum())
    parts = 1 + (len(_rankings(ig_steps, n_edges, baseline)) if curves else 0)
    if edges is None:
        n, circuit, rec = smallest_circuit(faith, scores, recover or DEFAULT_RECOVER)
    else:
        circuit = prune(graph, top_edges(scores, edges))
        n, rec = edges, recovered(faith, circuit[None]).recovered[0]
    out = Circuit(graph, "eap-ig" if ig_steps > 1 else "eap", ig_steps, direction, metric,
                  clean.shape[0], faith.m_base, faith.m_source, scores, circuit, n, rec,
                  target=None if edges is not None else (recover or DEFAULT_RECOVER),
                  rankings={"eap": eap, **({"eap-ig": ig} if ig_steps > 1 else {})})
    say("circuit search", 1, parts)
    if abs(out.gap) < SMALL_GAP:
        out.notes.append(f"the corrupted input changes the metric by only {abs(out.gap):.2g}: "
                         "every fraction is a ratio of small numbers; corrupt the input where "
                         "the model's prediction depends on it")
    if curves:
        rankings = out.rankings
        if "patching" in _rankings(ig_steps, n_edges, baseline):
            rankings["patching"] = edge_effects(model, base, source, metric, targets)
        for i, (name, ranking) in enumerate(rankings.items(), start=2):
            out.sizes, kept = curve_circuits(graph, ranking)
            f = recovered(faith, kept)
            out.curves[name] = list(zip(f.sizes, f.recovered))
            say("faithfulness curves", i, parts)
    return out


def _rankings(ig_steps: int, n_edges: int, baseline: bool | None) -> list[str]:
    """The rankings whose faithfulness curves find_circuit draws."""
    real = baseline if baseline is not None else n_edges <= BASELINE_MAX_EDGES
    return ["eap", *(["eap-ig"] if ig_steps > 1 else []), *(["patching"] if real else [])]


def circuit_cost(cfg, n_tokens: int, pairs: int, ig_steps: int, curves: bool,
                 step_s: float, baseline: bool | None = None) -> Cost:
    """What `find_circuit` on `pairs` pairs of `n_tokens` tokens costs, from `step_s` (one
    measured gradient step of one pair: `check_circuit_cost`): a step per --ig-steps, half a
    step per patched run of the search and of each curve (and per edge for the real baseline),
    times the pairs; and the memory it holds at once (the writers' values of both inputs, one
    gradient step's activations, the pairs themselves as they are built)."""
    graph = graph_of(cfg)
    n_edges = int(graph.valid().sum())
    search = 2 * max(1, n_edges).bit_length() + 16  # doubling, then bisection (smallest_circuit)
    ranked = _rankings(ig_steps, n_edges, baseline) if curves else []
    patched = search + 10 * len(ranked) + (n_edges if "patching" in ranked else 0)
    steps = ig_steps + 2 + 0.5 * patched
    d, L, H, U = cfg.n_embd, cfg.n_layer, cfg.n_head, graph.n_writers
    per_token = 4 * (2 * U * d + L * (16 * d + 2 * H * n_tokens)) + 2 * 80  # + the token lists
    return Cost(step_s * pairs * steps, float(pairs) * n_tokens * per_token)


def smallest_circuit(patcher: Patcher, scores: Tensor, target: float
                     ) -> tuple[int, Tensor, float]:
    """(N, pruned circuit, recovered) for the smallest N of the top-N circuits by |score|
    found to recover at least `target`: sizes 1, 2, 4, ... first, then bisection between
    the last that fell short and the first that reached it, 7 sizes per run (a search that
    assumes the fraction grows with N between those two; all edges recover 1)."""
    graph = patcher.graph
    total = int(graph.valid().sum())

    def try_sizes(sizes: list[int]) -> list[tuple[int, Tensor, float]]:
        kept = torch.stack([prune(graph, top_edges(scores, n)) for n in sizes])
        return list(zip(sizes, kept, recovered(patcher, kept).recovered))

    sizes = sorted({min(2 ** i, total) for i in range(total.bit_length() + 1)})
    tried = try_sizes(sizes)
    hit = next((i for i, t in enumerate(tried) if t[2] >= target), len(tried) - 1)
    best, lo = tried[hit], (tried[hit - 1][0] if hit else 0)
    while best[0] - lo > 1:
        step = max(1, (best[0] - lo) // 8)
        inner = sorted(set(range(lo + step, best[0], step))) or [lo + 1]
        found = try_sizes(inner)
        passing = [t for t in found if t[2] >= target]
        if passing:
            best = passing[0]
            lo = max([t[0] for t in found if t[0] < best[0]], default=lo)
        else:
            lo = inner[-1]
    return best
