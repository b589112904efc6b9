"""minigpt's training step against a nanoGPT-style model, side by side in one process.

    python benchmarks/step_ratio.py                      # ~60 s on 2 busy CPU cores
    python benchmarks/step_ratio.py --learned --profile 10 --json step_ratio.json
    python benchmarks/step_ratio.py --compile --profile 0 # + both models under torch.compile
    python benchmarks/step_ratio.py --config speedrun --shape config  # the speedrun's step

The shape of issue 18: n_layer 4, n_embd 128, n_head 4, block_size 64, batch 12, fp32, the
default BPE (1024 merges + <|endoftext|> = 1025 ids) on the bundled Shakespeare, AdamW lr 1e-3,
weight decay 0.1 on matrices, betas (0.9, 0.99), global-norm clip 1.0.

- minigpt: the REAL training step, `train.loop.Trainer.step` (offsets from the data generator,
  `train.batches` rows, forward, backward, the loss/stop-flag stats, clip_grad_norm_, AdamW as
  `train/weights.py` builds it, zero_grad), on a trainer built by `set_up` from the default
  config with the shape above, RoPE positions (the default), no compile, no head scores.
- reference: a plain GPT-2-style model written below, nanoGPT's layout: learned positions
  (wpe), pre-norm blocks, LayerNorm, one fused qkv Linear, `F.scaled_dot_product_attention(
  is_causal=True)`, GELU MLP (4x), tied LM head, no biases (minigpt's default), cross-entropy;
  its step is nanoGPT's: get_batch (torch.randint offsets, stacked numpy slices of the same
  training tokens), forward, backward, clip_grad_norm_(1.0), AdamW (decay / no-decay groups),
  zero_grad, loss.item(). nanoGPT asks for fused AdamW on CUDA only, so on CPU its AdamW is
  the default (foreach) kernel: row `reference`. Row `reference+fused` is the same model with
  fused AdamW (what minigpt uses), so the optimizer kernel can be told apart from the rest.

- `--config NAME`: minigpt's model and optimizer options from that config instead of the
  default's (speedrun: Muon, ReLU^2, QK-norm, soft-cap, dropout, weight average), at the shape;
  `--shape config` takes that config's block_size and batch_size for both models.
- `--learned`: also minigpt with learned positions (the reference's), to show what RoPE
  costs; `--compile`: also minigpt with `train.compile: true` and the reference under
  torch.compile (nanoGPT compiles by default), each compiled before timing starts.

Timing: the models run in alternating blocks of `--block` steps (the order rotates every
round) until `--seconds` of timed steps have passed, so machine load falls on all of them
alike. Per model: the median over rounds of wall ms/step and of process CPU ms/step (all
threads; on a machine shared with other jobs the CPU time is the steadier figure, since time
spent descheduled is not counted); paired ratio = the median over rounds of (other model's
ms / minigpt's ms) in the same round: > 1 means minigpt is faster; steps/s = 1000 / wall ms.
`--profile N` then profiles N steps of minigpt and of the reference (torch.profiler, top ops
by self CPU time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minigpt.config import load_config
from minigpt.device import amp_dtype, forward_context
from minigpt.events import no_events
from minigpt.train.distributed import DistInfo
from minigpt.train.loop import set_up
from minigpt.train.safety import StopFlag
from minigpt.train.saving import Saving

SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12}
LR, WD, BETAS, CLIP = 1e-3, 0.1, (0.9, 0.99), 1.0


# --------------------------------------------------------------------------------------------
# The reference: nanoGPT's model, written out here.


class RefAttention(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.n_head = H
        self.c_attn = nn.Linear(C, 3 * C, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, C: int, H: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, bias=False)
        self.attn = RefAttention(C, H)
        self.ln_2 = nn.LayerNorm(C, bias=False)
        self.c_fc = nn.Linear(C, 4 * C, bias=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * C, C, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, n_layer: int, n_head: int, n_embd: int, block_size: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(RefBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, dtype=torch.long))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                       ignore_index=-1)


class RefStep:
    """nanoGPT's training step on the same training tokens."""

    def __init__(self, tokens: np.ndarray, vocab: int, fused: bool, seed: int = 0,
                 bf16: bool = False):
        torch.manual_seed(seed)
        # nanoGPT's train.py runs the forward under bf16/fp16 autocast on CUDA and in plain
        # fp32 on CPU (`nullcontext` there); `bf16` = the same model under CPU bf16 autocast
        self.ctx = forward_context(torch.device("cpu"), torch.bfloat16 if bf16 else None)
        s = SHAPE
        self.model = RefGPT(vocab, s["n_layer"], s["n_head"], s["n_embd"], s["block_size"])
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **({"fused": True} if fused
                                                                     else {}))
        self.tokens, self.gen = tokens, torch.Generator().manual_seed(seed)

    def get_batch(self):
        T, B = SHAPE["block_size"], SHAPE["batch_size"]
        ix = torch.randint(len(self.tokens) - T, (B,), generator=self.gen)
        x = torch.stack([torch.from_numpy(self.tokens[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(self.tokens[i + 1:i + 1 + T].astype(np.int64))
                         for i in ix])
        return x, y

    def __call__(self) -> float:
        x, y = self.get_batch()
        with self.ctx():
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


# --------------------------------------------------------------------------------------------
# minigpt: its own trainer and step.


def minigpt_step(root: Path, pos: str, cache: Path, compile_: bool = False,
                 config: str = "default", precision: str = "auto"):
    s = SHAPE
    cfg = load_config(config, [
        f"model.n_layer={s['n_layer']}", f"model.n_head={s['n_head']}",
        f"model.n_embd={s['n_embd']}", f"model.block_size={s['block_size']}",
        f"train.batch_size={s['batch_size']}", f"train.learning_rate={LR}",
        f"train.min_lr={LR / 10}", f"train.weight_decay={WD}", f"train.beta1={BETAS[0]}",
        f"train.beta2={BETAS[1]}", f"train.grad_clip={CLIP}", f"train.precision={precision}",
        f"train.compile={'true' if compile_ else 'false'}", "train.head_scores_interval=off",
        "train.max_steps=1000000", f"model.pos_encoding={pos}", f"data.cache_dir={cache}"])
    run_dir = root / f"minigpt-{pos}-{precision}{'-compiled' if compile_ else ''}"
    trainer = set_up(cfg, Saving(run_dir, DistInfo(), resume=False), None, torch.device("cpu"),
                     DistInfo(), no_events)
    trainer.weights.model.train()
    flag = StopFlag()  # not entered: no signal handlers; step() only reads flag.signum

    def step() -> float:
        return trainer.step(flag)[0]

    return trainer, step


# --------------------------------------------------------------------------------------------


def measure(steps: dict, block: int, seconds: float, min_rounds: int = 4
            ) -> tuple[dict[str, list], dict[str, list]]:
    """Alternating blocks: wall and process-CPU ms/step of each model per round, the order
    rotating each round."""
    names = list(steps)
    wall, cpu = {n: [] for n in names}, {n: [] for n in names}
    spent, r = 0.0, 0
    while spent < seconds or r < min_rounds:
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                steps[n]()
            dt = time.perf_counter() - t0
            wall[n].append(1000 * dt / block)
            cpu[n].append(1000 * (time.process_time() - c0) / block)
            spent += dt
        r += 1
    return wall, cpu


def profile(step, n: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(n):
            step()
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def _median_ms(per: dict[str, list]) -> dict[str, float]:
    return {n: statistics.median(v) for n, v in per.items()}


def _paired(per: dict[str, list]) -> dict[str, float]:
    return {n: statistics.median(o / m for o, m in zip(per[n], per["minigpt"]))
            for n in per if n != "minigpt"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="timed seconds, all models")
    ap.add_argument("--block", type=int, default=5, help="steps per timed block")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps per model first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--learned", action="store_true",
                    help="also time minigpt with learned positions (the reference's)")
    ap.add_argument("--compile", action="store_true",
                    help="also time minigpt and the reference under torch.compile")
    ap.add_argument("--profile", type=int, default=10, help="steps profiled per model; 0 = off")
    ap.add_argument("--rows", type=int, default=15, help="ops listed per profile")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--config", default="default",
                    help="minigpt's model and optimizer options from this config (e.g. "
                         "speedrun: Muon, ReLU^2, QK-norm, soft-cap, dropout), at the shape")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="minigpt's train.precision (auto: bf16 autocast on a CPU with "
                         "AVX512-BF16 or AMX, fp32 elsewhere); when it is bf16, rows minigpt-fp32 "
                         "and reference+bf16 are added")
    ap.add_argument("--shape", choices=("issue18", "config"), default="issue18",
                    help="issue18: T 64, batch 12 (both models); config: --config's "
                         "block_size and batch_size")
    args = ap.parse_args()
    if args.shape == "config":
        c = load_config(args.config, [])
        SHAPE.update(block_size=c.model.block_size, batch_size=c.train.batch_size)
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    started = time.perf_counter()
    cache = Path(tempfile.gettempdir()) / "minigpt-step-ratio-cache"  # tokenizer, tokens
    with tempfile.TemporaryDirectory() as tmp:
        trainer, mg = minigpt_step(Path(tmp), "rope", cache, config=args.config,
                                   precision=args.precision)
        b = trainer.batches
        tokens, vocab = np.asarray(b.rows.data.train), b.tokenizer.n_vocab
        steps = {"minigpt": mg, "reference": RefStep(tokens, vocab, fused=False),
                 "reference+fused": RefStep(tokens, vocab, fused=True)}
        precision = amp_dtype(args.precision, torch.device("cpu")) or torch.float32
        if precision == torch.bfloat16:
            steps["minigpt-fp32"] = minigpt_step(Path(tmp), "rope", cache, config=args.config,
                                                 precision="fp32")[1]
            steps["reference+bf16"] = RefStep(tokens, vocab, fused=True, bf16=True)
        if args.learned:
            steps["minigpt-learned"] = minigpt_step(Path(tmp), "learned", cache,
                                                    config=args.config,
                                                    precision=args.precision)[1]
        compile_s = {}
        if args.compile:
            _, cstep = minigpt_step(Path(tmp), "rope", cache, compile_=True, config=args.config,
                                    precision=args.precision)
            ref = RefStep(tokens, vocab, fused=True)
            ref.model = torch.compile(ref.model)  # same Parameters: clip and AdamW unchanged
            for name, fn in (("minigpt+compile", cstep), ("reference+compile", ref)):
                t0 = time.perf_counter()
                fn()
                compile_s[name] = time.perf_counter() - t0
                steps[name] = fn
        params = {"minigpt": trainer.weights.model.num_params()["total"],
                  "reference": sum(p.numel() for p in steps["reference"].model.parameters())}
        for fn in steps.values():
            for _ in range(args.warmup):
                fn()
        wall, cpu = measure(steps, args.block, args.seconds)
        load1 = os.getloadavg()
        ms, cms = _median_ms(wall), _median_ms(cpu)
        paired, cpaired = _paired(wall), _paired(cpu)
        print(f"torch {torch.__version__}, {args.threads} threads, minigpt config {args.config}, "
              f"minigpt precision {args.precision} = {str(precision).removeprefix('torch.')}, "
              f"shape {SHAPE}, vocab {vocab}, params "
              f"{params}, {len(wall['minigpt'])} rounds x {args.block} steps, load average "
              f"{'/'.join(f'{x:.2f}' for x in load0)} before, "
              f"{'/'.join(f'{x:.2f}' for x in load1)} after"
              + (f", first compiled steps {compile_s}" if compile_s else ""))
        print(f"{'model':<18} {'wall ms':>8} {'steps/s':>8} {'ratio':>7} {'CPU ms':>8} "
              f"{'ratio':>7}   (ratio = its ms / minigpt's ms, paired per round)")
        for n in wall:
            r1 = "" if n == "minigpt" else f"{paired[n]:.3f}"
            r2 = "" if n == "minigpt" else f"{cpaired[n]:.3f}"
            print(f"{n:<18} {ms[n]:8.2f} {1000 / ms[n]:8.2f} {r1:>7} {cms[n]:8.2f} {r2:>7}")
        profiles = {}
        if args.profile:
            for n in ("minigpt", "reference"):
                profiles[n] = profile(steps[n], args.profile, args.rows)
                print(f"\nprofile: {n}, {args.profile} steps, top ops by self CPU time\n"
                      + profiles[n])
        print(f"total run time {time.perf_counter() - started:.0f} s")
        if args.json:
            args.json.write_text(json.dumps({
                "shape": SHAPE, "config": args.config, "precision": args.precision,
                "precision_dtype": str(precision), "threads": args.threads, "vocab": vocab,
                "params": params,
                "load_before": load0, "load_after": load1, "block": args.block,
                "wall_ms_per_round": wall, "cpu_ms_per_round": cpu, "wall_ms": ms,
                "cpu_ms": cms, "steps_per_s": {n: 1000 / v for n, v in ms.items()},
                "paired_ratio_wall": paired, "paired_ratio_cpu": cpaired,
                "first_compiled_step_s": compile_s, "profiles": profiles,
                "torch": torch.__version__}, indent=1) + "\n")
        assert all(math.isfinite(v) for v in ms.values())


if __name__ == "__main__":
    main()
