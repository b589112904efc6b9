"""What `inspect-heads --ablate` costs: seconds for every head's ablation effect (one batched
forward pass per chunk of heads, `minigpt.core.heads.ablate_heads`) against one plain
forward pass, on the default model's shape and on GPT-2 small's (random weights: the cost does
not depend on them), on the induction probe at a few lengths.

    python benchmarks/ablation_bench.py [--threads 2] [--repeats 3]

Prints one row per (shape, tokens, mode): the median seconds of ablate_heads, of one forward
pass of the same input, the number of heads and the passes' total rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT
from minigpt.core.heads import CHUNK_FLOATS, ablate_heads

SHAPES = {
    "default (4 x 128, V 1024)": ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128,
                                             vocab_size=1024),
    "GPT-2 small (12 x 768, V 50257)": ModelConfig(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257,
        pos_encoding="learned", bias=True, activation="gelu_tanh"),
}


def median_seconds(repeats: int, fn, *args, **kwargs) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        with torch.no_grad():
            fn(*args, **kwargs)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="zero,mean")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    print("| model | tokens | mode | ablate all heads (s) | one forward (s) | heads | rows per pass |")
    print("|---|---|---|---|---|---|---|")
    for name, cfg in SHAPES.items():
        model = GPT(cfg).eval()
        for T in (64, 128) if cfg.block_size <= 128 else (64, 128, 256):
            half = [int(i) for i in torch.randint(0, cfg.vocab_size, (T // 2,))]
            tokens = half + half
            positions = list(range(T // 2, T - 1))  # the second copy, as inspect-heads scores
            one = median_seconds(args.repeats, model, torch.tensor([tokens]))
            rows = max(1, CHUNK_FLOATS // (T * max(4 * cfg.n_embd, cfg.vocab_size)) - 1) + 1
            for mode in args.modes.split(","):
                secs = median_seconds(args.repeats, ablate_heads, model, tokens, mode,
                                      positions=positions)
                print(f"| {name} | {T} | {mode} | {secs:.2f} | {one:.3f} | "
                      f"{cfg.n_layer * cfg.n_head} | {min(rows, cfg.n_layer * cfg.n_head + 1)} |")


if __name__ == "__main__":
    main()
