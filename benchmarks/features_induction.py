"""What are the features of the induction head's output? For each induction run given: the
induction head (the best layer-1 induction score on the built-in probe), an SAE on layer 1 with
`minigpt features train`'s defaults (trained once into <run>/features/layer1, reused after),
then `features show --head`'s list of the features that head writes most (dense ones left
out), and for them: how many are selective on one token (features.show's selectivity: the
share of a feature's activation that falls on one token id, before, at or after where it
fires), where that token is, how many raise that very token most directly (W_dec through W_O
and the unembedding: the feature predicts the token it is about), and the share of their
activation on positions whose next token is a copy (its id came earlier in the row), against
the share of such positions overall. The same figures for the features the other layer-1
heads write most, as a baseline. One markdown row per run.

    python benchmarks/features_induction.py --run runs/ind5701 [--run ...] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from minigpt.display import head_name
from minigpt.features import collect, store
from minigpt.features.fit import SaeSettings
from minigpt.features.sae_run import open_sae
from minigpt.features.show import describe
from minigpt.features.show_options import ShowOptions
from minigpt.features.train_features import Source, train_features
from minigpt.heads.inspection import inspect
from minigpt.heads.probes import prepare_input
from minigpt.infer.inputs import load_run_or_model

DEFAULT_K = 0  # features train's default: automatic (features.fit.default_k)


def next_is_copy(rows: torch.Tensor) -> torch.Tensor:
    """(n * T,) bool: the token after input position t appeared at or before t in its row."""
    y, x = rows[:, 1:], rows[:, :-1]
    eq = y[:, :, None] == x[:, None, :]  # (n, T, T): [t, s] next token at t == token at s
    return torch.tril(eq).any(-1).reshape(-1)


def induction_head(loaded) -> tuple[int, float]:
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    insp = inspect(loaded.model, inp)
    scores = insp.scores["induction"][1]
    h = int(scores.argmax())
    return h, float(scores[h])


def summary(feats: list, place: str = "next") -> dict:
    sel = [f for f in feats if f.selectivity is not None]
    on = [f for f in sel if f.spot == place]
    raise_it = [f for f in on if f.promoted and f.promoted[0][0] == f.token]
    return {"features": len(feats), "selective": len(sel), place: len(on),
            f"{place}_and_raise_it": len(raise_it),
            "median_selectivity": round(statistics.median(f.selectivity for f in sel), 3)
            if sel else None}


def measure(run: Path, seed: int, k: int) -> dict:
    loaded = load_run_or_model(run, None, "cpu", None)
    head, score = induction_head(loaded)
    out = run / "features" / "layer1"
    t0 = time.monotonic()
    if not store.finished(out):
        train_features(Source(loaded, 1), SaeSettings(None, k, 2000, 1024, 0.0, seed), out)
    seconds = time.monotonic() - t0
    opened = open_sae(out, None, None, None, "cpu")
    info = opened.info
    view = describe(opened.loaded, opened.sae, info, out,
                    ShowOptions(head=head_name(1, head), top=10**6, contexts=1))
    others = [describe(opened.loaded, opened.sae, info, out,
                       ShowOptions(head=head_name(1, h), top=10**6, contexts=1)).features
              for h in range(loaded.cfg.model.n_head) if h != head]
    # the share of each head feature's activation where the next token is a copy
    rows = collect.draw_rows(collect.run_rows(opened.loaded, None), "val", 16_384, 1)
    acts = opened.sae.encode(collect.collect(opened.loaded.model, rows, 1))
    copy = next_is_copy(rows)
    idx = [f.index for f in view.features]
    share = (acts[copy][:, idx].sum(0) / acts[:, idx].sum(0).clamp_min(1e-12)).tolist()
    return {"run": str(run), "induction_head": head_name(1, head), "induction_score": score,
            "sae": {"k": info["settings"]["k"], "width": info["settings"]["width"],
                    "seed": info["settings"]["seed"], **info["quality"],
                    "ce_recovered": info["ce"]["recovered"], "train_s": round(seconds)},
            "dense": view.n_dense, "of": view.n_features,
            "head": summary(view.features),
            "other_heads": summary([f for fs in others for f in fs]),
            "copy_positions": round(float(copy.float().mean()), 3),
            "median_copy_share": round(statistics.median(share), 3) if share else None,
            "top5": [{"feature": f.index, "selectivity": f.selectivity, "place": f.spot,
                      "token": f.token, "raises": [t for t, _ in f.promoted[:3]]}
                     for f in view.features[:5]]}


def row(r: dict) -> str:
    h, o, s = r["head"], r["other_heads"], r["sae"]
    return (f"| {Path(r['run']).name} | {r['induction_head']} {r['induction_score']:.2f} | "
            f"k {s['k']}: {s['variance_explained']:.3f} / {100 * s['ce_recovered']:.1f}% | "
            f"{r['dense']} of {r['of']} | {h['features']} ({h['selective']}) | {h['next']} | "
            f"{h['next_and_raise_it']} | {h['median_selectivity']} | "
            f"{r['median_copy_share']} vs {r['copy_positions']} | "
            f"{o['next_and_raise_it']} of {o['selective']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, action="append", required=True)
    ap.add_argument("--seed", type=int, default=0, help="the SAE's seed")
    ap.add_argument("--k", type=int, default=DEFAULT_K)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if not a.json:
        print_header()
    for run in a.run:
        r = measure(run, a.seed, a.k)
        print(json.dumps(r) if a.json else row(r), flush=True)


def print_header() -> None:
    print("| run | induction head | SAE: variance explained / CE recovered | dense | head's "
          "features (selective) | on the next token | ... and raise it | median selectivity "
          "| activation where the next token is a copy | other heads' features: next and "
          "raise it |")
    print("|---|---|---|---|---|---|---|---|---|---|")


if __name__ == "__main__":
    main()
