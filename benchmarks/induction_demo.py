"""Induction-head demo: train configs/induction.yaml on the CPU, then ask inspect-heads for the
heads' types on the built-in induction probe.

    python benchmarks/induction_demo.py            # train into a fresh temp dir, then inspect
    python benchmarks/induction_demo.py --run DIR  # only inspect an existing run

Passes (exit 0) when `minigpt train` takes at most --budget seconds (wall clock, whole process
incl. start-up) and, on the induction probe, a layer-1 head has induction score >= --threshold
and a layer-0 head has previous-token score >= --threshold. The same layer-1 head must also
score >= --threshold on a probe with another period (--max-tokens 40, period 20): a head that
attends at a fixed offset scores high at one period only, an induction head at every period.
Exit 1 otherwise. Timings on a shared machine are noisy: note the load average printed with
them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def minigpt(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minigpt", *args]
    print("$ minigpt " + " ".join(args), file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=False, text=True,
                          stdout=subprocess.PIPE if capture else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="inspect this run instead of training one")
    ap.add_argument("--config", default="configs/induction.yaml")
    ap.add_argument("--set", action="append", default=[], help="extra --set for training")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds allowed for training")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    args = ap.parse_args()

    train_s = None
    run = args.run
    if run is None:
        run = Path(tempfile.mkdtemp(prefix="minigpt-induction-")) / "run"
        sets = [x for s in args.set for x in ("--set", s)]
        t0 = time.perf_counter()
        r = minigpt("train", "--config", args.config, "--out", str(run), "--device", "cpu", *sets)
        train_s = time.perf_counter() - t0
        if r.returncode:
            print(f"training failed (exit {r.returncode})", file=sys.stderr)
            return 1
    def probe(*extra: str) -> dict | None:
        r = minigpt("inspect-heads", "--run", str(run), "--probe", "induction", "--json",
                    "--device", "cpu", *extra, capture=True)
        if r.returncode:
            print(f"inspect-heads failed (exit {r.returncode})", file=sys.stderr)
            return None
        return json.loads(r.stdout)

    doc, other = probe(), probe("--max-tokens", "40")
    if doc is None or other is None:
        return 1
    heads = doc["heads"]

    def best(layer: int, score: str) -> dict:
        return max((h for h in heads if h["layer"] == layer),
                   key=lambda h: h[score] if h[score] is not None else -1.0)

    ind, prev = best(1, "induction"), best(0, "previous")
    ind_other = next(h for h in other["heads"] if h["layer"] == 1 and h["head"] == ind["head"])
    result = {
        "run": str(run), "step": doc["step"], "train_seconds": train_s,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "layer1_induction": {"head": ind["head"], "score": ind["induction"],
                             "score_period_20": ind_other["induction"]},
        "layer0_previous": {"head": prev["head"], "score": prev["previous"]},
        "parity_max_abs_diff": doc["parity_max_abs_diff"],
        "types": [f"L{h['layer']}H{h['head']}:{h['dominant']}" for h in heads],
    }
    ok_ind = min(ind["induction"] or 0, ind_other["induction"] or 0) >= args.threshold
    ok_prev = (prev["previous"] or 0) >= args.threshold
    ok_time = train_s is None or train_s <= args.budget
    result["passed"] = ok_ind and ok_prev and ok_time
    if args.json:
        print(json.dumps(result, indent=2))
    mark = {True: "ok", False: "FAIL"}
    if train_s is not None:
        print(f"train: {train_s:.1f} s wall (budget {args.budget:.0f} s, load average "
              f"{result['load_average']:.1f} on {os.cpu_count()} CPUs) [{mark[ok_time]}]",
              file=sys.stderr)
    print(f"layer 1 head {ind['head']}: induction {ind['induction']:.3f} at period "
          f"{len(doc['tokens']) // 2}, {ind_other['induction']:.3f} at period 20 "
          f"(>= {args.threshold} at both) [{mark[ok_ind]}]", file=sys.stderr)
    print(f"layer 0 head {prev['head']}: previous-token {prev['previous']:.3f} "
          f"(>= {args.threshold}) [{mark[ok_prev]}]", file=sys.stderr)
    print("head types: " + " ".join(result["types"]), file=sys.stderr)
    print(f"run kept at {run}", file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
