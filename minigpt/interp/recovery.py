"""How well a ranking of edges recovers a known circuit (a compiled program's truth,
minigpt.truth): the numbers MIB (Mueller et al. 2025) reports for circuits known by
construction.

- AUROC of a ranking against a set of true edges: over the graph's edges (U, R) (NaN: no
  edge), each edge ranked by |score|; the probability that a true edge drawn at random ranks
  above a false one, ties counted one half (Mann-Whitney's U over the two counts). 1: every
  true edge above every false one; 0.5: no better than chance. Undefined (None) when either
  set is empty.
- precision and recall of a circuit (a set of edges) against the true edges: the share of its
  edges that are true, and the share of the true edges it holds.
- the largest |score| among the false edges: the zero a finder should give an edge that
  carries nothing, measured (float32 noise shows here).
- which true edges carry a value that differs between the base and the source (`differs`):
  what a contrast can reveal at all.
"""

from __future__ import annotations

import torch
from torch import Tensor


def auroc(scores: Tensor, positives: Tensor) -> float | None:
    """AUROC (module docstring) of |scores| (U, R) (NaN: no edge) against `positives` (U, R)
    bool; None when there is no true or no false edge."""
    edge = ~torch.isnan(scores)
    s = scores[edge].abs().double()
    pos = positives[edge]
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = torch.argsort(s, stable=True)
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, len(s) + 1, dtype=torch.float64)
    for value in torch.unique(s[order]):  # ties share their mean rank
        tied = s == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    u = float(ranks[pos].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def precision_recall(circuit: Tensor, positives: Tensor) -> tuple[float | None, float | None]:
    """(precision, recall) of the edges `circuit` (U, R) bool against `positives` (U, R)
    bool; None where the denominator is 0."""
    hit = int((circuit & positives).sum())
    n_c, n_p = int(circuit.sum()), int(positives.sum())
    return (hit / n_c if n_c else None), (hit / n_p if n_p else None)


def largest_false(scores: Tensor, positives: Tensor) -> float:
    """The largest |score| of an edge that is not true (0.0 when there is none)."""
    false = ~torch.isnan(scores) & ~positives
    return float(scores[false].abs().max()) if bool(false.any()) else 0.0


def differs(base: Tensor, source: Tensor, dims: list[int], atol: float = 1e-6) -> bool:
    """Whether a writer's values `base` and `source` (B, T, C) differ anywhere on the residual
    directions `dims` (more than `atol`)."""
    if not dims:
        return False
    return bool(((base[..., dims] - source[..., dims]).abs() > atol).any())
