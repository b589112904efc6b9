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


def faithfulness(run: str, steps: int) -> dict:
    from minigpt.heads.edge_circuit import circuit_pairs
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.interp.edge_positions import position_split
    from minigpt.interp.position_circuits import positional_curve
    from minigpt.run import load_run

    loaded = load_run(run, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted", probe="induction")
    split = position_split(loaded.model, 1, p.clean.shape[1])
    result = find_circuit(loaded.model, p.clean, p.corrupted, p.metric, p.targets,
                          ig_steps=steps, collect=split)
    result.positions = split.result
    sizes, summed, ranked = positional_curve(loaded.model, result, p.clean, p.corrupted,
                                             p.targets)
    rows = [{"summed_edges": n, "positions": s, "summed_recovers": round(fs, 4),
             "position_aware_edges": k, "position_aware_recovers": round(fp, 4)}
            for n, s, (_, fs), (k, fp) in zip(result.sizes, sizes, summed, ranked)]
    return {"run": run, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ig-steps", type=int, default=5)
    ap.add_argument("--runs", default="", help="comma-separated induction runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()}", flush=True)
    if args.repeats:
        print(json.dumps({"speed": speed(args.repeats, args.tokens, args.ig_steps)}), flush=True)
    for run in filter(None, args.runs.split(",")):
        print(json.dumps(faithfulness(run, args.ig_steps)), flush=True)
    print(f"load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
