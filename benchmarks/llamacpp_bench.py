"""minigpt against llama.cpp on the same model, side by side: one GGUF written by
`minigpt export --format gguf` (f32: the same weights bit for bit) decoded greedily by
llama.cpp (llama-cpp-python, the version CI builds) and by `minigpt.core.generate.generate`
(the loop `minigpt sample` runs), from the same prompt ids, inside one context window.

    python benchmarks/llamacpp_bench.py [--rounds 5] [--threads 1,2] [--shapes default,6x384,gpt2]

Shapes: the default run's (4 x 128, vocab 1024, RoPE -> llama.cpp's gptneox), 6 x 384
(vocab 1024, RoPE) and GPT-2 small (12 x 768, vocab 50257, learned positions -> gpt2); random
weights with noise on every parameter (speed does not depend on them) and a bytes tokenizer
(the ids past 256 are unused tokens). Per shape and thread count, rounds alternate the two
engines in one process (the order flips every round, so a load change hits both alike):
decode tokens/s after the first token, first-token latency (prefill of the prompt + the
first token), the ratio minigpt / llama.cpp of the median tokens/s, and how many greedy
tokens agree before the first difference (llama.cpp runs its tanh-GELU table and an f32 KV
cache here; minigpt the model's own GELU, so a near tie may flip late on random weights).

llama.cpp is driven as fast as Python can drive it: llama_decode of one token and its C greedy
sampler (`llama_sampler_init_greedy`), no logits copied to Python. The machine may be
shared: the load average is printed with every row.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minigpt.config import from_dict
from minigpt.core.generate import generate
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.run.checkpoint import save_checkpoint

SHAPES = {  # name -> (model settings, prompt tokens, new tokens)
    "default": ({"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 128,
                 "vocab_size": 1024, "pos_encoding": "rope"}, 16, 112),
    "6x384": ({"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256,
               "vocab_size": 1024, "pos_encoding": "rope"}, 16, 240),
    "gpt2": ({"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024,
              "vocab_size": 50257, "pos_encoding": "learned", "bias": True,
              "activation": "gelu_tanh"}, 16, 64),
}


def make_gguf(name: str, model: dict, work: Path) -> tuple[GPT, Path]:
    """A run of a random, perturbed model and its GGUF, written by the installed command."""
    tok = bytes_tokenizer()
    cfg = from_dict({"model": model, "tokenizer": {"vocab_size": tok.n_vocab - 1}})
    net = GPT.from_config(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():  # norms and biases no longer 1 and 0
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    run = work / f"run-{name}"
    save_checkpoint(run, step=1, model=net, cfg=cfg, tokenizer=tok, trainer_state={"step": 1})
    out = work / f"{name}.gguf"
    subprocess.run([sys.executable, "-m", "minigpt", "export", "--run", str(run), "--format",
                    "gguf", "--out", str(out)], check=True, capture_output=True)
    return net.eval(), out


@dataclass
class Decode:
    first_s: float  # prefill + first token
    tokens_per_s: float  # the tokens after the first
    tokens: list[int]


def minigpt_decode(model: GPT, prompt: list[int], n: int, threads: int) -> Decode:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        it = generate(model, prompt, n, temperature=0.0)
        out = [next(it)]
        t1 = time.perf_counter()
        out += it
        t2 = time.perf_counter()
    finally:
        torch.set_num_threads(before)
    return Decode(t1 - t0, (n - 1) / (t2 - t1), out)


class LlamaCpp:
    """One llama.cpp context on the GGUF (f32 KV cache, `threads` for decode and prefill)."""

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx,
                                   n_ubatch=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   type_k=0, type_v=0, seed=0, verbose=False)
        self.ctx = self.llm.ctx
        self.greedy = llama_cpp.llama_sampler_init_greedy()

    def decode(self, prompt: list[int], n: int) -> Decode:
        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        ids = (lib.llama_token * len(prompt))(*prompt)
        one = (lib.llama_token * 1)()
        t0 = time.perf_counter()
        if lib.llama_decode(self.ctx, lib.llama_batch_get_one(ids, len(prompt))) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        out = [lib.llama_sampler_sample(self.greedy, self.ctx, -1)]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            one[0] = out[-1]
            if lib.llama_decode(self.ctx, lib.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
            out.append(lib.llama_sampler_sample(self.greedy, self.ctx, -1))
        t2 = time.perf_counter()
        return Decode(t1 - t0, (n - 1) / (t2 - t1), out)


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(name: str, model: GPT, path: Path, prompt_len: int, n: int, threads: int,
            rounds: int) -> None:
    vocab = model.cfg.vocab_size
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    llama = LlamaCpp(path, model.cfg.block_size, threads)
    ours, theirs = [], []
    for r in range(rounds + 1):  # round 0 warms both up and is not counted
        if r % 2:
            a, b = minigpt_decode(model, prompt, n, threads), llama.decode(prompt, n)
        else:
            b = llama.decode(prompt, n)
            a = minigpt_decode(model, prompt, n, threads)
        if r:
            ours.append(a)
            theirs.append(b)
    med = lambda xs, f: statistics.median(f(x) for x in xs)
    tps_m, tps_l = med(ours, lambda d: d.tokens_per_s), med(theirs, lambda d: d.tokens_per_s)
    ratios = sorted(a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs))
    same = agree(ours[0].tokens, theirs[0].tokens)
    print(f"| {name} (V {vocab}) | {threads} | {tps_m:,.0f} | {tps_l:,.0f} | "
          f"{tps_m / tps_l:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) | "
          f"{med(ours, lambda d: d.first_s) * 1e3:.1f} | "
          f"{med(theirs, lambda d: d.first_s) * 1e3:.1f} | {same}/{n} | "
          f"{os.getloadavg()[0]:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/minigpt-llamacpp-bench"))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed (pip install llama-cpp-python)")
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    print(f"torch {torch.__version__}, llama-cpp-python {llama_cpp.__version__}, "
          f"{os.cpu_count()} cores, median of {args.rounds} alternating rounds")
    print("| model | threads | minigpt tokens/s | llama.cpp tokens/s | minigpt / llama.cpp "
          "(range) | minigpt first token (ms) | llama.cpp first token (ms) | greedy tokens "
          "agree | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        settings, prompt_len, n = SHAPES[name]
        model, path = make_gguf(name, settings, args.dir)
        for threads in (int(t) for t in args.threads.split(",")):
            compare(name, model, path, prompt_len, n, threads, args.rounds)


if __name__ == "__main__":
    main()
