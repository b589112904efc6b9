"""Hugging Face import: load time, peak memory, inspect-heads and sampling speed, on random
GPT-2-shaped checkpoints written locally (nothing is downloaded):

    python benchmarks/hf_bench.py [--shape small|xl|both] [--dir /tmp/minigpt-hf-bench] [--keep]

- small: GPT-2 small's shape (12 layers x 768, 12 heads, 1024 positions, vocab 50257: 124 M
  parameters, 498 MB fp32 in one model.safetensors): load time, peak RSS, `minigpt
  inspect-heads --model` on 64 tokens, `minigpt sample --model` tokens/s with the KV cache.
- xl: GPT-2 XL's shape (48 x 1600, 25 heads: 1.56 B parameters, 6.2 GB fp32 in 1 GB shards with
  their index): load time and peak RSS.

The checkpoint is written tensor by tensor with safetensors (no transformers model of that size
is ever built), keys named as the Hub's gpt2 repository names them (no `transformer.` prefix),
Conv1D layout; the tokenizer is a synthetic GPT-2-sized byte-level BPE (50 000 merges, ids in
merge order, <|endoftext|> = 50256) as vocab.json + merges.txt.

Every figure comes from a fresh `python` process: load time = `minigpt.hf.load_model` in a
process that has already imported torch; peak RSS = the process's VmHWM after loading and one
forward pass over 8 tokens (the tied LM head reads every row of the embedding, the blocks every
weight), minus its VmRSS just before loading. One copy of the weights is the file size; two
copies would be twice that. The page cache is warm (the files were just written). The machine
is shared: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {"small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
          "xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25}}
VOCAB, POSITIONS = 50257, 1024
SHARD_BYTES = 1 << 30


def gpt2_tensors(n_layer: int, n_embd: int, gen: torch.Generator):
    """(name, tensor) of a random GPT-2 in the Hub's naming and Conv1D layout, one at a time."""
    C = n_embd

    def normal(*shape):
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)

    yield "wte.weight", normal(VOCAB, C)
    yield "wpe.weight", normal(POSITIONS, C)
    for i in range(n_layer):
        for ln in ("ln_1", "ln_2"):
            yield f"h.{i}.{ln}.weight", torch.ones(C)
            yield f"h.{i}.{ln}.bias", torch.zeros(C)
        for name, (n_in, n_out) in (("attn.c_attn", (C, 3 * C)), ("attn.c_proj", (C, C)),
                                    ("mlp.c_fc", (C, 4 * C)), ("mlp.c_proj", (4 * C, C))):
            yield f"h.{i}.{name}.weight", normal(n_in, n_out)
            yield f"h.{i}.{name}.bias", torch.zeros(n_out)
    yield "ln_f.weight", torch.ones(C)
    yield "ln_f.bias", torch.zeros(C)


def write_checkpoint(directory: Path, n_layer: int, n_embd: int, n_head: int) -> int:
    """config.json, the weights (1 GB shards + index past 1 GB) and the tokenizer; returns the
    weight bytes. At most one shard's tensors are held in memory at a time."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": VOCAB,
              "n_positions": POSITIONS, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "bos_token_id": 50256, "eos_token_id": 50256}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(0)
    shards: list[list[str]] = []  # tensor names per written shard
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        save_file(current, directory / f"shard-{len(shards)}.safetensors",
                  metadata={"format": "pt"})
        shards.append(list(current))
        current.clear()

    for name, t in gpt2_tensors(n_layer, n_embd, gen):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    if len(shards) == 1:
        os.replace(directory / "shard-0.safetensors", directory / "model.safetensors")
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.replace(directory / f"shard-{i}.safetensors", directory / final)
            weight_map.update(dict.fromkeys(names, final))
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}))
    write_tokenizer(directory)
    return total


def write_tokenizer(directory: Path, n_merges: int = VOCAB - 257) -> None:
    """A synthetic byte-level BPE of GPT-2's size: each merge joins two earlier tokens (short
    ones more often) into a token not seen before; ids follow the merges; then <|endoftext|>."""
    from minigpt.hf.tokenizer import byte_chars

    rng = random.Random(0)
    tokens = list(byte_chars())
    seen = set(tokens)
    merges = []
    while len(merges) < n_merges:
        a = tokens[min(int(rng.expovariate(1 / 300)), len(tokens) - 1)]
        b = tokens[min(int(rng.expovariate(1 / 300)), len(tokens) - 1)]
        if a + b not in seen and len(a + b) <= 16:
            seen.add(a + b)
            tokens.append(a + b)
            merges.append(f"{a} {b}")
    vocab = {t: i for i, t in enumerate(tokens)}
    vocab["<|endoftext|>"] = len(tokens)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False),
                                          encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                          encoding="utf-8")


MEASURE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from minigpt.hf import load_model
torch.set_num_threads(int(sys.argv[2]))
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = status('VmRSS:')
t1 = time.perf_counter()
loaded = load_model(sys.argv[1], 'cpu')
t2 = time.perf_counter()
after_load = status('VmHWM:')
with torch.inference_mode():
    loaded.model(torch.arange(8)[None])
t3 = time.perf_counter()
hwm = status('VmHWM:')
from minigpt.heads.inspection import inspect
from minigpt.heads.probes import prepare_input
inp = prepare_input(loaded.cfg, loaded.tokenizer, probe='induction', max_tokens=64,
                    eot_first=loaded.eot_first)
t4 = time.perf_counter()
inspect(loaded.model, inp)
t5 = time.perf_counter()
print(json.dumps({'import_s': t1 - t0, 'load_s': t2 - t1, 'first_forward_s': t3 - t2,
                  'inspect_s': t5 - t4, 'rss_before': before, 'hwm_after_load': after_load,
                  'hwm_after_forward': hwm}))
"""


def measure_load(directory: Path, threads: int) -> dict:
    r = subprocess.run([sys.executable, "-c", MEASURE, str(directory), str(threads)],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process (user + system), stdout) of a command: CPU
    time is what a busy shared machine disturbs least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("small", "xl", "both"), default="small")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/minigpt-hf-bench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = ap.parse_args()
    shapes = ["small", "xl"] if args.shape == "both" else [args.shape]
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{args.threads} threads")
    for shape in shapes:
        d = args.dir / f"gpt2-{shape}-random"
        t0 = time.perf_counter()
        if not (d / "config.json").is_file():
            shutil.rmtree(d, ignore_errors=True)
            write_checkpoint(d, **SHAPES[shape])
        files = [p for p in d.iterdir() if p.suffix == ".safetensors"]
        nbytes = sum(p.stat().st_size for p in files)
        print(f"\n{shape}: {d} ({len(files)} safetensors file(s), {nbytes / 1e9:.2f} GB; "
              f"written/found in {time.perf_counter() - t0:.0f} s)")
        m = measure_load(d, args.threads)
        grown = m["hwm_after_forward"] - m["rss_before"]
        print(f"  load_model: {m['load_s']:.2f} s (torch + minigpt import before it "
              f"{m['import_s']:.2f} s); first forward (8 tokens) {m['first_forward_s']:.2f} s")
        print(f"  peak RSS: {m['hwm_after_forward'] / 2**30:.2f} GiB; grew "
              f"{grown / 2**30:.2f} GiB over the {m['rss_before'] / 2**30:.2f} GiB before loading "
              f"= {grown / nbytes:.2f} x the weight files (after loading only: "
              f"{(m['hwm_after_load'] - m['rss_before']) / 2**30:.2f} GiB)")
        if shape != "small":
            continue
        print(f"  inspect() on the 64-token induction probe, in that process after the load: "
              f"{m['inspect_s']:.2f} s (explicit and SDPA forward passes, 144 heads scored)")
        s, cpu, out = timed(["minigpt", "inspect-heads", "--model", str(d), "--probe",
                             "induction", "--max-tokens", "64", "--json", "--device", "cpu"])
        print(f"  minigpt inspect-heads --model ... --probe induction --max-tokens 64: {s:.2f} s "
              f"wall, {cpu:.2f} s CPU (process start, imports, load, both attention paths, "
              f"scores); {json.loads(out)['n_tokens']} tokens")
        s, cpu, out = timed(["minigpt", "sample", "--model", str(d), "-p", "Hello, my name is",
                             "-n", "128", "-t", "0", "--json", "--device", "cpu"])
        doc = json.loads(out)
        print(f"  minigpt sample --model ... -n 128 -t 0: {doc['tokens_per_s']:.1f} tokens/s "
              f"with the KV cache, 1 thread ({doc['tokens']} tokens, first after "
              f"{doc['time_to_first_token_s'] * 1000:.0f} ms), {s:.2f} s wall, {cpu:.2f} s CPU")
        s, cpu, out = timed(["minigpt", "bench", "--suite", "sample", "--quick", "--model", str(d),
                             "--device", "cpu"])
        summary = json.loads(out.strip().splitlines()[-1])["sample"]
        print(f"  minigpt bench --suite sample --model ...: decode {summary['decode_tokens_per_s']}"
              f" tokens/s with the KV cache, {summary['decode_tokens_per_s_no_cache']} without; "
              f"time to first token {summary['ttft_ms']} ms (--quick: prompt 32 + 32 new)")
    print(f"\nload average {os.getloadavg()}")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    main()
