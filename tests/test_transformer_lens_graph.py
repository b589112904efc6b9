"""minigpt's circuit graph (minigpt.interp.edge_graph) against TransformerLens 4.3's
`transformer_lens.tools.analysis.attribution_patching`, on models exported with `minigpt
export --format hf` and opened offline with `TransformerBridge.boot_transformers(dir)` (the
export and the bridge's settings as tests/test_transformer_lens.py makes them): GPT-2 and
GPT-NeoX exports, each attention-only and with MLPs (bias: true; the default bias: false
GPT-NeoX export does not open in TransformerLens 4.3).

- Every edge's EAP score and every writer's node score equal TL's
  `attribute_patch(..., EdgeAttributionConfig(granularity="edge"))`: TL's edges are per
  position, minigpt's are summed over positions; TL's sign is the denoising one (clean minus
  corrupted activation, the gradient at the corrupted run), which is minigpt's
  `denoising`; minigpt's `noising` is TL's with the two inputs swapped.
- The faithfulness of the same circuit (minigpt's edges at every position) equals TL's
  `faithfulness`, and so do the clean and corrupted metrics it divides by.
Slow; skipped, saying why, where TransformerLens is not installed."""

from __future__ import annotations

import math

import pytest
import torch
from test_transformer_lens import (  # noqa: F401 (transformer_lens: the autouse skip)
    CLEAN,
    CORRUPTED,
    SECOND,
    export_pair,
    transformer_lens,
)

from minigpt.interp import edge_graph as G
from minigpt.interp.edge_args import DIRECTIONS
from minigpt.interp.patching import make_metric

pytestmark = pytest.mark.slow

MODELS = {
    "gpt2": {"pos_encoding": "learned", "bias": True, "n_layer": 3},
    "gpt2-attention-only": {"pos_encoding": "learned", "bias": True, "n_layer": 2,
                            "mlp": False},
    "neox": {"pos_encoding": "rope", "bias": True, "tie_weights": False, "n_layer": 2},
    "neox-attention-only": {"pos_encoding": "rope", "bias": True, "tie_weights": False,
                            "mlp": False, "n_layer": 2},
}
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    return export_pair(request.param, tmp_path_factory.mktemp(request.param),
                       MODELS[request.param])


def tl_name(node) -> tuple[str, str | None]:
    """A TransformerLens Node as (minigpt node name, input or None for a writer)."""
    kind = node.kind
    if kind == "embed":
        return "embed", None
    if kind == "attn_head_out":
        return f"L{node.layer}.H{node.head}", None
    if kind == "mlp_out":
        return f"L{node.layer}.MLP", None
    if kind in ("q_input", "k_input", "v_input"):
        return f"L{node.layer}.H{node.head}", kind[0]
    if kind == "mlp_in":
        return f"L{node.layer}.MLP", "mlp"
    return "logits", "logits"


def tl_matrix(graph: G.Graph, edge_scores: dict) -> torch.Tensor:
    """TL's per-position edge scores summed over positions, as minigpt's (U, R) matrix. TL's
    graph of an attention-only model keeps an MLP node per layer (its output is 0): its edges
    must score 0, and have no place in minigpt's graph."""
    writers = {graph.writer_name(u): u for u in range(graph.n_writers)}
    readers = {graph.reader_name(v): v for v in range(graph.n_readers)}
    out = torch.zeros(graph.n_writers, graph.n_readers, dtype=torch.float64)
    for (w, r), score in edge_scores.items():
        name, reader = tl_name(w)[0], tl_name(r)
        if not graph.mlp and (name.endswith("MLP") or reader[1] == "mlp"):
            assert abs(score) < 1e-9  # an absent MLP writes nothing; what it reads goes nowhere
            continue
        out[writers[name], readers[reader]] += score
    return out


def tl_edge_count(graph: G.Graph) -> int:
    """Edges of TL's graph per position: minigpt's, plus an attention-only model's MLP nodes'."""
    if graph.mlp:
        return int(graph.valid().sum())
    return int(G.Graph(graph.n_layer, graph.n_head, True).valid().sum())


def metric_fns(kind: str):
    """(minigpt Metric, targets (1, P) or None, TL metric_fn on one example's logits)."""
    if kind == "loss":
        targets = torch.tensor([[CLEAN[p + 1] for p in SECOND]])

        def loss(logits):
            return torch.nn.functional.cross_entropy(logits[0, SECOND], targets[0])
        return make_metric(len(CLEAN), SECOND), targets, loss
    return make_metric(len(CLEAN), answer=1, wrong=7), None, \
        lambda logits: logits[0, -1, 1] - logits[0, -1, 7]


@pytest.mark.parametrize("kind", ["loss", "logit_diff"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_every_edge_and_node_score_is_transformer_lens(pair, kind, direction):
    from transformer_lens.tools.analysis.attribution_patching import (
        EdgeAttributionConfig,
        attribution_patch,
    )

    model, bridge = pair
    metric, targets, metric_fn = metric_fns(kind)
    clean, corrupted = torch.tensor([CLEAN]), torch.tensor([CORRUPTED])
    base, source = (clean, corrupted) if direction == "noising" else (corrupted, clean)
    ours, _ = G.attribute_edges(model, base, source, metric, targets)
    # TL's convention is denoising: (a_clean - a_corrupt) . grad at the corrupt run
    tl_clean, tl_corrupt = source, base
    res = attribution_patch(bridge, tl_clean, tl_corrupt, metric_fn,
                            EdgeAttributionConfig(granularity="edge"))
    graph = G.graph_of(model.cfg)
    theirs = tl_matrix(graph, res.edge_scores)
    valid = graph.valid()
    assert len(res.edge_scores) == tl_edge_count(graph) * len(CLEAN)  # the graph, per position
    assert ours[valid].abs().max() > 0.05  # edges that matter
    assert (ours[valid] - theirs[valid]).abs().max() < TOL * max(1.0, float(theirs.abs().max()))
    nodes = {graph.writer_name(u): 0.0 for u in range(graph.n_writers)}
    for node, score in res.node_scores.items():
        if tl_name(node)[0] not in nodes:  # an attention-only model's MLP: writes nothing
            assert abs(score) < 1e-9
            continue
        nodes[tl_name(node)[0]] += score
    for u in range(graph.n_writers):
        assert ours[u].nansum() == pytest.approx(nodes[graph.writer_name(u)], abs=TOL * 10)


@pytest.mark.parametrize("n_edges", [20, 60])
def test_faithfulness_is_transformer_lens(pair, n_edges):
    from transformer_lens.tools.analysis.attribution_patching import Node, faithfulness

    model, bridge = pair
    metric, targets, metric_fn = metric_fns("loss")
    clean, corrupted = torch.tensor([CLEAN]), torch.tensor([CORRUPTED])
    graph = G.graph_of(model.cfg)
    eap, _ = G.attribute_edges(model, clean, corrupted, metric, targets)
    circuit = G.prune(graph, G.top_edges(eap, n_edges))
    assert circuit.any()
    ours = G.faithfulness(model, clean, corrupted, metric, targets, circuit[None])

    def tl_node(name: str, inp: str | None, pos: int):
        if name == "embed":
            return Node(kind="embed", position=pos)
        if name == "logits":
            return Node(kind="logits", position=pos, layer=model.cfg.n_layer - 1)
        layer = int(name[1:name.index(".")])
        if name.endswith("MLP"):
            return Node(kind="mlp_in" if inp else "mlp_out", position=pos, layer=layer)
        head = int(name.rsplit("H", 1)[1])
        return Node(kind=f"{inp}_input" if inp else "attn_head_out", position=pos,
                    layer=layer, head=head)

    edges = [(tl_node(graph.writer_name(u), None, p), tl_node(*graph.reader_name(v), p))
             for u, v in circuit.nonzero().tolist() for p in range(len(CLEAN))]
    res = faithfulness(bridge, clean, corrupted, metric_fn, edges)
    assert res.total_edges == tl_edge_count(graph) * len(CLEAN)
    assert ours.clean == pytest.approx(res.full_metric, abs=TOL)
    assert ours.corrupted == pytest.approx(res.corrupt_metric, abs=TOL)
    assert ours.recovered[0] == pytest.approx(res.recovered, abs=TOL)
    assert not math.isclose(res.recovered, 0.0, abs_tol=1e-3)  # the circuit does something
