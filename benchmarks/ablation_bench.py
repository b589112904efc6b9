"""What `inspect-heads --ablate` costs: seconds for every head's ablation effect
(`minigpt.interp.heads.ablate_heads`: one clean pass keeps the residual stream, then one batched
pass per layer from that layer on) against one plain forward pass, on the default model's shape
and on GPT-2 small's (random weights: the cost does not depend on them), on the induction probe
at a few lengths.

    python benchmarks/ablation_bench.py [--threads 2] [--repeats 3] [--tokens 64,128]
    python benchmarks/ablation_bench.py --baseline --shapes gpt2 --tokens 128 --modes zero

Prints one row per (shape, tokens, mode): the median seconds of ablate_heads (and the CPU
seconds of all threads, less sensitive to a shared machine), of one forward pass of the same
input, the number of heads and the batched passes' rows. `--baseline` also times, alternating
with it, the way it was done before (every row reruns the whole model, all heads in chunks of
one batched pass: `whole_pass_ablation` below) and prints the ratio and the largest difference
between the two's effects. The load average is printed with every row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT, ForwardSpec
from minigpt.interp.heads import ablate_heads
from minigpt.interp.patching import CHUNK_FLOATS

SHAPES = {
    "default": ("default (4 x 128, V 1024)", ModelConfig(
        n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=1024)),
    "gpt2": ("GPT-2 small (12 x 768, V 50257)", ModelConfig(
        n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257,
        pos_encoding="learned", bias=True, activation="gelu_tanh")),
}


@torch.no_grad()
def whole_pass_ablation(model: GPT, tokens: list[int], positions: list[int]) -> torch.Tensor:
    """The baseline (zero ablation): every head's row reruns the whole model from the
    embeddings, chunks of heads in one batched pass each with an unablated row, logits at every
    position, float64 cross-entropy. Effects (n_layer, n_head)."""
    cfg = model.cfg
    L, H = cfg.n_layer, cfg.n_head
    idx = torch.tensor([tokens])
    targets = idx[0, 1:][positions]
    heads = [(layer, head) for layer in range(L) for head in range(H)]
    rows = max(1, CHUNK_FLOATS // (idx.shape[1] * max(4 * cfg.n_embd, cfg.vocab_size)) - 1)
    effect = torch.zeros(L * H, dtype=torch.float64)
    for start in range(0, len(heads), rows):
        chunk = heads[start:start + rows]
        hit = torch.zeros(1 + len(chunk), L, H, dtype=torch.bool)
        for r, (layer, head) in enumerate(chunk, start=1):
            hit[r, layer, head] = True
        hook = lambda i, z, hit=hit: torch.where(hit[:, i, :, None, None], torch.zeros_like(z), z)
        logits = model(idx.expand(len(chunk) + 1, -1), attn=ForwardSpec(head_hook=hook))[0]
        picked = logits[:, positions]
        loss = F.cross_entropy(picked.reshape(-1, picked.shape[-1]).double(),
                               targets.repeat(len(chunk) + 1), reduction="none")
        loss = loss.view(len(chunk) + 1, -1).mean(dim=1)
        effect[start:start + len(chunk)] = loss[1:] - loss[0]
    return effect.view(L, H)


def timed(fn, *args, **kwargs):
    """(wall seconds, CPU seconds of every thread, result)."""
    t, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, time.process_time() - c, out


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
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="64,128")
    ap.add_argument("--baseline", action="store_true", help="also the whole-pass way (zero)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}")
    print("| model | tokens | mode | ablate all heads (s) | CPU (s) | one forward (s) | heads | "
          "rows per pass | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in args.shapes.split(","):
        name, cfg = SHAPES[key]
        model = GPT(cfg).eval()
        L, H = cfg.n_layer, cfg.n_head
        for T in (int(t) for t in args.tokens.split(",")):
            half = [int(i) for i in torch.randint(0, cfg.vocab_size, (T // 2,))]
            tokens = half + half
            positions = list(range(T // 2, T - 1))  # the second copy, as inspect-heads scores
            one = median_seconds(args.repeats, model, torch.tensor([tokens]))
            rows = max(1, CHUNK_FLOATS // max(T * 4 * cfg.n_embd,
                                              len(positions) * cfg.vocab_size) - 1)
            for mode in args.modes.split(","):
                runs = [timed(ablate_heads, model, tokens, mode, positions=positions)
                        for _ in range(args.repeats)]
                print(f"| {name} | {T} | {mode} | {statistics.median(r[0] for r in runs):.2f} | "
                      f"{statistics.median(r[1] for r in runs):.1f} | {one:.3f} | {L * H} | "
                      f"{min(rows, H) + 1} | {os.getloadavg()[0]:.1f} |", flush=True)
            if args.baseline:
                baseline(model, tokens, positions, args.repeats)


def baseline(model: GPT, tokens: list[int], positions: list[int], repeats: int) -> None:
    """Alternating rounds of ablate_heads (zero) and whole_pass_ablation: medians, ratio,
    largest difference of the effects."""
    new, old = [], []
    for r in range(repeats):
        pair = [lambda: timed(ablate_heads, model, tokens, "zero", positions=positions),
                lambda: timed(whole_pass_ablation, model, tokens, positions)]
        a, b = (pair[0](), pair[1]()) if r % 2 == 0 else reversed((pair[1](), pair[0]()))
        new.append(a)
        old.append(b)
    diff = (new[0][2].effect - old[0][2]).abs().max().item()
    med = lambda xs, i: statistics.median(x[i] for x in xs)
    print(f"baseline (zero): whole pass {med(old, 0):.2f} s wall / {med(old, 1):.1f} s CPU, from "
          f"the residual stream {med(new, 0):.2f} s / {med(new, 1):.1f} s CPU: "
          f"{med(old, 0) / med(new, 0):.2f}x wall, {med(old, 1) / med(new, 1):.2f}x CPU; "
          f"largest effect difference {diff:.1e}; load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
