"""Sampling speed: tokens/s with and without the KV cache, `minigpt sample` start-up time, and
the decoding thread count (`minigpt.device.decode_threads`).

    python benchmarks/sample_bench.py                 # both shapes + start-up
    python benchmarks/sample_bench.py --threads 1     # every shape on one thread
    python benchmarks/sample_bench.py --skip-startup --repeats 1
    python benchmarks/sample_bench.py --threads-table # issue 25's table (below)
    python benchmarks/sample_bench.py --crossover     # 1 vs 2 threads by width (below)
    python benchmarks/sample_bench.py --compiled      # the compiled decode step (issue 59)

--threads-table: KV-cache decoding tokens/s of the default shape (4 x 128, block 128, vocab
1024) and of 6 x 384 (block 256) at one and at two threads, each quiet and with a second
process busy (one single-threaded matmul loop, like another training job on the machine),
plus the thread count `decode_threads` picks, the no-cache rate at that count (the cache's
speed-up, >= 10x at 6 x 384 / 256) and `minigpt sample --json` on a random-init run of each
shape (the whole command's own tokens/s figure, decoding under the library's policy). The
two thread counts alternate within each repeat and the best repeat is kept, so a load spike
hits both alike.

--crossover: the same 1-against-2-thread comparison at widths 128 to 768 (4 layers, block
128): the width where 2 threads start to win sets `DECODE_WEIGHTS_PER_THREAD`.

Each measurement generates `block_size - 1` tokens from a one-token prompt (so the context
fills up exactly once and no re-prefill happens) with a random-init model at temperature 1,
and keeps the best of `--repeats` runs (the least disturbed by other processes). No-cache
recomputes the whole context for every token, so its per-token cost grows with the position;
the reported figure is the average over the whole fill. Issue 5's targets: cache >= 3x no-cache
at (n_layer 4, n_embd 128, block_size 64) (reference no-cache ~230 tokens/s), >= 10x at
(n_layer 6, n_embd 384, block_size 256); `minigpt sample` first token < 2 s after launch.

Start-up: a tiny random-init run is saved to a temporary directory, then
`python -m minigpt sample --run DIR --stream -n 1` runs in a subprocess; we time the first byte
on stdout (and the whole process), against `python -c "import torch"` for scale.

CPU timings on a shared machine are noisy: say so when quoting them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minigpt.config import ModelConfig, from_dict
from minigpt.core.generate import generate
from minigpt.core.gpt import GPT
from minigpt.device import decode_threads

SHAPES = {
    "small": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64},
    "big": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256},
}
TARGETS = {"small": 3.0, "big": 10.0}


def compiled_table(args) -> None:
    """Issue 59's decode table: both shapes decode block_size - 1 tokens from a one-token prompt
    (greedy) without the cache, with it (eager) and through the compiled one-token step
    (core/decode.py), the three alternating within every repeat; best wall tokens/s and best
    tokens per CPU-second of this thread, and how long the first compiled decode took (the
    compile: a warm inductor cache in the minigpt cache after the first run of a shape)."""
    from minigpt.device import use_compile_cache

    use_compile_cache("")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, vocab {args.vocab}, {args.pos}, fp32 CPU, "
          f"best of {args.repeats}; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores (shared machine: noisy)")
    for name, shape in SHAPES.items():
        model = random_model(shape, args.vocab, args.pos)
        n = shape["block_size"] - 1
        t0 = time.perf_counter()
        list(generate(model, [0], 4, temperature=0.0, compile_step=True))
        first = time.perf_counter() - t0
        paths = {"no cache": (False, False), "cache": (True, False), "compiled": (True, True)}
        wall, cpu, toks = dict.fromkeys(paths, 0.0), dict.fromkeys(paths, 0.0), {}
        for _ in range(args.repeats):
            for p, (cache, comp) in paths.items():
                t, c = time.perf_counter(), time.thread_time()
                toks[p] = list(generate(model, [0], n, temperature=0.0, use_kv_cache=cache,
                                        compile_step=comp))
                wall[p] = max(wall[p], n / (time.perf_counter() - t))
                cpu[p] = max(cpu[p], n / max(time.thread_time() - c, 1e-9))
        same = toks["compiled"] == toks["cache"] == toks["no cache"]
        print(f"{name:5s} {shape['n_layer']} x {shape['n_embd']}, {n} new tokens: "
              + ", ".join(f"{p} {wall[p]:.0f} tok/s ({cpu[p]:.0f} per CPU-s)" for p in paths)
              + f"; compiled / no cache {wall['compiled'] / wall['no cache']:.1f}x wall, "
              f"{cpu['compiled'] / cpu['no cache']:.1f}x CPU; cache / no cache "
              f"{wall['cache'] / wall['no cache']:.1f}x wall, "
              f"{cpu['cache'] / cpu['no cache']:.1f}x CPU; first compiled decode {first:.1f} s; "
              f"greedy tokens {'identical' if same else 'DIFFER'}; load "
              f"{os.getloadavg()[0]:.1f}")


def tokens_per_s(model: GPT, use_kv_cache: bool, repeats: int) -> tuple[float, float]:
    """Best (wall tokens/s, tokens per CPU-second of this process) over `repeats` runs. The
    CPU-time figure is less disturbed by other processes (with 1 thread it approximates an
    idle core); with several threads it also counts their spinning."""
    n = model.cfg.block_size - 1
    best_wall = best_cpu = 0.0
    for r in range(repeats):
        gen = torch.Generator().manual_seed(r)
        t0, c0 = time.perf_counter(), time.process_time()
        toks = list(generate(model, [0], n, temperature=1.0, generator=gen,
                             use_kv_cache=use_kv_cache))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert len(toks) == n
        best_wall, best_cpu = max(best_wall, n / wall), max(best_cpu, n / max(cpu, 1e-9))
    return best_wall, best_cpu


def bench_shapes(args) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {args.vocab}, "
          f"{args.pos}, fp32 CPU, best of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine: noisy)")
    for name, shape in SHAPES.items():
        cfg = ModelConfig(vocab_size=args.vocab, pos_encoding=args.pos, **shape)
        model = GPT.from_config(cfg, seed=0).eval()
        list(generate(model, [0], 8))  # warm-up (allocator, kernels)
        cached, cached_cpu = tokens_per_s(model, True, args.repeats)
        plain, plain_cpu = tokens_per_s(model, False, args.repeats)
        ok = "ok" if cached / plain >= TARGETS[name] else "BELOW TARGET"
        print(f"{name:5s} n_layer={shape['n_layer']} n_embd={shape['n_embd']} "
              f"block_size={shape['block_size']}: cache {cached:6.0f} tok/s, "
              f"no cache {plain:5.0f} tok/s, speed-up {cached / plain:5.1f}x "
              f"(target >= {TARGETS[name]:.0f}x: {ok}); per CPU-second: cache "
              f"{cached_cpu:.0f}, no cache {plain_cpu:.0f} ({cached_cpu / plain_cpu:.1f}x)")


DEFAULT_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128}  # configs/default
BIG_SHAPE = SHAPES["big"]


@contextlib.contextmanager
def busy_process(on: bool):
    """A second process keeping one core busy (single-threaded float32 matmuls, as a training
    job would), for the duration; nothing when `on` is false."""
    if not on:
        yield
        return
    code = ("import torch\ntorch.set_num_threads(1)\na = torch.randn(256, 256)\n"
            "while True:\n    a = (a @ a).tanh()\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(2.0)  # torch imported, the loop running
        yield
    finally:
        proc.kill()
        proc.wait()


def paired_rates(model: GPT, threads: list[int], repeats: int, n: int,
                 use_kv_cache: bool = True) -> dict[int, float]:
    """Best tokens/s of decoding `n` tokens (one-token prompt, temperature 1) at each thread
    count, the counts alternating within every repeat."""
    best = dict.fromkeys(threads, 0.0)
    for r in range(repeats):
        for t in threads:
            torch.set_num_threads(t)
            gen = torch.Generator().manual_seed(r)
            t0 = time.perf_counter()
            toks = list(generate(model, [0], n, temperature=1.0, generator=gen,
                                 use_kv_cache=use_kv_cache))
            best[t] = max(best[t], len(toks) / (time.perf_counter() - t0))
    return best


def random_model(shape: dict, vocab: int, pos: str = "rope") -> GPT:
    model = GPT.from_config(ModelConfig(vocab_size=vocab, pos_encoding=pos, **shape), seed=0)
    model.eval()
    list(generate(model, [0], 8))  # warm-up (allocator, kernels)
    return model


def cli_tokens_per_s(shape: dict, vocab: int, n: int, busy: bool) -> float:
    """`minigpt sample --json -n N` on a random-init run of `shape` (a byte tokenizer, the model
    padded to `vocab` rows): the tokens/s the command itself reports, best of two."""
    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.run.checkpoint import save_checkpoint

    tok = bytes_tokenizer()
    with tempfile.TemporaryDirectory() as tmp, busy_process(busy):
        cfg = from_dict({"model": {**shape, "vocab_size": max(vocab, tok.n_vocab)}})
        save_checkpoint(Path(tmp) / "run", step=0, model=GPT.from_config(cfg, seed=0), cfg=cfg,
                        tokenizer=tok, trainer_state={"step": 0})
        best = 0.0
        for _ in range(2):
            r = subprocess.run([sys.executable, "-m", "minigpt", "sample", "--run",
                                str(Path(tmp) / "run"), "-n", str(n), "--seed", "0", "--json",
                                "--device", "cpu"], capture_output=True, text=True, check=True)
            best = max(best, json.loads(r.stdout.splitlines()[0])["tokens_per_s"])
    return best


def threads_table(args) -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, vocab {args.vocab}, fp32 CPU, "
          f"best of {args.repeats} (1 and 2 threads alternating); load average "
          f"{os.getloadavg()[0]:.1f} at the start")
    print("| shape | load | 1 thread tok/s | 2 threads tok/s | policy | no cache at policy "
          "| cache speed-up | `minigpt sample` tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, shape in (("4 x 128 / 128 (default)", DEFAULT_SHAPE), ("6 x 384 / 256", BIG_SHAPE)):
        model = random_model(shape, args.vocab)
        policy = decode_threads(model, 2)
        n = shape["block_size"] - 1
        for busy in (False, True):
            with busy_process(busy):
                rates = paired_rates(model, [1, 2], args.repeats, n)
                torch.set_num_threads(policy)
                plain = tokens_per_s(model, False, max(1, args.repeats // 2))[0]
            cli = cli_tokens_per_s(shape, args.vocab, 500, busy)
            print(f"| {name} | {'busy' if busy else 'quiet'} | {rates[1]:.0f} | {rates[2]:.0f} "
                  f"| {policy} | {plain:.0f} | {rates[policy] / plain:.1f}x | {cli:.0f} |",
                  flush=True)


def crossover(args) -> None:
    print(f"1 vs 2 threads, KV-cache decoding of 127 tokens, 4 layers, block 128, vocab "
          f"{args.vocab}, best of {args.repeats}; load average {os.getloadavg()[0]:.1f}")
    print("| n_embd | 1 thread tok/s | 2 threads tok/s | 2 / 1 | decode_threads |")
    print("|---|---|---|---|---|")
    for width in (128, 192, 256, 320, 384, 512, 768):
        shape = {"n_layer": 4, "n_head": max(1, width // 64), "n_embd": width, "block_size": 128}
        model = random_model(shape, args.vocab)
        with busy_process(args.busy):
            rates = paired_rates(model, [1, 2], args.repeats, 127)
        print(f"| {width} | {rates[1]:.0f} | {rates[2]:.0f} | {rates[2] / rates[1]:.2f} | "
              f"{decode_threads(model, 2)} |", flush=True)


def bench_startup(args) -> None:
    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.run.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        tok = bytes_tokenizer()
        cfg = from_dict({"model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64,
                                   "vocab_size": tok.n_vocab}})
        save_checkpoint(run, step=0, model=GPT.from_config(cfg, seed=0), cfg=cfg, tokenizer=tok,
                        trainer_state={"step": 0})
        cmd = [sys.executable, "-m", "minigpt", "sample", "--run", str(run), "--stream",
               "-p", "To be", "-n", "20", "--seed", "0", "--device", "cpu"]
        firsts, totals = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            proc.stdout.read(1)
            firsts.append(time.perf_counter() - t0)
            proc.communicate()
            totals.append(time.perf_counter() - t0)
            if proc.returncode != 0:
                raise SystemExit(f"minigpt sample failed with exit code {proc.returncode}")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        torch_import = time.perf_counter() - t0
    best = min(firsts)
    print(f"start-up: `minigpt sample` first output byte after {best:.2f} s (best of "
          f"{args.repeats}; target < 2 s: {'ok' if best < 2 else 'ABOVE TARGET'}), "
          f"process done after {min(totals):.2f} s; `python -c 'import torch'` alone "
          f"{torch_import:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1024, help="vocab size (default tokenizer's)")
    ap.add_argument("--pos", default="rope", choices=("rope", "learned", "sinusoidal", "none"))
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads(N) for the shapes (0 = torch's default; "
                    "`minigpt sample` decodes with minigpt.device.decode_threads)")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--threads-table", action="store_true",
                    help="tokens/s at 1 and 2 threads, quiet and busy, and the policy's choice")
    ap.add_argument("--crossover", action="store_true", help="1 vs 2 threads by model width")
    ap.add_argument("--compiled", action="store_true",
                    help="no cache, cache and the compiled decode step at both shapes")
    ap.add_argument("--busy", action="store_true", help="--crossover with a second process busy")
    args = ap.parse_args()
    if args.threads_table or args.crossover:
        (threads_table if args.threads_table else crossover)(args)
        return
    if args.compiled:
        compiled_table(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    bench_shapes(args)
    if not args.skip_startup:
        bench_startup(args)


if __name__ == "__main__":
    main()
