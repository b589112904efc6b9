"""A circuit search on a compiled run, scored against the program's truth (`truth.json`):

- two truths over the graph's edges (interp.edge_graph): `all`, every edge of the program;
  `revealed`, those of its edges whose carried values differ between the clean run and the
  source (the corrupted input, or the ablation): all that this contrast can show, since an edge
  whose value the source leaves as it was changes nothing when patched;
- each finder's edge AUROC against both (interp.recovery): EAP, EAP-IG and the real
  single-edge patching effects (computed here when the search did not, on models of at most
  BASELINE_MAX_EDGES edges), and the largest |score| it gives a false edge (the zero it
  should be);
- the precision and recall of the circuit the search chose;
- the heads: what the program makes each head (truth.json's kinds: previous, induction)
  beside the type inspect-heads gives it on the induction probe of the program's vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minigpt.heads.edge_circuit import Pairs
from minigpt.heads.probes import prepare_input
from minigpt.interp.edge_graph import (
    BASELINE_MAX_EDGES,
    Circuit,
    Graph,
    edge_effects,
    source_values,
    writer_values,
)
from minigpt.interp.heads import attention_maps, dominant_type, score_heads
from minigpt.interp.recovery import auroc, differs, largest_false, precision_recall
from minigpt.truth.store import Truth


def truth_mask(graph: Graph, truth: Truth) -> tuple[Tensor, list[tuple[int, int]]]:
    """(U, R) bool of the truth's edges, and (u, v) of each truth edge in its order."""
    writers = {graph.writer_name(u): u for u in range(graph.n_writers)}
    readers = {graph.reader_name(v): v for v in range(graph.n_readers)}
    mask = torch.zeros(graph.n_writers, graph.n_readers, dtype=torch.bool)
    where = []
    for e in truth.edges:
        u, v = writers[e["from"]], readers[(e["to"], e["input"])]
        mask[u, v] = True
        where.append((u, v))
    assert bool((mask <= graph.valid()).all()), "a truth edge the graph does not have"
    return mask, where


def revealed_mask(model, graph: Graph, truth: Truth, pairs: Pairs,
                  where: list[tuple[int, int]]) -> Tensor:
    """(U, R) bool: the truth's edges whose carried directions' values differ between the
    clean run's writers and the source's (module docstring)."""
    index = {d["label"]: i for i, d in enumerate(truth.directions)}
    base = writer_values(model, graph, pairs.clean)
    source = source_values(model, graph, pairs.clean, pairs.corrupted)
    mask = torch.zeros(graph.n_writers, graph.n_readers, dtype=torch.bool)
    for e, (u, v) in zip(truth.edges, where):
        dims = [index[f"{c['variable']}:{x}"] if c["values"] else index[c["variable"]]
                for c in e["carries"] for x in (c["values"] or [None])]
        mask[u, v] = differs(base[u], source[u], dims)
    return mask


def score(model, cfg, tokenizer, result: Circuit, truth: Truth, pairs: Pairs,
          probe_seed: int = 0) -> dict:
    """The truth section of `minigpt circuit` on a compiled run (module docstring), as JSON;
    `cfg` and `tokenizer` the run's (the heads' probe is drawn from them)."""
    graph = result.graph
    every, where = truth_mask(graph, truth)
    shown = revealed_mask(model, graph, truth, pairs, where)
    rankings = dict(result.rankings)
    if "patching" not in rankings and int(graph.valid().sum()) <= BASELINE_MAX_EDGES:
        base, source = ((pairs.clean, pairs.corrupted) if result.direction == "noising"
                        else (pairs.corrupted, pairs.clean))
        rankings["patching"] = edge_effects(model, base, source, pairs.metric, pairs.targets)
    finders = {name: {"auroc": {"all": _r(auroc(s, every)), "revealed": _r(auroc(s, shown))},
                      "largest_false": _r(largest_false(s, every), 9)}
               for name, s in rankings.items()}
    precision, recall = precision_recall(result.circuit, every)
    _, recall_shown = precision_recall(result.circuit, shown)
    edges = [{**{k: e[k] for k in ("from", "to", "input", "tokens")},
              "variables": [c["variable"] for c in e["carries"]],
              "revealed": bool(shown[u, v]), "in_circuit": bool(result.circuit[u, v]),
              "scores": {name: _r(float(s[u, v]), 9) for name, s in rankings.items()}}
             for e, (u, v) in zip(truth.edges, where)]
    return {"program": truth.program["name"], "edges": len(truth.edges),
            "revealed": int(shown.sum()), "finders": finders,
            "circuit": {"edges": int(result.circuit.sum()), "precision": _r(precision),
                        "recall": _r(recall), "recall_revealed": _r(recall_shown)},
            "true_edges": edges, "heads": head_types(model, cfg, tokenizer, truth, probe_seed)}


def head_types(model, cfg, tokenizer, truth: Truth, seed: int = 0) -> list[dict]:
    """Every head the program gives a kind (truth.json: previous, induction), with the type
    inspect-heads gives it on the induction probe of the program's vocabulary (BOS first)."""
    kinds = [n for n in truth.nodes if ".H" in n["node"] and n.get("kind")]
    if not kinds:
        return []
    inp = prepare_input(cfg, tokenizer, probe="induction", seed=seed, eot_first=True)
    attn, _ = attention_maps(model, inp.tokens, next(model.parameters()).device)
    scores = score_heads(attn, inp.tokens)
    out = []
    for n in kinds:
        layer, head = (int(x[1:]) for x in n["node"].split("."))
        s = {k: float(v[layer, head]) for k, v in scores.items()}
        out.append({"head": n["node"], "layer": layer, "index": head, "program": n["kind"],
                    "typed": dominant_type(s),
                    "score": _r(s[n["kind"]])})
    return out


def _r(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(float(x), digits)
