"""What `minigpt circuit --positions` costs and what it finds.

Speed: position-aware EAP-IG (minigpt.interp.edge_positions.attribute_positions) against the
summed EAP-IG of the same passes (minigpt.interp.edge_graph.attribute_edges), on a random-init
model of GPT-2 small's shape (12 layers of 12 heads, 768 wide, MLPs, learned positions, the
GPT-2 vocabulary) at 64 tokens, one (clean, corrupted) pair, 5 IG steps, the logit difference
at the last position. Each timing alternates the two, the median of --repeats (after a
warm-up), wall clock and this process's CPU seconds, with the load average: on a shared machine
the wall clock is noisy; with --threads 1 the CPU seconds are the cleanest cost.

    python benchmarks/positions_bench.py --threads 1 --repeats 3

Faithfulness: with --runs, on each run's induction probe (corrupted second copy, 5 IG steps),
the summed EAP-IG curve and the position-aware one at the same sizes in positions
(minigpt.interp.position_circuits.positional_curve): which recovers more at equal size.

    python benchmarks/positions_bench.py --runs runs/a,runs/b --repeats 0

The same on compiled programs (`minigpt compile`'s runs, with truth.json): with --compiled, on
each run's --pairs random inputs of its vocabulary (seeds --seed, --seed + 1, ...) under each
of --sources (resample, zero, mean), the two curves at equal size, and the edge AUROC against
the program's truth (all its edges / those the contrast reveals) of the summed EAP-IG scores
and of the ranking by position (an edge ranked by its largest |score| at any pair of
positions: where the position-aware top-k first takes it in).

    python benchmarks/positions_bench.py --compiled runs/induction,... --repeats 0 --pairs 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from minigpt.config import load_config
from minigpt.core.gpt import GPT
from minigpt.interp.edge_graph import attribute_edges
from minigpt.interp.edge_positions import attribute_positions
from minigpt.interp.patching import make_metric


def speed(repeats: int, tokens: int, steps: int) -> dict:
    cfg = load_config(None, ["model.n_layer=12", "model.n_head=12", "model.n_embd=768",
                             "model.block_size=1024", "model.vocab_size=50257",
                             "model.pos_encoding=learned", "model.mlp=true", "model.bias=true",
                             "model.activation=gelu_tanh"])
    model = GPT.from_config(cfg, seed=0).eval()
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 50257, (1, tokens), generator=gen)
    corrupted = torch.randint(0, 50257, (1, tokens), generator=gen)
    metric = make_metric(tokens, answer=5, wrong=7)
    jobs = {"summed": lambda: attribute_edges(model, clean, corrupted, metric, None, steps),
            "positions": lambda: attribute_positions(model, clean, corrupted, metric, None,
                                                     steps)}
    for fn in jobs.values():  # warm-up
        fn()
    wall = {k: [] for k in jobs}
    cpu = {k: [] for k in jobs}
    for _ in range(repeats):
        for name, fn in jobs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    out = {k: {"wall_s": statistics.median(wall[k]), "cpu_s": statistics.median(cpu[k]),
               "runs_wall_s": [round(x, 2) for x in wall[k]]} for k in jobs}
    out["ratio_wall"] = out["positions"]["wall_s"] / out["summed"]["wall_s"]
    out["ratio_cpu"] = out["positions"]["cpu_s"] / out["summed"]["cpu_s"]
    return out


def _search(model, p, steps: int):
    """find_circuit (EAP-IG) with the split by position, and the rows of the two curves at
    equal size in positions."""
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.interp.edge_positions import position_split
    from minigpt.interp.position_circuits import positional_curve

    split = position_split(model, p.clean.shape[0], p.clean.shape[1])
    result = find_circuit(model, p.clean, p.corrupted, p.metric, p.targets, ig_steps=steps,
                          collect=split)
    result.positions = split.result
    sizes, summed, ranked = positional_curve(model, result, p.clean, p.corrupted, p.targets)
    rows = [{"summed_edges": n, "positions": s, "summed_recovers": round(fs, 4),
             "position_aware_edges": k, "position_aware_recovers": round(fp, 4)}
            for n, s, (_, fs), (k, fp) in zip(result.sizes, sizes, summed, ranked)]
    return result, rows


def faithfulness(run: str, steps: int) -> dict:
    from minigpt.heads.edge_circuit import circuit_pairs
    from minigpt.run import load_run

    loaded = load_run(run, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted", probe="induction")
    return {"run": run, "rows": _search(loaded.model, p, steps)[1]}


def compiled(run: str, source: str, pairs: int, seed: int, steps: int) -> dict:
    """One compiled program under one source: the two curves at equal size and the truth
    AUROCs of the summed and the by-position rankings (module docstring)."""
    from minigpt.interp.recovery import auroc
    from minigpt.run import load_run
    from minigpt.truth.inputs import program_pairs
    from minigpt.truth.scoring import revealed_mask, truth_mask
    from minigpt.truth.store import read_truth

    loaded = load_run(run, "cpu")
    truth = read_truth(run)
    p = program_pairs(loaded.model, loaded.tokenizer, truth, patch_from=source, pairs=pairs,
                      seed=seed)
    t0 = time.process_time()
    result, rows = _search(loaded.model, p, steps)
    cpu = time.process_time() - t0
    g = result.graph
    every, where = truth_mask(g, truth)
    shown = revealed_mask(loaded.model, g, truth, p, where)
    by_position = result.positions.dense().abs().amax((-1, -2)).masked_fill(~g.valid(),
                                                                            float("nan"))
    rank = {"summed": result.scores, "by_position": by_position}
    return {"run": run, "program": truth.program["name"], "source": source,
            "edges": int(g.valid().sum()), "true_edges": int(every.sum()),
            "revealed": int(shown.sum()), "cpu_s": round(cpu, 2), "rows": rows,
            "auroc": {k: [auroc(s, every), auroc(s, shown)] for k, s in rank.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ig-steps", type=int, default=5)
    ap.add_argument("--runs", default="", help="comma-separated induction runs")
    ap.add_argument("--compiled", default="", help="comma-separated compiled runs")
    ap.add_argument("--sources", default="resample,zero,mean")
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()}", flush=True)
    if args.repeats:
        print(json.dumps({"speed": speed(args.repeats, args.tokens, args.ig_steps)}), flush=True)
    for run in filter(None, args.runs.split(",")):
        print(json.dumps(faithfulness(run, args.ig_steps)), flush=True)
    for run in filter(None, args.compiled.split(",")):
        for source in args.sources.split(","):
            print(json.dumps(compiled(run, source, args.pairs, args.seed, args.ig_steps)),
                  flush=True)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
