"""Validation bits/byte against wall time for the shipped training recipes.

Trains each config with `minigpt train` (in a subprocess, into a temporary or given run
directory) and reads its metrics.jsonl, or, with --runs, only reads existing run directories.
Prints, per run: the eval curve (step, seconds, val bits/byte), the time to reach the
reference target (2.72 bits/byte, interpolated between evaluations), bits/byte at the
reference's wall time (218 s), steps/s and tokens/s.

Reference (issue 4): a GPT-2-style char-level model (n_layer 4, n_head 4, n_embd 128,
block_size 64, batch 12) reaches 2.72 bits/byte after 2000 steps in about 218 s on this
machine class (2 CPU cores). Goal: lower bits/byte at 218 s and 2.72 within ~73 s.

Wall time is `elapsed` in metrics.jsonl: seconds inside the training loop (steps, evals,
samples and checkpoints included; start-up, tokenizer and data preparation excluded).
Timings on a shared machine are noisy: run it on an otherwise idle machine.

    python benchmarks/train_quality.py                       # default and bytes, ~10 min
    python benchmarks/train_quality.py --configs bytes --set train.max_steps=500
    python benchmarks/train_quality.py --runs runs/default runs/bytes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_BPB = 2.72
REF_SECONDS = 218.0


def read_evals(run: Path) -> tuple[list[dict], list[dict]]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return ([r for r in recs if r.get("kind") == "eval"],
            [r for r in recs if r.get("kind") == "train"])


def time_to(evals: list[dict], target: float) -> float | None:
    """First time the val bits/byte curve crosses `target` (linear between evaluations)."""
    prev = (0.0, None)
    for r in evals:
        t, b = r["elapsed"], r["val_bpb"]
        if b is not None and b <= target:
            if prev[1] is None or prev[1] == b:
                return t
            return prev[0] + (t - prev[0]) * (prev[1] - target) / (prev[1] - b)
        prev = (t, b)
    return None


def bpb_at(evals: list[dict], seconds: float) -> float | None:
    """Best val bits/byte measured at or before `seconds` of wall time."""
    seen = [r["val_bpb"] for r in evals if r["elapsed"] <= seconds and r["val_bpb"] is not None]
    return min(seen) if seen else None


def report(name: str, run: Path) -> dict:
    evals, steps = read_evals(run)
    last = steps[-1] if steps else {}
    elapsed = last.get("elapsed") or 1e-9
    summary = {
        "run": name, "steps": last.get("step"), "seconds": round(elapsed, 1),
        "steps_per_s": round(last.get("step", 0) / elapsed, 2),
        "tokens_per_s": round(last.get("tokens_seen", 0) / elapsed),
        "final_bpb": evals[-1]["val_bpb"] if evals else None,
        "bpb_at_218s": bpb_at(evals, REF_SECONDS),
        "seconds_to_2.72": time_to(evals, TARGET_BPB),
    }
    print(f"\n## {name} ({run})")
    print("| step | seconds | val loss | val bits/byte |")
    print("|---:|---:|---:|---:|")
    for r in evals:
        print(f"| {r['step']} | {r['elapsed']:.1f} | {r['val_loss']:.4f} | {r['val_bpb']:.4f} |")
    return summary


def train(config: str, out: Path, sets: list[str]) -> None:
    cmd = [sys.executable, "-m", "minigpt", "train", "--config", config, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    code = subprocess.run(cmd, check=False, env={**os.environ}).returncode
    if code:  # e.g. Ctrl-C (130): report what the run logged so far
        print(f"note: {config} exited with {code}; its table is partial", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["default", "bytes"])
    ap.add_argument("--set", action="append", default=[], dest="sets",
                    help="extra --set passed to every training run")
    ap.add_argument("--out", type=Path, help="keep the runs under this directory")
    ap.add_argument("--runs", nargs="+", type=Path, help="only read these run directories")
    args = ap.parse_args()

    summaries = []
    if args.runs:
        summaries = [report(str(r), r) for r in args.runs]
    else:
        with tempfile.TemporaryDirectory(prefix="minigpt-quality-") as tmp:
            root = args.out or Path(tmp)
            for config in args.configs:
                train(config, root / config, args.sets)
                summaries.append(report(config, root / config))
    print(f"\n## summary (target {TARGET_BPB} bits/byte; reference: {TARGET_BPB} at "
          f"{REF_SECONDS:.0f} s)")
    print("| run | steps | seconds | steps/s | tokens/s | final bpb | bpb at 218 s | "
          "s to 2.72 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    fmt = lambda v, f="{:.3f}": "n/a" if v is None else f.format(v)
    for s in summaries:
        print(f"| {s['run']} | {s['steps']} | {s['seconds']} | {s['steps_per_s']} | "
              f"{s['tokens_per_s']} | {fmt(s['final_bpb'])} | {fmt(s['bpb_at_218s'])} | "
              f"{fmt(s['seconds_to_2.72'], '{:.1f}')} |")
    print(json.dumps(summaries))


if __name__ == "__main__":
    main()
