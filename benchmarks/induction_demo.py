"""Induction-head demo: train configs/induction.yaml on the CPU, then ask inspect-heads for the
heads' types on the built-in induction probe.

    python benchmarks/induction_demo.py                  # train into a fresh temp dir, inspect
    python benchmarks/induction_demo.py --seeds 1-10     # one run per seed, two at a time
    python benchmarks/induction_demo.py --run DIR        # only inspect an existing run
    python benchmarks/induction_demo.py --seeds 1000-1029 --save fresh.jsonl --markdown
    python benchmarks/induction_demo.py --results fresh.jsonl --markdown   # the table again

A run passes when `minigpt train` takes at most --budget seconds (wall clock, whole process incl.
start-up) and, on the induction probe (block_size tokens: a random sequence of block_size/2 ids
repeated), a layer-1 head has induction score >= --threshold and a layer-0 head has
previous-token score >= --threshold. The same layer-1 head must also score >= --threshold on a
probe with another period (5/16 of block_size, e.g. 10 for block_size 32): a head that attends
at a fixed offset scores high at one period only, an induction head at every period.
The pass count is also given by the built-in probe alone (what `minigpt train` and
`inspect-heads --probe induction` call formed), without the second period's check.
The ablation check: on the same induction probe, the loss of the predictions inside the second
copy (the copy loss; positions n..2n-2, whose targets are copies) and what it gains when the
chosen layer-1 induction head, the chosen layer-0 previous-token head, or any other head is
zero-ablated (`minigpt.interp.heads.ablate_heads`): if pattern and role agree, the two chosen
heads cost the most.
With several seeds the runs go --jobs at a time (default 2), each with one thread
(OMP_NUM_THREADS=1): two runs on a 2-core machine; --jobs 1 runs them one after another, each
alone, as a new user runs `minigpt train --config induction`. The per-seed table gives the
scores, the training seconds and steps (a run with train.stop_when_formed ends early: `ended`
says formed or finished), the step at which the built-in probe first saw the induction head
(from the run's `heads` records in metrics.jsonl), the ablation check, then the pass count.
Exit 0 when every run passes, 1 otherwise. Timings on a shared machine are noisy: note the load
average printed with them. `CPU s` is the training process's own CPU time (os.wait4), which
other work on the machine changes far less than the wall clock; with one thread per run the
training is deterministic, so re-running the same seeds on an idle machine re-times exactly the
same runs. --save appends each seed's result (one JSON line) as it finishes; --results prints
the table and --markdown from such a file without training (benchmarks/README.md's tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from minigpt.display import head_name
from minigpt.interp.heads import ablate_heads
from minigpt.run import load_run
from minigpt.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent


THREADS = {}  # extra environment for every subprocess (OMP_NUM_THREADS=1 with --jobs > 1)


def minigpt(*args: str, capture: bool = False, log=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "minigpt", *args]
    print("$ minigpt " + " ".join(args), file=sys.stderr, flush=True)
    return subprocess.run(cmd, cwd=ROOT, check=False, text=True, env={**os.environ, **THREADS},
                          stdout=subprocess.PIPE if capture else log,
                          stderr=log)


def timed_train(args: list[str], log) -> tuple[int, float, float]:
    """`minigpt train ARGS` with output to `log`: (exit status, wall seconds, CPU seconds of
    that process alone, user + system, from os.wait4: other runs beside it do not count)."""
    print("$ minigpt " + " ".join(args), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "minigpt", *args], cwd=ROOT, stdout=log,
                            stderr=log, env={**os.environ, **THREADS})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, wall, usage.ru_utime + usage.ru_stime


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a pass rate k/n (95% for z = 1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def parse_seeds(text: str) -> list[int]:
    """'1-10' -> 1..10; '1337,1,2' -> those; '1-3,7' -> 1, 2, 3, 7."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    return out


def formed_at(run: Path, threshold: float) -> tuple[int | None, int | None]:
    """First steps at which the run's own head scores (metrics.jsonl `heads` records, one probe
    period) saw a layer-1 induction head and a layer-0 previous-token head >= threshold."""
    ind = prev = None
    records, _ = read_metrics(run / "metrics.jsonl")
    for rec in records:
        if rec.get("kind") != "heads":
            continue
        sc = rec["scores"]
        if ind is None and len(sc["induction"]) > 1 and max(
                v or 0 for v in sc["induction"][1]) >= threshold:
            ind = rec["step"]
        if prev is None and max(v or 0 for v in sc["previous"][0]) >= threshold:
            prev = rec["step"]
    return ind, prev


def copy_loss_check(run: Path, tokens: list[int], ind_head: int, prev_head: int) -> dict:
    """Zero-ablation on the induction probe `tokens` (r r), scored on the second copy only: the
    predictions from positions n..2n-2 (n = len(r)), whose targets are copies. What the copy
    loss gains (nats/token) when the chosen layer-1 induction head or layer-0 previous-token
    head is ablated, and the largest gain from ablating any other head."""
    n = len(tokens) // 2
    model = load_run(run, "cpu").model
    ab = ablate_heads(model, tokens, "zero", positions=range(n, 2 * n - 1),
                      scored="the second copy")
    effect = ab.effect.tolist()  # [layer][head]
    others = [(effect[la][h], la, h) for la in range(len(effect)) for h in range(len(effect[la]))
              if (la, h) not in ((1, ind_head), (0, prev_head))]
    top = max(others, default=(float("nan"), -1, -1))
    return {"base_loss": ab.base_loss, "induction_head": effect[1][ind_head],
            "previous_head": effect[0][prev_head], "other_max": top[0],
            "other_head": head_name(top[1], top[2]), "n_scored": len(ab.positions)}


def done_reason(run: Path) -> str | None:
    """How training ended (summary.md's status row: finished / formed / ...)."""
    try:
        text = (run / "summary.md").read_text()
    except OSError:
        return None
    row = next((x for x in text.splitlines() if x.startswith("| status |")), None)
    return row.split("|")[2].strip().split()[0] if row else None


def probe(run: Path, *extra: str) -> dict | None:
    r = minigpt("inspect-heads", "--run", str(run), "--probe", "induction", "--json",
                "--device", "cpu", *extra, capture=True)
    if r.returncode:
        print(f"inspect-heads failed (exit {r.returncode})", file=sys.stderr)
        return None
    return json.loads(r.stdout)


def best(heads: list[dict], layer: int, score: str) -> dict:
    return max((h for h in heads if h["layer"] == layer),
               key=lambda h: h[score] if h[score] is not None else -1.0)


def demo(run: Path | None, config: str, sets: list[str], budget: float,
         threshold: float) -> dict | None:
    """Train (unless `run` is given), inspect, and return the result record (None on failure)."""
    train_s = cpu_s = None
    if run is None:
        run = Path(tempfile.mkdtemp(prefix="minigpt-induction-")) / "run"
        flags = [x for s in sets for x in ("--set", s)]
        with open(run.parent / "train.log", "w") as log:  # quiet: several runs at once
            code, train_s, cpu_s = timed_train(["train", "--config", config, "--out", str(run),
                                                "--device", "cpu", *flags], log)
        if code:
            print(f"training failed (exit {code}); log: {run.parent / 'train.log'}",
                  file=sys.stderr)
            return None
    block = yaml.safe_load((run / "config.yaml").read_text())["model"]["block_size"]
    other_len = 2 * max(2, block * 5 // 16)  # another period: 5/16 of block_size
    doc, other = probe(run), probe(run, "--max-tokens", str(other_len))
    if doc is None or other is None:
        return None
    ind, prev = best(doc["heads"], 1, "induction"), best(doc["heads"], 0, "previous")
    ind_other = next(h for h in other["heads"] if h["layer"] == 1 and h["index"] == ind["index"])
    result = {
        "run": str(run), "step": doc["step"], "train_seconds": train_s, "cpu_seconds": cpu_s,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(), "period": len(doc["tokens"]) // 2,
        "other_period": other_len // 2,
        "layer1_induction": {"head": ind["index"], "score": ind["induction"],
                             "score_other_period": ind_other["induction"]},
        "layer0_previous": {"head": prev["index"], "score": prev["previous"]},
        "parity_max_abs_diff": doc["parity_max_abs_diff"],
        "types": [f"{head_name(h['layer'], h['head'])}:{h['dominant']}" for h in doc["heads"]],
        "formed_at": dict(zip(("induction", "previous"), formed_at(run, threshold))),
        "ended": done_reason(run),
        "ablation": copy_loss_check(run, doc["tokens"], ind["index"], prev["index"]),
    }
    result["ok_induction"] = min(ind["induction"] or 0,
                                 ind_other["induction"] or 0) >= threshold
    result["ok_previous"] = (prev["previous"] or 0) >= threshold
    result["ok_time"] = train_s is None or train_s <= budget
    result["passed"] = result["ok_induction"] and result["ok_previous"] and result["ok_time"]
    return result


def report(res: dict, budget: float, threshold: float) -> None:
    mark = {True: "ok", False: "FAIL"}
    if res["train_seconds"] is not None:
        print(f"train: {res['train_seconds']:.1f} s wall (budget {budget:.0f} s, load average "
              f"{res['load_average']:.1f} on {res['cpu_count']} CPUs) [{mark[res['ok_time']]}]",
              file=sys.stderr)
    ind, prev = res["layer1_induction"], res["layer0_previous"]
    print(f"layer 1 head {ind['head']}: induction {cut(ind['score'])} at period {res['period']}, "
          f"{cut(ind['score_other_period'])} at period {res['other_period']} (>= {threshold} at "
          f"both) [{mark[res['ok_induction']]}]", file=sys.stderr)
    print(f"layer 0 head {prev['head']}: previous-token {cut(prev['score'])} (>= {threshold}) "
          f"[{mark[res['ok_previous']]}]", file=sys.stderr)
    ab = res["ablation"]
    print(f"copy loss on the second copy ({ab['n_scored']} predictions): "
          f"{ab['base_loss']:.3f} nats/token; zero-ablating layer 1 head {ind['head']} adds "
          f"{ab['induction_head']:.3f}, layer 0 head {prev['head']} adds "
          f"{ab['previous_head']:.3f}, "
          f"any other head at most {ab['other_max']:.3f} ({ab['other_head']})", file=sys.stderr)
    print("head types: " + " ".join(res["types"]), file=sys.stderr)
    print(f"run kept at {res['run']}", file=sys.stderr)


def verdict(r: dict) -> str:
    """pass, or FAIL: with the checks that failed (i induction, p previous-token, t time)."""
    return "pass" if r["passed"] else "FAIL:" + "".join(
        c for c, ok in (("i", r["ok_induction"]), ("p", r["ok_previous"]), ("t", r["ok_time"]))
        if not ok)


def rate(results: list[dict]) -> str:
    """'k of n seeds passed (p%, 95% Wilson interval lo-hi%)'."""
    k, n = sum(bool(r.get("passed")) for r in results), len(results)
    lo, hi = wilson(k, n)
    return (f"{k} of {n} seeds passed ({100 * k / max(n, 1):.0f}%, 95% Wilson interval "
            f"{100 * lo:.0f}-{100 * hi:.0f}%)")


def probe_only_rate(results: list[dict], threshold: float) -> str:
    """The same count by the built-in probe alone (`inspect-heads --probe induction`, period
    P), without the second period's check on the induction head."""
    ok = [not r.get("failed") and r["ok_time"] and r["ok_previous"]
          and (r["layer1_induction"]["score"] or 0) >= threshold for r in results]
    k, n = sum(ok), len(results)
    lo, hi = wilson(k, n)
    return (f"{k} of {n} by the built-in probe alone ({100 * k / max(n, 1):.0f}%, 95% Wilson "
            f"interval {100 * lo:.0f}-{100 * hi:.0f}%)")


def cut(v: float) -> str:
    """Three decimals, cut rather than rounded (as the run's summary says them): 0.8996 shows
    as 0.899, never as the 0.900 it does not reach."""
    return f"{math.floor(v * 1000) / 1000:.3f}"


def secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(results: list[dict], threshold: float) -> None:
    """One line per seed, then the pass count and what the columns mean."""
    print(f"{'seed':>6} {'train s':>8} {'CPU s':>7} {'steps':>6} {'ended':>8} {'L1 head':>7} "
          f"{'ind@P':>6} {'ind@P2':>6} {'L0 head':>7} {'prev':>6} {'ind. formed':>11} "
          f"{'copy':>6} {'-L1':>6} {'-L0':>6} {'-other':>13} {'result':>8}", file=sys.stderr)
    for r in results:
        if r.get("failed"):
            print(f"{r['seed']:>6} {'-':>8} {'training or inspection failed':>45}",
                  file=sys.stderr)
            continue
        ind, prev, ab = r["layer1_induction"], r["layer0_previous"], r["ablation"]
        at = r["formed_at"]["induction"]
        other = f"{ab['other_max']:.3f} {ab['other_head']}"
        print(f"{r['seed']:>6} {secs(r['train_seconds']):>8} {secs(r.get('cpu_seconds')):>7} "
              f"{r['step']:>6} {r['ended'] or '?':>8} {ind['head']:>7} "
              f"{cut(ind['score']):>6} {cut(ind['score_other_period']):>6} {prev['head']:>7} "
              f"{cut(prev['score']):>6} {at if at is not None else '-':>11} "
              f"{ab['base_loss']:>6.3f} {ab['induction_head']:>6.3f} {ab['previous_head']:>6.3f} "
              f"{other:>13} {verdict(r):>8}", file=sys.stderr)
    print(f"{rate(results)} (P = period {results[0].get('period', '?')}, P2 = "
          f"{results[0].get('other_period', '?')}; threshold {threshold}; FAIL:i/p/t = "
          "induction / previous-token / time)", file=sys.stderr)
    print(probe_only_rate(results, threshold), file=sys.stderr)
    print("CPU s = the training process's own CPU seconds (user + system); copy = loss on the "
          "second copy of the induction probe (nats/token); -L1, -L0, -other = what it gains "
          "when the L1 head, the L0 head, or (the largest of) any other head is zero-ablated; "
          "steps = steps trained; ended = finished (max_steps) or formed "
          "(train.stop_when_formed)", file=sys.stderr)


def markdown(results: list[dict], threshold: float = 0.9) -> str:
    """The per-seed table as benchmarks/README.md shows it, then the pass rate."""
    lines = ["| seed | train s | CPU s | steps | ended | layer-1 induction (P {} / {}) | layer-0 "
             "previous | copy loss | -L1 | -L0 | result |".format(
                 results[0].get("period", "?"), results[0].get("other_period", "?")),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("failed"):
            lines.append(f"| {r['seed']} | - | - | - | - | - | - | - | - | - | failed to run |")
            continue
        ind, prev, ab = r["layer1_induction"], r["layer0_previous"], r["ablation"]
        lines.append(
            f"| {r['seed']} | {secs(r['train_seconds'])} | {secs(r.get('cpu_seconds'))} | "
            f"{r['step']} | {r['ended'] or '?'} | L1H{ind['head']} {cut(ind['score'])} / "
            f"{cut(ind['score_other_period'])} | L0H{prev['head']} {cut(prev['score'])} | "
            f"{ab['base_loss']:.3f} | {ab['induction_head']:.2f} | {ab['previous_head']:.2f} | "
            f"{verdict(r).replace('FAIL:', 'fail ')} |")
    return "\n".join(lines) + (f"\n\n**{rate(results)}**; "
                                f"{probe_only_rate(results, threshold)}.\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="inspect this run instead of training one")
    ap.add_argument("--config", default="configs/induction.yaml")
    ap.add_argument("--set", action="append", default=[], help="extra --set for training")
    ap.add_argument("--seeds", default="", help="run.seed values, e.g. 1-10 or 1337,1,2")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once with several seeds (one "
                    "thread each)")
    ap.add_argument("--budget", type=float, default=180.0, help="seconds allowed for training")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    ap.add_argument("--markdown", action="store_true", help="print the per-seed table and the "
                    "pass rate as markdown on stdout (benchmarks/README.md's table)")
    ap.add_argument("--save", type=Path, help="append each seed's result to this file as one "
                    "JSON line as soon as it is done")
    ap.add_argument("--results", type=Path, help="print the table (and --markdown) of results "
                    "saved with --save, without training")
    args = ap.parse_args()

    if args.results is not None:
        results = [json.loads(x) for x in args.results.read_text().splitlines() if x.strip()]
        results.sort(key=lambda r: r["seed"])
        table(results, args.threshold)
        if args.markdown:
            print(markdown(results, args.threshold))
        return 0 if all(r["passed"] for r in results) else 1
    seeds = parse_seeds(args.seeds) if args.run is None else []
    if len(seeds) > 1 and args.jobs > 1:
        THREADS.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def one(seed: int | None) -> dict:
        sets = [*args.set, *([f"run.seed={seed}"] if seed is not None else [])]
        res = demo(args.run, args.config, sets, args.budget, args.threshold)
        res = res or {"failed": True, "passed": False}
        res.update(seed=seed, sets=sets, config=args.config)
        if args.save is not None:
            with open(args.save, "a") as fh:  # one line per seed, written whole
                fh.write(json.dumps(res) + "\n")
        if len(seeds) <= 1 and not res.get("failed"):
            report(res, args.budget, args.threshold)
        return res

    if len(seeds) > 1:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(one, seeds))
        table(results, args.threshold)
    else:
        results = [one(seeds[0] if seeds else None)]
        if results[0].get("failed"):
            return 1
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    if args.markdown:
        print(markdown(results, args.threshold))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
