"""attention(): the lecture's worked examples, the two paths' agreement, RoPE and scaling.

Numbers come from the course's documents, named by title: "CS498: Algorithmic Engineering,
Lecture 25: Multi-Head Attention & Positional Encoding" (cat/sat/mat), "Transformer Series (6/9)
— Multi-Head Attention & Causal Masking" (causal masking), and "Notebook 2: Multi-Head
Attention & Positional Encoding" (heads, sinusoidal, RoPE).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minigpt.core.gpt import (
    Rotary,
    apply_rope,
    attention,
    causal_mask,
    rope_full_tables,
    rope_tables,
    sinusoidal_table,
)


def as_heads(rows) -> torch.Tensor:
    """(T, D) table -> (1, 1, T, D) float64, one batch and one head."""
    return torch.tensor(rows, dtype=torch.float64)[None, None]


# Lecture 25: Q, K, V for cat, sat, mat (d_k = 2), unscaled softmax(QK^T) V.
Q = as_heads([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
K = as_heads([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
V = as_heads([[2.0, 0.0], [0.0, 2.0], [1.5, 0.5]])


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_lecture_cat_sat_mat_full_attention(impl):
    scores = (Q @ K.transpose(-2, -1))[0, 0]
    assert scores.tolist() == [[1.0, 0.0, 0.5], [0.0, 1.0, 0.5], [1.0, 0.0, 0.5]]
    out, probs = attention(Q, K, V, scale=1.0, causal=False, impl="explicit", return_probs=True)
    printed = [[0.51, 0.19, 0.31], [0.19, 0.51, 0.31], [0.51, 0.19, 0.31]]
    assert torch.allclose(probs[0, 0], torch.tensor(printed, dtype=torch.float64), atol=0.005)
    if impl == "sdpa":
        out, _ = attention(Q, K, V, scale=1.0, causal=False, impl="sdpa")
    # Exact outputs. The lecture prints (1.48, 0.53) and (0.84, 1.17) because it multiplied the
    # ROUNDED weights; the exact values are (1.4738, 0.5262) and (0.8334, 1.1666).
    exact = torch.tensor([[1.4738, 0.5262], [0.8334, 1.1666]], dtype=torch.float64)
    assert torch.allclose(out[0, 0, :2], exact, atol=5e-5)
    printed_out = torch.tensor([[1.48, 0.53], [0.84, 1.17]], dtype=torch.float64)
    assert (out[0, 0, :2] - printed_out).abs().max() <= 0.01
    # mat's query equals cat's, so its row and output equal cat's.
    assert torch.allclose(out[0, 0, 2], out[0, 0, 0])


@pytest.mark.parametrize("impl", ["explicit", "sdpa"])
def test_lecture_cat_sat_mat_causal(impl):
    out, probs = attention(Q, K, V, scale=1.0, causal=True, impl="explicit", return_probs=True)
    printed = torch.tensor([[1.00, 0.00, 0.00], [0.27, 0.73, 0.00], [0.51, 0.19, 0.31]],
                           dtype=torch.float64)
    assert torch.allclose(probs[0, 0], printed, atol=0.005)
    assert (probs[0, 0].triu(1) == 0).all()  # exactly zero above the diagonal
    out_sdpa, _ = attention(Q, K, V, scale=1.0, causal=True, impl=impl)
    assert torch.allclose(out_sdpa, out, atol=1e-12)
    assert torch.allclose(out[0, 0, 0], V[0, 0, 0])  # cat sees only itself
    # sat: 0.2689 * v_cat + 0.7311 * v_sat
    assert torch.allclose(out[0, 0, 1], torch.tensor([0.5379, 1.4621], dtype=torch.float64),
                          atol=1e-4)


def test_qa_seed_002_causal_rows_from_raw_scores():
    """Transformer Series (6/9)'s raw score table for "The cat sat on", masked and softmaxed by
    our attention.

    Its printed rows for "The" (1, 0, 0, 0) and "cat" (0.35, 0.65) are right. Its printed rows
    for "sat" (0.14, 0.26, 0.60) and "on" (0.08, 0.11, 0.22, 0.59) are WRONG: they are not the
    softmax of its own scores. The true rows are asserted below.
    """
    scores = torch.tensor([[2.0, 1.5, 0.8, 0.3],
                           [1.2, 1.8, 0.9, 0.4],
                           [0.5, 1.1, 2.1, 0.7],
                           [0.3, 0.6, 1.3, 1.9]], dtype=torch.float64)
    # Realise the score table as q k^T with q = scores (4 x 4) and k = identity, unscaled.
    q, k = scores[None, None], torch.eye(4, dtype=torch.float64)[None, None]
    _, probs = attention(q, k, k, scale=1.0, impl="explicit", return_probs=True)
    p = probs[0, 0]
    assert torch.allclose(p[0], torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    assert torch.allclose(p[1, :2], torch.tensor([0.35, 0.65], dtype=torch.float64), atol=0.005)
    assert torch.allclose(p[2, :3], torch.tensor([0.1286, 0.2344, 0.6370], dtype=torch.float64),
                          atol=1e-4)
    assert torch.allclose(p[3], torch.tensor([0.0998, 0.1347, 0.2713, 0.4943],
                                             dtype=torch.float64), atol=1e-4)
    # The printed "sat"/"on" rows are off by more than rounding.
    assert (p[2, :3] - torch.tensor([0.14, 0.26, 0.60], dtype=torch.float64)).abs().max() > 0.03
    assert (p[3] - torch.tensor([0.08, 0.11, 0.22, 0.59], dtype=torch.float64)).abs().max() > 0.05
    assert torch.allclose(p.sum(-1), torch.ones(4, dtype=torch.float64))


def test_causal_mask_bottom_right_aligned():
    # The blog's tril(ones(S, S_full), diagonal=past_length): 2 new queries after 3 cached keys.
    assert causal_mask(2, 5, 3).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert causal_mask(3, 3, 0).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


CASES = [  # (Tq, Tk, past_length): training, prefill+chunk, one-token decode, no mask
    (7, 7, 0), (3, 8, 5), (1, 9, 8), (4, 4, 0)]


@pytest.mark.parametrize("tq,tk,past", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_and_explicit_agree_on_outputs_and_gradients(tq, tk, past, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, tq, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 3, tk, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 3, tk, 8, generator=g, requires_grad=True)
    w = torch.randn(2, 3, tq, 8, generator=g)  # a random cotangent
    results = []
    for impl in ("sdpa", "explicit"):
        out, _ = attention(q, k, v, causal=causal, past_length=past, impl=impl)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        results.append((out, grads))
    (o1, g1), (o2, g2) = results
    assert torch.allclose(o1, o2, atol=1e-5)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-5)


def test_explicit_probs_are_causal_rows_and_match_manual_formula():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out, probs = attention(q, k, v, impl="explicit", return_probs=True)
    scores = q @ k.transpose(-2, -1) / 2.0  # sqrt(d_k) = 2
    scores = scores.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf"))
    assert torch.allclose(probs, scores.softmax(-1))
    assert torch.allclose(out, scores.softmax(-1) @ v)
    with pytest.raises(ValueError):
        attention(q, k, v, impl="sdpa", return_probs=True)


def test_scaling_variance_dk_before_and_one_after():
    # The lecture's reason for 1/sqrt(d_k): q.k of N(0,1) vectors has variance d_k.
    g = torch.Generator().manual_seed(0)
    for d_k in (16, 64, 512):
        q = torch.randn(20000, d_k, generator=g, dtype=torch.float64)
        k = torch.randn(20000, d_k, generator=g, dtype=torch.float64)
        dots = (q * k).sum(-1)
        assert abs(dots.var().item() / d_k - 1) < 0.05
        assert abs((dots / math.sqrt(d_k)).var().item() - 1) < 0.05


def test_rope_score_depends_only_on_offset():
    head_dim = 64
    cos, sin = rope_tables(4097, head_dim, 10000.0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(head_dim, generator=g)
    k = torch.randn(head_dim, generator=g)

    def score(m: int, n: int) -> torch.Tensor:
        qm = apply_rope(q.view(1, 1, 1, -1), cos[m, None, None], sin[m, None, None])
        kn = apply_rope(k.view(1, 1, 1, -1), cos[n, None, None], sin[n, None, None])
        return (qm * kn).sum()

    pos = torch.randint(0, 2048, (200, 2), generator=g)
    shift = torch.randint(0, 2048, (200,), generator=g)
    err = max((score(m, n) - score(m + s, n + s)).abs().item()
              for (m, n), s in zip(pos.tolist(), shift.tolist()))
    assert err < 1e-4
    # ...and it does depend on the offset (the check above can fail).
    assert (score(10, 3) - score(10, 4)).abs() > 1e-3
    # Rotation preserves norms; position 0 is the identity.
    assert torch.allclose(apply_rope(q.view(1, 1, 1, -1), cos[:1, None], sin[:1, None]).flatten(),
                          q)


def test_rope_rotates_interleaved_pairs_like_the_lecture():
    # Pair (2i, 2i+1) rotated by m * theta_i, theta_i = base^(-2i/d): d = 4, m = 3.
    cos, sin = rope_tables(4, 4, 10000.0)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = apply_rope(x.view(1, 1, 1, 4), cos[3, None, None], sin[3, None, None]).flatten()
    for i, theta in enumerate([1.0, 10000.0 ** (-2 / 4)]):
        a, b = x[2 * i].item(), x[2 * i + 1].item()
        c, s = math.cos(3 * theta), math.sin(3 * theta)
        assert out[2 * i].item() == pytest.approx(a * c - b * s, abs=1e-6)
        assert out[2 * i + 1].item() == pytest.approx(a * s + b * c, abs=1e-6)


def test_sinusoidal_table_matches_notebook_formula():
    pe = sinusoidal_table(50, 4)
    for pos in (0, 1, 3, 49):
        for i in range(2):
            w = pos / 10000 ** (2 * i / 4)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(w), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(w), abs=1e-6)
    # d0/d1 oscillate at frequency 1, d2/d3 at 1/100 (Notebook 2)
    assert pe[1, 0].item() == pytest.approx(math.sin(1.0), abs=1e-6)
    assert pe[1, 2].item() == pytest.approx(math.sin(0.01), abs=1e-6)


def complex_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: RoPE as minigpt computed it before issue 49, pair (x_2i, x_2i+1) as the
    complex number x_2i + i x_2i+1 times cos + i sin (half-width tables), in float32 or
    float64, cast back."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    rot = torch.complex(cos.to(xf.dtype), sin.to(xf.dtype))
    pairs = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)


def test_real_rope_equals_the_complex_rotation_with_gradients():
    cos, sin = rope_tables(6, 8, 10000.0)
    cos, sin = cos[:, None].double(), sin[:, None].double()  # (T, 1, D/2)
    base = torch.randn(2, 6, 3, 3, 8, dtype=torch.float64)  # (B, T, 3, H, D) like fused qkv
    x = base[:, :, :2].requires_grad_()  # non-contiguous q|k slice, as in the model
    y = x.detach().clone().requires_grad_()
    cos4, sin4 = cos[:, None], sin[:, None]  # (T, 1, 1, D/2) against (B, T, 2, H, D)
    full = rope_full_tables(cos4, sin4)  # (T, 1, 1, D): what Rotary keeps
    a, b = apply_rope(x, *full), complex_rope(y, cos4, sin4)
    assert torch.allclose(a, b, atol=1e-12)
    assert torch.allclose(apply_rope(x, cos4, sin4), b, atol=1e-12)  # half-width tables too
    w = torch.randn_like(a)
    (a * w).sum().backward()
    (b * w).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin),
                                    torch.randn(2, 6, 3, 8, dtype=torch.float64,
                                                requires_grad=True))
    half = apply_rope(x.detach().bfloat16(), *full)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.double(), a, atol=0.05)  # rotated in float32, rounded once
    assert torch.allclose(half.double(), complex_rope(x.detach().bfloat16(), cos4, sin4).double(),
                          atol=1e-2)
    # float32 at the model's scale: the tables Rotary keeps against the old complex product
    rotary = Rotary(32, 64, 10000.0)
    q = torch.randn(2, 3, 4, 64, 32)
    c, s = rope_tables(64, 32, 10000.0)
    assert torch.allclose(apply_rope(q, *rotary.tables(0, 64)), complex_rope(q, c, s), atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), t_q=st.integers(1, 9), past=st.integers(0, 9),
       d=st.sampled_from([2, 4, 8, 16]), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_paths_agree_on_random_shapes(b, h, t_q, past, d, causal, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t_q, d, generator=g)
    k, v = (torch.randn(b, h, past + t_q, d, generator=g) for _ in range(2))
    out1, _ = attention(q, k, v, causal=causal, past_length=past, impl="sdpa")
    out2, probs = attention(q, k, v, causal=causal, past_length=past, impl="explicit",
                            return_probs=True)
    assert torch.allclose(out1, out2, atol=1e-5)
    assert torch.allclose(probs.sum(-1), torch.ones(b, h, t_q), atol=1e-6)
    if causal:  # query i (absolute position past + i) never sees a later key
        assert (probs.masked_select(~causal_mask(t_q, past + t_q, past)) == 0).all()


def test_a_rope_model_is_the_model_with_the_complex_rotation(monkeypatch):
    """A RoPE model's logits and gradients, QK-norm on, are the same when every layer rotates
    q and k with the old complex product instead (the reference above), training and decoding
    with the KV cache."""
    from minigpt.config import ModelConfig
    from minigpt.core import gpt

    model = gpt.GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50,
                                qk_norm=True))
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))

    def run():
        model.zero_grad()
        logits, loss = model(idx, idx)
        loss.backward()
        with torch.no_grad():
            cache = model.new_kv_cache(2)
            model(idx[:, :9], kv_cache=cache)
            step, _ = model(idx[:, 9:10], kv_cache=cache)
        return logits.detach(), step, [p.grad.clone() for p in model.parameters()]

    real, real_step, g_real = run()
    monkeypatch.setattr(gpt, "apply_rope", lambda x, cos, sin: complex_rope(
        x, cos[..., ::2], sin[..., 1::2]))  # the full tables back to (T, D/2)
    ref, ref_step, g_ref = run()
    assert torch.allclose(real, ref, atol=1e-5) and torch.allclose(real_step, ref_step, atol=1e-5)
    assert torch.allclose(real_step[:, -1], real[:, 9], atol=1e-5)  # the cache: as a full pass
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_real, g_ref, strict=True))
