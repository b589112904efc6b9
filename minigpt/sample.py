"""Text generation: token ids in, token ids out (no tokenizer import, like nanochat's engine).

Three layers, each usable alone:

- `filter_logits` / `sample_token`: temperature, top-k and top-p on one logits vector.
- `generate`: an iterator of new token ids for one prompt. With the KV cache it prefills the
  context once (GPT.forward) and then feeds one token per step (`DecodeStep`, a lean copy of
  GPT.forward for one token, tested equal to it); without the cache, every step recomputes
  the whole context (the reference the cache is tested against).
- `TextStream`: turns a stream of token ids into text that is safe to print as it arrives
  (never half a UTF-8 character) and applies `--stop` strings, which live in text space
  because a stop string need not fall on token boundaries.

`sample` ties them together for the CLI: it returns one `SampleResult` per sample and reports
printable text through `on_text`, so the same code serves streaming, `--json` and tests.

Contracts:
- temperature 0 = greedy: argmax, no random numbers drawn, top-k/top-p ignored.
- top_k 0 and top_p 1.0 mean off. top-k keeps every token whose logit ties the k-th largest
  (so ties may admit more than k). top-p keeps the smallest set of most-likely tokens whose
  probability sums to >= top_p (the most likely token is always kept), applied after top-k.
- Same generator state, same model, same device: same tokens.
- Samples run one after another (not batched): one generator gives sample i the same tokens
  whether or not later samples are requested, and each sample can stop on its own.
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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minigpt.config import MinigptError
from minigpt.model import GPT

# Generation past this many tokens per sample is refused: a typo such as `-n 10000000000`
# should fail at once, not run for days. A million tokens is hours of CPU sampling.
MAX_NEW_TOKENS = 1_000_000


def check_sampling_args(temperature: float, top_k: int, top_p: float,
                        max_new_tokens: int, num_samples: int = 1) -> None:
    """Raise MinigptError (one line naming the flag) for values sampling cannot honour."""
    if not math.isfinite(temperature) or temperature < 0:
        raise MinigptError(f"--temperature: must be a finite number >= 0 (0 = greedy), "
                           f"got {temperature}")
    if top_k < 0:
        raise MinigptError(f"--top-k: must be >= 0 (0 = off), got {top_k}")
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise MinigptError(f"--top-p: must be in (0, 1] (1 = off), got {top_p}")
    if max_new_tokens < 1:
        raise MinigptError(f"--max-new-tokens: must be >= 1, got {max_new_tokens}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise MinigptError(f"--max-new-tokens: at most {MAX_NEW_TOKENS:,} per sample, "
                           f"got {max_new_tokens:,}")
    if num_samples < 1:
        raise MinigptError(f"--num-samples: must be >= 1, got {num_samples}")


def check_seed(seed: int) -> None:
    """torch generators take seeds in [0, 2**64); say so instead of an overflow traceback."""
    if not 0 <= seed < 2**64:
        raise MinigptError(f"--seed: must be in [0, 2**64), got {seed}")


# --------------------------------------------------------------------------------------------
# Filtering and sampling one step.


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> temperature-scaled logits with -inf outside the allowed set.

    `softmax` of the result is the distribution `sample_token` draws from. temperature must
    be > 0 here (greedy decoding never calls this)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vocab = logits.size(-1)
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p; the first
        # token has 0 before it, so it always survives.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> int:
    """Draw one token id from logits (V,). temperature 0 = argmax (draws no random number)."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    # Inverse-CDF draw (4 small ops; torch.multinomial costs ~3x more per call). u lies in
    # [0, cdf[-1]), so the first index with cdf > u exists and has probability > 0: a token
    # filtered out (probability exactly 0 adds nothing to the cumsum) is never chosen.
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand(1, generator=generator, device=probs.device) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True))


# --------------------------------------------------------------------------------------------
# The decoding loop.


class DecodeStep:
    """One decode step of a minigpt GPT for batch 1: logits (V,) for the token after the
    cached ones, written into the same KVCache as `GPT.forward(idx, kv_cache=cache)` writes.

    It computes exactly what GPT.forward computes for one new token (same weights, kernels
    and RoPE convention; tests compare the two at every step), with about half of its CPU
    time at small widths: the module-call overhead is gone, the weights are looked up once,
    q and k are rotated in one complex multiply, and no mask is built (one query at the end
    sees every cached key). Generation of small models on CPU is bound by this per-op
    overhead, not by arithmetic. Models it does not recognise use GPT.forward instead.
    """

    def __init__(self, model: torch.nn.Module):
        if type(model) is not GPT:
            raise TypeError("DecodeStep needs a minigpt GPT")
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.n_head, self.head_dim, self.n_embd = cfg.n_head, cfg.head_dim, cfg.n_embd
        self.layers = []
        for blk in model.blocks:
            a = blk.attn
            mlp = None
            if blk.mlp is not None:
                mlp = (self._norm(blk.ln_2), blk.mlp.c_fc.weight, blk.mlp.c_fc.bias,
                       blk.mlp.c_proj.weight, blk.mlp.c_proj.bias)
            self.layers.append((self._norm(blk.ln_1), a.c_attn.weight, a.c_attn.bias,
                                a.c_proj.weight, a.c_proj.bias, mlp))
        self.ln_f = self._norm(model.ln_f)
        self.wte, self.head = model.wte.weight, model.lm_head.weight
        self._cache, self._kv = None, []
        self.rot = None
        if model.rotary is not None:
            # e^{i m theta_i} per position m: (block_size, D/2) complex64. The window never
            # holds more than block_size positions, which the model's tables already cover.
            cos, sin = model.rotary.tables(0, cfg.block_size)  # each (P, 1, D/2)
            self.rot = torch.complex(cos[:, 0], sin[:, 0])

    @staticmethod
    def _norm(mod: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        if type(mod) is torch.nn.LayerNorm:
            shape, w, b, eps = mod.normalized_shape, mod.weight, mod.bias, mod.eps
            return lambda x: torch.layer_norm(x, shape, w, b, eps)  # skips F's dispatch checks
        if type(mod) is torch.nn.RMSNorm:
            shape, w, eps = mod.normalized_shape, mod.weight, mod.eps
            return lambda x: torch.rms_norm(x, shape, w, eps)
        return mod.forward

    def __call__(self, token: torch.Tensor, cache) -> torch.Tensor:
        """token (1, 1) long -> logits (V,) float32; appends the token's k/v to `cache`."""
        F = torch.nn.functional
        H, D, C = self.n_head, self.head_dim, self.n_embd
        pos = cache.length
        if pos >= cache.max_len:
            raise MinigptError(f"KV cache full ({cache.max_len} tokens): crop the context")
        if cache is not self._cache:  # per-layer (H, max_len, D) views, made once per cache
            self._cache = cache
            self._kv = [(k, v, k[0], v[0]) for k, v in zip(cache.k, cache.v)]
        x = F.embedding(token.view(1), self.wte)  # (1,) -> (1, C)
        if self.model.wpe is not None:
            x = x + self.model.wpe.weight[pos]
        elif self.cfg.pos_encoding == "sinusoidal":
            x = x + self.model.pe[pos]
        rot = self.rot[pos] if self.rot is not None else None  # (D/2,) complex
        n = pos + 1  # keys after this token
        for (ln_1, w_attn, b_attn, w_proj, b_proj, mlp), (k_buf, v_buf, k_hd, v_hd) in zip(
                self.layers, self._kv):
            qkv = F.linear(ln_1(x), w_attn, b_attn).view(3, H, D)  # q | k | v, head-major
            if rot is not None:  # rotate q and k together: pairs (2i, 2i+1) as complex numbers
                pairs = torch.view_as_complex(qkv[:2].view(2, H, D // 2, 2))
                q, k = torch.view_as_real(pairs * rot).view(2, H, D).unbind(0)  # each (H, D)
            else:
                q, k = qkv[0], qkv[1]
            k_hd.select(1, pos).copy_(k)  # cache[layer][0, :, pos] = k
            v_hd.select(1, pos).copy_(qkv[2])
            y = F.scaled_dot_product_attention(q.view(1, H, 1, D), k_buf.narrow(2, 0, n),
                                               v_buf.narrow(2, 0, n))  # (1, H, 1, D)
            x = x + F.linear(y.reshape(1, C), w_proj, b_proj)
            if mlp is not None:
                ln_2, w_fc, b_fc, w_out, b_out = mlp
                x = x + F.linear(F.gelu(F.linear(ln_2(x), w_fc, b_fc)), w_out, b_out)
        cache.advance(1)
        return F.linear(self.ln_f(x), self.head).view(-1).float()


def make_decode_step(model: torch.nn.Module) -> Callable | None:
    """DecodeStep for a plain minigpt GPT, None for anything else (use model.forward)."""
    try:
        return DecodeStep(model)
    except TypeError:
        return None


def context_keep(block_size: int) -> int:
    """Tokens kept when the context window jumps forward (see the module docstring)."""
    return block_size - max(1, block_size // 4)


def truncate_prompt(prompt_ids: Sequence[int], block_size: int) -> tuple[list[int], int]:
    """Left-truncate a prompt to the model's context; returns (ids, number of ids dropped)."""
    ids = list(prompt_ids)
    dropped = max(0, len(ids) - block_size)
    return ids[dropped:], dropped


@torch.inference_mode()
def generate(model: torch.nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             generator: torch.Generator | None = None, use_kv_cache: bool = True,
             stop_ids: Sequence[int] = (),
             on_logits: Callable[[torch.Tensor], None] | None = None) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids continuing `prompt_ids` (non-empty).

    Ends early after yielding a token in `stop_ids` (e.g. <|endoftext|>). `on_logits`, if
    given, sees each step's next-token logits (V,) float32 before sampling (for tests and
    inspection). `model` is a minigpt GPT (anything with `.cfg.block_size`,
    `forward(idx, kv_cache=...)` and `new_kv_cache`); it is put in eval mode for the duration.
    The iterator may be abandoned at any point (e.g. after a stop string)."""
    check_sampling_args(temperature, top_k, top_p, max_new_tokens)
    ids = [int(t) for t in prompt_ids]
    if not ids:
        raise MinigptError("generate: the prompt must hold at least one token "
                           "(use <|endoftext|> to start from nothing)")
    vocab = model.cfg.vocab_size
    if not all(0 <= t < vocab for t in ids):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise MinigptError(f"generate: prompt token id {bad} is outside the model's "
                           f"vocabulary [0, {vocab})")
    block = model.cfg.block_size
    keep = context_keep(block)
    device = next(model.parameters()).device
    stops = frozenset(int(t) for t in stop_ids)
    was_training = model.training
    model.eval()
    try:
        start = max(0, len(ids) - block)  # first id of the model's current window
        cache = model.new_kv_cache(1, block) if use_kv_cache else None
        step = make_decode_step(model) if use_kv_cache else None
        step_in = torch.empty((1, 1), dtype=torch.long, device=device)  # reused decode input

        def window_logits() -> torch.Tensor:
            """Logits after the whole window ids[start:] (a fresh cache when cached)."""
            if cache is not None:
                cache.reset()
            idx = torch.tensor([ids[start:]], dtype=torch.long, device=device)
            return model(idx, kv_cache=cache)[0][0, -1]

        logits = window_logits()
        for i in range(max_new_tokens):
            if on_logits is not None:
                on_logits(logits)
            tok = sample_token(logits, temperature, top_k, top_p, generator)
            yield tok
            if tok in stops or i == max_new_tokens - 1:
                return
            ids.append(tok)
            if len(ids) - start > block:
                start = len(ids) - keep
                logits = window_logits()
            elif cache is None:
                logits = window_logits()
            else:
                step_in.fill_(tok)
                logits = (step(step_in, cache) if step is not None
                          else model(step_in, kv_cache=cache)[0][0, -1])
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------------------------
# Token ids -> printable text.

_REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenizer with stop strings.

    `push(id)` returns the text that became safe to print: whole characters only (a token
    may end inside a multi-byte UTF-8 character; `decode` renders the partial bytes as
    U+FFFD, which is held back until later tokens complete it) and nothing that might be
    the start of a stop string. Once a stop string appears, `stopped` is set and the text
    before it is the last thing released. `finish()` releases whatever is still held.
    `text` is everything released so far. `decode` must never raise (errors="replace").
    """

    # An incomplete character lacks at most 3 bytes, so at most 3 more tokens complete it; a
    # trailing U+FFFD that survives more tokens than this is a genuinely invalid byte.
    MAX_HELD_TOKENS = 4

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._pending: list[int] = []  # ids whose decoded text is not all released yet
        self._pending_done = 0  # chars of decode(_pending) already passed on
        self._stalled = 0  # consecutive pushes that made no printable progress
        self._held = ""  # whole characters held back as a possible stop-string prefix
        self.text = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._pending.append(int(token_id))
        s = self._decode(self._pending)
        end = len(s)
        while end > self._pending_done and s[end - 1] == _REPLACEMENT:
            end -= 1
        # Tokens in a row that added nothing printable: a character still incomplete after
        # more than MAX_HELD_TOKENS of them is broken, not pending.
        self._stalled = 0 if end > self._pending_done else self._stalled + 1
        if end == len(s) or self._stalled > self.MAX_HELD_TOKENS:
            new = s[self._pending_done:]
            self._pending, self._pending_done, self._stalled = [], 0, 0
        else:
            new = s[self._pending_done:end]
            self._pending_done = end
        return self._release(new)

    def finish(self) -> str:
        """Release everything still held (incomplete bytes print as U+FFFD)."""
        if self.stopped:
            return ""
        out = ""
        if self._pending:
            out = self._release(self._decode(self._pending)[self._pending_done:])
            self._pending, self._pending_done, self._stalled = [], 0, 0
        if not self.stopped and self._held:
            out += self._held
            self.text += self._held
            self._held = ""
        return out

    def _release(self, new: str) -> str:
        buf = self._held + new
        if not self._stops:
            self.text += buf
            self._held = ""
            return buf
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            out = buf[:min(hits)]
            self.stopped = True
            self._held = ""
        else:
            # Hold the longest suffix that a stop string starts with: a stop found later
            # then lies entirely inside held + new text (nothing released can be part of it).
            hold = 0
            for n in range(min(len(buf), self._longest_stop - 1), 0, -1):
                if any(s.startswith(buf[-n:]) for s in self._stops):
                    hold = n
                    break
            out = buf[:len(buf) - hold]
            self._held = buf[len(buf) - hold:]
        self.text += out
        return out


# --------------------------------------------------------------------------------------------
# Whole samples, for the CLI.


@dataclass
class SampleResult:
    index: int  # 0-based sample number
    text: str  # generated text (no prompt, no stop string)
    token_ids: list[int] = field(repr=False)  # generated ids (incl. a final stop/eot token)
    finish_reason: str  # "length" | "stop" (a stop string) | "eot" (a stop id)
    seconds: float  # wall time from starting this sample to its last token
    first_token_s: float  # wall time from starting this sample to its first token

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


def sample(model: torch.nn.Module, prompt_ids: Sequence[int], decode: Callable[[Sequence[int]], str],
           *, max_new_tokens: int, num_samples: int = 1, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, seed: int = 0, stops: Sequence[str] = (),
           stop_ids: Sequence[int] = (), use_kv_cache: bool = True,
           on_text: Callable[[int, str], None] | None = None,
           on_done: Callable[[SampleResult], None] | None = None) -> list[SampleResult]:
    """Generate `num_samples` continuations of `prompt_ids` one after another from one
    generator seeded with `seed`. `on_text(sample_index, text)` receives printable text as it
    becomes safe (see TextStream); `on_done(result)` is called as each sample ends."""
    check_sampling_args(temperature, top_k, top_p, max_new_tokens, num_samples)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    stop_set = frozenset(stop_ids)
    results = []
    for index in range(num_samples):
        stream = TextStream(decode, stops)
        token_ids: list[int] = []
        reason = "length"
        t0 = time.perf_counter()
        first = None
        for tok in generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                            generator, use_kv_cache):
            if first is None:
                first = time.perf_counter() - t0
            token_ids.append(tok)
            if tok in stop_set:
                reason = "eot"
                break
            piece = stream.push(tok)
            if piece and on_text is not None:
                on_text(index, piece)
            if stream.stopped:
                reason = "stop"
                break
        seconds = time.perf_counter() - t0
        tail = stream.finish()
        if tail and on_text is not None:
            on_text(index, tail)
        result = SampleResult(index, stream.text, token_ids, reason, seconds,
                              first if first is not None else seconds)
        results.append(result)
        if on_done is not None:
            on_done(result)
    return results


def read_prompt_file(path: str | Path) -> str:
    """The text of `--prompt-file` (UTF-8); MinigptError if missing, unreadable or empty."""
    p = Path(path)
    if not p.exists():
        raise MinigptError(f"--prompt-file {p}: no such file")
    if p.is_dir():
        raise MinigptError(f"--prompt-file {p}: is a directory; give a text file")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise MinigptError(f"--prompt-file {p}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise MinigptError(f"--prompt-file {p}: not UTF-8 text (invalid byte at offset "
                           f"{e.start})") from None
    if not text:
        raise MinigptError(f"--prompt-file {p}: the file is empty; put a prompt in it, or "
                           "leave out --prompt-file to start from <|endoftext|>")
    return text
