"""The GPT, top to bottom in one file: the lecture's attention, the position encodings, then
the transformer that uses them (CausalSelfAttention, MLP, Block, GPT), like nanoGPT's model.py.
Tensors of attention are `[batch, head, query, key]`. The KV cache and the compiled one-token
decode step of this same pass are core/decode.py's.

The hand-written CPU pieces it calls (the fused attention kernel's CPU-bf16 rule, the
soft-capped loss and ReLU^2 as one autograd node each, the packed dropout mask, the leaf layers
called without nn.Module's overhead) are in core/kernels.py, each the same numbers as plain torch.

`attention()` is the one attention function of the project. Two paths, one result:

- `impl="sdpa"`: `F.scaled_dot_product_attention` (fused kernel; never materialises T x T).
- `impl="explicit"`: `softmax(q k^T * scale + causal_mask) v` written out; it can return the
  probabilities `(B, H, Tq, Tk)` that inspect-heads draws.

Positions: query i sits at absolute position `past_length + i`, key j at position j. The causal
mask lets query i see keys `j <= past_length + i`: the blog's bottom-right aligned
`tril(ones(Tq, Tk), diagonal=past_length)`. SDPA's `is_causal=True` is top-left aligned, so it is
used only when `Tq == Tk` and `past_length == 0`, and never together with `attn_mask`.

RoPE convention (one, written down): INTERLEAVED PAIRS, as in the lecture, the blog and RoFormer.
Dimensions (2i, 2i+1) of each head form one plane, rotated by the angle `m * theta_i` with
`theta_i = rope_base^(-2i/head_dim)` and m the absolute position:
    q'_{2i}   = q_{2i} cos(m theta_i) - q_{2i+1} sin(m theta_i)
    q'_{2i+1} = q_{2i} sin(m theta_i) + q_{2i+1} cos(m theta_i)
(Not GPT-NeoX/Llama's rotate-half, which pairs i with i + head_dim/2 and rotates it by the same
theta_i: weights are not interchangeable as they are. Permuting the query and key rows of each
head with `rope_interleaved_to_halves` makes them so: q . k is unchanged when both are permuted
alike, and each pair is rotated by the same angle in its new place.)

Notebook API (stable; inspect-heads and export use it):

    from minigpt.config import load_config
    from minigpt.core.gpt import GPT
    cfg = load_config("default", ["model.vocab_size=256"])
    model = GPT.from_config(cfg, seed=0).eval()          # Config or ModelConfig
    idx = torch.tensor([[72, 101, 108, 108, 111]])        # (B, T) token ids
    logits, _ = model(idx)                                # (B, T, vocab_size) float32
    logits, loss = model(idx[:, :-1], targets=idx[:, 1:]) # mean cross-entropy
    logits, probs = model.forward_with_attention(idx)     # probs: n_layer x (B, n_head, T, T)
    cache = model.new_kv_cache(batch_size=1)              # incremental decoding, see KVCache
    model.num_params()                                    # {"total": ..., ...}
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.config.settings import Config, ModelConfig
from minigpt.core.decode import KVCache, decode_steps
from minigpt.core.kernels import (
    dropout,
    embedding,
    hooked,
    linear,
    norm,
    relu2,
    sdpa,
    softcap_cross_entropy,
)

__all__ = ["GPT", "ForwardSpec", "Intervention", "KVCache", "attention", "device_of",
           "eval_mode", "flops_per_token"]

# --------------------------------------------------------------------------------------------
# Attention: both kernels, one result.

IMPLS = ("sdpa", "explicit")


class Intervention:
    """The forward pass's one intervention point, carried by `ForwardSpec.intervention`: every
    layer calls it where the residual stream is read and where it is written, and goes on with
    what it returns. Here each method is the identity; interp/patching.py and interp/edge_graph.py
    subclass it (ablation, head patching, edge patching, edge attribution, recording).

    Writers (what adds to the residual stream): `embed` (the token embedding plus the position
    embedding where one is added, (B, T, C)), `heads` (every head's output z
    `[batch, head, query, d_head]` of a layer, before W_O mixes them: head h writes
    z[:, h] @ W_O[:, h*D:(h+1)*D]^T), `mlp_out` (an MLP's output, (B, T, C)).
    Readers (what reads it, before their norm): `attn_in` (the stream a layer's heads read,
    (B, T, C); it may return (3, H, B', T, C): each head's query, key and value input apart,
    which the layer then projects head by head; B' = B, or B * T copies, one per query
    position, whose heads' outputs `heads` then takes back to (B, ...)), `mlp_in` (an MLP's
    input, (B, T, C)) and
    `final_in` (what the final norm and the LM head read, (B, T, C)). A reader's change
    reaches that reader only: the residual stream itself goes on unchanged.
    Inside a layer: `qk` (every head's queries and keys `[batch, head, position, d_head]` as
    the scores read them, after QK-norm and RoPE; interp/qk.py records them)."""

    def embed(self, x: Tensor) -> Tensor:
        return x

    def attn_in(self, layer: int, x: Tensor) -> Tensor:
        return x

    def heads(self, layer: int, z: Tensor) -> Tensor:
        return z

    def qk(self, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def mlp_in(self, layer: int, x: Tensor) -> Tensor:
        return x

    def mlp_out(self, layer: int, y: Tensor) -> Tensor:
        return y

    def final_in(self, x: Tensor) -> Tensor:
        return x


class HeadHook(Intervention):
    """`ForwardSpec.head_hook` as an Intervention: `hook(layer, z)` on every layer's head
    outputs."""

    def __init__(self, hook: Callable[[int, Tensor], Tensor]) -> None:
        self.hook = hook

    def heads(self, layer: int, z: Tensor) -> Tensor:
        return self.hook(layer, z)


@dataclass(frozen=True)
class ForwardSpec:
    """How one forward pass runs, passed as one value (`attn=`) from the model to every layer
    (never by changing the config): how it computes attention, and the one intervention it
    carries through every layer. `impl` sdpa (fused kernel) or explicit (softmax written out);
    `scale` None = 1/sqrt(head_dim); `return_probs` returns the (B, H, Tq, Tk) probabilities
    (explicit only); `causal` False lifts the mask (the permutation demonstration only: models
    are trained causal).

    `intervention` (an `Intervention`) is the one place to read or change what a writer adds
    to the residual stream or what a reader takes from it. `head_hook`, if given, is the
    short form for the heads alone: it is called in every layer as `head_hook(layer, z)` with
    z the heads' outputs `[batch, head, query, d_head]` (each head's attention-weighted values,
    before W_O mixes the heads into the residual stream) and returns the z to use (it becomes
    `intervention = HeadHook(head_hook)`; giving both is an error).
    `impl` and `return_probs` are checked where they are used, by `attention()`."""

    impl: str = "sdpa"
    scale: float | None = None
    return_probs: bool = False
    causal: bool = True
    head_hook: Callable[[int, Tensor], Tensor] | None = None
    intervention: Intervention | None = None

    def __post_init__(self) -> None:
        if self.head_hook is not None:
            if self.intervention is not None:
                raise ValueError("give ForwardSpec a head_hook or an intervention, not both")
            object.__setattr__(self, "intervention", HeadHook(self.head_hook))


INSPECT = ForwardSpec("explicit", return_probs=True)  # what inspect-heads runs


def causal_mask(t_q: int, t_k: int, past_length: int, device=None) -> Tensor:
    """Boolean (Tq, Tk) mask, True = may attend: query i sees keys j <= past_length + i."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=past_length)


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: bool = True,
              past_length: int = 0, impl: str = "sdpa", return_probs: bool = False,
              dropout_p: float = 0.0, mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention over heads.

    q (B, H, Tq, D), k and v (B, H, Tk, D) -> out (B, H, Tq, D), probs (B, H, Tq, Tk) or None.
    `scale` defaults to 1/sqrt(D); pass 1.0 for the lecture's unscaled examples. `causal` masks
    keys after each query's absolute position `past_length + i`; a boolean `mask` (Tq, Tk), True
    = may attend, replaces that rule (a static KV cache's: core/decode.py). `dropout_p` drops
    attention probabilities (pass 0 outside training). Probabilities come only from
    `impl="explicit"`.
    """
    if impl not in IMPLS:  # the one check of `impl` and `return_probs` (ForwardSpec has none)
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if return_probs and impl != "explicit":
        raise ValueError("attention probabilities need impl='explicit'")
    t_q, t_k = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # A mask is needed unless every query may see every key (e.g. one-token decode with a cache).
    needs_mask = mask is not None or (causal and past_length < t_k - 1)
    top_left = mask is None and needs_mask and t_q == t_k and past_length == 0  # training's case
    if needs_mask and mask is None and not top_left:
        mask = causal_mask(t_q, t_k, past_length, q.device)
    if impl == "sdpa":
        return sdpa(q, k, v, mask=mask, is_causal=top_left, scale=scale, dropout_p=dropout_p), None
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, D) @ (B, H, D, Tk) -> (B, H, Tq, Tk)
    if needs_mask:
        if mask is None:
            mask = causal_mask(t_q, t_k, 0, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, H, Tq, Tk), each row sums to 1
    dropped = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
    out = dropped @ v  # (B, H, Tq, Tk) @ (B, H, Tk, D) -> (B, H, Tq, D)
    return out, (probs if return_probs else None)


# --------------------------------------------------------------------------------------------
# Position tables. Both are computed in float64 and stored as float32 non-persistent buffers
# (never in a checkpoint), sized for block_size and grown on demand when generation goes past it.


def rope_tables(n_pos: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin of `m * theta_i`: each (n_pos, head_dim // 2), theta_i = base^(-2i/head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]  # (P, D/2)
    return angles.cos().float(), angles.sin().float()


def rope_full_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`rope_tables`' (..., D/2) cos, sin laid out over the whole head, (..., D): cos repeated
    for both dimensions of each pair, sin with the pair's sign folded in, (-sin_i, +sin_i), so
    that `apply_rope` is x * cos + swap_pairs(x) * sin."""
    return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)


def swap_pairs(x: Tensor) -> Tensor:
    """(x_0, x_1, x_2, x_3, ...) -> (x_1, x_0, x_3, x_2, ...) along the last dim."""
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of the last dim by the angles whose cos/sin are given.

    x (..., D). The tables are `rope_tables`' (..., D/2) or `rope_full_tables`' (..., D) (the
    model keeps the latter, so a rotation is three element-wise ops), broadcasting against x,
    e.g. x (2, B, H, T, D) with (T, D/2) or (T, D). Real arithmetic only:
        x'_{2i} = x_{2i} cos - x_{2i+1} sin,   x'_{2i+1} = x_{2i+1} cos + x_{2i} sin,
    written as x * cos + swap_pairs(x) * (-sin, +sin), which torch.compile fuses into one
    kernel. Half/bf16 inputs are rotated in float32 and cast back (one rounding, as before)."""
    if cos.shape[-1] != x.shape[-1]:  # half-width tables: lay them out over the head
        cos, sin = rope_full_tables(cos, sin)
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    out = torch.addcmul(xf * cos.to(xf.dtype), swap_pairs(xf), sin.to(xf.dtype))
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rope_interleaved_to_halves(head_dim: int) -> Tensor:
    """Indices p with `x[..., p]` = x in the rotate-half layout: interleaved pair (2i, 2i+1)
    moves to (i, i + head_dim/2), i.e. p = [0, 2, 4, ..., 1, 3, 5, ...]. Applied to the rows of
    W_Q and W_K of each head (and their biases), a minigpt RoPE model becomes a GPT-NeoX one;
    `argsort(p)` goes back. Proven by the logits parity test in tests/test_hf.py."""
    return torch.arange(head_dim).view(head_dim // 2, 2).t().reshape(-1)


def sinusoidal_table(n_pos: int, n_embd: int, base: float = 10000.0) -> Tensor:
    """Notebook 004's fixed table (n_pos, n_embd): PE[p, 2i] = sin(p / base^(2i/d)),
    PE[p, 2i+1] = cos(p / base^(2i/d)). Not a parameter."""
    inv_freq = base ** (-torch.arange(0, n_embd, 2, dtype=torch.float64) / n_embd)  # (ceil(d/2),)
    angles = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    pe = torch.zeros(n_pos, n_embd, dtype=torch.float64)
    pe[:, 0::2] = angles.sin()
    pe[:, 1::2] = angles.cos()[:, : n_embd // 2]  # odd n_embd: the last sin column has no cos
    return pe.float()


class Rotary(nn.Module):
    """Cached RoPE tables for one head size, laid out over the whole head (`rope_full_tables`);
    shared by every layer of a GPT."""

    def __init__(self, head_dim: int, block_size: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self._fill(block_size, None)

    def _fill(self, n_pos: int, device) -> None:
        cos, sin = rope_full_tables(*rope_tables(n_pos, head_dim=self.head_dim, base=self.base))
        self.register_buffer("cos", cos.to(device), persistent=False)  # (P, D)
        self.register_buffer("sin", sin.to(device), persistent=False)  # (P, D), sign folded in

    def tables(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin for positions [start, start + length), each (T, D): they broadcast against
        q|k stacked as (2, B, H, T, D)."""
        end = start + length
        if end > self.cos.shape[0]:  # past block_size during generation: grow (doubling)
            self._fill(max(end, 2 * self.cos.shape[0]), self.cos.device)
        return self.cos[start:end], self.sin[start:end]


class QKNorm(nn.Module):
    """QK-norm: RMSNorm of every head's query and key over head_dim, then a learned gain per
    dimension (`q_weight` for queries, `k_weight` for keys, each (D,), shared by the layer's
    heads, initialised to 1). Applied after the projection and before RoPE, so the attention
    logit q.k * scale is bounded by the gains rather than by the weights' growth. The gains are
    1-D, so they train like the other norms' gains (AdamW, no weight decay)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.q_weight = nn.Parameter(torch.ones(head_dim))
        self.k_weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, qk: Tensor) -> Tensor:
        """qk: queries and keys stacked on the first axis, (2, B, H, T, D). Returns the
        normalised qk, same shape and dtype (under autocast the fp32 gains would otherwise
        promote a bf16 q and k away from v's dtype)."""
        gains = torch.stack((self.q_weight, self.k_weight)).view(2, 1, 1, 1, -1)  # (2,1,1,1,D)
        out = F.rms_norm(qk, (qk.shape[-1],), eps=self.eps) * gains
        return out if out.dtype == qk.dtype else out.to(qk.dtype)


# --------------------------------------------------------------------------------------------
# The transformer: attention layer, MLP, block, GPT.


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "none":  # a compiled program's blocks read the residual stream as it is
        return nn.Identity()
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    """Fused QKV projection -> split -> heads -> attention -> merge -> W_O (the blog's order)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        inner = cfg.n_head * cfg.head_dim  # n_embd, unless model.d_head sets the head width
        self.c_attn = nn.Linear(cfg.n_embd, 3 * inner, bias=cfg.bias)  # W_Q | W_K | W_V
        self.c_proj = nn.Linear(inner, cfg.n_embd, bias=cfg.bias)  # W_O
        self.c_proj.residual_proj = True  # scaled init, see GPT._init_weights
        self.attn_dropout, self.resid_dropout = cfg.attn_dropout, cfg.dropout
        self.qk_norm = QKNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, *, rope: tuple[Tensor, Tensor] | None,
                cache: KVCache | None, layer: int, spec: ForwardSpec,
                values: ValueSkip | None = None) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C), or (3, H, B, T, C): each head's query, key and value input apart (an
        Intervention's `attn_in`). Returns the layer's output (B, T, C) and, when asked, the
        attention probabilities."""
        if x.dim() == 3:
            B, T, _ = x.shape
            # Head i of Q uses columns [i*head_dim, (i+1)*head_dim) of Q's H*D columns (likewise
            # K, V); one permute puts every head's q, k and v in the `[batch, head, position,
            # d_head]` layout.
            qkv = linear(self.c_attn, x)  # (B, T, C) -> (B, T, 3HD)
            qkv = qkv.view(B, T, 3, self.n_head, self.head_dim)  # -> (B, T, 3, H, D)
            qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, D), a view
        else:
            B, T = x.shape[2:4]
            qkv = self._split_qkv(x)  # (3, B, H, T, D)
        if rope is None and self.qk_norm is None:
            q, k, v = qkv.unbind(0)  # 3 x (B, H, T, D)
        else:  # q and k are normalised and rotated together (one op each); v is left alone
            # split, not slicing: its backward is one cat instead of zero-fill + copy per slice
            qk, v = qkv.split([2, 1])  # (2, B, H, T, D), (1, B, H, T, D)
            if self.qk_norm is not None:  # before RoPE: the rotation keeps the norm
                qk = self.qk_norm(qk)
            if rope is not None:  # positions live in q and k only; v stays position-free
                qk = apply_rope(qk, *rope)  # tables (T, D) broadcast over (2, B, H)
            q, k = qk.unbind(0)  # 2 x (B, H, T, D)
            v = v.squeeze(0)  # (B, H, T, D)
        if values is not None:  # model.value_skip
            v = values(layer, v)
        if spec.intervention is not None:  # the queries and keys the scores read
            q, k = spec.intervention.qk(layer, q, k)
        past, mask = 0, None
        if cache is not None:  # a static cache's step never reads its length (core/decode.py)
            past = 0 if cache.static else cache.length
            k, v, mask = cache.append(layer, k, v)  # (B, H, past + T or max_len, D)
            if k.dtype != q.dtype:  # the cache is in the weights' dtype; q is autocast's
                k, v = k.to(q.dtype), v.to(q.dtype)
        # Dropout inside the kernel (attn_dropout) sends CPU SDPA to its math fallback; the
        # residual dropout below (model.dropout) leaves the fused kernel alone.
        drop = self.attn_dropout if self.training else 0.0
        z, probs = attention(q, k, v, scale=spec.scale, causal=spec.causal, past_length=past,
                             impl=spec.impl, return_probs=spec.return_probs,
                             dropout_p=drop, mask=mask)  # z: every head's output, (B, H, T, D)
        if spec.intervention is not None:  # the one place to read or change a single head
            z = spec.intervention.heads(layer, z)
        # merge: (B', T, H*D) -> (B', T, C); B' is the stream's batch, which `heads` may
        # restore from the per-query copies an `attn_in` made (position-aware patching)
        y = linear(self.c_proj, z.transpose(1, 2).flatten(2))
        return dropout(y, self.resid_dropout if self.training else 0.0), probs

    def _split_qkv(self, x: Tensor) -> Tensor:
        """Every head's q, k and v (3, B, H, T, D) from x (3, H, B, T, C), which holds each
        head's own query, key and value input: each is projected by its own rows of W_Q | W_K
        | W_V (the same numbers as c_attn on that input, 3H times cheaper)."""
        H, D = self.n_head, self.head_dim
        _, _, B, T, C = x.shape
        if self.c_attn.__class__ is not nn.Linear or hooked(self.c_attn):  # call the module
            full = linear(self.c_attn, x).view(3, H, B, T, 3, H, D)  # every input, every row
            s, h = torch.arange(3)[:, None], torch.arange(H)[None, :]
            own = full[s, h, :, :, s, h]  # (3, H, B, T, D): input (s, h) through its own rows
            return own.permute(0, 2, 1, 3, 4)
        w = self.c_attn.weight.view(3 * H, D, C)  # rows of W_Q | W_K | W_V, head by head
        qkv = torch.bmm(x.reshape(3 * H, B * T, C), w.transpose(1, 2))  # (3H, BT, D)
        qkv = qkv.view(3, H, B, T, D)
        if self.c_attn.bias is not None:
            qkv = qkv + self.c_attn.bias.view(3, H, 1, 1, D)
        return qkv.permute(0, 2, 1, 3, 4)  # (3, B, H, T, D)


# model.activation -> the function; elementwise, so any shape in, the same shape out
ACTIVATIONS = {
    "gelu": F.gelu,  # x * Phi(x), Phi the normal CDF (erf)
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's gelu_new
    "relu2": relu2,
    "relu": F.relu,  # a compiled program's MLPs (tracr)
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_dim, bias=cfg.bias)  # mlp_dim: 4C by default
        self.c_proj = nn.Linear(cfg.mlp_dim, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_proj = True
        self.dropout = cfg.dropout
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(linear(self.c_fc, x))  # (B, T, C) -> (B, T, mlp_dim)
        y = linear(self.c_proj, h)  # (B, T, mlp_dim) -> (B, T, C)
        return dropout(y, self.dropout if self.training else 0.0)


class ValueSkip:
    """model.value_skip in one forward pass: layer 0's values v_0 (B, H, T, D), kept as it
    computes them, and each later layer l's values become v_l + lambdas[l - 1] * v_0."""

    def __init__(self, lambdas: Tensor) -> None:
        self.lambdas, self.first = lambdas, None

    def __call__(self, layer: int, v: Tensor) -> Tensor:
        if layer == 0:
            self.first = v
            return v
        return v + self.lambdas[layer - 1].to(v.dtype) * self.first


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)) (no MLP when cfg.mlp is false)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg) if cfg.mlp else None
        self.mlp = MLP(cfg) if cfg.mlp else None

    def forward(self, x: Tensor, *, rope, cache: KVCache | None, layer: int,
                spec: ForwardSpec, values: ValueSkip | None = None
                ) -> tuple[Tensor, Tensor | None]:
        g = spec.intervention  # what each reader reads and each writer writes, when set
        xa = x if g is None else g.attn_in(layer, x)  # (B, T, C) or (B, T, 3, H, C)
        a, probs = self.attn(norm(self.ln_1, xa), rope=rope, cache=cache, layer=layer, spec=spec,
                             values=values)
        x = x + a
        if self.mlp is not None:
            if g is None:
                x = x + self.mlp(norm(self.ln_2, x))
            else:
                x = x + g.mlp_out(layer, self.mlp(norm(self.ln_2, g.mlp_in(layer, x))))
        return x, probs


class GPT(nn.Module):
    """Token embedding (+ learned/sinusoidal positions) -> n_layer Blocks -> norm -> LM head.

    `cfg.pos_encoding`: rope (inside every attention layer), learned (GPT-2 table added at the
    input; more than block_size positions is a ValueError), sinusoidal (fixed table added at
    the input), none. `cfg.norm` none: no norms (a compiled program's blocks). The LM head
    (`cfg.n_out` outputs: the vocabulary, or a compiled program's output values) shares the
    embedding matrix when `cfg.tie_weights`; with `cfg.head_init` zero (untied only) it
    starts at zero, so the first predictions are uniform.
    `cfg.logit_softcap` > 0 squashes every logit into (-cap, cap): cap * tanh(logit / cap).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # The config refuses all of these with a one-line error; here they are broken invariants.
        if cfg.vocab_size <= 0:
            raise ValueError("vocab_size is 0: set it to the tokenizer's n_vocab before building "
                             "the model (GPT.from_config(cfg, vocab_size=...))")
        if (cfg.n_embd % cfg.n_head and not cfg.d_head) or (cfg.pos_encoding == "rope"
                                                             and cfg.head_dim % 2):
            raise ValueError(f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd} into an "
                             "(even, for RoPE) head dimension")
        self.cfg = cfg
        self._spec = ForwardSpec(cfg.attn_impl)  # how forward() attends unless told otherwise
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # E[y_i]: (V, C)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_encoding == "learned" \
            else None
        self.rotary = Rotary(cfg.head_dim, cfg.block_size, cfg.rope_base) \
            if cfg.pos_encoding == "rope" else None
        if cfg.pos_encoding == "sinusoidal":
            self.register_buffer("pe", sinusoidal_table(cfg.block_size, cfg.n_embd),
                                 persistent=False)  # (P, C), grown on demand
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.n_out, bias=False)  # (V, C): V = n_out
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight  # one Parameter, two uses
        # model.mtp_weight: [stream, next token's embedding] (2C) -> C, added to the stream
        self.mtp = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=False) if cfg.mtp_weight else None
        self.value_lambdas = (nn.Parameter(torch.full((cfg.n_layer - 1,), 0.5))
                              if cfg.value_skip else None)  # model.value_skip (ValueSkip)
        self.apply(self._init_weights)
        if cfg.head_init == "zero":  # after the normal init, so every other weight is unchanged
            nn.init.zeros_(self.lm_head.weight)
        if self.mtp is not None:  # starts as the identity on the stream
            nn.init.zeros_(self.mtp.weight)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2: N(0, 0.02) everywhere; projections into the residual stream (attention W_O,
        MLP c_proj) get 0.02/sqrt(2*n_layer) because 2*n_layer of them add up in the stream."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_proj",
                                                                    False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @classmethod
    def from_config(cls, cfg: Config | ModelConfig, *, vocab_size: int | None = None,
                    seed: int | None = None) -> GPT:
        """Build from a Config (its `.model`) or a ModelConfig, not mutating it. `vocab_size`
        overrides the config's (required when that is 0); `seed` makes the init reproducible
        without touching the global RNG."""
        mcfg = cfg.model if isinstance(cfg, Config) else cfg
        if vocab_size is not None:
            mcfg = dataclasses.replace(mcfg, vocab_size=vocab_size)
        else:
            mcfg = dataclasses.replace(mcfg)
        if seed is None:
            return cls(mcfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(mcfg)

    # ----------------------------------------------------------------------------------------

    def _embed(self, idx: Tensor, start: int) -> Tensor:
        """Token (+ absolute position) embeddings for positions [start, start + T): (B, T, C)."""
        T = idx.shape[1]
        x = embedding(self.wte, idx)  # (B, T) -> (B, T, C)
        if self.wpe is not None:
            if start + T > self.cfg.block_size:  # callers crop (core/generate.py, inspect-heads)
                raise ValueError(
                    f"sequence reaches position {start + T - 1} but model.block_size="
                    f"{self.cfg.block_size} with pos_encoding 'learned' has no embedding past "
                    f"position {self.cfg.block_size - 1}; crop the context to the last "
                    f"{self.cfg.block_size} tokens")
            if hooked(self.wpe):  # its hooks fire: called as a module on the positions
                x = x + self.wpe(torch.arange(start, start + T, device=idx.device))
            else:
                x = x + self.wpe.weight[start:start + T]  # (T, C) broadcast over B
        elif self.cfg.pos_encoding == "sinusoidal":
            if start + T > self.pe.shape[0]:  # generation past block_size: grow the fixed table
                self.pe = sinusoidal_table(max(start + T, 2 * self.pe.shape[0]),
                                           self.cfg.n_embd).to(self.pe.device)
            x = x + self.pe[start:start + T]
        return dropout(x, self.cfg.dropout if self.training else 0.0)

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                kv_cache: KVCache | None = None, *, attn: ForwardSpec | None = None,
                ) -> tuple[Tensor, Tensor | None]:
        """THE forward pass. idx (B, T) long -> logits (B, T, vocab_size) float32 and, with
        targets (B, T), the mean cross-entropy (targets of -1 are ignored).

        `attn` says how attention is computed (default: `cfg.attn_impl`) and is where a
        writer's output or a reader's input can be read or changed (`ForwardSpec.intervention`).
        With `kv_cache`, idx continues the cached sequence (see KVCache for the contract); one
        token at a time this is the decode step of generation, where the one query sees every
        cached key and no mask is built. Training, sampling, inspection and imported models
        all run this pass."""
        x, _ = self._stream(idx, kv_cache, attn or self._spec)
        if targets is None:
            return self.unembed(x), None
        logits, loss = self._loss(self.raw_logits(x), targets)
        if self.mtp is not None and self.training:  # model.mtp_weight: the token after next
            nxt = embedding(self.wte, targets[:, :-1].clamp(min=0))  # (B, T-1, C)
            y = x[:, :-1] + linear(self.mtp, torch.cat((x[:, :-1], nxt), dim=-1))  # (B, T-1, C)
            loss = loss + self.cfg.mtp_weight * self._loss(self.raw_logits(y), targets[:, 1:])[1]
        return logits, loss

    def _loss(self, raw: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Raw logits (B, T, V) float32 and targets (B, T) (-1 = ignored) -> the logits
        (soft-capped when cfg.logit_softcap: cap and cross-entropy in one pass) and the mean
        cross-entropy."""
        cap, flat = self.cfg.logit_softcap, raw.reshape(-1, raw.shape[-1])  # (B*T, V)
        if cap:
            logits, loss = softcap_cross_entropy(flat, targets.reshape(-1), cap)
            return logits.view(raw.shape), loss
        return raw, F.cross_entropy(flat, targets.reshape(-1), ignore_index=-1)

    def forward_with_attention(self, idx: Tensor, scale: float | None = None,
                               causal: bool = True, head_hook=None) -> tuple[Tensor, list[Tensor]]:
        """The explicit path: logits (B, T, V) and n_layer attention-probability tensors
        (B, n_head, T, T) (`[batch, head, query, key]`, rows sum to 1). `scale` defaults to
        1/sqrt(head_dim); `causal=False` lifts the mask (the permutation demonstration only:
        the model is trained causal); `head_hook` as in ForwardSpec."""
        spec = INSPECT if scale is None and causal and head_hook is None else ForwardSpec(
            "explicit", scale=scale, return_probs=True, causal=causal, head_hook=head_hook)
        return self._run(idx, None, spec)

    def _run(self, idx: Tensor, kv_cache: KVCache | None, spec: ForwardSpec
             ) -> tuple[Tensor, list[Tensor]]:
        """Embed -> blocks -> final norm -> LM head: logits (B, T, V) float32 and, when
        `spec.return_probs`, each layer's attention probabilities."""
        x, all_probs = self._stream(idx, kv_cache, spec)
        return self.unembed(x), all_probs

    def _stream(self, idx: Tensor, kv_cache: KVCache | None, spec: ForwardSpec
                ) -> tuple[Tensor, list[Tensor]]:
        """Embed -> blocks: the residual stream leaving the last block (B, T, C), as the final
        norm reads it, and, when `spec.return_probs`, each layer's attention probabilities."""
        B, T = idx.shape
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            if T > kv_cache.remaining or B != kv_cache.batch_size:  # callers crop and reset
                raise ValueError(f"{B} x {T} new tokens do not fit the KV cache ({kv_cache.length}"
                                 f" of {kv_cache.max_len} positions used, batch "
                                 f"{kv_cache.batch_size}); crop, reset() and prefill again")
            kv_cache.begin(T)
        x = self._embed(idx, start)  # (B, T, C)
        if spec.intervention is not None:
            x = spec.intervention.embed(x)
        x, all_probs = self._blocks(x, 0, start, kv_cache, spec)
        if kv_cache is not None:
            kv_cache.advance(T)
        return x, all_probs

    def _blocks(self, x: Tensor, first: int, start: int, kv_cache: KVCache | None,
                spec: ForwardSpec, stream: list[Tensor] | None = None
                ) -> tuple[Tensor, list[Tensor]]:
        """Blocks `first`.. on the residual stream x (B, T, C) entering block `first`, at
        positions [start, start + T). Appends to `stream` the residual entering each block.
        Returns the stream leaving the last block as the final norm reads it (an
        Intervention's `final_in`)."""
        rope = self.rotary.tables(start, x.shape[1]) if self.rotary is not None else None
        plain = spec.intervention is None and not spec.return_probs and self.value_lambdas is None
        steps = (decode_steps(self, kv_cache, x.shape[1], plain)  # compiled one-token steps
                 if kv_cache is not None and kv_cache.static else None)
        if self.value_lambdas is not None and first > 0:
            raise ValueError(f"model.value_skip: a pass from block {first} on lacks the first "
                             "layer's values; run the whole pass")
        values = ValueSkip(self.value_lambdas) if self.value_lambdas is not None else None
        all_probs = []
        for i, block in enumerate(self.blocks):
            if i < first:
                continue
            if stream is not None:
                stream.append(x)
            if steps is None:
                x, probs = block(x, rope=rope, cache=kv_cache, layer=i, spec=spec, values=values)
            else:  # a compiled one-token step, on this layer's slot of the static cache
                x, probs = steps[i](x, rope=rope, cache=kv_cache.slots[i], layer=i, spec=spec)
            if probs is not None:
                all_probs.append(probs)
        if spec.intervention is not None:
            x = spec.intervention.final_in(x)
        return x, all_probs

    def unembed(self, x: Tensor) -> Tensor:
        """Final norm -> LM head (-> soft-cap) on the residual stream leaving the last block:
        (..., C) -> logits (..., V) float32."""
        return self._softcap(self.raw_logits(x))

    def raw_logits(self, x: Tensor) -> Tensor:
        """Final norm -> LM head, before the soft-cap: (..., C) -> raw logits (..., V) float32."""
        return linear(self.lm_head, norm(self.ln_f, x)).float()  # (..., C) -> (..., V)

    def residual_stream(self, idx: Tensor, *, attn: ForwardSpec | None = None) -> list[Tensor]:
        """The residual stream of the forward pass on idx (B, T) (no cache): n_layer + 1
        tensors (B, T, C), the one entering each block and, last, the one leaving the last
        block (`unembed` of it = the logits)."""
        spec = attn or self._spec
        stream: list[Tensor] = []
        x = self._embed(idx, 0)
        if spec.intervention is not None:
            x = spec.intervention.embed(x)
        x, _ = self._blocks(x, 0, 0, None, spec, stream)
        return [*stream, x]

    def from_layer(self, layer: int, x: Tensor, *, attn: ForwardSpec | None = None) -> Tensor:
        """The forward pass from block `layer` on: x (B, T, C) is the residual stream entering
        it at positions 0..T-1 (e.g. `residual_stream(idx)[layer]`); returns the stream leaving
        the last block (B, T, C), the same numbers as the whole pass gives when x is. What an
        intervention at layer `layer` changes starts here: the layers below need no rerun."""
        return self._blocks(x, layer, 0, None, attn or self._spec)[0]

    def _softcap(self, logits: Tensor) -> Tensor:
        """cap * tanh(logits / cap) with cap = cfg.logit_softcap (0 = logits unchanged)."""
        cap = self.cfg.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, *,
                     static: bool = False) -> KVCache:
        """An empty cache on the model's device/dtype; max_len defaults to block_size. `static`:
        one-token steps run each block compiled (core/decode.py; the first step compiles)."""
        p = self.wte.weight
        return KVCache(self.cfg.n_layer, batch_size, self.cfg.n_head,
                       max_len or self.cfg.block_size, self.cfg.head_dim,
                       device=p.device, dtype=p.dtype, static=static)

    def num_params(self) -> dict[str, int]:
        """Parameter counts. `total` counts every distinct Parameter once (a tied LM head is the
        embedding matrix, counted in `embedding`; `lm_head` is then 0). `position` is the
        learned table (0 otherwise; rope/sinusoidal have no parameters). `non_embedding` =
        total - embedding - position (Kaplan et al.'s N). `matmul` = weights used in matrix
        multiplies per token (blocks + LM head), the N of flops_per_token. `mtp` = the
        training-only matrix of model.mtp_weight (0 without it), in `total` only."""
        count = lambda ps: sum(p.numel() for p in ps)
        attn = count(p for b in self.blocks for p in b.attn.parameters())
        mlp = count(p for b in self.blocks if b.mlp is not None for p in b.mlp.parameters())
        total = count(self.parameters())  # Module.parameters() yields a shared Parameter once
        emb = self.wte.weight.numel()
        pos = self.wpe.weight.numel() if self.wpe is not None else 0
        head = 0 if self.cfg.tie_weights else self.lm_head.weight.numel()
        mtp = self.mtp.weight.numel() if self.mtp is not None else 0
        norm = total - attn - mlp - emb - pos - head - mtp
        matmul = sum(m.weight.numel() for m in self.blocks.modules() if isinstance(m, nn.Linear))
        return {"total": total, "embedding": emb, "position": pos, "lm_head": head,
                "attention": attn, "mlp": mlp, "norm": norm, "non_embedding": total - emb - pos,
                "matmul": matmul + self.lm_head.weight.numel(), "mtp": mtp}


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`with eval_mode(model):` runs the block in eval mode (no dropout) and gives the model
    back in the mode it had, also when the block raises: every measurement of a model that may
    be training (evaluation, sampling, head scores, circuits) goes through it."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def device_of(model: nn.Module) -> torch.device:
    """The device the model's weights are on, where its inputs must be."""
    return next(model.parameters()).device


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, PaLM appendix B convention:
    6 * N + 12 * n_layer * A * seq_len, where N = matmul weights per token
    (n_layer * (4 C A attention + 2 C M MLP if cfg.mlp) + n_out * C for the LM head, tied or
    not, with A = n_head * head_dim (C by default) and M = mlp_dim (4C by default); biases,
    norms, softmax and the embedding lookup are not counted). The attention term counts
    Q K^T and A V over all seq_len keys (2 * 2 * A * T per layer forward, x3 for backward);
    the causal half is not discounted. MFU = flops_per_token * tokens/s / peak."""
    C, A = cfg.n_embd, cfg.n_head * cfg.head_dim
    per_layer = 4 * C * A + (2 * C * cfg.mlp_dim if cfg.mlp else 0)  # c_attn 3CA + c_proj CA
    n = cfg.n_layer * per_layer + cfg.n_out * C
    return 6.0 * n + 12.0 * cfg.n_layer * A * seq_len
