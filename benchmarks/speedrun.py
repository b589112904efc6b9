"""Best text per CPU-minute: validation bits/byte at fixed wall-time budgets, whole process.

Runs `minigpt train` (a subprocess, fresh run directory, a fresh token/tokenizer cache unless
--cache is given, so BPE training and start-up count) for a config plus --set overrides, once
per seed, and prints per run: the whole-process wall time, the start-up share (tokenizer
training, data preparation, model build: wall time minus the training loop's own clock), the
validation bits/byte at each evaluation, and the bits/byte at the --at budgets (seconds of
whole-process wall time: the last evaluation at or before the budget), the step time and the
median over seeds.

    python benchmarks/speedrun.py --config speedrun --seeds 1,2,3          # the 3-seed result
    python benchmarks/speedrun.py --config default --set train.max_steps=2600 --threads 1
    python benchmarks/speedrun.py --config speedrun --jobs 2 --threads 1 --seeds 1,2

--jobs N runs N seeds at once (use --threads 1 with --jobs 2 on 2 cores: the comparisons stay
fair between runs made the same way, not with runs made alone with 2 threads). Timings on a
shared machine are noisy: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from minigpt.run.state import read_metrics  # skips damaged lines, as `minigpt runs` does

ROOT = Path(__file__).resolve().parent.parent


def at_budget(evals: list[tuple[int, float, float]], budget: float) -> float | None:
    """Val bits/byte of the last evaluation (step, whole-process s, bpb) done by `budget` s."""
    done = [bpb for _, t, bpb in evals if t <= budget]
    return done[-1] if done else None


def one(config: str, sets: list[str], seed: int, threads: int, cache: str | None,
        keep: Path | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="minigpt-speedrun-"))
    run = (keep / f"seed{seed}") if keep else tmp / "run"
    flags = [x for s in [*sets, f"run.seed={seed}",
                         f"data.cache_dir={cache or tmp / 'cache'}"] for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "minigpt", "train", "--config", config, "--out", str(run),
           "--device", "cpu", *flags]
    print("$ " + " ".join(cmd[2:]), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(tmp / "train.log", "w") as log:
        rc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, stdout=log,
                            stderr=log).returncode
    wall = time.perf_counter() - t0
    if rc:
        return {"seed": seed, "failed": f"exit {rc}, log {tmp / 'train.log'}"}
    recs, _ = read_metrics(run / "metrics.jsonl")
    evals = [r for r in recs if r.get("kind") == "eval"]
    trains = [r for r in recs if r.get("kind") == "train"]
    heads = [r for r in recs if r.get("kind") == "heads"]
    loop = max(r["elapsed"] for r in recs if "elapsed" in r)
    startup = wall - loop  # tokenizer, data, model build, and the final save/summary
    steps = trains[-1]["step"]
    return {"seed": seed, "wall": wall, "startup": startup, "steps": steps,
            "step_ms": 1000 * loop / steps, "run": str(run),
            "evals": [(e["step"], round(startup + e["elapsed"], 1), e["val_bpb"]) for e in evals],
            "final_bpb": evals[-1]["val_bpb"], "best_bpb": min(e["val_bpb"] for e in evals),
            "head_score_s": sum(h.get("seconds", 0.0) for h in heads),
            "load": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="speedrun")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--seeds", default="1337")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--at", default="150,300", help="whole-process budgets in seconds")
    ap.add_argument("--cache", help="reuse this token cache (start-up then excludes BPE training)")
    ap.add_argument("--keep", type=Path, help="keep the run directories under this directory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    budgets = [float(b) for b in args.at.split(",")]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda s: one(args.config, args.set, s, args.threads,
                                              args.cache, args.keep), seeds))
    for r in results:
        if "failed" in r:
            print(f"seed {r['seed']}: FAILED {r['failed']}", file=sys.stderr)
            continue
        r["at"] = {str(int(b)): at_budget(r["evals"], b) for b in budgets}
        curve = " ".join(f"{s}:{t:.0f}s:{v:.3f}" for s, t, v in r["evals"])
        at = " ".join(f"@{k}s={v:.4f}" if v is not None else f"@{k}s=-"
                      for k, v in r["at"].items())
        print(f"seed {r['seed']}: wall {r['wall']:.1f} s (start-up {r['startup']:.1f} s), "
              f"{r['steps']} steps, {r['step_ms']:.1f} ms/step, final {r['final_bpb']:.4f} "
              f"bpb, {at}, head scoring {r['head_score_s']:.2f} s, load {r['load']:.1f}\n"
              f"  evals (step:s:bpb) {curve}", file=sys.stderr)
    ok = [r for r in results if "failed" not in r]
    for b in budgets:
        vals = [r["at"][str(int(b))] for r in ok if r["at"][str(int(b))] is not None]
        if vals:
            print(f"median val bits/byte at {b:.0f} s over {len(vals)} seeds: "
                  f"{statistics.median(vals):.4f} ({', '.join(f'{v:.4f}' for v in vals)})",
                  file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
