"""The train suite of `minigpt bench`: one optimizer step of the real `GPT` with the real
optimizer, and the peak FLOP rate that MFU divides by.

MFU = model FLOPs per token (`minigpt.core.gpt.flops_per_token`, 6N + attention) x tokens/s /
peak. The peak on CPU is the fp32 / bf16 matmul rate measured in the same run (an achievable
peak, not a datasheet number); on CUDA a table of dense tensor-core datasheet peaks, overridden
by `--peak-tflops`, and None ("n/a") for a GPU not in the table rather than a wrong number.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field

import torch

from minigpt.bench.timing import Timing, synchronize, time_fn
from minigpt.config import ModelConfig, TrainConfig
from minigpt.core.gpt import GPT, flops_per_token
from minigpt.device import autocast
from minigpt.events import BenchEvent, OnEvent
from minigpt.train.weights import build_optimizer

# Dense (no sparsity) bf16 tensor-core peaks with fp32 accumulation, TFLOP/s, from vendor
# datasheets and architecture whitepapers (the "with sparsity" figures are twice these). Order
# matters: the first pattern that matches torch.cuda.get_device_name() wins, so the specific
# variants (PCIe, NVL) come before the family. GeForce/RTX figures are the bf16/fp16 rate with
# fp32 accumulation (what PyTorch uses); NVIDIA's headline fp16-accumulate rate is twice that.
# T4 and V100 have no bf16 tensor cores: theirs is the fp16 rate (`--dtype float16`).
GPU_PEAK_TFLOPS: list[tuple[str, str, float]] = [
    (r"B200", "B200", 2250.0),
    (r"H200.*NVL", "H200 NVL", 835.0),
    (r"GH200", "GH200", 989.0),
    (r"H200", "H200 SXM", 989.0),
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.0),
    (r"H100", "H100 SXM", 989.0),
    (r"A100", "A100", 312.0),
    (r"L40S", "L40S", 362.0),
    (r"\bL40\b", "L40", 181.0),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),
    (r"RTX 4090", "RTX 4090", 165.0),
    (r"RTX 3090", "RTX 3090", 71.0),
    (r"\bT4\b", "T4 (fp16)", 65.0),
    (r"V100", "V100 (fp16)", 125.0),
]
FP16_ONLY = {"T4 (fp16)", "V100 (fp16)"}  # labels whose peak holds for float16 only


def gpu_peak_tflops(name: str) -> tuple[str, float] | None:
    """(table entry, TFLOP/s) for a CUDA device name, or None when the GPU is not listed."""
    for pattern, label, tflops in GPU_PEAK_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label, tflops
    return None


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
        if hit[0] in FP16_ONLY and dtype != torch.float16:
            return Peak(None, "unknown", name, f"{hit[0]} has no bf16 tensor cores (its table "
                        "peak is float16): use --dtype float16 or pass --peak-tflops")
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
    flops_per_token: float  # minigpt.core.gpt.flops_per_token(cfg, block_size)
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
    opt, _ = build_optimizer(model, TrainConfig(), device)  # what `minigpt train` steps with
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
