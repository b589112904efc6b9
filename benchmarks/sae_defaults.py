"""Dense features and quality of `minigpt features train`'s SAE at several settings, on one run's
layer: layer L's z collected once (the run's own data, `features train`'s default token counts
and seed), then for each setting asked for and each SAE seed, a TopK SAE trained the way
`features train` trains it (features.fit) and measured on the held-out tokens: the fraction of
features active on more than 10% (and 20%) of them (dense: what `features show` leaves out),
the fraction never active, L0, the variance explained and the cross-entropy loss recovered.
One JSON line per SAE (appended to --out when given).

    python benchmarks/sae_defaults.py --run runs/induction --layer 1 --k 16 --k 8 [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minigpt.features import collect
from minigpt.features.fit import SaeSettings, fit_sae, new_state
from minigpt.features.train_features import Source, gather
from minigpt.infer.inputs import load_run_or_model
from minigpt.interp.sae import ce_recovered, quality


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--k", type=int, action="append", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_run_or_model(a.run, None, "cpu", None)
    x, held, held_rows = gather(Source(loaded, a.layer), 0, lambda e: None)
    for k in a.k:
        for seed in a.seeds:
            s = SaeSettings(None, k, 2000, 1024, 0.0, seed).resolved(x.shape[1])
            t0, c0 = time.monotonic(), time.process_time()
            state = new_state(x, s)
            fit_sae(x, s, state)
            sae = state.sae.eval()
            q = quality(sae, held)
            with torch.no_grad():
                clean, zero, spliced = collect.spliced_losses(loaded.model, held_rows, a.layer,
                                                              sae)
            d = q.density
            rec = {"run": str(a.run), "layer": a.layer, "k": k, "width": s.width, "seed": seed,
                   "dense_over_0.1": float((d > 0.1).float().mean()),
                   "dense_over_0.2": float((d > 0.2).float().mean()),
                   "never_active": q.dead_fraction, "l0": q.l0,
                   "variance_explained": q.variance_explained,
                   "ce_recovered": ce_recovered(clean, zero, spliced),
                   "cpu_s": round(time.process_time() - c0, 1),
                   "wall_s": round(time.monotonic() - t0, 1)}
            print(json.dumps(rec), flush=True)
            if a.out:
                with open(a.out, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
