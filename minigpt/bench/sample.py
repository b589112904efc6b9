"""The sample suite of `minigpt bench`: greedy decoding of one sequence (batch 1) without the
KV cache, with it, and (`--compile`) with it through the compiled one-token step
(core/decode.py), through the same generation loop as `minigpt sample`
(`minigpt.core.generate.generate`) on the same threads (`minigpt.device.decoding_threads`, the one
thread policy): time to first token, prefill and decode tokens/s, whether every path produced
the same tokens, and beside the tokens/s the arithmetic of a decoded token (`decode_arithmetic`:
its FLOPs and the bytes of weights and cache it reads), as GFLOP/s and GB/s."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch

from minigpt.bench.timing import Timing, synchronize
from minigpt.config import ModelConfig
from minigpt.core.generate import generate
from minigpt.core.gpt import GPT
from minigpt.device import autocast, decoding_threads
from minigpt.events import BenchEvent, OnEvent


@dataclass
class SampleSettings:
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 256
    vocab_size: int = 1024
    prompt_len: int = 64
    new_tokens: int = 128
    warmup: int = 1
    repeats: int = 5
    model: str = ""  # '' = a random-init minigpt model of the shape above; else what was loaded


@dataclass
class SampleRow:
    """Greedy decoding of one sequence (batch 1). Times are medians over repeats."""

    kv_cache: bool
    compiled: bool  # the compiled one-token step (core/decode.py); its compile is the warm-up
    prompt_len: int
    new_tokens: int
    ttft: Timing  # prompt forward + first token, ms
    decode: Timing  # ms per generated token after the first
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    threads: int  # intra-op threads it decoded on (minigpt.device.decode_threads on CPU)
    flops_per_token: float = 0.0  # the arithmetic of a decoded token (decode_arithmetic)
    bytes_per_token: float = 0.0

    @property
    def label(self) -> str:
        return "compiled" if self.compiled else "yes" if self.kv_cache else "no"

    @property
    def gflops(self) -> float:
        return self.flops_per_token * self.decode_tokens_per_s / 1e9

    @property
    def gbytes(self) -> float:
        return self.bytes_per_token * self.decode_tokens_per_s / 1e9

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ttft"], d["decode"] = self.ttft.as_dict(), self.decode.as_dict()
        d["ttft_ms"] = self.ttft.median_ms
        d["gflops"], d["gbytes_per_s"] = self.gflops, self.gbytes
        return d


def decode_arithmetic(model: GPT, prompt_len: int, new_tokens: int, kv_cache: bool
                      ) -> tuple[float, float]:
    """FLOPs and bytes read per decoded token, averaged over the tokens after the first (the
    positions prompt_len .. prompt_len + new_tokens - 2 are the contexts they extend): with the
    cache, one token through every weight matrix (2 FLOPs a weight) and its attention over the
    context (4 x n_embd FLOPs a key a layer), reading every weight once and the cached keys and
    values; without it, the whole context through the model (every position's logits, the
    causal half of attention), reading the weights once. Norms, softmax and the embedding
    lookup are not counted."""
    cfg, size = model.cfg, next(model.parameters()).element_size()
    n = model.num_params()
    weights, mat = n["total"] - n["mtp"], n["matmul"]
    contexts = range(prompt_len + 1, prompt_len + new_tokens)
    flops = bytes_ = 0.0
    for ctx in contexts:
        attn = 4 * cfg.n_layer * cfg.n_embd * ctx
        if kv_cache:
            flops += 2 * mat + attn
            bytes_ += size * (weights + 2 * cfg.n_layer * cfg.n_embd * ctx)
        else:
            flops += ctx * 2 * mat + attn * ctx / 2
            bytes_ += size * weights
    return flops / len(contexts), bytes_ / len(contexts)


def _generate(model: GPT, prompt: list[int], n: int, use_cache: bool, compiled: bool,
              device: torch.device, dtype: torch.dtype) -> tuple[float, float, list[int]]:
    """Greedy-generate n tokens through `minigpt.core.generate.generate`, as `minigpt sample` does:
    (seconds to first token, seconds for the other n-1, tokens). Each token is a Python int,
    so every step has finished on the device when it is counted."""
    with autocast(device, dtype):
        synchronize(device)
        t0 = time.perf_counter()
        tokens = generate(model, prompt, n, temperature=0.0, use_kv_cache=use_cache,
                          compile_step=compiled)
        out = [next(tokens)]  # prefill + the first token
        t1 = time.perf_counter()
        out += tokens
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out


def settings_for(model: GPT, s: SampleSettings, name: str) -> SampleSettings:
    """`s` resized to a given model: its shape, and the prompt and new tokens within its
    context (at most half of it for the prompt)."""
    m = model.cfg
    prompt = min(s.prompt_len, m.block_size // 2)
    return replace(s, n_layer=m.n_layer, n_embd=m.n_embd, n_head=m.n_head,
                   block_size=m.block_size, vocab_size=m.vocab_size, prompt_len=prompt,
                   new_tokens=min(s.new_tokens, m.block_size - prompt), model=name)


def run_sample_suite(device: torch.device, dtype: torch.dtype, s: SampleSettings,
                     on_event: OnEvent | None = None, model: GPT | None = None,
                     threads: int = 0, compiled: bool = False) -> tuple[list[SampleRow], bool]:
    """Rows without and with the KV cache (and, `compiled`, through the compiled one-token
    step, whose warm-up compiles it), and whether all produced the same greedy tokens.
    `model`: decode this model (on `device`, shaped as `s` says: see `settings_for`) instead
    of a random-init one. `threads`: as `minigpt sample --threads` (0: its own choice)."""
    say = on_event or (lambda e: None)
    if s.prompt_len + s.new_tokens > s.block_size or s.new_tokens < 2:
        raise ValueError("sample suite: need prompt_len + new_tokens <= block_size, new >= 2")
    if model is None:
        cfg = ModelConfig(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd,
                          block_size=s.block_size, vocab_size=s.vocab_size)
        model = GPT.from_config(cfg, seed=0).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, s.vocab_size, (s.prompt_len,), generator=gen).tolist()
    rows, tokens = [], []
    for use_cache, comp in ((False, False), (True, False), (True, True))[:3 if compiled else 2]:
        say(BenchEvent("sample", f"greedy decode, kv_cache={use_cache}"
                       + (", compiled step (the warm-up compiles it)" if comp else "")))
        ttft, per_tok = [], []
        with decoding_threads(model, threads) as used:  # as `minigpt sample` decodes
            for i in range(s.warmup + s.repeats):
                first, rest, out = _generate(model, prompt, s.new_tokens, use_cache, comp,
                                             device, dtype)
                if i >= s.warmup:
                    ttft.append(first * 1e3)
                    per_tok.append(rest * 1e3 / (s.new_tokens - 1))
        tokens.append(out)
        t_ttft, t_dec = Timing.from_samples(ttft), Timing.from_samples(per_tok)
        rows.append(SampleRow(use_cache, comp, s.prompt_len, s.new_tokens, t_ttft, t_dec,
                              s.prompt_len / (t_ttft.median_ms * 1e-3),
                              1e3 / t_dec.median_ms, used,
                              *decode_arithmetic(model, s.prompt_len, s.new_tokens, use_cache)))
    return rows, all(t == tokens[0] for t in tokens)
