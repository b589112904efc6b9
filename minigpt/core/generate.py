"""Generation on token ids: ids in, ids out. This module knows no tokenizer, no text and no
clock (like nanochat's engine): turning ids into printable text, stop strings and timings are
minigpt/infer/sample.py's, a consumer of this loop.

Two layers, each usable alone:

- `filter_logits` / `sample_token`: temperature, top-k and top-p on one logits vector.
- `generate` (and `sampling_loop`, the same with settings already validated in a `Sampling`):
  an iterator of new token ids for one prompt. With the KV cache it prefills the context once
  and then feeds one token per step, both through `GPT.forward` (whose decode step is the
  one-query case of core/gpt.py's `attention`); without the cache, every step recomputes the
  whole context (the reference the cache is tested against).

Contracts:
- temperature 0 = greedy: argmax, no random numbers drawn, top-k/top-p ignored. A
  temperature > 0 so small that logits / temperature overflows draws from the tokens tied for
  the largest logit (one such token = greedy), computed stably (see `filter_logits`).
- Logits with NaN or +inf stop generation with a MinigptError naming the step
  (`check_logits`); a drawn id always lies in [0, V).
- top_k 0 and top_p 1.0 mean off. top-k keeps every token whose logit ties the k-th largest
  (so ties may admit more than k). top-p keeps the smallest set of most-likely tokens whose
  probability sums to >= top_p (the most likely token is always kept), applied after top-k.
- Same generator state, same model, same device: same tokens.
- Context window: the model sees at most `block_size` tokens. When the sequence would exceed
  that, the window jumps forward to the last `keep = block_size - max(1, block_size // 4)`
  tokens and (with the cache) the cache is re-prefilled from them; positions restart at 0 in
  the new window, which is what the model was trained on for every position encoding
  (a cache cannot simply be shifted: cached keys of learned/sinusoidal positions carry absolute
  positions, and for every encoding the deeper layers' keys were computed from the dropped
  tokens). The uncached path uses the same windows, so both give identical tokens at every
  length. Jumping by block_size // 4 instead of sliding by 1 re-prefills once every
  block_size // 4 tokens instead of every token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from minigpt.core.gpt import device_of, eval_mode
from minigpt.core.sampling import Sampling
from minigpt.errors import ArgumentError, MinigptError

# `Sampling`, `check_seed` and MAX_NEW_TOKENS live in sampling.py (no torch: the command
# line checks its flags before torch loads); import them from there.


# --------------------------------------------------------------------------------------------
# Filtering and sampling one step.


def check_logits(logits: torch.Tensor, step: int) -> None:
    """Refuse next-token logits (V,) holding NaN or +inf, or no finite value at all: nothing
    sensible can be drawn from them (greedy argmax would pick the NaN, a draw an id past the
    vocabulary). `step` is the 1-based generation step, for the message."""
    top = float(logits.max())  # NaN if any entry is NaN, +inf if any is +inf
    if not math.isfinite(top):
        raise MinigptError(
            f"generation step {step}: the model's next-token logits are not finite (largest "
            f"is {top}), so no token can be drawn; the weights hold NaN/inf (a diverged or "
            "damaged run): sample an earlier checkpoint or retrain")


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> float64 tempered logits with -inf outside the allowed set.

    `softmax` of the result is the distribution `sample_token` draws from. temperature must
    be > 0 here (greedy decoding never calls this). Tiny temperatures are computed stably:
    the largest logit is subtracted BEFORE dividing, so every value lies in [-inf, 0] and a
    quotient that overflows becomes -inf, never NaN; when it does, the distribution is exactly
    uniform over the tokens tied for the largest logit (one largest logit = greedy). The
    division is done in float64, where any temperature > 0 the validation admits is nonzero.
    Expects finite logits (see `check_logits`); -inf entries are allowed (never drawn)."""
    logits = logits.double()
    if temperature != 1.0:  # (softmax shifts by the max itself; only a division overflows)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # max exactly 0
    vocab = logits.size(-1)
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)  # float64
        # Keep a token while the tokens strictly more likely hold less than top_p: the
        # smallest set whose mass reaches top_p. "Mass before" is the EXCLUSIVE cumsum, a
        # running sum of the earlier terms only (cumsum - probs would subtract two nearly
        # equal numbers and lose the last digits exactly at the boundary).
        before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
        before[..., 0] = 0.0  # the most likely token always survives
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> int:
    """Draw one token id in [0, V) from finite logits (V,) (see `check_logits`).
    temperature 0 = argmax (draws no random number)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    # Inverse-CDF draw (4 small ops; torch.multinomial costs ~3x more per call). u lies in
    # [0, cdf[-1]): a float32 uniform r <= 1 - 2**-24 times cdf[-1] in float64 stays below
    # cdf[-1] (the product keeps 53 bits), so the first index with cdf > u exists, lies in
    # [0, V) and has probability > 0: a token filtered out (probability exactly 0 adds
    # nothing to the cumsum) is never chosen.
    cdf = torch.cumsum(probs, dim=-1)  # float64
    u = torch.rand(1, generator=generator, device=probs.device).double() * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True))


# --------------------------------------------------------------------------------------------
# The decoding loop.


def context_keep(block_size: int) -> int:
    """Tokens kept when the context window jumps forward (see the module docstring)."""
    return block_size - max(1, block_size // 4)


def truncate_prompt(prompt_ids: Sequence[int], block_size: int) -> tuple[list[int], int]:
    """Left-truncate a prompt to the model's context; returns (ids, number of ids dropped)."""
    ids = list(prompt_ids)
    dropped = max(0, len(ids) - block_size)
    return ids[dropped:], dropped


def generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, use_kv_cache: bool = True,
             stop_ids: Sequence[int] = (),
             on_logits: Callable[[torch.Tensor], None] | None = None,
             compile_step: bool = False) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids continuing `prompt_ids` (non-empty).

    Ends early after yielding a token in `stop_ids` (e.g. <|endoftext|>). `on_logits`, if
    given, sees each step's next-token logits (V,) float32 before sampling (for tests and
    inspection). `model` is a minigpt GPT (anything with `.cfg.block_size`,
    `forward(idx, kv_cache=...)` and `new_kv_cache`); it is put in eval mode for the duration.
    `compile_step` (with the cache): a static cache, so each one-token step runs the blocks
    compiled (core/decode.py: the first step compiles them). The iterator may be abandoned at
    any point (e.g. after a stop string)."""
    how = Sampling(temperature, top_k, top_p, max_new_tokens)
    return sampling_loop(model, prompt_ids, how, generator, use_kv_cache, stop_ids, on_logits,
                         compile_step)


@torch.inference_mode()
def sampling_loop(model: torch.nn.Module, prompt_ids: Sequence[int], how: Sampling,
            generator: torch.Generator | None, use_kv_cache: bool, stop_ids: Sequence[int],
            on_logits: Callable[[torch.Tensor], None] | None,
            compile_step: bool = False) -> Iterator[int]:
    """The decoding loop of `generate`, with the settings already validated in `how`
    (`how.num_samples` is not used: one call, one sample). infer/sample.py runs it per sample."""
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise ArgumentError("prompt_ids", "the prompt must hold at least one token (use "
                            "<|endoftext|> to start from nothing)")
    vocab = model.cfg.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ArgumentError("prompt_ids", f"token id {bad} is outside the model's vocabulary "
                            f"[0, {vocab})")
    block = model.cfg.block_size
    keep = context_keep(block)
    device = device_of(model)
    stops = frozenset(int(t) for t in stop_ids)
    with eval_mode(model):
        _, start = truncate_prompt(ids, block)  # the first id of the model's window
        cache = model.new_kv_cache(1, block, static=compile_step) if use_kv_cache else None
        step_in = torch.empty((1, 1), dtype=torch.long, device=device)  # reused decode input

        def window_logits() -> torch.Tensor:
            """Logits after the whole window ids[start:] (a fresh cache when cached)."""
            if cache is not None:
                cache.reset()
            idx = torch.tensor([ids[start:]], dtype=torch.long, device=device)  # (1, T)
            return model(idx, kv_cache=cache)[0][0, -1]  # (1, T, V) -> (V,)

        logits = window_logits()
        for i in range(how.max_new_tokens):
            check_logits(logits, i + 1)
            if on_logits is not None:
                on_logits(logits)
            tok = sample_token(logits, how.temperature, how.top_k, how.top_p, generator)
            yield tok
            if tok in stops or i == how.max_new_tokens - 1:
                return
            ids.append(tok)
            if len(ids) - start > block:
                start = len(ids) - keep
                logits = window_logits()
            elif cache is None:
                logits = window_logits()
            else:  # one new token: the model's decode step (no mask, one query)
                step_in.fill_(tok)
                logits = model(step_in, kv_cache=cache)[0][0, -1]
