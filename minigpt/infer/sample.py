"""Text generation for `minigpt sample`: the token loop of core/generate.py, consumed per
sample, with what that loop leaves out on purpose: text and time.

- `TextStream`: turns a stream of token ids into text that is safe to print as it arrives
  (never half a UTF-8 character) and applies `--stop` strings, which live in text space
  because a stop string need not fall on token boundaries.
- `sample` ties them together for the CLI: it returns one `SampleResult` per sample and reports
  printable text through `on_text`, so the same code serves streaming, `--json` and tests.
  Samples run one after another (not batched): one generator gives sample i the same tokens
  whether or not later samples are requested, and each sample can stop on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from minigpt.core.generate import sampling_loop
from minigpt.core.gpt import device_of, flops_per_token
from minigpt.core.sampling import Sampling
from minigpt.cost import Work, check_flops
from minigpt.device import use_compile_cache
from minigpt.errors import ArgumentError

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


def sample(model: torch.nn.Module, prompt_ids: Sequence[int],
           decode: Callable[[Sequence[int]], str],
           how: Sampling, *, seed: int = 0, stops: Sequence[str] = (),
           stop_ids: Sequence[int] = (), use_kv_cache: bool = True,
           on_text: Callable[[int, str], None] | None = None,
           on_done: Callable[[SampleResult], None] | None = None,
           compile_step: bool = False) -> list[SampleResult]:
    """Generate `how.num_samples` continuations of `prompt_ids` one after another from one
    generator seeded with `seed`. `on_text(sample_index, text)` receives printable text as it
    becomes safe (see TextStream); `on_done(result)` is called as each sample ends.
    `compile_step`: decode through the compiled one-token step (`decode_compiles`)."""
    if compile_step:
        use_compile_cache("")  # inductor's caches under the minigpt cache: compiled once
    device = device_of(model)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    stop_set = frozenset(stop_ids)
    results = []
    for index in range(how.num_samples):
        stream = TextStream(decode, stops)
        token_ids: list[int] = []
        reason = "length"
        t0 = time.perf_counter()
        first = None
        for tok in sampling_loop(model, prompt_ids, how, generator, use_kv_cache, (), None,
                                 compile_step):
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


# --------------------------------------------------------------------------------------------
# What a sampling costs, before it starts.


def sample_flops(cfg, prompt_len: int, new_tokens: int, samples: int,
                 kv_cache: bool = True) -> float:
    """The FLOPs of `samples` samples of `new_tokens` tokens after a `prompt_len`-token prompt
    from a model of `cfg` (a ModelConfig): a forward pass is a third of
    core.gpt.flops_per_token per token at its context; with the KV cache the prompt once and
    one token per step, at the mean context; without it, the whole context every step."""
    block = cfg.block_size
    context = min(block, prompt_len + new_tokens // 2) or 1
    per = flops_per_token(cfg, context) / 3
    step = per if kv_cache else per * context
    return samples * (min(prompt_len, block) * per + new_tokens * step)


def check_sample_cost(model, prompt_len: int, how: Sampling, kv_cache: bool = True,
                      force: bool = False) -> None:
    """`sample_flops` checked by cost's rule (`cost.check_flops`: an hour at this machine's
    measured matmul rate, a lower bound: decoding is slower than its FLOPs): refused naming
    `max_new_tokens` or `num_samples`, whichever is further above its default (200, 1), and
    the largest that fits, unless `force`. Sampling streams its text and may end early at a
    stop: the bound is on what was asked for."""
    cfg = model.cfg
    n, k = how.max_new_tokens, how.num_samples
    name = "num_samples" if k >= n / 200 else "max_new_tokens"

    def work_of(v: int) -> Work:
        new, samples = (n, v) if name == "num_samples" else (v, k)
        return Work(sample_flops(cfg, prompt_len, new, samples, kv_cache), 0.0)

    check_flops(name, getattr(how, name), work_of, device=device_of(model),
                dtype=next(model.parameters()).dtype, force=force,
                what=f"{k:,} sample(s) of {n:,} tokens")


# --------------------------------------------------------------------------------------------
# Whether to decode through the compiled step.


def decode_compiles(use_kv_cache: bool, compile_step: bool) -> bool:
    """`--compile`: decode through the compiled one-token step (core/decode.py), the KV
    cache's, so asking for it with `--no-kv-cache` is an ArgumentError. Off by default: the
    compile (0.4-7 s with inductor's cache warm, 22-140 s cold under load here;
    benchmarks/README.md "The compiled decode step") costs more than it saves on the few
    hundred tokens `minigpt sample` usually draws."""
    if compile_step and not use_kv_cache:
        raise ArgumentError("compile", "--compile compiles the KV-cache decode step; drop "
                            "--no-kv-cache, or --compile")
    return compile_step
