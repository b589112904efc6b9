"""How long a compiled program takes (issue 55's bars: a compile within 60 s, a scored circuit
within 30 s, on 2 cores): for every built-in program, `minigpt compile PROGRAM` and then
`minigpt circuit --run RUN --pairs N` (EAP-IG at 5 steps, the faithfulness curves, the truth
scored) as a user runs them, each a fresh process (its imports included), timed wall and CPU
(the children's user + system seconds), with the load average beside every figure. Needs
tracr.

    python benchmarks/truth_speed.py [--out DIR] [--pairs 16] [--programs induction,...]

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from minigpt.truth.programs import BUILT_IN


def timed(args: list[str]) -> tuple[float, float, float]:
    """(wall s, CPU s, the 1-minute load average when it started) of `python -m minigpt
    ARGS`."""
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "minigpt", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/minigpt-truth-speed"))
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--programs", default=",".join(BUILT_IN))
    a = ap.parse_args()
    shutil.rmtree(a.out, ignore_errors=True)
    print(f"{os.cpu_count()} CPUs; `minigpt circuit --pairs {a.pairs}` (EAP-IG 5 steps, curves, "
          "truth)\n")
    print("| program | compile: wall s (CPU s, load) | circuit: wall s (CPU s, load) |")
    print("|---|---|---|")
    for name in a.programs.split(","):
        run = a.out / name
        c = timed(["compile", name, "--out", str(run)])
        s = timed(["circuit", "--run", str(run), "--pairs", str(a.pairs), "--device", "cpu"])
        print(f"| {name} | {c[0]:.1f} ({c[1]:.1f}, {c[2]:.1f}) | {s[0]:.1f} ({s[1]:.1f}, "
              f"{s[2]:.1f}) |", flush=True)


if __name__ == "__main__":
    main()
