"""What `inspect-heads --qk all` costs on GPT-2 small's shape: every head's score split into
(query writer x key writer) terms (minigpt.interp.qk) on a random-init model of 12 layers of 12
heads, 768 wide (MLPs, learned positions, biases, the GPT-2 vocabulary), at 64 tokens, at each
query's most attended key (63 pairs a head, the default with text) and at 32 induction targets
(a probe of two copies), beside one forward pass of the same input.

    python benchmarks/qk_bench.py                      # 2 threads, 3 repeats
    python benchmarks/qk_bench.py --threads 1 --repeats 5

Each timing is the median of --repeats runs (the first, warm-up, run is not counted), wall
clock and this process's CPU seconds; the load average is printed with it: on a shared machine
the wall clock is noisy, and with 2 threads on a loaded machine the CPU seconds include
OpenMP's spinning, so --threads 1 gives the cleanest CPU cost. The work per layer is
one product (writers x 64 tokens x 768) @ (768 x 2 x 768) and then, per head and pair, a
(writers x 64) @ (64 x writers) product: 144 heads of up to 146 writers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from minigpt.config import load_config
from minigpt.core.gpt import GPT
from minigpt.interp.qk import induction_pairs, qk_attribution


def timed(fn, repeats: int) -> tuple[float, list[float], float]:
    """Median wall seconds, every run's, and the median CPU seconds of this process."""
    fn()  # warm-up
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(times), times, statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(None, ["model.n_layer=12", "model.n_head=12", "model.n_embd=768",
                             "model.block_size=1024", "model.vocab_size=50257",
                             "model.pos_encoding=learned", "model.mlp=true", "model.bias=true",
                             "model.activation=gelu_tanh"])
    model = GPT.from_config(cfg, seed=0).eval()
    T = args.tokens
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50257, (1, T), generator=gen)
    half = torch.randint(0, 50257, (T // 2,), generator=gen)
    probe = torch.cat([half, half])[None]
    heads = [(la, h) for la in range(12) for h in range(12)]
    print(f"GPT-2 small shape, {T} tokens, {args.threads} thread(s), torch "
          f"{torch.__version__}; load average before: {os.getloadavg()}")
    with torch.no_grad():
        fwd, _, fwd_cpu = timed(lambda: model(idx), args.repeats)
    print(f"one forward pass: {fwd * 1000:.1f} ms ({fwd_cpu * 1000:.1f} CPU-ms)")
    pairs = induction_pairs(probe[0].tolist(), T // 2)
    for name, x, p in (("each query's most attended key (63 pairs a head)", idx, None),
                       (f"the {len(pairs)} induction targets", probe, pairs)):
        med, times, cpu = timed(lambda x=x, p=p: qk_attribution(model, x, heads, p),
                                args.repeats)
        print(f"every head (144) at {name}: median {med:.2f} s, {cpu:.2f} CPU-s "
              f"(runs {', '.join(f'{t:.2f}' for t in times)})")
    res = qk_attribution(model, idx, heads)
    print(f"largest closure over every head: {max(h.closure for h in res):.1e}; "
          f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
