"""`minigpt circuit --format graph`: the circuit as an attribution graph in the format of
circuit-tracer's graph viewer and Neuronpedia (their "Anthropic attribution graph" JSON:
`metadata`, `qParams`, `nodes`, `links`, and per node an optional `qk_tracing_results`), written
as `<slug>.json` beside `graph-metadata.json`, the list of graphs the viewer opens
(docs/export.md).

The graph. Its nodes are what writes to the residual stream, at each position: the token
embedding at every position (`embedding`), every head and every MLP at the positions where the
position-aware edge scores (interp/edge_positions.py) give them a part, and the logits of the
scored tokens at their positions (`logit`, labelled `Output "tok" (p=0.123)`, p the model's
probability of that token there on the first clean input). A head is an attention component:
its feature type is Neuronpedia's `lorsa` (a low-rank sparse attention feature, i.e. an
attention head of its own; the type whose nodes carry a QK panel); an MLP is the whole MLP at
that position, which in a replacement model with no transcoder features is its `mlp
reconstruction error` node. A link u@i -> n@j is the sum of the position-aware scores of the
edges from writer u at position i into node n's inputs at position j (its query, key and value
for a head), signed as the behaviour: positive when the clean value helps the prediction (the
estimated change of the metric when the edge's clean value is kept instead of the corrupted
one; for a loss, its decrease).

Influence and pruning, as circuit-tracer computes them: A[n, m] = |weight of m -> n|, each
node's inputs normalised to sum 1; the logits weigh 1 / (their count) each (the metric is their
mean); a node's influence is the logits' weights times A + A^2 + ... (every path to the
logits); nodes are kept from the most influential down to `node_threshold` of the total (the
embeddings and logits always), then links by the same rule at `edge_threshold`, then nodes
without a kept input (or output) dropped until none is. Each node's `influence` is the
cumulative share of the total up to it in that order: smallest for the most important, so the
viewer's pruning slider keeps the nodes whose influence is at most its value.

Each head node carries `qk_tracing_results`: the exact split of its attention score at that
query position and its most attended key into (query writer x key writer) terms, by margin, as
`minigpt inspect-heads --qk HEAD --qk-pairs QUERY:KEY` prints them (interp/qk.py): the top
pair-wise terms, [query writer's node id at the query, key writer's node id at the key,
margin], and the query-side and key-side marginals (each writer's terms summed over the other
side). Writers that are no node of the pruned graph are described in `qk_only_nodes` (the
position embedding of a model that adds one: `P_<pos>`; every constant: `bias`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from minigpt.display import visible_token
from minigpt.errors import MinigptError
from minigpt.files import atomic_write_bytes, load_json

SCAN_GPT2_SMALL = "gpt2-small"
NODE_THRESHOLD, EDGE_THRESHOLD = 0.8, 0.98  # circuit-tracer's defaults
QK_TOP = 10  # terms in each list of qk_tracing_results
METADATA = "graph-metadata.json"
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
              "block_size": 1024, "pos_encoding": "learned"}


def scan_of(cfg, run_dir: Path | None) -> str:
    """The graph's `scan` (Neuronpedia's model id): `gpt2-small` for an imported model of
    GPT-2 small's shape, else the run's (or imported model's) name, reduced to the characters
    the viewers accept."""
    m = cfg.model
    if run_dir is None and all(getattr(m, k) == v for k, v in GPT2_SMALL.items()):
        return SCAN_GPT2_SMALL
    name = Path(run_dir).name if run_dir is not None else (cfg.run.name or "model")
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:100] or "model"


# --------------------------------------------------------------------------------------------
# Nodes and links.


class _Nodes:
    """The graph's node ids and descriptions: writer u at position t is index u * T + t; the
    logits at the scored positions follow."""

    def __init__(self, graph, tokens: list[int], strs: list[str], logit_pos: list[int],
                 logit_tok: list[int]) -> None:
        self.g, self.tokens, self.strs, self.T = graph, tokens, strs, len(tokens)
        self.logit_pos, self.logit_tok = logit_pos, logit_tok
        self.n = graph.n_writers * self.T + len(logit_pos)

    def writer_id(self, name: str, t: int) -> str:
        """The node id of the writer `name` (as the graph and interp/qk.py name them) at t."""
        g = self.g
        if name in ("embed", "embed.tok"):
            return f"E_{self.tokens[t]}_{t}"
        if name == "embed.pos":
            return f"P_{t}"
        if name == "bias":
            return "bias"
        layer, rest = name[1:].split(".")
        return f"{layer}_{g.n_head if rest == 'MLP' else int(rest[1:])}_{t}"

    def describe(self, k: int) -> dict:
        g, T = self.g, self.T
        if k >= g.n_writers * T:
            i = k - g.n_writers * T
            p, tok = self.logit_pos[i], self.logit_tok[i]
            return {"node_id": f"{g.n_layer + 1}_{tok}_{p}", "feature": tok,
                    "layer": str(g.n_layer + 1), "ctx_idx": p, "feature_type": "logit",
                    "jsNodeId": f"L_{tok}-{p}", "is_target_logit": True}
        u, t = divmod(k, T)
        name = g.writer_name(u)
        if u == 0:
            return {"node_id": self.writer_id(name, t), "feature": t, "layer": "E",
                    "ctx_idx": t, "feature_type": "embedding",
                    "jsNodeId": f"E_{self.tokens[t]}-{t}"}
        layer, rest = name[1:].split(".")
        feature = g.n_head if rest == "MLP" else int(rest[1:])
        return {"node_id": self.writer_id(name, t), "feature": feature, "layer": layer,
                "ctx_idx": t,
                "feature_type": "mlp reconstruction error" if rest == "MLP" else "lorsa",
                "jsNodeId": f"{layer}_{feature}-{t}"}


GRAPH_BYTES_PER_ENTRY = 32  # W (float64) and, at the peak of `prune`, 24 bytes more per entry
                           # (measured: ru_maxrss over prune of a random acyclic W, N = 3000)


def graph_bytes(cfg, n_tokens: int) -> float:
    """The memory `build` holds at once for a model of `cfg` on `n_tokens` tokens: its dense
    N x N links, N = the writers at every position and the logits (GPT-2 small at 64 tokens:
    N = 10,112, 3.3 GB)."""
    from minigpt.interp.edge_graph import graph_of

    n = graph_of(cfg).n_writers * n_tokens + n_tokens
    return float(GRAPH_BYTES_PER_ENTRY) * n * n


def weights(pos, logit_pos: list[int], sign: float) -> Tensor:
    """W (N, N) float64, W[n, m] the link m -> n (module docstring) from the position-aware
    scores `pos` (edge_positions.PositionScores) and the scored positions."""
    g, T = pos.graph, pos.n_tokens
    N = g.n_writers * T + len(logit_pos)
    W = torch.zeros(N, N, dtype=torch.float64)
    ar = torch.arange(T)
    for v in range(g.n_readers):
        node = g.node_of_reader(v)
        w = g.available(v)
        if node is None:  # the logits
            for i, p in enumerate(logit_pos):
                W[g.n_writers * T + i, torch.arange(w) * T + p] += sign * pos.at[:w, v, p]
            continue
        where = pos._kv_index(v)
        rows = node * T + ar  # the node at each reader position j
        if where is None:  # writer and reader at the same position
            cols = torch.arange(w)[:, None] * T + ar[None, :]  # (w, T)
            W[rows[None, :].expand(w, T), cols] += sign * pos.at[:w, v]
        else:
            layer, s, h = where
            grid = pos.kv[layer][:, s, h]  # (w, Tq, Tk)
            cols = torch.arange(w)[:, None] * T + ar[None, :]  # (w, Tk)
            W[rows[:, None, None].expand(T, w, T).permute(1, 0, 2),
              cols[:, None, :].expand(w, T, T)] += sign * grid
    return W


def influence(A: Tensor, logit_weights: Tensor) -> Tensor:
    """(N,) the logits' weights times A + A^2 + ... for A (N, N) of a graph without cycles
    (rows: a node's inputs, normalised)."""
    total = torch.zeros_like(logit_weights)
    cur = logit_weights @ A
    for _ in range(A.shape[0] + 1):
        if not cur.any():
            return total
        total += cur
        cur = cur @ A
    raise RuntimeError("the attribution graph has a cycle")  # a minigpt bug


def _normalised(W: Tensor) -> Tensor:
    A = W.abs()
    return A / A.sum(1, keepdim=True).clamp(min=1e-30)


def _threshold(scores: Tensor, fraction: float) -> float:
    """The score at which the largest scores reach `fraction` of their total (the scores are
    >= 0; only the positive ones are sorted, as zeros add nothing to the total: a graph's
    links are a small part of its N x N entries)."""
    s = scores[scores > 0].sort(descending=True).values
    if not len(s):
        return 0.0
    cum = s.cumsum(0) / s.sum().clamp(min=1e-30)
    return float(s[min(int(torch.searchsorted(cum, fraction)), len(s) - 1)])


def prune(W: Tensor, n_embed: int, n_logits: int, node_threshold: float,
          edge_threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """(nodes kept (N,), links kept (N, N), cumulative influence (N,)) of the graph W (N, N)
    whose first `n_embed` nodes are the embeddings and last `n_logits` the logits, as the
    module docstring (and circuit-tracer) prune."""
    N = W.shape[0]
    logit_w = torch.zeros(N, dtype=torch.float64)
    logit_w[N - n_logits:] = 1.0 / n_logits
    node_inf = influence(_normalised(W), logit_w)
    fixed = torch.zeros(N, dtype=torch.bool)
    fixed[:n_embed] = True
    fixed[N - n_logits:] = True
    keep = (node_inf >= _threshold(node_inf, node_threshold)) & (node_inf > 0) | fixed
    A = _normalised(W * keep[:, None] * keep[None, :])
    edge_inf = A * (influence(A, logit_w) + logit_w)[:, None]
    links = (edge_inf >= _threshold(edge_inf.flatten(), edge_threshold)) & (edge_inf > 0)
    while True:  # drop nodes left without a kept output (or, not fixed, input)
        before = keep.clone()
        keep &= links.any(0) | fixed
        keep &= links.any(1) | fixed
        links &= keep[:, None] & keep[None, :]
        if torch.equal(before, keep):
            break
    order = node_inf.argsort(descending=True, stable=True)
    cum = torch.zeros(N, dtype=torch.float64)
    cum[order] = node_inf[order].cumsum(0) / node_inf.sum().clamp(min=1e-30)
    return keep, links, cum


def build(result, tokens: list[int], strs: list[str], *, slug: str, scan: str, prompt: str,
          probs: list[float], logit_strs: list[str], qk: dict, activity: Tensor,
          node_threshold: float = NODE_THRESHOLD, edge_threshold: float = EDGE_THRESHOLD
          ) -> dict:
    """The attribution graph document of a circuit `result` (edge_graph.Circuit with its
    position-aware scores) on the first clean input `tokens` (token strings `strs`): `probs`
    the model's probability of each scored token at its position and `logit_strs` its
    string, `qk` head (layer, head) ->
    interp.qk.QKHead at (t, its most attended key) for t = 1.., `activity` (U, T) the norm
    of what each writer writes at each position."""
    pos, g, metric = result.positions, result.graph, result.metric
    T = len(tokens)
    logit_pos = list(metric.positions)
    logit_tok = ([metric.answer] if metric.logit_diff else
                 metric.targets(tokens))
    sign = (-1.0 if result.direction == "noising" else 1.0) * (-1.0 if metric.kind == "loss"
                                                               else 1.0)
    W = weights(pos, logit_pos, sign)
    keep, links, cum = prune(W, T, len(logit_pos), node_threshold, edge_threshold)
    names = _Nodes(g, tokens, strs, logit_pos, logit_tok)
    nodes = []
    for k in keep.nonzero().flatten().tolist():
        nodes.append(_finish_node(names.describe(k), k, names, cum, activity, probs, qk,
                                  logit_strs))
    ids = {n["node_id"] for n in nodes}
    out_links = [{"source": names.describe(m)["node_id"], "target": names.describe(n)["node_id"],
                  "weight": float(f"{float(W[n, m]):.8g}")}
                 for n, m in links.nonzero().tolist()]
    meta = {"slug": slug, "scan": scan, "prompt_tokens": strs, "prompt": prompt,
            "node_threshold": node_threshold,
            "info": {"description": _description(result), "generator": {"name": "minigpt"}},
            "generation_settings": {"method": result.method, "ig_steps": result.ig_steps,
                                    "direction": result.direction,
                                    "metric": metric.describe(), "pairs": result.n_pairs},
            "pruning_settings": {"node_threshold": node_threshold,
                                 "edge_threshold": edge_threshold}}
    doc = {"metadata": meta,
           "qParams": {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "",
                       "sg_pos": ""},
           "nodes": nodes, "links": out_links}
    extra = _qk_only(nodes, ids, names)
    if extra:
        doc["qk_only_nodes"] = extra
    return doc


def _description(result) -> str:
    return (f"minigpt circuit: position-aware {result.method.upper()} edges "
            f"({result.direction}), {result.metric.describe()}")


def _finish_node(d: dict, k: int, names: _Nodes, cum: Tensor, activity: Tensor,
                 probs: list[float], qk: dict, logit_strs: list[str]) -> dict:
    """The node `k` described by `d`, with its label (clerp), influence and activation, and a
    head's QK split."""
    g, T, strs = names.g, names.T, names.strs
    if d["feature_type"] == "logit":  # the viewer reads p from the label's "(p=...)"
        i = k - g.n_writers * T
        return {**d, "clerp": f"Output {_shown(logit_strs[i])} (p={probs[i]:.3f})",
                "influence": None, "activation": None, "token_prob": probs[i]}
    u, t = divmod(k, T)
    node = {**d, "influence": float(cum[k]), "activation": float(activity[u, t])}
    name = g.writer_name(u)
    if u == 0:
        node["clerp"] = f"Emb: {_shown(strs[t])}"
    elif name.endswith("MLP"):
        node["clerp"] = f"{name} at {_shown(strs[t])}"
    else:
        layer, head = (int(x) for x in name[1:].replace("H", "").split("."))
        split = qk.get((layer, head))
        node["clerp"] = name
        if split is not None and t >= 1:
            results, key = _qk_results(split, t, names)
            node["qk_tracing_results"] = results
            terms = "; ".join(f"{q} x {kk} {m:+.2f}" for q, kk, m in _largest_terms(split, t, 2))
            node["clerp"] = f"{name} -> {_shown(strs[key])}@{key}: {terms}"
    return node


def _shown(s: str) -> str:
    """A token as a label shows it: quoted, control bytes and blanks made visible."""
    return f'"{visible_token(s, 24)}"'


def _largest_terms(split, t: int, n: int) -> list[tuple[str, str, float]]:
    """(query writer, key writer, margin) of the `n` largest-margin terms of head `split` at
    query t, named as inspect-heads --qk names them."""
    W = len(split.writers)
    grid = split.margin_grid[t - 1]
    order = grid.flatten().argsort(descending=True, stable=True).tolist()[:n]
    return [(split.writers[i // W], split.writers[i % W], float(grid.flatten()[i]))
            for i in order]


def _qk_results(split, t: int, names: _Nodes) -> tuple[dict, int]:
    """(qk_tracing_results, key position) of head `split` (interp.qk.QKHead over the pairs
    (0, t, most attended key) for t = 1..T-1) at query t."""
    p = t - 1
    _, tq, key = split.pairs[p]
    assert tq == t, "the split's pairs are the queries 1.. in order"
    grid = split.margin_grid[p]  # (W, W) [query writer, key writer]
    W = len(split.writers)
    qid = [names.writer_id(w, t) for w in split.writers]
    kid = [names.writer_id(w, key) for w in split.writers]
    flat = grid.flatten()
    order = flat.argsort(descending=True, stable=True).tolist()[:QK_TOP]
    pairs = [[qid[i // W], kid[i % W], float(f"{float(flat[i]):.6g}")] for i in order]
    rows, cols = grid.sum(1), grid.sum(0)
    q_top = [[qid[i], float(f"{float(rows[i]):.6g}")]
             for i in rows.argsort(descending=True, stable=True).tolist()[:QK_TOP]]
    k_top = [[kid[i], float(f"{float(cols[i]):.6g}")]
             for i in cols.argsort(descending=True, stable=True).tolist()[:QK_TOP]]
    return {"pair_wise_contributors": pairs, "top_q_marginal_contributors": q_top,
            "top_k_marginal_contributors": k_top}, key


def _qk_only(nodes: list[dict], ids: set, names: _Nodes) -> dict:
    """Descriptions of the writers the QK results name that are no node of the graph."""
    out = {}
    for n in nodes:
        res = n.get("qk_tracing_results")
        if not res:
            continue
        named = ([q for q, _, _ in res["pair_wise_contributors"]]
                 + [k for _, k, _ in res["pair_wise_contributors"]]
                 + [x for x, _ in res["top_q_marginal_contributors"]]
                 + [x for x, _ in res["top_k_marginal_contributors"]])
        for nid in named:
            if nid in ids or nid in out:
                continue
            out[nid] = _describe_id(nid, names)
    return out


def _describe_id(nid: str, names: _Nodes) -> dict:
    if nid == "bias":
        return {"node_id": "bias", "feature": None, "layer": "E", "ctx_idx": 0,
                "feature_type": "bias", "jsNodeId": "bias",
                "clerp": "constant: the norms' and projections' biases"}
    if nid.startswith("P_"):
        t = int(nid[2:])
        return {"node_id": nid, "feature": t, "layer": "E", "ctx_idx": t,
                "feature_type": "embedding", "jsNodeId": f"P-{t}",
                "clerp": f"position embedding at {t}"}
    g = names.g
    first, second, t = nid.split("_")
    t_ = int(t)
    if first == "E":
        k = t_
    else:
        layer, idx = int(first), int(second)
        u = (g.mlp_writer(layer) if idx == g.n_head else g.head_writers(layer).start + idx)
        k = u * names.T + t_
    d = names.describe(k)
    name = g.writer_name(k // names.T)
    return {**d, "clerp": f"{name} at {_shown(names.strs[t_])}"}


# --------------------------------------------------------------------------------------------
# The files.


def listed_graphs(out: Path) -> list[dict]:
    """The graphs `graph-metadata.json` in `out` lists (none when there is no such file);
    MinigptError naming the file when it is not the viewer's list: checked before a search
    that will add to it."""
    meta_path = out / METADATA
    if not meta_path.exists():
        return []
    listed = load_json(meta_path)
    if not (isinstance(listed, dict) and isinstance(listed.get("graphs"), list)
            and all(isinstance(x, dict) for x in listed["graphs"])):
        raise MinigptError(f"{meta_path}: not the viewer's list of graphs "
                           '({"graphs": [...]}); move it away or give --out another directory')
    return listed["graphs"]


def write(doc: dict, out: Path) -> list[Path]:
    """`<slug>.json` and `graph-metadata.json` (the viewer's list of graphs: this one added,
    or replacing the one of the same slug) in `out`; the paths written."""
    meta_path = out / METADATA
    graphs = [x for x in listed_graphs(out) if x.get("slug") != doc["metadata"]["slug"]]
    slug = doc["metadata"]["slug"]
    graph_path = atomic_write_bytes(
        out / f"{slug}.json",
        (json.dumps(doc, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8"))
    graphs.append(doc["metadata"])
    meta = atomic_write_bytes(meta_path, (json.dumps({"graphs": graphs}, indent=2,
                                                     ensure_ascii=False) + "\n").encode())
    return [graph_path, meta]


# --------------------------------------------------------------------------------------------
# From a circuit search to the document.


def graph_document(model, tokenizer, result, clean: Tensor, *, slug: str, scan: str,
                   node_threshold: float = NODE_THRESHOLD,
                   edge_threshold: float = EDGE_THRESHOLD) -> dict:
    """The attribution graph (`build`) of `result` (a Circuit with position-aware scores) on
    the first of the clean inputs `clean` (B, T): the model's probabilities of the scored
    tokens, every head's QK split at each query's most attended key, and what each writer
    writes, from one forward pass each."""
    from minigpt.core.gpt import eval_mode
    from minigpt.interp.edge_graph import writer_values
    from minigpt.interp.qk import qk_attribution

    g, metric = result.graph, result.metric
    idx = clean[:1]
    tokens = idx[0].tolist()
    strs = [tokenizer.token_str(t) for t in tokens]
    logit_tok = [metric.answer] if metric.logit_diff else metric.targets(tokens)
    with eval_mode(model), torch.no_grad():
        logits = model(idx)[0][0].float()  # (T, V)
        probs = logits[list(metric.positions)].softmax(-1)
        p = [float(probs[i, tok]) for i, tok in enumerate(logit_tok)]
        activity = writer_values(model, g, idx)[:, 0].norm(dim=-1)  # (U, T)
    heads = [(la, h) for la in range(g.n_layer) for h in range(g.n_head)]
    qk = ({(s.layer, s.head): s for s in qk_attribution(model, idx, heads)}
          if idx.shape[1] >= 2 else {})
    return build(result, tokens, [visible_token(s) for s in strs], slug=slug, scan=scan,
                 prompt=tokenizer.decode(tokens),
                 probs=p, logit_strs=[tokenizer.token_str(t) for t in logit_tok],
                 qk=qk, activity=activity, node_threshold=node_threshold,
                 edge_threshold=edge_threshold)
