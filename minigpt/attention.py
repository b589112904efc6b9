"""Attention and position encodings: the lecture's maths, on `[batch, head, query, key]` tensors.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IMPLS = ("sdpa", "explicit")


@dataclass(frozen=True)
class AttnSpec:
    """How a forward pass computes attention, passed as one value from the model to every layer
    (never by changing the config): `impl` sdpa (fused kernel) or explicit (softmax written out);
    `scale` None = 1/sqrt(head_dim); `return_probs` returns the (B, H, Tq, Tk) probabilities
    (explicit only); `causal` False lifts the mask (the permutation demonstration only: models
    are trained causal).

    `head_hook`, if given, is called in every layer as `head_hook(layer, z)` with z the heads'
    outputs `[batch, head, query, d_head]` (each head's attention-weighted values, before W_O
    mixes the heads into the residual stream) and returns the z to use: the one place to read,
    scale, zero or replace a single head's output (heads/ablation.py builds on it)."""

    impl: str = "sdpa"
    scale: float | None = None
    return_probs: bool = False
    causal: bool = True
    head_hook: Callable[[int, Tensor], Tensor] | None = None

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.return_probs and self.impl != "explicit":
            raise ValueError("attention probabilities need impl='explicit'")


INSPECT = AttnSpec("explicit", return_probs=True)  # what inspect-heads runs


def causal_mask(t_q: int, t_k: int, past_length: int, device=None) -> Tensor:
    """Boolean (Tq, Tk) mask, True = may attend: query i sees keys j <= past_length + i."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(diagonal=past_length)


def attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, causal: bool = True,
              past_length: int = 0, impl: str = "sdpa", return_probs: bool = False,
              dropout_p: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """Scaled dot-product attention over heads.

    q (B, H, Tq, D), k and v (B, H, Tk, D) -> out (B, H, Tq, D), probs (B, H, Tq, Tk) or None.
    `scale` defaults to 1/sqrt(D); pass 1.0 for the lecture's unscaled examples. `causal` masks
    keys after each query's absolute position `past_length + i`. `dropout_p` drops attention
    probabilities (pass 0 outside training). Probabilities come only from `impl="explicit"`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    t_q, t_k = q.shape[-2], k.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    # A mask is needed unless every query may see every key (e.g. one-token decode with a cache).
    needs_mask = causal and past_length < t_k - 1
    top_left = needs_mask and t_q == t_k and past_length == 0  # the training case
    if impl == "sdpa":
        if return_probs:
            raise ValueError("attention probabilities need impl='explicit'")
        mask = causal_mask(t_q, t_k, past_length, q.device) if needs_mask and not top_left else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                             is_causal=top_left, scale=scale)
        return out, None
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Tq, D) @ (B, H, D, Tk) -> (B, H, Tq, Tk)
    if needs_mask:
        scores = scores.masked_fill(~causal_mask(t_q, t_k, past_length, q.device), float("-inf"))
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


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, rot: Tensor | None = None) -> Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of the last dim by the angles whose cos/sin are given.

    x (..., D); cos/sin broadcast against (..., D/2), e.g. x (2, B, H, T, D) with (T, D/2).
    Eager mode treats pair (x_2i, x_2i+1) as the complex number x_2i + i x_2i+1 and multiplies
    it by cos + i sin: one fused op, ~3x faster on CPU (fwd+bwd) than the real arithmetic of
    `apply_rope_real`, which torch.compile gets (inductor handles complex poorly). Half/bf16
    inputs are rotated in float32 (there is no complex bf16) and cast back. `rot`, if given, is
    the precomputed `cos + i sin` (Rotary keeps it, so decoding builds no complex per layer)."""
    if torch.compiler.is_compiling():
        return apply_rope_real(x, cos, sin)
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if rot is None:
        rot = torch.complex(cos.to(xf.dtype), sin.to(xf.dtype))  # (..., D/2) e^{i m theta_i}
    pairs = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))  # (..., D) -> (..., D/2) complex
    out = torch.view_as_real(pairs * rot).flatten(-2)  # (..., D/2) complex -> (..., D)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def apply_rope_real(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope` written out in real arithmetic (same convention, same result)."""
    pairs = x.unflatten(-1, (-1, 2))  # (..., D) -> (..., D/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # each (..., D/2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (..., D/2, 2)
    return rotated.flatten(-2)  # (..., D)


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
    """Cached RoPE tables for one head size; shared by every layer of a GPT."""

    def __init__(self, head_dim: int, block_size: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base
        self._fill(block_size, None)

    def _fill(self, n_pos: int, device) -> None:
        cos, sin = rope_tables(n_pos, head_dim=self.head_dim, base=self.base)
        self.register_buffer("cos", cos.to(device), persistent=False)  # (P, D/2)
        self.register_buffer("sin", sin.to(device), persistent=False)
        self._rot: Tensor | None = None  # cos + i sin; not a buffer: Module.to(dtype) would cast it

    def tables(self, start: int, length: int) -> tuple[Tensor, Tensor, Tensor]:
        """cos, sin and cos + i sin for positions [start, start + length), each (T, D/2): they
        broadcast against q|k stacked as (2, B, H, T, D/2)."""
        end = start + length
        if end > self.cos.shape[0]:  # past block_size during generation: grow (doubling)
            self._fill(max(end, 2 * self.cos.shape[0]), self.cos.device)
        rot = self._rot
        if rot is None or rot.shape[0] != self.cos.shape[0] or rot.device != self.cos.device:
            rot = self._rot = torch.complex(self.cos.float(), self.sin.float())  # (P, D/2)
        return self.cos[start:end], self.sin[start:end], rot[start:end]


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


class KVCache:
    """Keys and values of every layer for incremental decoding (inference only, no autograd).

    Per layer, `k[i]` and `v[i]` are preallocated (B, n_head, max_len, head_dim); `length` is the
    number of tokens cached (the same for every sequence in the batch). Keys are stored AFTER
    RoPE, at their absolute positions 0..length-1.

    Contract with `GPT.forward(idx, kv_cache=cache)`:
    - prefill: pass the prompt (B, T) to an empty cache; decode: pass the next 1+ tokens. The
      model places them at positions `length .. length+T-1` (RoPE angles and learned/sinusoidal
      rows offset by `length`), attends to everything cached plus causally within the new
      tokens, and advances `length` by T. Logits equal a full recompute of the whole sequence.
    - capacity: if `length + T > max_len` the model raises ValueError; nothing is written.
    - block_size: `GPT.new_kv_cache(B)` allocates `max_len = block_size`. When the context is
      full the caller crops: keep the last `block_size - 1` (or fewer) tokens, `reset()` the
      cache and prefill them again; positions restart at 0 for the window. Re-prefilling (not
      sliding the cached keys) is what makes the logits equal a full forward of the cropped
      context: deeper layers' cached k/v depend on the tokens that were dropped. This works for
      every pos_encoding. For rope / sinusoidal / none the caller may instead allocate
      `max_len > block_size` and keep decoding (tables extend on demand; positions past the
      trained length are extrapolation). With `learned` positions, any position >= block_size
      raises ValueError (the table has no row for it): the sampler crops or stops.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 *, device=None, dtype: torch.dtype = torch.float32) -> None:
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0

    @property
    def remaining(self) -> int:
        return self.max_len - self.length

    def reset(self) -> None:
        """Forget everything (buffers are reused); the next forward is a prefill at position 0."""
        self.length = 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write new k, v (B, H, T, D) at [length, length+T) of `layer`; return the filled
        prefix views (B, H, length+T, D). `length` advances only through `advance()`."""
        start, n = self.length, k.shape[2]
        kb, vb = self.k[layer], self.v[layer]
        kb.narrow(2, start, n).copy_(k)  # narrow + copy_: cheaper than slice assignment
        vb.narrow(2, start, n).copy_(v)
        return kb.narrow(2, 0, start + n), vb.narrow(2, 0, start + n)

    def advance(self, n: int) -> None:
        self.length += n
