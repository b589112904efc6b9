"""GPT: both attention paths, KV cache vs recompute, positions, causality, counts and FLOPs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from minigpt.config import Config, ModelConfig, load_config
from minigpt.core.gpt import GPT, ForwardSpec, KVCache, flops_per_token

ENCODINGS = ["rope", "learned", "sinusoidal", "none"]


def tiny(**kw) -> ModelConfig:
    base = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32, "vocab_size": 50}
    return ModelConfig(**{**base, **kw})


def build(seed: int = 0, **kw) -> GPT:
    return GPT.from_config(tiny(**kw), seed=seed)


def tokens(b: int, t: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---- the two paths -------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ENCODINGS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_sdpa_and_explicit_models_agree_on_logits_and_gradients(pos, norm):
    idx, tgt = tokens(3, 20), tokens(3, 20, seed=1)
    results = []
    for impl in ("sdpa", "explicit"):
        model = build(pos_encoding=pos, norm=norm, attn_impl=impl, bias=True)
        logits, loss = model(idx, tgt)
        loss.backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = results
    assert torch.allclose(l1, l2, atol=1e-5)
    assert g1.keys() == g2.keys()
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-5), name
    assert any(g.abs().max() > 1e-4 for g in g1.values())  # gradients are not trivially zero


@pytest.mark.parametrize("pos", ENCODINGS)
def test_sdpa_and_explicit_agree_with_kv_cache(pos):
    idx = tokens(2, 24)
    outs = []
    for impl in ("sdpa", "explicit"):
        model = build(pos_encoding=pos, attn_impl=impl).eval()
        cache = model.new_kv_cache(2)
        with torch.no_grad():  # prefill 10, a chunk of 5, then single tokens
            parts = [model(idx[:, :10], kv_cache=cache)[0], model(idx[:, 10:15], kv_cache=cache)[0]]
            parts += [model(idx[:, t:t + 1], kv_cache=cache)[0] for t in range(15, 24)]
        outs.append(torch.cat(parts, dim=1))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("pos", ENCODINGS)
def test_sdpa_and_explicit_agree_on_gradients_of_a_cached_decode_step(pos):
    """Prefill without grad, then a 3-token chunk with grad: the chunk's queries sit at
    positions 10..12 (offset RoPE/tables, bottom-right mask) on both paths."""
    idx = tokens(2, 13)
    grads = []
    for impl in ("sdpa", "explicit"):
        model = build(pos_encoding=pos, attn_impl=impl)
        cache = model.new_kv_cache(2)
        with torch.no_grad():
            model(idx[:, :10], kv_cache=cache)
        logits, _ = model(idx[:, 10:], kv_cache=cache)
        (logits * torch.linspace(-1, 1, 50)).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-5), name
    assert grads[0]["blocks.0.attn.c_attn.weight"].abs().max() > 1e-4


def test_training_path_uses_fused_sdpa_and_never_builds_the_score_matrix():
    from torch.profiler import ProfilerActivity, profile

    model = build(n_layer=1)
    idx = tokens(2, 16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        _, loss = model(idx, idx)
        loss.backward()
    names = {e.key for e in prof.key_averages()}
    assert any("scaled_dot_product" in n for n in names)
    assert not names & {"aten::softmax", "aten::_softmax", "aten::bmm", "aten::masked_fill"}
    shapes = [s for e in prof.key_averages(group_by_input_shape=True) for s in e.input_shapes]
    assert [2, 4, 16, 16] not in shapes  # no (B, H, T, T) tensor anywhere


def test_forward_with_attention_matches_forward_and_probs_are_causal_rows():
    model = build().eval()
    idx = tokens(2, 12)
    logits, probs = model.forward_with_attention(idx)
    assert torch.allclose(logits, model(idx)[0], atol=1e-5)
    assert len(probs) == 2
    for p in probs:
        assert p.shape == (2, 4, 12, 12)
        assert torch.allclose(p.sum(-1), torch.ones(2, 4, 12))
        assert (p.triu(1) == 0).all()
    _, flat = model.forward_with_attention(idx, scale=0.0)  # scale 0 -> uniform over the past
    row = flat[0][0, 0, 3]
    assert torch.allclose(row[:4], torch.full((4,), 0.25)) and (row[4:] == 0).all()


# ---- KV cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", ENCODINGS)
def test_kv_cache_logits_equal_full_recompute_at_every_step_of_200(pos):
    """Prefill 1 token, then 200 one-token decode steps; at EVERY step the cached logits (not
    greedy tokens) equal the full forward's logits at that position (by causality, the same as
    recomputing the prefix; a literal prefix recompute is checked too at some steps).
    rope/sinusoidal/none run past block_size=64 (tables grow); learned needs block_size >= 201."""
    block = 256 if pos == "learned" else 64
    model = build(pos_encoding=pos, block_size=block, n_layer=2, n_embd=16, n_head=2).eval()
    seq = tokens(1, 201, seed=3)
    cache = model.new_kv_cache(1, max_len=201)
    with torch.no_grad():
        full, _ = model(seq)  # (1, 201, V)
        steps = [model(seq[:, :1], kv_cache=cache)[0][0, -1]]
        steps += [model(seq[:, t:t + 1], kv_cache=cache)[0][0, -1] for t in range(1, 201)]
        cached = torch.stack(steps)  # (201, V)
        for t in (1, 2, 63, 64, 65, 130, 200):  # literal recompute of the prefix
            assert torch.allclose(model(seq[:, :t + 1])[0][0, -1], cached[t], atol=1e-5)
    assert cache.length == 201
    assert (cached - full[0]).abs().max().item() < 1e-5


def test_kv_cache_full_raises_and_reset_reprefill_matches_cropped_forward():
    model = build(block_size=16).eval()
    seq = tokens(1, 30)
    cache = model.new_kv_cache(1)
    assert cache.max_len == 16
    with torch.no_grad():
        model(seq[:, :16], kv_cache=cache)
        with pytest.raises(ValueError, match="do not fit the KV cache"):
            model(seq[:, 16:17], kv_cache=cache)
        assert cache.length == 16  # nothing was written
        # The documented way on: crop, reset, prefill again (positions restart at 0).
        cache.reset()
        window = seq[:, 17 - 15:17]
        got, _ = model(window, kv_cache=cache)
        assert torch.allclose(got, model(window)[0], atol=1e-5)


def test_kv_cache_object_shapes_and_batch_check():
    model = build()
    cache = model.new_kv_cache(3, max_len=10)
    assert isinstance(cache, KVCache)
    assert len(cache.k) == 2 and cache.k[0].shape == (3, 4, 10, 8) and cache.length == 0
    with torch.no_grad(), pytest.raises(ValueError):
        model(tokens(2, 4), kv_cache=cache)


# ---- the head hook: the one place to read or change a single head ------------------------------


def zero_head(layer: int, head: int):
    def hook(i, z):  # z: (B, H, T, D)
        if i != layer:
            return z
        z = z.clone()
        z[:, head] = 0.0
        return z
    return hook


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_head_hook_sees_every_layer_and_an_identity_hook_changes_nothing(impl):
    model = build(attn_impl=impl, bias=True).eval()
    idx = tokens(2, 11)
    seen = []
    hook = lambda i, z: seen.append((i, tuple(z.shape))) or z
    with torch.no_grad():
        plain, _ = model(idx)
        hooked, _ = model(idx, attn=ForwardSpec(impl, head_hook=hook))
    assert seen == [(0, (2, 4, 11, 8)), (1, (2, 4, 11, 8))]  # [batch, head, query, d_head]
    assert torch.equal(plain, hooked)


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_zeroing_a_head_equals_zeroing_its_columns_of_w_o(impl):
    """Head h's output reaches the residual stream only through columns h*D..(h+1)*D of the
    layer's W_O, so zeroing it in the hook is the same model as zeroing those columns."""
    model = build(attn_impl=impl, bias=True).eval()
    idx = tokens(2, 13)
    edited = build(attn_impl=impl, bias=True).eval()
    with torch.no_grad():
        edited.blocks[1].attn.c_proj.weight[:, 2 * 8:3 * 8] = 0.0  # layer 1, head 2, D = 8
        want, _ = edited(idx)
        got, _ = model(idx, attn=ForwardSpec(impl, head_hook=zero_head(1, 2)))
        unchanged, _ = model(idx)
    assert torch.allclose(got, want, atol=1e-6)
    assert (got - unchanged).abs().max() > 1e-4  # the head mattered


def test_head_hook_applies_through_the_kv_cache():
    model = build().eval()
    seq = tokens(1, 20)
    spec = ForwardSpec(head_hook=zero_head(0, 1))
    with torch.no_grad():
        full, _ = model(seq, attn=spec)
        cache = model.new_kv_cache(1)
        steps = [model(seq[:, :4], kv_cache=cache, attn=spec)[0][0]]
        steps += [model(seq[:, t:t + 1], kv_cache=cache, attn=spec)[0][0] for t in range(4, 20)]
    assert torch.allclose(torch.cat(steps), full[0], atol=1e-5)


# ---- positions -----------------------------------------------------------------------------


def test_learned_positions_beyond_block_size_is_a_clear_error():
    """Callers crop (core/generate.py, inspect-heads), so this is a broken invariant: ValueError."""
    model = build(pos_encoding="learned", block_size=8)
    with pytest.raises(ValueError, match="block_size=8"):
        model(tokens(1, 9))
    cache = model.new_kv_cache(1, max_len=20)
    with torch.no_grad():
        model(tokens(1, 8), kv_cache=cache)
        with pytest.raises(ValueError, match="learned"):
            model(tokens(1, 1), kv_cache=cache)
    model(tokens(1, 8))  # exactly block_size is fine


@pytest.mark.parametrize("pos", ["rope", "sinusoidal", "none"])
def test_other_encodings_run_past_block_size(pos):
    model = build(pos_encoding=pos, block_size=8).eval()
    idx = tokens(1, 20)
    logits, _ = model(idx)
    assert logits.shape == (1, 20, 50) and torch.isfinite(logits).all()
    # growing the tables does not change positions inside block_size
    assert torch.allclose(model(idx[:, :8])[0], logits[:, :8], atol=1e-5)


def test_position_tables_are_not_saved():
    for pos in ENCODINGS:
        keys = set(build(pos_encoding=pos).state_dict())
        assert not any(k.endswith(("cos", "sin", ".pe")) or k == "pe" for k in keys), keys
    assert "wpe.weight" in build(pos_encoding="learned").state_dict()


@pytest.mark.parametrize("pos", ENCODINGS)
def test_permutation_equivariance_only_without_positions(pos):
    """No causal mask: with `none`, permuting tokens permutes logits and attention rows/columns
    the same way; any position encoding breaks that."""
    model = build(pos_encoding=pos).eval()
    idx = tokens(1, 10)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    logits, probs = model.forward_with_attention(idx, causal=False)
    plogits, pprobs = model.forward_with_attention(idx[:, perm], causal=False)
    same = torch.allclose(plogits, logits[:, perm], atol=1e-5)
    same_attn = torch.allclose(pprobs[0], probs[0][:, :, perm][:, :, :, perm], atol=1e-6)
    if pos == "none":
        assert same and same_attn
    else:
        assert not same and not same_attn


@pytest.mark.parametrize("pos", ENCODINGS)
def test_causality_changing_token_t_never_changes_earlier_logits(pos):
    model = build(pos_encoding=pos).eval()
    idx = tokens(2, 16)
    base, _ = model(idx)
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 50
        out, _ = model(changed)
        assert torch.equal(out[:, :t], base[:, :t]) or torch.allclose(out[:, :t], base[:, :t],
                                                                      atol=1e-6)
        assert (out[:, t] - base[:, t]).abs().max() > 1e-4


# ---- multi-head mechanics (notebook 004) ---------------------------------------------------


def test_head_i_uses_columns_i_dk_to_i_plus_1_dk():
    """d_model = 4, h = 2, W_Q = W_K = W_V = I: head i attends with columns [2i, 2i+2) of X."""
    model = GPT.from_config(ModelConfig(n_layer=1, n_head=2, n_embd=4, vocab_size=4,
                                        block_size=4, pos_encoding="none", mlp=False), seed=0)
    attn = model.blocks[0].attn
    x = torch.tensor([[1.0, 0.2, 0.0, 0.5], [0.9, 0.4, 0.1, 0.0],
                      [0.0, 0.3, 1.0, 0.8], [0.2, 0.0, 0.7, 1.0]])[None]  # (1, T=4, 4)
    with torch.no_grad():
        attn.c_attn.weight.copy_(torch.cat([torch.eye(4)] * 3))  # Q = K = V = X
        attn.c_proj.weight.copy_(torch.eye(4))  # W_O = I: the output is the concatenation
        out, probs = attn(x, rope=None, cache=None, layer=0,
                          spec=ForwardSpec("explicit", return_probs=True, causal=False))
    assert probs.shape == (1, 2, 4, 4)
    for i in range(2):
        cols = x[0, :, 2 * i:2 * i + 2]  # (T, d_k)
        expected = (cols @ cols.T / math.sqrt(2)).softmax(-1)
        assert torch.allclose(probs[0, i], expected, atol=1e-6)
        assert torch.allclose(out[0, :, 2 * i:2 * i + 2], expected @ cols, atol=1e-6)
    assert not torch.allclose(probs[0, 0], probs[0, 1])  # two heads, two views


def test_multi_head_has_the_parameter_count_of_one_head_with_dk_d():
    for n_head in (2, 4, 8):
        assert build(n_head=n_head).num_params() == build(n_head=1).num_params()


# ---- parameters, init, options -------------------------------------------------------------


def test_num_params_counts_tied_head_once_and_adds_up():
    m = build(pos_encoding="learned", bias=True)
    n = m.num_params()
    assert n["total"] == sum(p.numel() for p in m.parameters())
    assert n["lm_head"] == 0 and m.lm_head.weight is m.wte.weight
    parts = ("embedding", "position", "lm_head", "attention", "mlp", "norm")
    assert sum(n[k] for k in parts) == n["total"]
    assert n["embedding"] == 50 * 32 and n["position"] == 32 * 32
    # per layer: 3C^2 + C^2 (+ 4C biases) attention, 8C^2 (+ 5C) MLP, 2 LayerNorms of 2C
    assert n["attention"] == 2 * (4 * 32 * 32 + 4 * 32)
    assert n["mlp"] == 2 * (8 * 32 * 32 + 5 * 32)
    assert n["norm"] == 2 * 2 * 2 * 32 + 2 * 32
    untied = build(tie_weights=False).num_params()
    assert untied["total"] == build().num_params()["total"] + 50 * 32 == \
        sum(p.numel() for p in build(tie_weights=False).parameters())


def test_attention_only_model_has_no_mlp():
    m = build(mlp=False)
    assert m.num_params()["mlp"] == 0 and all(b.mlp is None for b in m.blocks)
    logits, loss = m(tokens(2, 8), tokens(2, 8, seed=1))
    assert logits.shape == (2, 8, 50) and loss.item() > 0


def test_gpt2_init_and_initial_loss():
    m = build(n_layer=8, n_embd=64, vocab_size=512)
    assert abs(m.blocks[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert abs(m.blocks[0].attn.c_proj.weight.std().item() - 0.02 / 4) < 0.0005  # sqrt(2*8)=4
    assert abs(m.blocks[0].mlp.c_proj.weight.std().item() - 0.02 / 4) < 0.0005
    _, loss = m(tokens(4, 32, vocab=512), tokens(4, 32, vocab=512, seed=1))
    assert abs(loss.item() - math.log(512)) < 0.1  # near-uniform predictions at init


def test_from_config_is_seeded_and_does_not_mutate():
    cfg = Config()
    cfg.model.n_layer, cfg.model.n_embd = 1, 16
    a = GPT.from_config(cfg, vocab_size=30, seed=5)
    b = GPT.from_config(cfg, vocab_size=30, seed=5)
    assert cfg.model.vocab_size == 0
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.cfg.vocab_size == 30 and isinstance(a.cfg, ModelConfig)
    with pytest.raises(ValueError, match="vocab_size"):
        GPT.from_config(cfg)


def test_logits_are_float32_and_ignore_index():
    m = build()
    tgt = tokens(2, 8, seed=1)
    tgt[:, :4] = -1
    logits, loss = m(tokens(2, 8), tgt)
    assert logits.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits[:, 4:].reshape(-1, 50),
                                                 tgt[:, 4:].reshape(-1))
    assert torch.allclose(loss, expected)


def test_dropout_only_in_training():
    m = build(dropout=0.5)
    idx = tokens(1, 8)
    assert not torch.allclose(m(idx)[0], m(idx)[0])
    m.eval()
    assert torch.equal(m(idx)[0], m(idx)[0])


def _sdpa_kernels(model: GPT) -> set[str]:
    """The SDPA implementations a training forward + backward of `model` ran (CPU profiler)."""
    from torch.profiler import ProfilerActivity, profile

    idx = tokens(2, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, loss = model.train()(idx, idx)
        loss.backward()
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


def test_residual_dropout_keeps_the_fused_cpu_kernel_and_attention_dropout_does_not():
    """model.dropout (embeddings, attention and MLP outputs) leaves SDPA on its fused CPU
    kernel (flash attention for CPU, forward and backward); model.attn_dropout drops inside
    the kernel, which on CPU makes SDPA fall back to its math implementation."""
    fused = {"aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}
    math_kernel = "aten::_scaled_dot_product_attention_math"
    resid = _sdpa_kernels(build(dropout=0.2))
    assert fused <= resid and math_kernel not in resid
    attn = _sdpa_kernels(build(attn_dropout=0.2))
    assert math_kernel in attn and not fused & attn


def test_dropouts_act_only_in_training_and_off_draws_nothing():
    """Either dropout changes the training forward and nothing in eval mode; with both off a
    training forward draws no random numbers and equals the eval forward (runs that set
    neither train as before the split)."""
    idx = tokens(2, 12)
    m = build(dropout=0.3)
    assert not torch.equal(m.train()(idx)[0], m.eval()(idx)[0])
    plain = build()
    state = torch.get_rng_state()
    train_logits = plain.train()(idx)[0]
    assert torch.equal(torch.get_rng_state(), state)  # no random numbers drawn
    assert torch.equal(train_logits, plain.eval()(idx)[0])
    a = build(attn_dropout=0.3)
    assert not torch.equal(a.train()(idx)[0], a.eval()(idx)[0])
    for model in (m, a):
        model.eval()
        assert torch.equal(model(idx)[0], model(idx)[0])


def test_activation_and_norm_eps_options():
    """gelu_tanh is GPT-2's gelu_new formula; norm_eps reaches every norm; the default model is
    unchanged by the options (exact GELU, eps 1e-5)."""
    x = torch.linspace(-6, 6, 101)
    gelu_new = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    m = build(activation="gelu_tanh", norm_eps=1e-3, bias=True)
    assert torch.allclose(m.blocks[0].mlp.act(x), gelu_new, atol=1e-6)
    assert {n.eps for n in m.modules() if isinstance(n, torch.nn.LayerNorm)} == {1e-3}
    d = build()
    exact_gelu = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    assert torch.allclose(d.blocks[0].mlp.act(x), exact_gelu, atol=1e-6)
    r = build(activation="relu2").blocks[0].mlp.act(x)
    assert torch.equal(r, torch.where(x > 0, x * x, torch.zeros_like(x)))
    assert {n.eps for n in d.modules() if isinstance(n, torch.nn.LayerNorm)} == {1e-5}
    idx = tokens(1, 8)
    exact = build(seed=1)
    tanh = build(seed=1, activation="gelu_tanh")
    assert not torch.equal(exact(idx)[0], tanh(idx)[0])  # same weights, another nonlinearity


# ---- FLOPs ---------------------------------------------------------------------------------


def test_flops_per_token_hand_count():
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, block_size=4)
    # per layer: qkv 8x24 = 192, W_O 64, MLP 8x32 + 32x8 = 512 -> 768; LM head 10 x 8 = 80
    n = 2 * 768 + 80  # 1616 matmul weights
    attn = 2 * 2 * 2 * 8 * 4 * 3  # layers x (QK^T + AV) x 2 FLOPs/MAC x C x T x (fwd + 2 bwd)
    assert flops_per_token(cfg, 4) == 6 * n + attn == 10464
    assert flops_per_token(dataclasses.replace(cfg, mlp=False), 4) == 6 * (2 * 256 + 80) + 768
    assert GPT(cfg).num_params()["matmul"] == n


# ---- speedrun options: QK-norm, ReLU^2, logit soft-cap, zero head ------------------------


OPTIONS = {"qk_norm": True, "activation": "relu2", "logit_softcap": 2.0}  # cap 2: active at init


@pytest.mark.parametrize("pos", ENCODINGS)
def test_options_sdpa_and_explicit_agree_on_logits_and_gradients(pos):
    idx, tgt = tokens(3, 20), tokens(3, 20, seed=1)
    results = []
    for impl in ("sdpa", "explicit"):
        model = build(pos_encoding=pos, attn_impl=impl, **OPTIONS)
        logits, loss = model(idx, tgt)
        loss.backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
        assert torch.allclose(model.forward_with_attention(idx)[0], logits, atol=1e-5)
    (l1, g1), (l2, g2) = results
    assert torch.allclose(l1, l2, atol=1e-5)
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-5), name
    assert g1["blocks.0.attn.qk_norm.q_weight"].abs().max() > 1e-5  # the gains learn


@pytest.mark.parametrize("pos", ENCODINGS)
def test_options_kv_cache_one_token_decode_equals_recompute(pos):
    """One token at a time through the KV cache, QK-norm, ReLU^2 and the soft-cap give the full
    forward's logits at every step (weights perturbed so the gains are not all 1)."""
    model = build(pos_encoding=pos, block_size=64, **OPTIONS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    seq = tokens(1, 60, seed=4)
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        full, _ = model(seq)
        steps = [model(seq[:, :5], kv_cache=cache)[0][0]]  # prefill 5, then one at a time
        steps += [model(seq[:, t:t + 1], kv_cache=cache)[0][0] for t in range(5, 60)]
    assert (torch.cat(steps) - full[0]).abs().max().item() < 1e-4


def test_qk_norm_normalises_each_head_before_rope_with_its_own_gains():
    from minigpt.core.gpt import QKNorm

    norm = QKNorm(8, 1e-6)
    with torch.no_grad():
        norm.q_weight.fill_(2.0)
        norm.k_weight.fill_(3.0)
    qk = torch.randn(2, 2, 4, 5, 8) * (0.5 + 10 * torch.rand(2, 2, 4, 5, 1))  # (2, B, H, T, D)
    rms = norm(qk).pow(2).mean(-1).sqrt()  # (2, B, H, T)
    assert torch.allclose(rms[0], torch.full((2, 4, 5), 2.0), atol=1e-4)
    assert torch.allclose(rms[1], torch.full((2, 4, 5), 3.0), atol=1e-4)
    # In the model: scaling W_Q and W_K changes nothing with QK-norm (the norm undoes it),
    # and changes the logits without it.
    idx = tokens(2, 12)
    for qk_norm in (True, False):
        model = build(qk_norm=qk_norm).eval()
        before = model(idx)[0]
        with torch.no_grad():
            for b in model.blocks:
                b.attn.c_attn.weight[:64].mul_(7.0)  # rows of W_Q | W_K (C = 32 each)
        moved = (model(idx)[0] - before).abs().max().item()
        assert (moved < 1e-4) if qk_norm else (moved > 1e-3)
    n = build(qk_norm=True).num_params()
    assert n["attention"] == build().num_params()["attention"] + 2 * 2 * 8  # 2 gains of D / layer


def test_qk_norm_keeps_q_and_k_in_vs_dtype_under_bf16_autocast():
    from minigpt.core.gpt import QKNorm

    qk = torch.randn(2, 2, 4, 3, 8, dtype=torch.bfloat16)  # (2, B, H, T, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert QKNorm(8, 1e-5)(qk).dtype == torch.bfloat16
        model = build(**OPTIONS)  # QK-norm, ReLU^2, soft-cap
        logits, loss = model(tokens(2, 8), tokens(2, 8, seed=1))
    loss.backward()
    assert logits.dtype == torch.float32 and math.isfinite(loss.item())
    assert model.blocks[0].attn.qk_norm.k_weight.grad.abs().max() > 0


def test_logit_softcap_squashes_logits_for_loss_and_sampling():
    idx, tgt = tokens(2, 10), tokens(2, 10, seed=1)
    plain, capped = build(), build(logit_softcap=0.5)
    capped.load_state_dict(plain.state_dict())
    raw, _ = plain(idx)
    logits, loss = capped(idx, tgt)
    assert torch.allclose(logits, 0.5 * torch.tanh(raw / 0.5), atol=1e-6)
    assert logits.abs().max() <= 0.5 < raw.abs().max()
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits.view(-1, 50),
                                                                 tgt.view(-1)))
    capped.eval()
    cache = capped.new_kv_cache(1)
    with torch.no_grad():  # the decode step is capped too
        capped(idx[:1, :9], kv_cache=cache)
        last = capped(idx[:1, 9:10], kv_cache=cache)[0]
    assert torch.allclose(last[0, 0], logits[0, 9], atol=1e-6)


def written_out(z: torch.Tensor, t: torch.Tensor, cap: float):
    logits = torch.tanh(z / cap) * cap
    return logits, torch.nn.functional.cross_entropy(logits, t, ignore_index=-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softcap_cross_entropy_in_one_pass_equals_the_written_out_formula(dtype):
    """The one-pass loss (one autograd node) gives the capped logits, the loss and the gradient
    of raw logits that cap * tanh(z / cap) then F.cross_entropy give, with ignored targets and
    with a gradient arriving through the logits as well as through the loss."""
    from minigpt.core.kernels import softcap_cross_entropy

    gen = torch.Generator().manual_seed(3)
    z = (20 * torch.randn(37, 11, generator=gen, dtype=dtype)).requires_grad_()
    t = torch.randint(0, 11, (37,), generator=gen)
    t[[3, 10]] = -1
    w = torch.randn(37, 11, generator=gen, dtype=dtype)  # a use of the logits besides the loss
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # caps 5 and 60: both sides of the cap up to which exp(c) needs no max pass
    for cap, through_logits in ((5.0, False), (5.0, True), (60.0, False), (60.0, True)):
        got, want = [], []
        for fn, out in ((softcap_cross_entropy, got), (written_out, want)):
            logits, loss = fn(z * (cap / 5.0), t, cap)
            (loss + (logits * w).sum() if through_logits else loss).backward()
            out += [logits.detach(), loss.detach(), z.grad]
            z.grad = None
        for a, b in zip(got, want):
            assert a.dtype == dtype and torch.allclose(a, b, atol=tol * cap, rtol=tol)
    small = z.detach()[:6].double().requires_grad_()  # gradcheck wants float64
    assert torch.autograd.gradcheck(lambda a: softcap_cross_entropy(a, t[:6], 2.0), (small,))
    loss = softcap_cross_entropy(small, t[:6], 2.0)[1]
    first = torch.autograd.grad(loss, small, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(loss, small)[0], first)  # a retained graph again


def test_softcap_cross_entropy_of_bfloat16_logits_is_computed_in_float32():
    """bfloat16 logits (autocast on CUDA) give the loss F.cross_entropy gives under autocast:
    the sum over the vocabulary in float32, not in bfloat16's 8 bits, and a gradient in the
    logits' own dtype."""
    from minigpt.core.kernels import softcap_cross_entropy

    gen = torch.Generator().manual_seed(4)
    z32 = 8 * torch.randn(64, 1025, generator=gen)
    t = torch.randint(0, 1025, (64,), generator=gen)
    z = z32.bfloat16().requires_grad_()
    _, loss = softcap_cross_entropy(z, t, 30.0)
    want = written_out(z.detach().float(), t, 30.0)[1]
    assert loss.dtype == torch.float32 and abs(loss.item() - want.item()) < 1e-5
    loss.backward()
    assert z.grad.dtype == torch.bfloat16 and torch.isfinite(z.grad).all()


def test_relu2_as_one_node_equals_relu_then_square():
    from minigpt.core.kernels import relu2

    x = torch.randn(7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x[0, :3] = 0.0  # the kink: both give gradient 0 there
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(7, 9, dtype=torch.float64)
    (ga,) = torch.autograd.grad(relu2(a), a, g)
    (gb,) = torch.autograd.grad(torch.relu(b).square(), b, g)
    assert torch.equal(relu2(x), torch.relu(x).square()) and torch.allclose(ga, gb)
    assert torch.autograd.gradcheck(relu2, (x[1:].clone().requires_grad_(),))


def test_zero_head_starts_uniform_and_leaves_the_other_weights_alone():
    zero, normal = build(tie_weights=False, head_init="zero"), build(tie_weights=False)
    assert not zero.lm_head.weight.any() and normal.lm_head.weight.std() > 0.01
    for (n, p), (_, q) in zip(zero.named_parameters(), normal.named_parameters()):
        if n != "lm_head.weight":
            assert torch.equal(p, q), n
    logits, loss = zero(tokens(2, 8), tokens(2, 8, seed=1))
    assert not logits.any() and loss.item() == pytest.approx(math.log(50))
    with pytest.raises(Exception, match="model.head_init"):  # tied: refused by the config
        from minigpt.config import from_dict
        from_dict({"model": {"head_init": "zero"}})


def test_a_bad_attention_spec_fails_in_attention_the_one_place_it_is_checked():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="impl must be one of"):
        model(idx, attn=ForwardSpec("flash"))
    with pytest.raises(ValueError, match="need impl='explicit'"):
        model(idx, attn=ForwardSpec("sdpa", return_probs=True))


def test_a_leaf_layer_replaced_by_another_module_is_still_called():
    """The forward runs nn.Linear and the norms as functions of their parameters (no module
    call); a module put in their place (an adapter, a subclass) is called as a module."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=20)
    model = GPT.from_config(cfg, seed=0).eval()
    idx = torch.randint(0, 20, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(idx)[0]

        class Doubled(torch.nn.Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        old, old_ln = model.blocks[1].mlp.c_fc, model.blocks[0].ln_1
        new = Doubled(16, 64, bias=False)
        new.weight.copy_(old.weight)
        model.blocks[1].mlp.c_fc = new
        model.blocks[0].ln_1 = torch.nn.Identity()
        after = model(idx)[0]
        model.blocks[1].mlp.c_fc, model.blocks[0].ln_1 = old, old_ln
        assert torch.equal(model(idx)[0], before)
    assert (after - before).abs().max() > 1e-3


def test_dropout_drops_p_of_the_elements_and_scales_the_rest():
    """core.kernels.dropout on CPU: about p of the elements are zero (the 16-bit draws round p to a
    multiple of 2^-16), the kept ones are x / (1 - p), the gradient is the same mask times
    1 / (1 - p), the seed fixes the mask, and p = 0 returns x itself without drawing."""
    from minigpt.core.kernels import dropout

    x = torch.randn(64, 128, 129, requires_grad=True)  # odd size: the last int64 draw is cut
    for p in (0.1, 0.5):
        torch.manual_seed(3)
        y = dropout(x, p)
        kept = y != 0
        n = x.numel()
        frac = 1 - kept.float().mean().item()
        assert abs(frac - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma of a binomial
        assert torch.allclose(y[kept], x[kept] / (1 - p))
        (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
        assert torch.allclose(g, kept.float() / (1 - p))
        torch.manual_seed(3)
        assert torch.equal(dropout(x, p), y)
    state = torch.get_rng_state()
    assert dropout(x, 0.0) is x and torch.equal(torch.get_rng_state(), state)


def test_dropout_masks_are_independent_across_the_16_bit_lanes():
    """Four elements share one 64-bit draw: each lane (element index mod 4) drops about p on
    its own, and the lanes' masks are uncorrelated (no lane copies another)."""
    from minigpt.core.kernels import dropout

    torch.manual_seed(0)
    mask = (dropout(torch.ones(1 << 20), 0.25) == 0).float().view(-1, 4)  # (draws, lane)
    n = mask.shape[0]
    sigma = math.sqrt(0.25 * 0.75 / n)
    assert ((mask.mean(0) - 0.25).abs() < 5 * sigma).all()
    corr = torch.corrcoef(mask.t())  # (4, 4)
    assert (corr - torch.eye(4)).abs().max() < 5 / math.sqrt(n)


def test_sdpa_under_cpu_bf16_autocast_runs_in_float32_and_keeps_the_dtype():
    """On CPU, bf16 q, k, v (autocast's) go through the fused kernel in float32 (twice as fast
    there, forward + backward): the result is the float32 attention of the same bf16 values,
    rounded once to bf16, and gradients reach q, k, v in bf16."""
    from minigpt.core.gpt import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8).bfloat16().requires_grad_() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                            is_causal=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.bfloat16())
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))


def test_precision_auto_follows_the_cpus_bf16_instructions(monkeypatch):
    """train.precision auto is bf16 autocast on a CPU with AVX512-BF16 or AMX and fp32 on one
    without; fp32 and bf16 are what they say on any CPU."""
    from minigpt.device import amp_dtype

    cpu = torch.device("cpu")
    for avx512_bf16, amx, want in ((True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                   (False, False, None)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda a=avx512_bf16: a)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda a=amx: a)
        assert amp_dtype("auto", cpu) == want
        assert amp_dtype("fp32", cpu) is None and amp_dtype("bf16", cpu) == torch.bfloat16


def test_mtp_adds_the_loss_of_the_token_after_next_in_training_only():
    """model.mtp_weight w: in training the loss is CE(next) + w * CE(token after next), the
    second from the final stream plus mtp([stream, embedding of the next token]) through the
    same final norm, head and soft-cap; in eval mode, and without targets, the plain pass."""
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                             "model.vocab_size=20", "model.logit_softcap=10",
                             "model.mtp_weight=0.3", "model.tie_weights=false"])
    m = GPT.from_config(cfg, seed=0)
    torch.nn.init.normal_(m.mtp.weight, std=0.1)  # it starts at zero
    x, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    y[0, 2] = -1
    _, loss = m(x, y)
    stream = m.residual_stream(x)[-1]  # (2, 8, C)
    z = stream[:, :-1] + m.mtp(torch.cat((stream[:, :-1], m.wte(y[:, :-1].clamp(min=0))), -1))
    ce = lambda lg, t: F.cross_entropy(lg.reshape(-1, 20), t.reshape(-1), ignore_index=-1)
    expected = ce(m.unembed(stream), y) + 0.3 * ce(m.unembed(z), y[:, 1:])
    assert torch.allclose(loss, expected, atol=1e-5)
    m.eval()
    assert torch.allclose(m(x, y)[1], ce(m.unembed(stream), y), atol=1e-6)
    assert m.num_params()["mtp"] == 2 * 16 * 16


def test_value_skip_adds_a_share_of_the_first_layers_values():
    """model.value_skip: layer l > 0 attends with v_l + lambda_l * v_0. With every lambda 0 it
    is the plain model; the lambdas train (they get gradients); the cache decodes the whole
    pass's logits; a pass that starts mid-model is refused."""
    sets = ["model.n_layer=3", "model.n_embd=16", "model.n_head=2", "model.vocab_size=20"]
    m = GPT.from_config(load_config(None, [*sets, "model.value_skip=true"]), seed=0)
    plain = GPT.from_config(load_config(None, sets), seed=0).eval()
    assert m.value_lambdas.tolist() == [0.5, 0.5]
    x = torch.randint(0, 20, (2, 8))
    _, loss = m(x, x)
    loss.backward()
    assert m.value_lambdas.grad.abs().min() > 0
    m.eval()
    with torch.no_grad():
        plain.load_state_dict({k: t for k, t in m.state_dict().items() if k != "value_lambdas"})
        logits = m(x)[0]
        assert not torch.allclose(plain(x)[0], logits, atol=1e-4)
        cache = m.new_kv_cache(2)
        steps = [m(x[:, :5], kv_cache=cache)[0]] + [m(x[:, t:t + 1], kv_cache=cache)[0]
                                                     for t in range(5, 8)]
        assert torch.allclose(torch.cat(steps, 1), logits, atol=1e-5)
        m.value_lambdas.zero_()
        assert torch.allclose(plain(x)[0], m(x)[0], atol=1e-6)
    with pytest.raises(ValueError, match="model.value_skip: a pass from block 1 on"):
        m.from_layer(1, torch.zeros(2, 8, 16))
