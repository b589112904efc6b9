"""Threads on a busy machine (issue 41): `minigpt train`, `sample` and `inspect-heads` with the
thread policy before and after, against fixed thread counts, under load conditions the script
makes itself; prints the markdown table of benchmarks/README.md ("Threads on a busy machine").

    python benchmarks/threads_bench.py                       # idle, trainer, compile; 3 rounds
    python benchmarks/threads_bench.py --conditions present --rounds 5   # the load already there

Conditions (what the script adds, stopped when the condition ends; the 1-minute load average
is printed with every figure, and the table gives its range):
- `idle`: nothing added. Run it on a quiet machine: other jobs' load shows in the figures.
- `trainer`: a second trainer, `minigpt train --config bytes --set train.threads=1`, training
  throughout (one busy core, as a second experiment).
- `compile`: two `gcc -O2` processes compiling a generated C file over and over (as `make -j2`
  would).
- `present`: nothing added and nothing assumed: A/B runs under whatever load there is.

Settings, each a real `minigpt` command in its own process, taken in a rotating order within
each round (so a change of load hits every setting alike):
- `before`: the old default: 0 threads (torch's count) with GOMP_SPINCOUNT=300000, libgomp's
  own spin-wait (about 3 ms), which minigpt ran with until issue 41.
- `default`: the command as shipped (0 threads; `minigpt` sets GOMP_SPINCOUNT itself,
  `minigpt.threads.OPENMP_SPIN`).
- `N threads`: `train.threads=N` / `--threads N`, N = 1 .. the CPUs (with the shipped spin).

Figures: train, tokens/s of the training steps after the first logged interval
(metrics.jsonl: tokens seen over training seconds, so start-up and the first step's warm-up are
left out); sample, the decode tokens/s `minigpt sample --json` reports (200 greedy tokens);
inspect-heads, the whole command's wall seconds (`--ablate zero` on the default text, start-up
included). Each cell is the median over the rounds; "best fixed" is the fastest fixed thread
count in that condition, and "default / best" how many times slower the default was than it
(the goal: at most 2).

The model is configs/default.yaml's (4 x 128, BPE 1024, context 128, batch 16), trained for
a few steps first (not timed) so sample and inspect-heads have a run to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from minigpt.threads import usable_cpus

MINIGPT = shutil.which("minigpt") or "minigpt"
QUIET_TRAIN = ["--set", "train.eval_interval=100000", "--set", "train.eval_batches=1",
               "--set", "train.sample_tokens=0", "--set", "train.head_scores_interval=off",
               "--set", "train.checkpoint_interval=100000", "--set", "train.log_interval=5"]


def load() -> float:
    return os.getloadavg()[0]


def run(args: list[str], env: dict, cwd: Path,
        timeout: float = 1800) -> subprocess.CompletedProcess:
    r = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       check=False)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r


def settings(cpus: int) -> dict[str, tuple[dict, int]]:
    """name -> (environment changes, threads value)."""
    out = {"before": ({"GOMP_SPINCOUNT": "300000"}, 0), "default": ({}, 0)}
    out.update({f"{n} thread{'s' if n > 1 else ''}": ({}, n) for n in range(1, cpus + 1)})
    return out


def measure(command: str, extra_env: dict, threads: int, base_env: dict, work: Path,
            trained: Path, steps: int, tag: str) -> float:
    """One figure of `command` (train and sample: tokens/s; inspect-heads: seconds)."""
    env = {**base_env, **extra_env}
    if command == "train":
        out = work / f"train-{tag}"
        shutil.rmtree(out, ignore_errors=True)
        run([MINIGPT, "train", "--out", str(out), "--set", f"train.max_steps={steps}",
             "--set", f"train.threads={threads}", *QUIET_TRAIN], env, work)
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        recs = [r for r in recs if r.get("kind") == "train"]
        first, last = recs[1], recs[-1]  # from the first logged interval's end
        shutil.rmtree(out, ignore_errors=True)
        return (last["tokens_seen"] - first["tokens_seen"]) / (last["elapsed"] - first["elapsed"])
    if command == "sample":
        r = run([MINIGPT, "sample", "--run", str(trained), "-n", "200", "-t", "0", "--seed", "1",
                 "--json", "--threads", str(threads)], env, work)
        return float(json.loads(r.stdout.splitlines()[-1])["tokens_per_s"])
    t0 = time.perf_counter()
    run([MINIGPT, "inspect-heads", "--run", str(trained), "--json", "--ablate", "zero",
         "--threads", str(threads)], env, work)
    return time.perf_counter() - t0


@contextmanager
def condition(name: str, work: Path, env: dict):
    """Start the load of condition `name`; stop it afterwards."""
    procs: list[subprocess.Popen] = []
    try:
        if name == "trainer":
            procs.append(subprocess.Popen(
                [MINIGPT, "train", "--config", "bytes", "--set", "train.threads=1",
                 "--set", "train.max_steps=1000000", "--out", str(work / "load-trainer")],
                env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        elif name == "compile":
            src = work / "big.c"
            src.write_text("".join(f"double f{i}(double x) {{ double s = 0; for (int j = 0; j < "
                                   f"{i % 7 + 3}; j++) s += x * j / (j + {i}.0); return s; }}\n"
                                   for i in range(3000)))
            loop = f"while true; do gcc -O2 -c {src} -o /dev/null; done"
            procs += [subprocess.Popen(["sh", "-c", loop], start_new_session=True)
                      for _ in range(2)]
        if procs:
            time.sleep(20)  # let the load settle (and the trainer get past its start-up)
        yield
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15) if name == "compile" else p.terminate()
            except ProcessLookupError:
                pass
            p.wait()
        shutil.rmtree(work / "load-trainer", ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conditions", default="idle,trainer,compile",
                    help="comma-separated: idle, trainer, compile, present")
    ap.add_argument("--commands", default="train,sample,inspect-heads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=30)
    a = ap.parse_args()
    cpus = usable_cpus()
    sets = settings(cpus)
    with tempfile.TemporaryDirectory(prefix="threads-bench-") as tmp:
        work = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT",
                                                                "OMP_WAIT_POLICY",
                                                                "OMP_NUM_THREADS")}
        env["MINIGPT_CACHE"] = str(work / "cache")
        trained = work / "trained"
        print(f"training the run to read ({a.train_steps} steps, not timed) ...", file=sys.stderr)
        run([MINIGPT, "train", "--out", str(trained), "--set", f"train.max_steps={a.train_steps}",
             *QUIET_TRAIN], env, work)
        rows = []
        for cond in a.conditions.split(","):
            with condition(cond, work, env):
                figures: dict[tuple[str, str], list[float]] = {}
                loads: list[float] = []
                for r in range(a.rounds):
                    order = list(sets)[r % len(sets):] + list(sets)[:r % len(sets)]
                    for command in a.commands.split(","):
                        for name in order:
                            loads.append(load())
                            x = measure(command, sets[name][0], sets[name][1], env, work,
                                        trained, a.train_steps, f"{cond}-{r}-{name}")
                            figures.setdefault((command, name), []).append(x)
                            print(f"{cond} round {r + 1} {command} {name}: {x:,.1f} (load "
                                  f"{loads[-1]:.2f})", file=sys.stderr, flush=True)
                rows += table_rows(cond, a.commands.split(","), list(sets), figures, loads)
    print_table(list(sets), rows)


def table_rows(cond: str, commands: list[str], names: list[str],
               figures: dict[tuple[str, str], list[float]], loads: list[float]) -> list[list[str]]:
    out = []
    for command in commands:
        med = {n: statistics.median(figures[(command, n)]) for n in names}
        faster = (lambda x: 1 / x) if command == "inspect-heads" else (lambda x: x)
        fixed = [n for n in names if n[0].isdigit()]
        best = max(fixed, key=lambda n: faster(med[n]))
        slower = faster(med[best]) / faster(med["default"])
        unit = " s" if command == "inspect-heads" else ""
        out.append([command, f"{cond} (load {min(loads):.1f}-{max(loads):.1f})",
                    *(f"{med[n]:,.1f}{unit}" if unit else f"{med[n]:,.0f}" for n in names),
                    best, f"{slower:.2f}x"])
    return out


def print_table(names: list[str], rows: list[list[str]]) -> None:
    head = ["command", "condition", *names, "best fixed", "default / best"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
