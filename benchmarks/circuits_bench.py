"""What `inspect-heads --dla / --composition / --patch-from` cost (minigpt.interp.head_circuits), on
the default model's shape and on GPT-2 small's (random weights: the cost does not depend on
them), on the induction probe and its corrupted copy:

- direct logit attribution of every head and component: one forward pass (plus the
  per-component arithmetic), against a plain forward pass;
- composition scores (Q, K and V, every pair of heads, weights only) and, separately, the
  random-weights baseline;
- patching every head against ablating every head (zero), alternated A/B in one process so a
  busy machine slows both alike.

    python benchmarks/circuits_bench.py [--threads 2] [--repeats 3] [--tokens 64]

Prints one markdown row per model with the median seconds of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT
from minigpt.interp import head_circuits as c
from minigpt.interp.heads import ablate_heads
from minigpt.interp.patching import make_metric

SHAPES = {
    "default (4 x 128, V 1024)": ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128,
                                             vocab_size=1024),
    "GPT-2 small (12 x 768, V 50257)": ModelConfig(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257,
        pos_encoding="learned", bias=True, activation="gelu_tanh"),
}


def seconds(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    with torch.no_grad():
        fn(*args, **kwargs)
    return time.perf_counter() - t


def measure(cfg: ModelConfig, T: int, repeats: int) -> dict[str, float]:
    """Median seconds of each operation on a random model of shape `cfg`, T tokens."""
    model = GPT(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    half = torch.randperm(cfg.vocab_size, generator=gen)[:T // 2].tolist()
    clean = half + half
    corrupted = half + torch.randperm(cfg.vocab_size, generator=gen)[:T // 2].tolist()
    metric = make_metric(T, range(T // 2, T - 1))
    out: dict[str, list[float]] = {k: [] for k in ("forward", "dla", "composition",
                                                   "baseline", "patch", "ablate")}
    for _ in range(repeats):
        out["forward"].append(seconds(model, torch.tensor([clean])))
        out["dla"].append(seconds(c.direct_logit_attribution, model, clean, metric))
        out["composition"].append(seconds(c.composition_from_weights, c.head_weights(model)))
        out["baseline"].append(seconds(c.composition_baseline, cfg.n_head, cfg.n_embd,
                                       cfg.head_dim, True))
        out["patch"].append(seconds(c.patch_heads, model, clean, corrupted, metric))
        out["ablate"].append(seconds(ablate_heads, model, clean, "zero",
                                     positions=list(metric.positions)))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--only", default="", help="run only the shapes whose name has this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}, "
          f"{args.tokens} tokens, load average {os.getloadavg()[0]:.1f} at the start")
    print("| model | one forward | DLA (all heads) | composition (Q, K, V) | baseline | "
          "patch all heads | ablate all heads | patch / ablate |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cfg in SHAPES.items():
        if args.only and args.only not in name:
            continue
        m = measure(cfg, args.tokens, args.repeats)
        print(f"| {name} | {m['forward']:.3f} s | {m['dla']:.3f} s | {m['composition']:.2f} s | "
              f"{m['baseline']:.2f} s | {m['patch']:.2f} s | {m['ablate']:.2f} s | "
              f"{m['patch'] / m['ablate']:.2f} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
