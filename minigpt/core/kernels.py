"""The hand-written pieces under the model (core/gpt.py), each the same numbers as the plain
torch it replaces (tests/test_model.py and tests/test_attention.py check each against it), kept
here so gpt.py reads as the maths alone. Measured on the development machine (2 cores, AMD EPYC
with AVX512-BF16, torch 2.13):

- `sdpa`: torch's fused attention kernel, except that on the CPU bf16/fp16 q, k, v run it in
  fp32 and the output is rounded once: the CPU kernel's bf16 forward + backward took twice as
  long as fp32 at the model's shapes ((16, 4, 128, 32) causal: 12.5 against 6.0 ms).
- `softcap_cross_entropy`: the soft-cap and the cross-entropy as one autograd node in eager mode
  (five otherwise; the speedrun's loss went 32.8 -> 12.7 ms a step under the profiler).
- `relu2`: ReLU squared as one autograd node (4.6 -> 1.7 ms a step).
- `dropout`: on the CPU, the mask drawn four elements per 64-bit random integer ((16, 128, 128):
  1.6 ms with `bernoulli_`, 0.3 ms here).
- `linear`, `norm`, `embedding`: the leaf layers called as functions of their parameters,
  skipping nn.Module.__call__ (~10% of a one-token decode step at 4 x 128), unless a hook is on
  the module, so every hook a user registers fires.

Under torch.compile each is written out, for inductor to fuse. Imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

__all__ = ["dropout", "embedding", "hooked", "linear", "norm", "relu2", "sdpa",
           "softcap_cross_entropy"]

# --------------------------------------------------------------------------------------------
# Attention's fused kernel.


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, is_causal: bool, scale: float,
         dropout_p: float) -> Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, ...)`:
    q (B, H, Tq, D), k and v (B, H, Tk, D) -> (B, H, Tq, D). On the CPU, half and bfloat16
    inputs run in float32 outside autocast (which would cast back down) and the output is
    rounded once to their dtype."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", enabled=False):
            out = sdpa(q.float(), k.float(), v.float(), mask=mask, is_causal=is_causal,
                       scale=scale, dropout_p=dropout_p)
        return out.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


# --------------------------------------------------------------------------------------------
# The loss with soft-capped logits, in one pass.


def softcap_cross_entropy(z: Tensor, targets: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """The soft-capped logits `cap * tanh(z / cap)` of raw logits z (N, V) float and their mean
    cross-entropy against targets (N,) (-1 = ignored): the numbers of
    `F.cross_entropy(cap * tanh(z / cap), targets, ignore_index=-1)`, both differentiable.

    Eager, one autograd node instead of five: the capped logits c bound exp(c) by exp(cap), so
    up to a cap of 40 the log-sum-exp needs no max pass and exp(c) is kept for the backward
    (the softmax is exp(c) / its row sum); its backward is (softmax - one_hot) / n_kept times
    tanh's derivative 1 - (c / cap)^2, from the saved c, in three passes over (N, V).
    Under torch.compile the written-out formula, which inductor fuses on its own. Half- and
    bfloat16 logits are computed in float32, as autocast runs F.cross_entropy (a sum of exp
    over the vocabulary in bfloat16 keeps 8 bits); the model's own `raw_logits` are float32
    already, so this guards other callers."""
    if z.dtype in (torch.float16, torch.bfloat16):
        z = z.float()  # (N, V) float32
    if torch.compiler.is_compiling():
        logits = torch.tanh(z / cap) * cap
        return logits, F.cross_entropy(logits, targets, ignore_index=-1)
    return _SoftcapCrossEntropy.apply(z, targets, cap)


class _SoftcapCrossEntropy(torch.autograd.Function):
    EXP_CAP = 40.0  # exp(40) * V stays finite in float32 for any vocabulary below 1e21

    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor, cap: float) -> tuple[Tensor, Tensor]:
        logits = torch.tanh(z * (1.0 / cap)).mul_(cap)  # c (N, V), |c| < cap
        if cap <= _SoftcapCrossEntropy.EXP_CAP:
            e = torch.exp(logits)  # (N, V), no overflow: exp(c) < exp(cap)
            total = e.sum(dim=-1)  # (N,)
            lse = total.log()
        else:
            e, total, lse = None, None, torch.logsumexp(logits, dim=-1)
        keep = targets != -1
        rows = targets.clamp(min=0)  # ignored rows read column 0, weighted 0
        picked = logits.gather(1, rows[:, None]).squeeze(1)  # (N,)
        weight = keep.to(logits.dtype) / keep.sum()  # 1 / n_kept on kept rows, 0 elsewhere
        loss = ((lse - picked) * weight).sum()
        ctx.save_for_backward(logits, total, rows, weight)
        ctx.cap, ctx.exp = cap, e  # exp(c): the backward's buffer (once; recomputed if retained)
        ctx.set_materialize_grads(False)
        return logits, loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_logits: Tensor | None, d_loss: Tensor | None):
        logits, total, rows, weight = ctx.saved_tensors
        e, ctx.exp = ctx.exp, None
        if e is None and total is not None:  # a second backward (retain_graph)
            e = torch.exp(logits)
        if d_loss is not None:  # d loss / d c = (softmax - one_hot) * weight, row by row
            w = weight * d_loss  # (N,)
            g = (e.mul_((w / total)[:, None]) if e is not None
                 else torch.softmax(logits, dim=-1).mul_(w[:, None]))
            g.scatter_add_(1, rows[:, None], -w[:, None])
            if d_logits is not None:
                g.add_(d_logits)
        elif d_logits is not None:
            g = d_logits.clone()
        else:
            return None, None, None
        # through the cap: d c / d z = 1 - tanh^2 = 1 - (c / cap)^2
        g.addcmul_(g * logits, logits, value=-1.0 / (ctx.cap * ctx.cap))
        return g, None, None


# --------------------------------------------------------------------------------------------
# ReLU squared and dropout.


def relu2(x: Tensor) -> Tensor:
    """ReLU squared, max(x, 0)^2 (So et al., Primer, 2021). Eager, one autograd node that
    keeps r = max(x, 0) for its backward, 2 r * grad (the written-out relu then square keep
    both x and r and make four passes back); under torch.compile written out, for inductor."""
    if torch.compiler.is_compiling():
        return F.relu(x).square()
    return _ReLU2.apply(x)


class _ReLU2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        r = F.relu(x)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        (r,) = ctx.saved_tensors
        return torch.mul(r, grad).mul_(2.0)


def dropout(x: Tensor, p: float) -> Tensor:
    """Inverted dropout: each element zeroed with probability `p`, the rest scaled by 1/(1-p);
    p = 0 returns x itself and draws nothing.

    On CPU outside torch.compile the mask is drawn four elements per 64-bit random integer
    (the int64 draws viewed as 16-bit ones; an element is dropped when its 16 bits, read as
    0..65535, fall below round(p * 65536), so p is exact to 2^-17): F.dropout draws one
    double per element, 1.6 ms of a (16, 128, 128) mask against 0.3 ms. Elsewhere F.dropout
    (one fused kernel on CUDA, inductor's under compile). Both use torch's default generator,
    so `torch.manual_seed` fixes the mask."""
    if p == 0.0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p)
    n = x.numel()
    draws = torch.randint(-2**63, 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64)
    bits = draws.view(torch.int16)[:n].view(x.shape)  # uniform over -32768..32767
    keep = bits >= -32768 + round(p * 65536)
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))


# --------------------------------------------------------------------------------------------
# The leaf layers (nn.Linear, the norms, the embeddings) run as functions of their parameters:
# the same op and the same numbers as calling the module, without nn.Module.__call__, whose
# overhead is a fair share of a one-token decode step on CPU (~10% at 4 x 128). A leaf with a
# hook on it (its own forward, pre-forward or backward hooks, or torch's global ones) is called
# as a module, so every hook a user registers fires, as in any torch model: `hooked` is the
# test nn.Module.__call__ itself makes before skipping its hook machinery. A leaf replaced by
# another kind of module (an adapter, a quantised layer) is called as a module too.


# torch's global hook registries (dicts torch fills and empties in place, never rebinds)
_GLOBAL_FWD = _torch_module._global_forward_hooks
_GLOBAL_FWD_PRE = _torch_module._global_forward_pre_hooks
_GLOBAL_BWD = _torch_module._global_backward_hooks
_GLOBAL_BWD_PRE = _torch_module._global_backward_pre_hooks


def hooked(m: nn.Module) -> bool:
    """Whether calling `m` would run any hook (torch's own fast-path test in Module.__call__)."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or _GLOBAL_FWD or _GLOBAL_FWD_PRE or _GLOBAL_BWD
                or _GLOBAL_BWD_PRE)


def linear(m: nn.Module, x: Tensor) -> Tensor:
    """`m(x)`: x (..., in) -> (..., out); a module put in place of the nn.Linear (a subclass,
    an adapter), or one with hooks, is called as a module. Under torch.compile on the CPU, one
    row (a decode step's) is a multiply-reduce over the weight, which inductor fuses into one
    pass that streams the weight once: 1.7x MKL's matrix-vector product here (the 6 x 384
    model's 25 matrices: 2.37 against 4.01 ms, one thread; core/decode.py)."""
    if m.__class__ is nn.Linear and not hooked(m):
        if torch.compiler.is_compiling() and x.device.type == "cpu" and x.numel() == x.shape[-1]:
            y = (m.weight * x.reshape(1, -1)).sum(-1)  # (out, in) * (1, in) -> (out,)
            y = y if m.bias is None else y + m.bias
            return y.view(*x.shape[:-1], -1)  # (..., out)
        return F.linear(x, m.weight, m.bias)
    return m(x)


def norm(m: nn.Module, x: Tensor) -> Tensor:
    """`m(x)` for the norms `make_norm` builds (LayerNorm or RMSNorm over the last dim, or
    nn.Identity for none); any other module, or one with hooks, is called as a module."""
    if m.__class__ is nn.Identity and not hooked(m):
        return x
    if m.__class__ is nn.LayerNorm and not hooked(m):
        return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    if m.__class__ is nn.RMSNorm and not hooked(m):
        return F.rms_norm(x, m.normalized_shape, m.weight, m.eps)
    return m(x)


def embedding(m: nn.Module, idx: Tensor) -> Tensor:
    """`m(idx)` for an nn.Embedding: the rows of its weight; with hooks, the module is called."""
    if m.__class__ is nn.Embedding and not hooked(m):
        return F.embedding(idx, m.weight)
    return m(idx)
