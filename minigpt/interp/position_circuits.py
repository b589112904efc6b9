"""Circuits of position-aware edges (interp/edge_positions.py): patching an edge at a pair of
positions, pruning such circuits, and the faithfulness curve that ranks position-aware edges,
measured against the summed edges at equal size.

The position-aware graph: the edges u -> v at (writer position i, reader position j) that can
reach the metric: i = j for a query, MLP or logits reader, i <= j for a key or value reader,
every position at most the last scored one, and the logits only at the scored positions.

Patching a set of them (as interp/edge_graph.py patches edges): reader v at position j takes
the source run's contribution of u at i instead of the current run's, for each patched (u, i).
A query, MLP or logits input changes at its own position. A key or value input at position i is
seen by every query j >= i; when a head's patched writers at key i differ between queries, the
layer runs once per query position (B x T copies of the batch), each copy's keys and values
patched for its query, and each query's output is taken from its own copy: exact, at T times
the attention's cost for that layer (small models).

A circuit of positions is kept and pruned as the summed one is (a node is now a writer at a
position): an edge stays only if the embedding reaches its writer at its position through kept
edges and its reader's node at its position reaches the logits. The summed circuit of N edges
is, in this graph, all the positions of those edges: the curve compares the summed circuit of
the top N edges with the circuit of the top S position-aware edges, S the number of positions
the summed one covers (`find_positional_curve`), at every size of the summed curve.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minigpt.core.gpt import eval_mode
from minigpt.interp.edge_graph import (
    FRACTIONS,
    EdgeRows,
    Graph,
    Patcher,
    _EdgePatch,
    check_gap,
    curve_circuits,
    top_edges,
)
from minigpt.interp.patching import sweep


def position_graph(graph: Graph, n_tokens: int, scored: list[int]) -> Tensor:
    """(U, R, T, T) bool, [writer, reader, reader position j, writer position i]: the
    position-aware edges that can reach the metric (module docstring)."""
    T, last = n_tokens, max(scored)
    ar = torch.arange(T)
    live = (ar <= last)
    same = torch.diag_embed(live.expand(T))  # (T, T): j == i <= last
    causal = (ar[:, None] >= ar[None, :]) & live[:, None]  # i <= j <= last
    logits = torch.zeros(T, T, dtype=torch.bool)
    logits[scored, scored] = True
    out = torch.zeros(graph.n_writers, graph.n_readers, T, T, dtype=torch.bool)
    valid = graph.valid()
    for v in range(graph.n_readers):
        inp = graph.reader_name(v)[1]
        pattern = logits if inp == "logits" else causal if inp in ("k", "v") else same
        out[valid[:, v], v] = pattern
    return out


def prune_positions(graph: Graph, keep: Tensor) -> Tensor:
    """The edges of `keep` (U, R, T, T) whose writer at its position the embedding reaches and
    whose reader's node at its position reaches the logits, both through kept edges."""
    U, R, T, _ = keep.shape
    node = [graph.node_of_reader(v) for v in range(R)]
    reached = torch.zeros(U, T, dtype=torch.bool)
    reached[0] = True
    for v in range(R):  # readers in graph order: a node's readers before its own writes
        if node[v] is not None:
            reached[node[v]] |= (keep[:, v] & reached[:, None, :]).any(-1).any(0)
    useful = torch.zeros(U, T, dtype=torch.bool)
    for v in reversed(range(R)):
        at = torch.ones(T, dtype=torch.bool) if node[v] is None else useful[node[v]]
        useful |= (keep[:, v] & at[None, :, None] & reached[:, None, :]).any(1)
    live_reader = torch.stack([torch.ones(T, dtype=torch.bool) if n is None else useful[n]
                               for n in node])  # (R, T): the reader's node at j
    return (keep & reached[:, None, None, :] & useful[:, None, None, :]
            & live_reader[None, :, :, None])


class _PositionPatch(_EdgePatch):
    """Rows of position-aware patching: `patched` (n, U, R, T, T) float, 1 where reader v at
    position j takes writer u's source contribution at i (module docstring)."""

    def __init__(self, model, graph: Graph, source: Tensor, base_embed: Tensor,
                 patched: Tensor, care: Tensor) -> None:
        self.at = patched.diagonal(dim1=-2, dim2=-1)  # (n, U, R, T): reader and writer at t
        super().__init__(model, graph, source, base_embed, patched.sum((-1, -2)) > 0)
        self.full, self.care, self.copies = patched, care, set()

    def _input(self, x: Tensor, cols: slice, n_writers: int) -> Tensor:
        """Readers `cols`' inputs (R', n * B, T, C), each patched at its own positions."""
        m = self.at[:, :n_writers, cols]  # (n, w, R, T)
        if not m.any():
            return x
        d = self.delta[:n_writers].view(n_writers, self.n, self.B, *x.shape[1:])
        corr = torch.einsum("nwrt,wnbtc->rnbtc", m.to(d), d)
        return x[None] + corr.reshape(cols.stop - cols.start, *x.shape)

    def attn_in(self, layer: int, x: Tensor) -> Tensor:
        g, H = self.graph, self.graph.n_head
        rows, w = g.attn_readers(layer), g.head_writers(layer).start
        q = self._input(x, slice(rows.start, rows.start + H), w)  # (H, nB, T, C) or x
        q = q if q.dim() == 4 else x.expand(H, *x.shape)
        kv = self.full[:, :w, rows.start + H:rows.stop]  # (n, w, 2H, Tq, Tk)
        T = x.shape[1]
        first = kv.diagonal(dim1=-2, dim2=-1)  # each key's own query: (n, w, 2H, Tk)
        d = self.delta[:w].view(w, self.n, self.B, T, -1)
        if bool(((kv == first[..., None, :]) | ~self.care).all()):  # every query alike
            corr = torch.einsum("nwht,wnbtc->hnbtc", first.to(d), d)
            kvx = x[None] + corr.reshape(2 * H, *x.shape)
            return torch.cat([q[None], kvx.view(2, H, *x.shape)]).contiguous()
        self.copies.add(layer)
        corr = torch.einsum("nwhji,wnbic->hnbjic", kv.to(d), d)  # (2H, n, B, Tq, Tk, C)
        kvx = x.view(self.n, self.B, 1, T, -1) + corr  # (2H, n, B, Tq, Tk, C)
        qx = q.view(H, self.n, self.B, 1, T, -1).expand(H, self.n, self.B, T, T, -1)
        out = torch.cat([qx, kvx]).reshape(3, H, self.n * self.B * T, T, -1)
        return out

    def heads(self, layer: int, z: Tensor) -> Tensor:
        if layer in self.copies:  # query j's output from its own copy: (nB, H, T, D)
            T = z.shape[2]
            z = z.view(-1, T, *z.shape[1:]).diagonal(dim1=1, dim2=3).permute(0, 1, 3, 2)
        return super().heads(layer, z)


class _PositionRows(EdgeRows):
    """A Plan (interp.patching): row r patches the position-aware edges `patched[r]`; `care`
    (Tq, Tk) the (query, key) pairs that can reach the metric."""

    care: Tensor | None = None

    def row_floats(self, n_tokens: int) -> int:  # the per-query copies of a layer
        return super().row_floats(n_tokens) * (n_tokens + 1)

    def intervention(self, rows, batch: int):
        return _PositionPatch(self.model, self.graph, self.source, self.base_embed,
                              self.patched[list(rows)].float(), self.care)


def run_positions(patcher: Patcher, patched: Tensor) -> Tensor:
    """The metric (n,) float64 of the patcher's base run with, in row r, the position-aware
    edges `patched[r]` ((n, U, R, T, T) bool) taking the source's values."""
    plan = _PositionRows(patcher.model, patcher.graph, patcher.values, patcher.base_embed,
                         patched)
    T, last = patched.shape[-1], max(patcher.metric.positions)
    ar = torch.arange(T)
    plan.care = (ar[:, None] >= ar[None, :]) & (ar[:, None] <= last)
    with eval_mode(patcher.model):
        return sweep(patcher.model, patcher.base, patcher.metric, patcher.targets, plan)[1]


def recovered_positions(patcher: Patcher, circuits: Tensor, live: Tensor) -> list[float]:
    """The fraction each circuit of position-aware edges (n, U, R, T, T) recovers: the clean
    run with every other edge of the position-aware graph `live` patched."""
    m_clean, m_corr = patcher.m_base, patcher.m_source
    check_gap(m_clean, m_corr)
    values = run_positions(patcher, live[None] & ~circuits)
    return ((values - m_corr) / (m_clean - m_corr)).tolist()


def positional_curve(model, result, clean: Tensor, corrupted: Tensor, targets: Tensor | None
                     ) -> tuple[list[int], list[tuple[int, float]], list[tuple[int, float]]]:
    """At each size of the summed faithfulness curve (the top int(p E) edges by the method's
    summed scores, pruned): (the positions the summed circuit covers S, [(its positions,
    recovered)], [(the pruned circuit of the top S position-aware edges: its edges,
    recovered)]), both run through position-aware patching (module docstring)."""
    g, metric, pos = result.graph, result.metric, result.positions
    live = position_graph(g, clean.shape[1], list(metric.positions))
    patcher = Patcher(model, clean, corrupted, metric, targets)
    _, summed = curve_circuits(g, result.scores)  # (10, U, R)
    as_positions = summed[:, :, :, None, None] & live[None]
    sizes = [int(c.sum()) for c in as_positions]
    scores = pos.dense().masked_fill(~live, float("nan"))
    ranked = torch.stack([prune_positions(g, top_edges(scores, s)) for s in sizes])
    rec = recovered_positions(patcher, torch.cat([as_positions, ranked]), live)
    n = len(FRACTIONS)
    return (sizes, list(zip(sizes, rec[:n])),
            list(zip([int(c.sum()) for c in ranked], rec[n:])))
