"""Position-aware edges (minigpt/interp/edge_positions.py): every edge's EAP and EAP-IG score
split by (writer position, reader position) sums to its summed score, the key and value splits
sum over the queries to the key's (value's) own term, nothing is scored where it cannot reach
the metric, and a single position-aware edge's score is its first-order effect."""

from __future__ import annotations

import pytest
import torch

from minigpt.config.settings import ModelConfig
from minigpt.core.gpt import GPT
from minigpt.interp.edge_graph import attribute_edges, graph_of
from minigpt.interp.edge_positions import attribute_positions
from minigpt.interp.patching import make_metric

SHAPES = [{}, {"norm": "rmsnorm"}, {"qk_norm": True}, {"pos_encoding": "learned"},
          {"pos_encoding": "learned", "bias": False, "mlp": False},
          {"qk_norm": True, "norm": "rmsnorm", "activation": "relu2",
           "pos_encoding": "sinusoidal"},
          {"norm": "none", "d_head": 5, "activation": "relu", "pos_encoding": "learned"}]


def model_and_inputs(seed: int = 3, **over):
    cfg = ModelConfig(**{"n_layer": 3, "n_head": 4, "n_embd": 32, "block_size": 24,
                         "vocab_size": 40, **over})
    model = GPT.from_config(cfg, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from the init's symmetry: every term matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    base = torch.randint(0, 40, (2, 12), generator=g)
    source = torch.randint(0, 40, (2, 12), generator=g)
    metric = make_metric(12, positions=[5, 8])
    targets = torch.tensor([metric.targets(b.tolist()) for b in base])
    return model, base, source, metric, targets


@pytest.mark.parametrize("over", SHAPES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
                         or "default")
@pytest.mark.parametrize("ig_steps", [1, 3])
def test_the_positions_sum_to_the_summed_scores(over, ig_steps):
    model, base, source, metric, targets = model_and_inputs(**over)
    eap, ig = attribute_edges(model, base, source, metric, targets, ig_steps)
    eap2, ig2, pos = attribute_positions(model, base, source, metric, targets, ig_steps)
    summed = ig if ig_steps > 1 else eap
    valid = graph_of(model.cfg).valid()
    assert torch.equal(eap.isnan(), eap2.isnan()) and torch.equal(ig.isnan(), ig2.isnan())
    assert (eap2 - eap)[valid].abs().max() < 1e-9 and (ig2 - ig)[valid].abs().max() < 1e-9
    assert summed[valid].abs().max() > 0.01  # scores worth comparing
    assert (pos.summed() - summed)[valid].abs().max() < 1e-5
    dense = pos.dense()  # [writer, reader, reader position, writer position]
    assert (dense.sum((-1, -2)) - summed.nan_to_num())[valid].abs().max() < 1e-5
    # every edge's list of positions sums to its score
    for u, v in valid.nonzero()[::7].tolist():
        assert abs(sum(s for _, _, s in pos.entries(u, v)) - float(summed[u, v])) < 1e-5


@pytest.mark.parametrize("over", SHAPES[:4], ids=["default", "rmsnorm", "qk_norm", "learned"])
def test_key_and_value_splits_sum_over_the_queries_to_their_own_term(over):
    model, base, source, metric, targets = model_and_inputs(**over)
    _, _, pos = attribute_positions(model, base, source, metric, targets, 2)
    g, H = pos.graph, pos.graph.n_head
    for layer, grid in enumerate(pos.kv):
        w, r0 = grid.shape[0], g.attn_readers(layer).start
        by_key = grid.sum(-2)  # over the queries: (w, 2, H, T)
        assert (by_key[:, 0] - pos.at[:w, r0 + H:r0 + 2 * H]).abs().max() < 1e-6
        assert (by_key[:, 1] - pos.at[:w, r0 + 2 * H:r0 + 3 * H]).abs().max() < 1e-6
        # a key after its query is never read
        assert grid.triu(1).abs().max() == 0


def test_nothing_is_scored_where_it_cannot_reach_the_metric():
    model, base, source, metric, targets = model_and_inputs()
    _, _, pos = attribute_positions(model, base, source, metric, targets, 2)
    dense = pos.dense()
    assert dense[:, :, 9:].abs().max() == 0 and dense[..., 9:].abs().max() == 0  # after 8
    logits = pos.at[:, pos.graph.logits_reader]
    assert logits[:, [5, 8]].abs().max() > 0  # the scored positions
    assert logits[:, [0, 1, 2, 3, 4, 6, 7]].abs().max() == 0


def test_a_position_aware_key_edge_is_its_first_order_effect():
    """One layer, the metric at query 4 only, so the key at position 0 reaches it through
    query 4 alone: the metric's derivative along the embedding's difference at that key (head
    1's key input only) is the edge's position-aware EAP score (embed at 0 -> L0.H1 k at 4)."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=20, mlp=False)
    model = GPT.from_config(cfg, seed=1).eval()
    with torch.no_grad():  # sharp attention: the key matters
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    base = torch.tensor([[1, 2, 3, 4, 5, 6]])
    source = torch.tensor([[7, 2, 3, 4, 5, 6]])
    metric = make_metric(6, positions=[4], kind="logit")
    targets = torch.tensor([metric.targets(base[0].tolist())])
    _, _, pos = attribute_positions(model, base, source, metric, targets, 1)
    g = pos.graph
    k_reader = g.attn_readers(0).start + g.n_head + 1  # head 1's key input
    score = float(pos.kv[0][0, 0, 1, 4, 0])  # embed -> L0.H1 k, key 0, query 4

    from minigpt.core.gpt import ForwardSpec, Intervention

    delta = (model._embed(source, 0) - model._embed(base, 0)).detach()

    class Nudge(Intervention):
        def __init__(self, eps):
            self.eps = eps

        def attn_in(self, layer, x):
            xs = x.expand(3, g.n_head, *x.shape).clone()
            xs[1, 1, :, 0] += self.eps * delta[:, 0]  # head 1's key at position 0 only
            return xs

    def value(eps):
        with torch.no_grad():
            out = model(base, attn=ForwardSpec(intervention=Nudge(eps)))[0]
        return float(metric.values(out[:, [4]], targets)[0])

    change = (value(1e-3) - value(-1e-3)) / 2e-3  # the derivative along the difference
    assert abs(score) > 1e-2 and abs(change - score) < 1e-3 * max(1.0, abs(score))
    assert abs(float(pos.at[0, k_reader, 0]) - score) < 1e-6  # the key's only query here


# -- circuits of position-aware edges (minigpt/interp/position_circuits.py) ----------------------


def test_patching_every_position_of_edges_is_patching_the_edges():
    from minigpt.interp.edge_graph import Patcher
    from minigpt.interp.position_circuits import position_graph, run_positions

    model, base, source, metric, targets = model_and_inputs(pos_encoding="learned")
    patcher = Patcher(model, base, source, metric, targets)
    g = patcher.graph
    live = position_graph(g, base.shape[1], list(metric.positions))
    gen = torch.Generator().manual_seed(0)
    summed = (torch.rand(4, g.n_writers, g.n_readers, generator=gen) < 0.4) & g.valid()
    want = patcher.run(summed)
    got = run_positions(patcher, summed[:, :, :, None, None] & live[None])
    assert (want - patcher.m_base).abs().max() > 1e-3  # the patches matter
    assert (got - want).abs().max() < 1e-5


def test_a_key_patched_for_one_query_is_the_key_patched_where_only_that_query_counts():
    """One layer, the metric at query 6 only: patching head 1's key input at position 2 for
    query 6 alone (the layer then runs once per query) equals patching it for every query (the
    other queries reach no scored position)."""
    from minigpt.interp.edge_graph import Patcher
    from minigpt.interp.position_circuits import position_graph, run_positions

    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=10, vocab_size=20, mlp=False)
    model = GPT.from_config(cfg, seed=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    base = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    source = torch.tensor([[9, 2, 11, 4, 5, 6, 7, 8]])
    metric = make_metric(8, positions=[6], kind="logit")
    targets = torch.tensor([metric.targets(base[0].tolist())])
    patcher = Patcher(model, base, source, metric, targets)
    g = patcher.graph
    k1 = g.attn_readers(0).start + g.n_head + 1
    one = torch.zeros(1, g.n_writers, g.n_readers, 8, 8, dtype=torch.bool)
    one[0, 0, k1, 6, 2] = True  # embed at key 2 -> L0.H1's key, for query 6
    every = torch.zeros_like(one)
    every[0, 0, k1, 2:, 2] = True  # ... for every query that sees key 2
    a, b = run_positions(patcher, one), run_positions(patcher, every)
    assert abs(float(a[0] - patcher.m_base)) > 1e-3 and abs(float(a[0] - b[0])) < 1e-5
    live = position_graph(g, 8, [6])
    assert live[0, k1, 6, 2] and not live[0, k1, 7, 2] and not live[0, k1, 1, 2]


def test_the_positional_curve_ends_where_the_summed_one_does():
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.interp.edge_positions import position_split
    from minigpt.interp.position_circuits import position_graph, positional_curve

    model, base, source, metric, targets = model_and_inputs(pos_encoding="learned", n_layer=2)
    split = position_split(model, base.shape[0], base.shape[1])
    result = find_circuit(model, base, source, metric, targets, ig_steps=2, edges=10,
                          collect=split)
    result.positions = split.result
    sizes, summed, ranked = positional_curve(model, result, base, source, targets)
    assert sizes == sorted(sizes)
    assert sizes[-1] == int(position_graph(result.graph, 12, [5, 8]).sum())  # all of them
    for (_, f_pos), (_, f_sum) in zip(summed, result.curves["eap-ig"]):
        assert abs(f_pos - f_sum) < 1e-5  # the summed circuits, run as positions
    assert abs(ranked[-1][1] - 1.0) < 1e-5 and all(k <= s for (k, _), s in zip(ranked, sizes))
