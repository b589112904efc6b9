"""The train and sample suites of `minigpt bench`, run on the real `GPT`, plus the peak FLOP
rate that MFU divides by.

MFU = model FLOPs per token (`minigpt.model.flops_per_token`, 6N + attention) x tokens/s /
peak. The peak on CPU is the fp32 / bf16 matmul rate measured in the same run (an achievable
peak, not a datasheet number); on CUDA a table of dense tensor-core datasheet peaks, overridden
by `--peak-tflops`, and None ("n/a") for a GPU not in the table rather than a wrong number.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import asdict, dataclass, field

import torch

from minigpt.bench_timing import BenchEvent, OnEvent, Timing, synchronize, time_fn
from minigpt.config import ModelConfig
from minigpt.model import GPT, flops_per_token
from minigpt.sample import make_decode_step

# Dense (no sparsity) bf16/fp16 tensor-core peaks, TFLOP/s, from vendor datasheets. Order
# matters: the first pattern that matches the device name wins. GeForce figures are NVIDIA's
# FP16-accumulate numbers (fp32 accumulation, what PyTorch uses, peaks at half of them).
GPU_PEAK_TFLOPS: list[tuple[str, str, float]] = [
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100", "H100 SXM", 989.0),
    (r"A100", "A100", 312.0),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),
    (r"RTX 4090", "RTX 4090", 165.0),
]


def gpu_peak_tflops(name: str) -> tuple[str, float] | None:
    """(table entry, TFLOP/s) for a CUDA device name, or None when the GPU is not listed."""
    for pattern, label, tflops in GPU_PEAK_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label, tflops
    return None


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16/fp16 mixed precision (weights stay fp32), as training does; fp32 = no autocast."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, warmup: int = 2,
                  repeats: int = 5) -> tuple[float, Timing]:
    """Measured rate of an (n, n) @ (n, n) matmul in `dtype`: 2 n^3 FLOPs / median time."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device, dtype)
    b = torch.randn(n, n, generator=gen).to(device, dtype)
    t = time_fn(lambda: a @ b, device, warmup=warmup, repeats=repeats, min_sample_ms=20.0)
    return 2.0 * n**3 / (t.median_ms * 1e-3) / 1e12, t


@dataclass
class Peak:
    """The denominator of MFU. tflops None = unknown (MFU reported as n/a)."""

    tflops: float | None
    source: str  # "measured matmul" | "datasheet table" | "--peak-tflops" | "unknown"
    dtype: str
    note: str = ""
    measured: dict = field(default_factory=dict)  # CPU: {"float32": TFLOP/s, "bfloat16": ...}


def find_peak(device: torch.device, dtype: torch.dtype, override: float | None, n: int,
              on_event: OnEvent | None = None) -> Peak:
    say = on_event or (lambda e: None)
    name = str(dtype).removeprefix("torch.")
    measured: dict = {}
    if device.type == "cpu":
        for dt in dict.fromkeys((torch.float32, torch.bfloat16, dtype)):
            say(BenchEvent("train", f"matmul peak {dt} n={n}"))
            tf, t = matmul_tflops(device, dt, n)
            measured[str(dt).removeprefix("torch.")] = {"tflops": tf, "n": n,
                                                        "timing": t.as_dict()}
    if override is not None:
        return Peak(override, "--peak-tflops", name, measured=measured)
    if device.type == "cpu":
        return Peak(measured[name]["tflops"], "measured matmul", name,
                    f"measured {n}x{n} {name} matmul rate on this CPU in this run", measured)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        hit = gpu_peak_tflops(gpu)
        if hit is None:
            return Peak(None, "unknown", name, f"{gpu} not in the table; pass --peak-tflops")
        if dtype not in (torch.bfloat16, torch.float16):
            return Peak(None, "unknown", name, f"table has {hit[0]} bf16/fp16 peaks only; "
                        "pass --peak-tflops for float32")
        return Peak(hit[1], "datasheet table", name, f"{hit[0]} dense bf16/fp16 datasheet peak")
    return Peak(None, "unknown", name, f"no peak for {device.type}; pass --peak-tflops")


# --------------------------------------------------------------------------------------------
# train suite


@dataclass
class TrainShape:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    block_size: int
    batch_size: int
    vocab_size: int = 1024  # the default BPE tokenizer's size

    def model_config(self) -> ModelConfig:
        return ModelConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                           block_size=self.block_size, vocab_size=self.vocab_size)


TRAIN_SHAPES = [TrainShape("4L-128", 4, 128, 4, 64, 12), TrainShape("6L-384", 6, 384, 6, 256, 8)]
TRAIN_SHAPES_QUICK = [TrainShape("4L-128", 4, 128, 4, 64, 12)]


@dataclass
class TrainRow:
    shape: TrainShape
    mode: str  # eager | compile
    params: int  # GPT.num_params()["total"]
    timing: Timing
    tokens_per_s: float
    flops_per_token: float  # minigpt.model.flops_per_token(cfg, block_size)
    achieved_tflops: float
    mfu: float | None  # achieved / peak, None when the peak is unknown
    first_step_s: float  # the first call: includes torch.compile's compilation

    def as_dict(self) -> dict:
        d = asdict(self)
        d["timing"] = self.timing.as_dict()
        d["ms_per_step"] = self.timing.median_ms
        return d


def mfu(flops_per_tok: float, tokens_per_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the peak FLOP/s (None if no peak)."""
    if not peak_tflops:
        return None
    return flops_per_tok * tokens_per_s / (peak_tflops * 1e12)


def run_train_shape(shape: TrainShape, device: torch.device, dtype: torch.dtype, mode: str,
                    peak: Peak, warmup: int, repeats: int) -> TrainRow:
    """Time one optimizer step (forward, backward, AdamW) on random tokens."""
    cfg = shape.model_config()
    model = GPT.from_config(cfg, seed=0).to(device).train()
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.99))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, cfg.vocab_size, (2, shape.batch_size, shape.block_size),
                         generator=gen).to(device)
    fwd = torch.compile(model) if mode == "compile" else model

    def step() -> None:
        with autocast(device, dtype):
            _, loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    synchronize(device)
    t0 = time.perf_counter()
    step()  # eager: allocator and optimizer state warm-up; compile: compilation
    synchronize(device)
    first = time.perf_counter() - t0
    t = time_fn(step, device, warmup=warmup, repeats=repeats)
    tok_s = shape.batch_size * shape.block_size / (t.median_ms * 1e-3)
    fpt = flops_per_token(cfg, shape.block_size)
    return TrainRow(shape, mode, model.num_params()["total"], t, tok_s, fpt,
                    fpt * tok_s / 1e12, mfu(fpt, tok_s, peak.tflops), first)


# --------------------------------------------------------------------------------------------
# sample suite


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


@dataclass
class SampleRow:
    """Greedy decoding of one sequence (batch 1). Times are medians over repeats."""

    kv_cache: bool
    prompt_len: int
    new_tokens: int
    ttft: Timing  # prompt forward + first token, ms
    decode: Timing  # ms per generated token after the first
    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ttft"], d["decode"] = self.ttft.as_dict(), self.decode.as_dict()
        d["ttft_ms"] = self.ttft.median_ms
        return d


def _generate(model: GPT, prompt: torch.Tensor, n: int, use_cache: bool,
              device: torch.device, dtype: torch.dtype) -> tuple[float, float, list[int]]:
    """Greedy-generate n tokens: (seconds to first token, seconds for the other n-1, tokens).
    With the cache in fp32, decode steps go through `DecodeStep`, as `minigpt sample` does."""
    step = make_decode_step(model) if use_cache and dtype == torch.float32 else None
    with torch.inference_mode(), autocast(device, dtype):
        synchronize(device)
        t0 = time.perf_counter()
        cache = model.new_kv_cache(1, prompt.shape[1] + n) if use_cache else None
        logits, _ = model(prompt, kv_cache=cache)  # prefill: (1, P, V)
        nxt = logits[0, -1].argmax().view(1, 1)  # (1, 1)
        synchronize(device)
        t1 = time.perf_counter()
        out, ctx = [nxt], prompt
        for _ in range(n - 1):
            if step is not None:
                last = step(nxt, cache)  # one new position: (V,)
            elif use_cache:
                last = model(nxt, kv_cache=cache)[0][0, -1]  # (1, 1, V) -> (V,)
            else:
                ctx = torch.cat([ctx, nxt], dim=1)  # recompute the whole context: (1, P+i)
                last = model(ctx)[0][0, -1]
            nxt = last.argmax().view(1, 1)
            out.append(nxt)
        synchronize(device)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, torch.cat(out, dim=1)[0].tolist()


def run_sample_suite(device: torch.device, dtype: torch.dtype, s: SampleSettings,
                     on_event: OnEvent | None = None) -> tuple[list[SampleRow], bool]:
    """Rows without and with the KV cache, and whether both produced the same greedy tokens."""
    say = on_event or (lambda e: None)
    if s.prompt_len + s.new_tokens > s.block_size or s.new_tokens < 2:
        raise ValueError("sample suite: need prompt_len + new_tokens <= block_size, new >= 2")
    cfg = ModelConfig(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd,
                      block_size=s.block_size, vocab_size=s.vocab_size)
    model = GPT.from_config(cfg, seed=0).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, s.vocab_size, (1, s.prompt_len), generator=gen).to(device)
    rows, tokens = [], {}
    for use_cache in (False, True):
        say(BenchEvent("sample", f"greedy decode, kv_cache={use_cache}"))
        ttft, per_tok = [], []
        for i in range(s.warmup + s.repeats):
            first, rest, tokens[use_cache] = _generate(model, prompt, s.new_tokens, use_cache,
                                                       device, dtype)
            if i >= s.warmup:
                ttft.append(first * 1e3)
                per_tok.append(rest * 1e3 / (s.new_tokens - 1))
        t_ttft, t_dec = Timing.from_samples(ttft), Timing.from_samples(per_tok)
        rows.append(SampleRow(use_cache, s.prompt_len, s.new_tokens, t_ttft, t_dec,
                              s.prompt_len / (t_ttft.median_ms * 1e-3),
                              1e3 / t_dec.median_ms))
    return rows, tokens[False] == tokens[True]
