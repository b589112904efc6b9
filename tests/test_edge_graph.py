"""The circuit as a graph (minigpt.interp.edge_graph) on tiny random models and on the hand-built
induction circuit: edge patching of every edge is the corrupted run and of none the clean run;
one edge patched equals a hand-written intervention on that one reader; EAP equals the
gradient of the metric read through a hand-written split of every reader; EAP-IG with one
step is EAP exactly and approaches the real single-edge effects as the steps grow; pruning
and the area follow their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT, ForwardSpec, Intervention
from minigpt.errors import ArgumentError, MinigptError
from minigpt.interp import edge_graph as G
from minigpt.interp.patching import make_metric, record, run_value

T = 12
POS = list(range(6, 11))


def tiny(seed: int = 1, **over) -> GPT:
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": T,
                         "vocab_size": 30, "bias": True, **over})
    model = GPT.from_config(cfg, seed=seed).eval()
    with torch.no_grad():  # heads that matter
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(5)
    return model


def pairs(n: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clean, corrupted, targets): corrupted = clean with its second half redrawn."""
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 30, (n, T), generator=gen)
    corrupted = clean.clone()
    corrupted[:, T // 2:] = torch.randint(0, 30, (n, T - T // 2), generator=gen)
    targets = clean[:, [p + 1 for p in POS]]
    return clean, corrupted, targets


METRIC = make_metric(T, POS)


def test_the_graph_counts_and_names():
    gpt2 = G.Graph(12, 12, True)
    assert gpt2.n_writers == 157 and gpt2.n_readers == 445
    assert int(gpt2.valid().sum()) == 32491  # the MIB benchmark's count for GPT-2 small
    g = G.Graph(2, 4, False)
    assert int(g.valid().sum()) == 12 * 1 + 12 * 5 + 9
    assert [g.writer_name(u) for u in range(g.n_writers)][:3] == ["embed", "L0.H0", "L0.H1"]
    assert g.reader_name(0) == ("L0.H0", "q") and g.reader_name(4 + 1) == ("L0.H1", "k")
    assert g.reader_name(g.logits_reader) == ("logits", "logits")
    h = G.Graph(2, 2, True)
    assert h.writer_name(h.mlp_writer(1)) == "L1.MLP" and h.reader_name(h.mlp_reader(0)) == (
        "L0.MLP", "mlp")
    assert h.available(h.mlp_reader(0)) == 3 and h.available(h.attn_readers(1).start) == 4
    with pytest.raises(MinigptError, match="no head for a circuit"):
        G.graph_of(ModelConfig(n_layer=0))


@pytest.mark.parametrize("over", [{}, {"mlp": False, "pos_encoding": "learned"}])
def test_patching_every_edge_is_the_corrupted_run_and_none_the_clean_run(over):
    model = tiny(**over)
    clean, corrupted, targets = pairs()
    valid = G.graph_of(model.cfg).valid()
    rows = torch.stack([valid, torch.zeros_like(valid)])
    got = G.patch_edges(model, clean, corrupted, METRIC, targets, rows)
    assert got[0] == pytest.approx(run_value(model, corrupted, METRIC, targets), abs=1e-5)
    assert got[1] == pytest.approx(run_value(model, clean, METRIC, targets), abs=1e-6)
    f = G.faithfulness(model, clean, corrupted, METRIC, targets, torch.stack([valid, ~valid]))
    assert f.recovered == pytest.approx([1.0, 0.0], abs=1e-5)


class OneEdge(Intervention):
    """By hand: the corrupted run's output of head (0, 1) minus the clean run's, added to the
    value input of head 1 of layer 1 only."""

    def __init__(self, model, delta):
        self.model, self.delta = model, delta

    def attn_in(self, layer, x):
        if layer != 1:
            return x
        xs = x.repeat(3, 2, 1, 1, 1)  # (3, H, B, T, C)
        xs[2, 1] += self.delta  # v of head 1
        return xs


@torch.no_grad()
def test_one_edge_patched_is_that_readers_input_changed_by_hand():
    model = tiny()
    clean, corrupted, targets = pairs()
    g = G.graph_of(model.cfg)

    def head_out(idx):
        z = record(model, idx)[1].z[0][:, 1]  # (B, T, D) of head 1, layer 0
        w_o = model.blocks[0].attn.c_proj.weight[:, 8:16]  # (C, D)
        return z @ w_o.T

    spec = ForwardSpec(intervention=OneEdge(model, head_out(corrupted) - head_out(clean)))
    want = run_value(model, clean, METRIC, targets, spec) - run_value(model, clean, METRIC,
                                                                      targets)
    effects = G.edge_effects(model, clean, corrupted, METRIC, targets)
    u, v = g.head_writers(0).start + 1, g.attn_readers(1).start + 5  # L0.H1 -> L1.H1 v
    assert g.writer_name(u) == "L0.H1" and g.reader_name(v) == ("L1.H1", "v")
    assert float(effects[u, v]) == pytest.approx(want, abs=1e-6)
    assert abs(want) > 1e-3
    assert torch.isnan(effects[~g.valid()]).all()


class SplitAll(Intervention):
    """Every reader's input its own leaf-like copy, kept for autograd."""

    def __init__(self):
        self.inputs = []

    def attn_in(self, layer, x):
        xs = x.expand(3, 2, *x.shape).clone()  # (3, H, B, T, C)
        self.inputs.append(xs)
        return xs

    def mlp_in(self, layer, x):
        self.inputs.append(x.clone())
        return self.inputs[-1]

    def final_in(self, x):
        self.inputs.append(x.clone())
        return self.inputs[-1]


@pytest.mark.parametrize("over", [{}, {"mlp": False, "pos_encoding": "learned"}])
def test_eap_is_the_source_minus_base_writer_dotted_with_the_readers_gradient(over):
    """Recomputed with autograd on a hand-written split: noising = base clean, source
    corrupted; each writer's contribution from a recording, W_O applied by hand."""
    model = tiny(**over)
    clean, corrupted, targets = pairs()
    g = G.graph_of(model.cfg)
    eap, _ = G.attribute_edges(model, clean, corrupted, METRIC, targets)
    split = SplitAll()
    logits, _ = model(clean, attn=ForwardSpec(intervention=split))
    metric = METRIC.values(logits[:, POS], targets).sum()
    grads = torch.autograd.grad(metric, split.inputs)
    flat = torch.cat([gr.reshape(-1, 2, T, 16) for gr in grads])  # (R, B, T, C)
    with torch.no_grad():
        delta = G.writer_values(model, g, corrupted) - G.writer_values(model, g, clean)
    want = torch.einsum("ubtc,rbtc->ur", delta, flat).double() / 2
    valid = g.valid()
    assert (eap[valid] - want[valid]).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))
    assert torch.isnan(eap[~valid]).all() and want[valid].abs().max() > 1e-2


def test_one_ig_step_is_eap_exactly():
    model = tiny()
    clean, corrupted, targets = pairs()
    _, ig1 = G.attribute_edges(model, clean, corrupted, METRIC, targets, ig_steps=1)
    eap5, ig5 = G.attribute_edges(model, clean, corrupted, METRIC, targets, ig_steps=5)
    assert torch.equal(ig1.nan_to_num(), eap5.nan_to_num())  # bit for bit
    assert not torch.allclose(ig5.nan_to_num(), eap5.nan_to_num())
    with pytest.raises(ArgumentError, match="at least 1"):
        G.attribute_edges(model, clean, corrupted, METRIC, targets, ig_steps=0)


def test_ig_approaches_the_real_edge_effects_as_steps_grow():
    """On six attention-only models, sum |EAP-IG - real single-edge effect| / sum |real| over
    the 29 edges, measured when written, for 1, 2, 5, 20, 50 steps:
    0.31 0.18 0.14 0.19 0.20 | 0.39 0.36 0.30 0.28 0.28 | 2.16 1.47 0.90 0.62 0.57 |
    0.22 0.18 0.16 0.15 0.15 | 0.34 0.16 0.12 0.11 0.11 | 0.28 0.12 0.09 0.11 0.11.
    From 1 to 5 steps the error fell on every one (asserted); past 5 it levels off, and rose
    a little on two. With MLPs (the same six): 0.36 0.21 0.28 .. | 0.57 0.33 0.41 .. | 0.70
    0.88 0.98 .. | 0.39 0.23 0.25 .. | 0.35 0.26 0.26 .. | 0.85 0.92 1.03 ..: the integrated
    gradient estimates patching along the path of the whole input, not of one edge alone, and
    need not converge to the single-edge effect (not asserted)."""
    for seed in range(6):
        model = tiny(seed=seed + 1, mlp=False, pos_encoding="learned")
        clean, corrupted, targets = pairs(seed=seed)
        real = G.edge_effects(model, clean, corrupted, METRIC, targets)
        valid = ~torch.isnan(real)
        err = [float((G.attribute_edges(model, clean, corrupted, METRIC, targets, ig_steps=m)[1]
                      - real)[valid].abs().sum()) for m in (1, 5)]
        assert err[1] < err[0], seed


def test_prune_keeps_what_connects_the_embedding_to_the_logits():
    g = G.Graph(2, 2, False)  # writers: embed, L0.H0, L0.H1, L1.H0, L1.H1
    keep = torch.zeros(g.n_writers, g.n_readers, dtype=torch.bool)
    e, l0h0, l0h1, l1h0 = 0, 1, 2, 3
    k_l1h0, q_l1h0, v_l0h0 = g.attn_readers(1).start + 2, g.attn_readers(1).start, 2 * 2
    keep[e, v_l0h0] = True            # embed -> L0.H0 v
    keep[l0h0, k_l1h0] = True         # L0.H0 -> L1.H0 k
    keep[l1h0, g.logits_reader] = True  # L1.H0 -> logits
    keep[l0h1, q_l1h0] = True         # L0.H1 is never reached from the embedding
    keep[e, g.attn_readers(1).start + 1] = True  # embed -> L1.H1 q: L1.H1 reaches nothing
    out = G.prune(g, keep)
    assert out.sum() == 3 and out[e, v_l0h0] and out[l0h0, k_l1h0] and out[
        l1h0, g.logits_reader]
    assert G.prune(g, out).equal(out)
    assert G.prune(g, torch.zeros_like(keep)).sum() == 0


def test_top_edges_and_the_area():
    scores = torch.tensor([[1.0, -3.0, math.nan], [2.0, 0.5, -0.1]])
    assert G.top_edges(scores, 2).tolist() == [[False, True, False], [True, False, False]]
    assert int(G.top_edges(scores, 10).sum()) == 5
    under, between = G.area([1.0] * 10)
    assert under == pytest.approx(0.999) and between == 0.0
    assert G.area([0.0] * 10) == pytest.approx((0.0, 0.999))


def test_the_hand_built_induction_circuit():
    """The circuit's edges carry the copy: the induction head into the logits is the
    strongest real effect and the strongest EAP-IG score (noising); EAP and its two strongest
    edges keep the clean loss almost whole (faithfulness)."""
    from test_head_circuits import PROBE, SECOND, V, induction_circuit_model

    from minigpt.heads.probes import corrupt_second_copy

    model = induction_circuit_model()
    clean = torch.tensor([PROBE])
    corrupted = torch.tensor([corrupt_second_copy(PROBE, 0, range(V))])
    metric = make_metric(len(PROBE), SECOND)
    targets = torch.tensor([[PROBE[p + 1] for p in SECOND]])
    g = G.graph_of(model.cfg)
    real = G.edge_effects(model, clean, corrupted, metric, targets)
    _, ig = G.attribute_edges(model, clean, corrupted, metric, targets, ig_steps=5)
    ind_logits = (g.head_writers(1).start, g.logits_reader)
    for scores in (real, ig):
        assert G.top_edges(scores, 1)[ind_logits]
    circuit = G.prune(g, G.top_edges(real, 2))
    f = G.faithfulness(model, clean, corrupted, metric, targets, circuit[None])
    assert f.corrupted > 3.0 and f.clean < 0.3 and f.recovered[0] > 0.95
