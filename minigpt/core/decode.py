"""Decoding state for the forward pass (core/gpt.py): the KV cache, and the compiled one-token
step.

`KVCache` holds the keys and values of the positions decoded so far. A static cache
(`static=True`) makes the shapes of a one-token step the same at every position: each layer
writes its new key and value at a position held in a tensor and attends over the whole buffer
with a mask of the positions written (preallocated, updated in place each step). That is what
lets the forward pass run each block's one-token step through `torch.compile` (`decode_steps`):
the same Block, compiled once per block for that one shape, so a step makes one call per layer,
and inductor streams each weight matrix once per token in its own fused multiply-reduce
(core/kernels.py's `linear` under compile). Logits equal the eager pass's to float rounding
(tests/test_decode.py).

The compiled step serves only plain decoding: when anything could watch or change the pass (a
hook on any module, torch's global hooks, an Intervention, attention probabilities), the blocks
run eagerly, as always, so every hook fires.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from minigpt.core.kernels import hooked

__all__ = ["KVCache", "decode_steps"]

# inductor's options for a decode step: realize every pointwise result (a vector of n_embd or
# 4 n_embd values) rather than recompute it inside the matrix-vector reductions that read it
# once per output row (GELU's erf 4 n_embd times per row, the norm per row: slower than MKL)
OPTIONS = {"realize_opcount_threshold": 1, "realize_acc_reads_threshold": 1}


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
    - static (the module docstring): `begin(T)` (the forward pass calls it) sets the new
      positions `pos` (T,) and the mask `mask` (T, max_len) (key j visible to new token i when
      j <= length + i); `append` writes at `pos` and returns the whole buffers and the mask.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 *, device=None, dtype: torch.dtype = torch.float32, static: bool = False) -> None:
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.static = static
        self.slots = [LayerSlot(self, i) for i in range(n_layer)] if static else []
        self._keys = torch.arange(max_len, device=device)  # (max_len,) key positions
        self._pos1 = torch.zeros(1, dtype=torch.long, device=device)  # a one-token step's
        self._mask1 = torch.zeros(1, max_len, dtype=torch.bool, device=device)
        self.pos, self.mask = self._pos1, self._mask1

    @property
    def remaining(self) -> int:
        return self.max_len - self.length

    def reset(self) -> None:
        """Forget everything (buffers are reused); the next forward is a prefill at position 0."""
        self.length = 0

    def begin(self, n: int) -> None:
        """A static cache's positions and mask for the next `n` tokens (one token: in place)."""
        if not self.static:
            return
        if n == 1:
            self.pos, self.mask = self._pos1, self._mask1
            self.pos.fill_(self.length)
            torch.le(self._keys, self.length, out=self.mask[0])
            return
        self.pos = torch.arange(self.length, self.length + n, device=self._keys.device)  # (T,)
        self.mask = self._keys[None, :] <= self.pos[:, None]  # (T, max_len)

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write new k, v (B, H, T, D) at [length, length+T) of `layer`; return the keys and
        values to attend to and their mask: the filled prefix views (B, H, length+T, D) and None
        (the positions say it), or, static, the whole buffers (B, H, max_len, D) and `mask`.
        `length` advances only through `advance()`."""
        if self.static:
            return self.slots[layer].append(layer, k, v)
        kb, vb = self.k[layer], self.v[layer]
        start, n = self.length, k.shape[2]
        kb.narrow(2, start, n).copy_(k)  # narrow + copy_: cheaper than slice assignment
        vb.narrow(2, start, n).copy_(v)
        return kb.narrow(2, 0, start + n), vb.narrow(2, 0, start + n), None

    def advance(self, n: int) -> None:
        self.length += n


class LayerSlot:
    """Layer i of a static KVCache as its compiled one-token step sees it: that layer's buffers
    and the cache's positions and mask, all tensors, so one compiled step serves every layer
    (nothing in it depends on which layer it is). Passed as the block's `cache`."""

    static = True

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.k, self.v = cache, cache.k[layer], cache.v[layer]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """KVCache.append for this layer (`layer` is not read)."""
        self.k.index_copy_(2, self.cache.pos, k)
        self.v.index_copy_(2, self.cache.pos, v)
        return self.k, self.v, self.cache.mask


def decode_steps(model: nn.Module, cache: KVCache | None, n_new: int, plain: bool
                 ) -> list[Callable] | None:
    """Each block of `model` compiled for a one-token step on a static cache, or None where the
    step runs eagerly: no static cache, more than one new token, a pass that is not `plain`
    (an Intervention, attention probabilities), under torch.compile already, or a hook on any
    module (so that it fires). Compiled once per model and kept on it (not as a submodule)."""
    if cache is None or not cache.static or n_new != 1 or not plain:
        return None
    if torch.compiler.is_compiling() or any(hooked(m) for m in model.modules()):
        return None
    blocks = list(model.blocks)
    steps = model.__dict__.get("_decode_steps")
    if steps is None or [s._orig_mod for s in steps] != blocks:  # new, or a block replaced
        steps = [torch.compile(b, dynamic=False, fullgraph=True, options=OPTIONS) for b in blocks]
        object.__setattr__(model, "_decode_steps", steps)  # never a registered submodule
    return steps
