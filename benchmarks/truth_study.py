"""Every finder on every built-in compiled program, scored against the program's truth
(issue 55): each program compiled once (`minigpt compile`'s library; needs tracr) into
DIR/<program> (reused when it is there), then `minigpt circuit`'s library on --pairs random
inputs of its vocabulary (seeds --seed, --seed + 1, ...), under each source: `resample` (a
fresh random input), `zero` and `mean` (ablations), EAP, EAP-IG (--ig-steps, and every count in
--ig-sweep) and the real single-edge patching effects, each scored by edge AUROC against all
the program's edges and against those the contrast reveals, with the largest |score| of a
false edge and the precision / recall of the circuit EAP-IG chose.

    python benchmarks/truth_study.py [--runs DIR] [--pairs 16] [--seed 0] [--ig-steps 5]
        [--ig-sweep 1,2,5,20,50] [--programs induction,...] [--json]

Prints one markdown table per source, then the EAP-IG sweep (AUROC against all edges).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minigpt.interp import edge_graph as G
from minigpt.interp.recovery import auroc
from minigpt.run import load_run
from minigpt.truth.inputs import SOURCES, program_pairs
from minigpt.truth.programs import BUILT_IN
from minigpt.truth.scoring import revealed_mask, score, truth_mask
from minigpt.truth.store import read_truth


def compiled(runs: Path, name: str) -> Path:
    """The run of the built-in program `name` under `runs`, compiled when it is missing."""
    out = runs / name
    if not (out / "truth.json").exists():
        from minigpt.truth.make import make_compiled_run

        made = make_compiled_run(BUILT_IN[name], out)
        print(f"compiled {name} in {made.seconds:.1f} s", file=sys.stderr)
    return out


def study(run: Path, source: str, pairs: int, seed: int, ig_steps: int,
          sweep: list[int]) -> dict:
    """One program under one source: the truth section of `minigpt circuit`, its time, and
    EAP-IG's AUROC (all, revealed) at each step count of `sweep`."""
    loaded = load_run(run, "cpu")
    truth = read_truth(run)
    p = program_pairs(loaded.model, loaded.tokenizer, truth, patch_from=source, pairs=pairs,
                      seed=seed)
    t0 = time.perf_counter()
    result = G.find_circuit(loaded.model, p.clean, p.corrupted, p.metric, p.targets,
                            ig_steps=ig_steps)
    scored = score(loaded.model, loaded.cfg, loaded.tokenizer, result, truth, p, seed)
    seconds = time.perf_counter() - t0
    every, where = truth_mask(result.graph, truth)
    shown = revealed_mask(loaded.model, result.graph, truth, p, where)
    steps = {}
    for m in sweep:
        _, ig = G.attribute_edges(loaded.model, p.clean, p.corrupted, p.metric, p.targets, m)
        steps[m] = (auroc(ig, every), auroc(ig, shown))
    return {"program": truth.program["name"], "source": source, "seconds": seconds,
            "gap": result.gap, "recovered": result.recovered, "truth": scored,
            "sweep": steps}


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(rows: list[dict], source: str) -> str:
    head = ("| program | edges (revealed) | EAP | EAP-IG | patching | "
            "largest false (EAP, EAP-IG, patching) | circuit P / R | s |")
    out = [f"\n**{source}**\n", head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["truth"]
        f = t["finders"]
        cells = [f"{_f(f[n]['auroc']['all'])} / {_f(f[n]['auroc']['revealed'])}"
                 for n in ("eap", "eap-ig", "patching")]
        false = ", ".join(f"{f[n]['largest_false']:.1g}" for n in ("eap", "eap-ig", "patching"))
        c = t["circuit"]
        out.append(f"| {r['program']} | {t['edges']} ({t['revealed']}) | {' | '.join(cells)} | "
                   f"{false} | {_f(c['precision'])} / {_f(c['recall'])} | "
                   f"{r['seconds']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=Path("/tmp/minigpt-truth-study"))
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ig-steps", type=int, default=5)
    ap.add_argument("--ig-sweep", default="1,2,5,20,50")
    ap.add_argument("--programs", default=",".join(BUILT_IN))
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sweep = [int(x) for x in a.ig_sweep.split(",") if x]
    rows = [study(compiled(a.runs, name), source, a.pairs, a.seed, a.ig_steps, sweep)
            for name in a.programs.split(",") for source in a.sources.split(",")]
    if a.json:
        print(json.dumps(rows, indent=1, default=str))
        return
    for source in a.sources.split(","):
        print(table([r for r in rows if r["source"] == source], source))
    print("\n**EAP-IG's AUROC (all / revealed) by step count**\n")
    print("| program | source | " + " | ".join(f"{m} steps" for m in sweep) + " |")
    print("|---|---|" + "---|" * len(sweep))
    for r in rows:
        print(f"| {r['program']} | {r['source']} | " + " | ".join(
            f"{_f(a_)} / {_f(b_)}" for a_, b_ in (r["sweep"][m] for m in sweep)) + " |")


if __name__ == "__main__":
    main()
