"""Why the induction head attends where it does, per seed: train `configs/induction.yaml` on
fresh seeds (or take runs already trained), then split the induction head's attention scores
into (query writer x key writer) terms (`inspect-heads --qk`, minigpt.interp.qk) at the built-in
induction probe's induction targets (each query of the second copy and the key one after the
earlier occurrence of its token) and ask whether the largest-margin term is the textbook one:
the query's embedding x the key's previous-token head (K-composition).

    python benchmarks/qk_study.py --seeds 3001-3012 --root /tmp/qk_runs --train --markdown
    python benchmarks/qk_study.py --seeds 3001-3012 --root /tmp/qk_runs --markdown  # trained

--train runs, for each seed whose run is missing, `nice minigpt train --config induction --set
run.seed=SEED --out ROOT/sSEED --set train.threads=1` (--jobs at a time, default 2). Each run
stops at the first head measurement where both heads formed (train.stop_when_formed) or at
8,000 steps. The heads are taken as the built-in probe scores them on the run's final weights
(`events.circuit_check`: the best layer-1 induction head and the best layer-0 previous-token
head; "formed" = both >= 0.9). The split is at --probe-seed's probe of block_size tokens. Per
seed: the heads, the mean score and margin at the induction targets, the largest-margin term,
the textbook term's margin and rank, and what share of the margin it carries.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from minigpt.events import circuit_check
from minigpt.heads.probes import prepare_input
from minigpt.interp.heads import attention_maps, score_heads
from minigpt.interp.qk import induction_pairs, qk_attribution
from minigpt.run import load_run

ROOT = Path(__file__).resolve().parent.parent


def seeds_of(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def train(seed: int, root: Path) -> None:
    out = root / f"s{seed}"
    if (out / "config.yaml").exists():
        return
    args = ["nice", sys.executable, "-m", "minigpt", "train", "--config", "induction", "--set",
            f"run.seed={seed}", "--out", str(out), "--set", "train.threads=1"]
    with open(root / f"log{seed}.txt", "w") as log:
        subprocess.run(args, cwd=ROOT, stdout=log, stderr=log, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})


def study(run_dir: Path, probe_seed: int = 0) -> dict:
    """One run: its heads, and the induction head's score split at the induction targets."""
    loaded = load_run(run_dir, "cpu")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction", seed=probe_seed)
    attn, _ = attention_maps(loaded.model, inp.tokens, torch.device("cpu"))
    scores = {k: v.tolist() for k, v in score_heads(attn, inp.tokens).items()}
    check = circuit_check(loaded.step, scores)
    (li, hi, ind), (lp, hp, prev) = check.induction, check.previous
    pairs = induction_pairs(inp.tokens, inp.positions[0])
    (h,) = qk_attribution(loaded.model, torch.tensor([inp.tokens]), [(li, hi)], pairs)
    query = "embed" if "embed" in h.writers else "embed.tok"
    textbook = (query, f"L{lp}.H{hp}")
    terms = h.terms()
    rank = next(i for i, (q, k, _, _) in enumerate(terms) if (q, k) == textbook) + 1
    return {"run": run_dir.name, "step": loaded.step, "formed": check.formed,
            "induction": f"L{li}.H{hi} {ind:.3f}", "previous": f"L{lp}.H{hp} {prev:.3f}",
            "score": float(h.scores.mean()), "margin": float(h.margins.mean()),
            "top": f"{terms[0][0]} x {terms[0][1]}", "top_margin": terms[0][3],
            "second": f"{terms[1][0]} x {terms[1][1]} {terms[1][3]:+.2f}",
            "textbook_margin": h.term_margin(*textbook), "rank": rank,
            "share": h.term_margin(*textbook) / float(h.margins.mean()),
            "closure": h.closure, "is_textbook": terms[0][:2] == textbook}


def markdown(rows: list[dict]) -> str:
    head = ("| run | step | formed | induction head | previous-token head | score | margin | "
            "largest-margin term | its margin | second | embed x prev margin (rank) | share of "
            "the margin | closure |\n|" + "---|" * 13)
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['step']} | {'yes' if r['formed'] else 'no'} | {r['induction']} "
            f"| {r['previous']} | {r['score']:+.2f} | {r['margin']:+.2f} | {r['top']} | "
            f"{r['top_margin']:+.2f} | {r['second']} | {r['textbook_margin']:+.2f} "
            f"({r['rank']}) | {100 * r['share']:.0f}% | {r['closure']:.0e} |")
    formed = [r for r in rows if r["formed"]]
    hits = sum(r["is_textbook"] for r in formed)
    lines.append(f"\n**{hits} of {len(formed)} runs where the heads formed** have (embed x "
                 f"previous-token head) as the induction head's largest-margin term "
                 f"({len(rows) - len(formed)} of {len(rows)} runs did not form both heads).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", required=True, help="e.g. 3001-3012 or 3001,3005")
    ap.add_argument("--root", type=Path, default=Path("/tmp/qk_runs"))
    ap.add_argument("--train", action="store_true", help="train the missing runs first")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--probe-seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    seeds = seeds_of(args.seeds)
    if args.train:
        args.root.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda s: train(s, args.root), seeds))
    torch.set_num_threads(1)
    rows = [study(args.root / f"s{s}", args.probe_seed) for s in seeds]
    for r in rows:
        print(r)
    if args.markdown:
        print(markdown(rows))


if __name__ == "__main__":
    main()
