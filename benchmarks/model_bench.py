"""Model speed: forward and full training-step time and MFU, fp32, with a profile.

    python benchmarks/model_bench.py                 # both reference shapes, vocab 1025
    python benchmarks/model_bench.py --vocab 256 --steps 20 --no-profile
    python benchmarks/model_bench.py --shapes small --vocab 1088 --adamw fused   # train-side ideas

A training step is forward + backward + clip_grad_norm_(1.0) + AdamW (the train loop's work).
MFU = flops_per_token(cfg, block_size) * tokens per step / step time / peak, where the peak is
this machine's fp32 matmul rate measured in the same run (best of a few square torch.mm sizes).
Timings: median (and min) over `--steps` steps after warm-up; on a shared machine they are
noisy (the min is the better estimate of the machine's speed, MFU uses the median).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as prof

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT, flops_per_token
from minigpt.train.weights import adamw_groups

SHAPES = {  # name: (n_layer, n_head, n_embd, block_size, batch)
    "small": (4, 4, 128, 64, 12),
    "medium": (6, 6, 384, 256, 8),
}


def matmul_peak(seconds: float = 1.0) -> tuple[float, int]:
    """Best fp32 GFLOP/s of torch.mm over a few sizes: (gflops, size)."""
    best = (0.0, 0)
    for n in (256, 512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        times = []
        while time.perf_counter() - t0 < seconds / 4:
            t = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t)
            reps += 1
        gflops = 2 * n**3 / min(times) / 1e9
        best = max(best, (gflops, n))
    return best


def step_times(fn, steps: int, warmup: int = 3) -> tuple[float, float]:
    """(median, min) seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def make(shape: str, vocab: int, adamw: str = "default", seed: int = 0):
    n_layer, n_head, n_embd, block, batch = SHAPES[shape]
    cfg = ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block,
                      vocab_size=vocab, dropout=0.0)
    model = GPT.from_config(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (batch, block), generator=g)
    y = torch.randint(0, vocab, (batch, block), generator=g)
    extra = {"fused": True} if adamw == "fused" else {"foreach": True} if adamw == "foreach" \
        else {}
    groups, _ = adamw_groups(list(model.named_parameters()), 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99), **extra)

    def train_step():
        with record_function("phase: forward + loss"):
            _, loss = model(x, y)
        with record_function("phase: backward"):
            loss.backward()
        with record_function("phase: clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with record_function("phase: AdamW step + zero_grad"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    def forward():
        with torch.no_grad():
            model(x)

    return cfg, batch, model, forward, train_step


CATEGORIES = (  # op-name substring -> bucket, first match wins
    ("matmul (mm/addmm/bmm)", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention (SDPA)", ("scaled_dot_product",)),
    ("softmax / cross-entropy", ("softmax", "nll_loss")),
    ("norms", ("layer_norm", "rms_norm", "linalg_vector_norm")),
    ("GELU", ("gelu",)),
    ("AdamW kernels", ("adam", "addcmul", "lerp", "addcdiv", "sqrt")),
    ("copies / fills / cat", ("copy_", "fill_", "zero_", "cat", "stack", "clone")),
    ("embedding", ("embedding",)),
    ("other elementwise", ("aten::add", "aten::mul", "aten::sub", "aten::div", "aten::sum")),
)


def profile(train_step, steps: int = 5, rows: int = 12) -> str:
    """Where a training step's time goes: phases, op buckets (self time) and the top ops."""
    for _ in range(2):
        train_step()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            train_step()
    avgs = p.key_averages()
    phases = {e.key: e.cpu_time_total for e in avgs if e.key.startswith("phase: ")}
    total = sum(phases.values())
    per_step = total / steps / 1e3
    lines = [f"  profile over {steps} steps ({per_step:.1f} ms/step under the profiler):"]
    lines += [f"    {k[7:]:32s} {v / steps / 1e3:7.1f} ms  {v / total:5.0%}"
              for k, v in phases.items()]
    buckets: dict[str, float] = {}
    for e in avgs:
        if e.key.startswith("phase: "):
            continue
        name = next((b for b, keys in CATEGORIES if any(k in e.key for k in keys)), "other")
        buckets[name] = buckets.get(name, 0.0) + e.self_cpu_time_total
    self_total = sum(buckets.values())
    lines.append("  by op kind (self CPU time):")
    lines += [f"    {k:32s} {v / steps / 1e3:7.1f} ms  {v / self_total:5.0%}"
              for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])]
    table = avgs.table(sort_by="self_cpu_time_total", row_limit=rows)
    return "\n".join(lines) + "\n" + table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--vocab", type=int, default=1025, help="vocab_size (256 = bytes, "
                    "1025 = default BPE 1024 + <|endoftext|>)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--adamw", default="default", choices=("default", "foreach", "fused"),
                    help="AdamW implementation (default = torch's choice: a for-loop on CPU)")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    peak, n = matmul_peak()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32 CPU "
          "(shared machine: timings are noisy)")
    print(f"measured fp32 matmul peak: {peak:.1f} GFLOP/s (torch.mm {n}x{n})")
    for shape in args.shapes:
        cfg, batch, model, forward, train_step = make(shape, args.vocab, args.adamw)
        tokens = batch * cfg.block_size
        fpt = flops_per_token(cfg, cfg.block_size)
        t_fwd, t_fwd_min = step_times(forward, args.steps)
        t_step, t_step_min = step_times(train_step, args.steps)
        achieved = fpt * tokens / t_step / 1e9
        print(f"\n[{shape}] n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd {cfg.n_embd}, "
              f"block_size {cfg.block_size}, batch {batch}, vocab {cfg.vocab_size}, "
              f"AdamW {args.adamw}; "
              f"params {model.num_params()['total']:,} (matmul {model.num_params()['matmul']:,})")
        print(f"  forward (no_grad): {t_fwd * 1e3:8.1f} ms (min {t_fwd_min * 1e3:.1f})   "
              f"({fpt / 3 * tokens / t_fwd / 1e9:.1f} GFLOP/s, "
              f"{fpt / 3 * tokens / t_fwd / 1e9 / peak:.0%} of peak)")
        print(f"  train step:        {t_step * 1e3:8.1f} ms (min {t_step_min * 1e3:.1f})   "
              f"({tokens / t_step:,.0f} tok/s, "
              f"{achieved:.1f} GFLOP/s, MFU {achieved / peak:.0%}, at min "
              f"{fpt * tokens / t_step_min / 1e9 / peak:.0%}; {fpt * tokens / 1e9:.2f} GFLOP/step)")
        if not args.no_profile:
            print(profile(train_step))


if __name__ == "__main__":
    main()
