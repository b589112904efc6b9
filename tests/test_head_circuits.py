"""How heads work together (minigpt.interp.head_circuits) on hand-built models: a previous-token
head feeding an induction head gives each number its meaning (direct logit attribution lands on
the induction head, K-composition links the two heads, patching the induction head moves the
whole metric); random models check the algebra (the attribution adds up to the logit, the
factored composition scores equal the dense matrices', batched patching equals patching head by
head)."""

from __future__ import annotations

import pytest
import torch

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT, ForwardSpec
from minigpt.errors import ArgumentError, MinigptError
from minigpt.heads.probes import corrupt_copy, corrupt_second_copy
from minigpt.interp import head_circuits as c
from minigpt.interp import patching
from minigpt.interp.patching import make_metric

V, T, C = 12, 16, 64  # vocabulary, positions, width; two heads of 32
TOK, POS = slice(0, V), slice(V, V + T)
PREV, OUT = slice(V + T, V + T + V), slice(V + T + V, V + T + 2 * V)
PROBE = [3, 1, 6, 0, 7, 2, 5, 4] * 2  # 8 distinct tokens, twice: an induction probe
SECOND = list(range(8, 15))  # the predictions inside the second copy


def induction_circuit_model() -> GPT:
    """Two attention-only layers, learned positions, untied head; the residual stream has a
    block for the token, the position, the previous token and the output.
    - L0.H0 is a previous-token head: query position t meets key position t - 1, its value is
      the token, W_O writes it into the previous-token block.
    - L1.H0 is an induction head: its query is the current token, its KEY READS THE
      PREVIOUS-TOKEN BLOCK (K-composition with L0.H0), so query t attends to the position s
      after an earlier occurrence of its token; its value is the token at s, written into the
      output block, which is all the LM head reads.
    - Head 1 of each layer attends somewhere but writes nothing (W_V = 0)."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=C, block_size=T, vocab_size=V, mlp=False,
                      pos_encoding="learned", tie_weights=False)
    model = GPT(cfg).eval()
    d = C // 2
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.blocks[0].ln_1, model.blocks[1].ln_1, model.ln_f):
            norm.weight.fill_(1.0)
        model.wte.weight[:, TOK] = 10 * torch.eye(V)
        model.wpe.weight[:, POS] = 10 * torch.eye(T)
        w0, w1 = model.blocks[0].attn.c_attn.weight, model.blocks[1].attn.c_attn.weight
        w0[0:T, POS] = 8 * torch.eye(T)  # L0.H0 query: position t
        w0[C + 1:C + T, POS][:, :T - 1] = 8 * torch.eye(T - 1)  # key: position s -> s + 1
        w0[2 * C:2 * C + V, TOK] = torch.eye(V)  # value: the token
        model.blocks[0].attn.c_proj.weight[PREV, 0:V] = 10 * torch.eye(V)
        w1[0:V, TOK] = 8 * torch.eye(V)  # L1.H0 query: the current token
        w1[C:C + V, PREV] = 8 * torch.eye(V)  # key: the token before the key
        w1[2 * C:2 * C + V, TOK] = torch.eye(V)  # value: the key's own token
        model.blocks[1].attn.c_proj.weight[OUT, 0:V] = 10 * torch.eye(V)
        for w in (w0, w1):
            w[C + d:C + d + T, POS] = torch.randn(T, T, generator=torch.Generator().manual_seed(0))
        model.lm_head.weight[:, OUT] = 5 * torch.eye(V)
    return model


def random_model(seed: int = 3, **over) -> GPT:
    cfg = ModelConfig(**{"n_layer": 3, "n_head": 4, "n_embd": 32, "block_size": 24,
                         "vocab_size": 40, **over})
    return GPT.from_config(cfg, seed=seed).eval()


def random_ids(n: int = 24, seed: int = 1) -> list[int]:
    return torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --------------------------------------------------------------------------------------------
# Direct logit attribution.


def test_the_induction_head_writes_the_prediction():
    model = induction_circuit_model()
    dla = c.direct_logit_attribution(model, PROBE, make_metric(len(PROBE), SECOND))
    assert dla.heads[1, 0] > 5.0  # the copied token's logit comes from the induction head
    assert dla.heads[1, 0] > 0.9 * dla.logit
    assert dla.heads[0, 1] == 0.0 and dla.heads[1, 1] == 0.0  # W_V = 0: exactly nothing
    # the previous-token head writes into a block the LM head never reads: only the norm's
    # centring (its mean over the width) reaches the logit, a small negative share
    assert -1.0 < dla.heads[0, 0] < 0.0
    assert dla.total == pytest.approx(dla.logit, abs=1e-5)


@pytest.mark.parametrize("over", [{"bias": True}, {"norm": "rmsnorm"},
                                  {"mlp": False, "pos_encoding": "learned"},
                                  {"pos_encoding": "sinusoidal", "logit_softcap": 10.0},
                                  {"qk_norm": True, "tie_weights": False}])
def test_the_components_add_up_to_the_logit(over):
    """Heads + embeddings + attention biases + MLPs + the final norm's bias = the model's own
    logit (before the soft-cap), for the next token, a fixed target and a logit difference."""
    model = random_model(**over)
    ids = random_ids()
    for metric in (make_metric(len(ids)), make_metric(len(ids), [3, 9], target=7),
                   make_metric(len(ids), answer=3, wrong=5)):
        dla = c.direct_logit_attribution(model, ids, metric)
        assert dla.total == pytest.approx(dla.logit, abs=1e-5)
        assert dla.heads.shape == (3, 4) and dla.heads.abs().sum() > 0
        names = list(dla.rows)
        assert names[0] == "token embedding" and names[-1] == "final norm bias"
        assert ("layer 2 MLP" in names) == model.cfg.mlp
        assert ("position embedding" in names) == (model.cfg.pos_encoding in ("learned",
                                                                              "sinusoidal"))
    with torch.no_grad():
        logits, _ = model(torch.tensor([ids]))
    want = logits[0, -1, 3] - logits[0, -1, 5]
    if not model.cfg.logit_softcap:
        assert dla.logit == pytest.approx(float(want), abs=1e-5)


@torch.no_grad()
def test_one_head_share_is_its_output_read_by_the_unembedding():
    """The share of head h is (its output through W_O, centred, / the final scale) . (gamma u)
    averaged over positions: recomputed here from a head_hook capture."""
    model = random_model(bias=True)
    ids = random_ids()
    pos = [5, 11, 20]
    dla = c.direct_logit_attribution(model, ids, make_metric(len(ids), pos))
    zs = []
    model(torch.tensor([ids]), attn=ForwardSpec(head_hook=lambda la, z: zs.append(z) or z))
    la, h, D = 1, 2, model.cfg.head_dim
    w_o = model.blocks[la].attn.c_proj.weight[:, h * D:(h + 1) * D]  # (C, D)
    out = zs[la][0, h] @ w_o.T  # (T, C)
    final = []  # the final residual: the last block's output, read with a forward hook
    handle = model.blocks[-1].register_forward_hook(lambda m, i, o: final.append(o[0]))
    model(torch.tensor([ids]))
    handle.remove()
    x = final[0][0, pos]
    scale = (x.var(-1, unbiased=False) + model.cfg.norm_eps).sqrt()
    u = model.lm_head.weight[[ids[p + 1] for p in pos]] * model.ln_f.weight
    o = out[pos] - out[pos].mean(-1, keepdim=True)
    want = ((o * u).sum(-1) / scale).mean()
    assert float(dla.heads[la, h]) == pytest.approx(float(want), abs=1e-5)


# --------------------------------------------------------------------------------------------
# Composition.


def test_k_composition_certifies_the_induction_circuit_from_the_weights():
    comp = c.composition_scores(induction_circuit_model())
    assert comp.strongest("k")[:4] == (0, 0, 1, 0)  # previous-token head -> induction keys
    k = comp.scores["k"][0, 0, 1, 0]
    assert k > 2 * comp.baseline["k"]
    assert comp.scores["q"][0, 0, 1, 0] < 0.1 * k  # the query reads the token, not L0.H0
    assert comp.scores["v"][0, 0, 1, 0] < 0.1 * k
    assert comp.scores["k"][0, 1, 1, 0] == 0.0  # a head that writes nothing composes with none
    assert comp.scores["k"][1, 0, 0, 0] == 0.0  # only earlier -> later layers
    recs = comp.records()
    assert len(recs) == 3 * 2 * 2 and {r["kind"] for r in recs} == {"q", "k", "v"}
    best = max((r for r in recs if r["kind"] == "k"), key=lambda r: r["score"])
    assert (best["from_layer"], best["from_index"], best["to_layer"], best["to_index"]) == (0, 0,
                                                                                        1, 0)


@pytest.mark.parametrize("over", [{"bias": True}, {"norm": "rmsnorm"}])
@torch.no_grad()
def test_factored_scores_equal_the_dense_matrices(over):
    """||OV M||_F / (||OV||_F ||M||_F) on the full C x C matrices, LayerNorm folded in by hand."""
    model = random_model(**over)
    comp = c.composition_scores(model)
    D, Cw = 8, 32
    P = torch.eye(Cw, dtype=torch.float64)
    if over.get("norm") != "rmsnorm":
        P -= 1.0 / Cw

    def mats(la, h):
        b = model.blocks[la]
        g = torch.diag(b.ln_1.weight.double())
        w = b.attn.c_attn.weight.double()
        q, k, v = (P @ g @ w[i * Cw + h * D:i * Cw + (h + 1) * D].T for i in range(3))
        o = b.attn.c_proj.weight.double()[:, h * D:(h + 1) * D].T @ P
        return q, k, v, o

    def score(a, m):
        return float((a @ m).norm() / a.norm() / m.norm())

    for (l1, h1), (l2, h2) in [((0, 1), (2, 3)), ((1, 0), (2, 0)), ((0, 3), (1, 2))]:
        _, _, v1, o1 = mats(l1, h1)
        q2, k2, v2, o2 = mats(l2, h2)
        ov = v1 @ o1
        for kind, m in (("q", q2 @ k2.T), ("k", k2 @ q2.T), ("v", v2 @ o2)):
            assert float(comp.scores[kind][l1, h1, l2, h2]) == pytest.approx(score(ov, m),
                                                                            rel=1e-5)
    assert c.k_composition(model, (0, 1), (2, 3)) == pytest.approx(
        float(comp.scores["k"][0, 1, 2, 3]), rel=1e-6)
    for kind in "qkv":  # random weights of these shapes score about this much
        assert 0.05 < comp.baseline[kind] < 0.6


def test_one_layer_has_no_composition():
    with pytest.raises(MinigptError, match="1 layer: composition needs heads in two layers"):
        c.composition_scores(random_model(n_layer=1))


# --------------------------------------------------------------------------------------------
# Activation patching.


def test_patching_the_induction_head_moves_the_whole_metric():
    model = induction_circuit_model()
    bad = corrupt_second_copy(PROBE, 0, range(V))
    assert bad[:8] == PROBE[:8] and not set(bad[8:]) & set(PROBE)
    metric = make_metric(len(PROBE), SECOND)
    noising = c.patch_heads(model, PROBE, bad, metric)
    assert noising.clean < 0.3 and noising.corrupted > 3.0  # copying works, then cannot
    assert noising.effect[1, 0] == pytest.approx(1.0, abs=1e-3)
    assert noising.effect[0, 1] == 0.0 and noising.effect[1, 1] == 0.0  # they write nothing
    # The keys the induction head reads lie in the FIRST copy, which the corruption left
    # alone: the previous-token head's corrupted output there is its clean one, so patching
    # it changes (almost) nothing in this direction.
    assert abs(noising.effect[0, 0]) < 1e-3
    denoising = c.patch_heads(model, PROBE, bad, metric, direction="denoising")
    assert (denoising.clean, denoising.corrupted) == pytest.approx(
        (noising.clean, noising.corrupted))
    assert denoising.effect[0, 1] == 0.0 and denoising.effect[1, 0] > 0.5


def test_corrupting_the_first_copy_shows_the_previous_token_head():
    """With the FIRST copy corrupted, the keys the induction head reads carry the previous
    tokens of other ids: the previous-token head's output there differs, so patching it alone
    breaks the copying (the second-copy corruption above leaves it at 0)."""
    model = induction_circuit_model()
    bad = corrupt_copy(PROBE, 0, range(V), copy=1)
    assert bad[8:] == PROBE[8:] and not set(bad[:8]) & set(PROBE)
    p = c.patch_heads(model, PROBE, bad, make_metric(len(PROBE), SECOND))
    assert p.clean < 0.3 and p.corrupted > 3.0
    assert p.effect[0, 0] > 0.5 and p.effect[1, 0] > 0.5  # both heads carry the difference
    assert p.effect[0, 1] == 0.0 and p.effect[1, 1] == 0.0
    assert corrupt_copy(PROBE, 0, range(V), copy=2) == corrupt_second_copy(PROBE, 0, range(V))


def test_logit_difference_metric():
    """At the last position (token 4, seen before followed by 3) the model says 3, not 1."""
    model = induction_circuit_model()
    metric = make_metric(len(PROBE), answer=3, wrong=1)
    dla = c.direct_logit_attribution(model, PROBE, metric)
    assert dla.logit > 5 and dla.heads[1, 0] > 0.9 * dla.logit
    bad = corrupt_second_copy(PROBE, 0, range(V))
    p = c.patch_heads(model, PROBE, bad, metric)
    assert p.metric == "logit_diff" and p.clean > 5 > p.corrupted
    assert p.effect[1, 0] == pytest.approx(1.0, abs=1e-3)


def test_batched_patching_equals_patching_one_head_at_a_time(monkeypatch):
    model = random_model(bias=True)
    clean, corrupted = random_ids(seed=1), random_ids(seed=2)
    metric = make_metric(len(clean))
    p = c.patch_heads(model, clean, corrupted, metric)
    src = []
    model(torch.tensor([corrupted]), attn=ForwardSpec(head_hook=lambda la, z: src.append(z) or z))
    y = torch.tensor(clean[1:])

    def loss(spec=None) -> float:
        logits = model(torch.tensor([clean]), attn=spec)[0][0, :-1]
        return torch.nn.functional.cross_entropy(logits, y).item()

    with torch.no_grad():
        base = loss()
        for la, h in [(0, 0), (1, 3), (2, 1)]:
            def hook(i, z, la=la, h=h):
                if i == la:
                    z = z.clone()
                    z[:, h] = src[la][:, h]
                return z
            assert float(p.delta[la, h]) == pytest.approx(loss(ForwardSpec(head_hook=hook)) - base,
                                                          abs=1e-5)
    assert p.clean == pytest.approx(base, abs=1e-5)
    assert torch.allclose(p.effect, p.delta / (p.corrupted - p.clean))
    monkeypatch.setattr(patching, "CHUNK_FLOATS", 1)  # one head per pass: the same numbers
    assert torch.allclose(c.patch_heads(model, clean, corrupted, metric).delta, p.delta,
                          atol=1e-6)


def test_bad_patching_input():
    model = random_model()
    ids = random_ids()
    metric = make_metric(len(ids))
    with pytest.raises(ArgumentError, match="has 20 tokens but the input has 24"):
        c.patch_heads(model, ids, ids[:20], metric)
    with pytest.raises(ArgumentError, match="leaves the metric where it was"):
        c.patch_heads(model, ids, ids, metric)
    with pytest.raises(ArgumentError, match="both"):
        make_metric(len(ids), answer=3)
    with pytest.raises(ArgumentError, match="same token"):
        make_metric(len(ids), answer=3, wrong=3)
    with pytest.raises(ArgumentError, match="'sideways' is not a direction"):
        c.patch_heads(model, ids, random_ids(seed=5), metric, direction="sideways")
    assert model.training is False
