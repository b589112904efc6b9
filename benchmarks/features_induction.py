"""Is there an SAE feature of an induction model's layer 1 that the induction head writes and
that fires on second-copy tokens? Trains `minigpt features train`'s SAE (the library call) on a
run's layer, then, on held-out rows of its own synthetic data, gives per feature: its density,
each head's share of its decoder norm, and the share of its firings (and of its activation
mass) on second-copy positions (tokens whose id came earlier in the row: with
data.induction_distinct every such token is part of a copy), against the share of such
positions overall. Prints a markdown table of the features the named head writes most.

    python benchmarks/features_induction.py --run /tmp/ind4 --head 2 [--layer 1] [--k 8]
        [--width N] [--steps 600] [--tokens 65536] [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from minigpt.features import collect
from minigpt.features.fit import SaeSettings
from minigpt.features.show import head_fractions
from minigpt.features.train_features import Source, train_features
from minigpt.infer.inputs import load_run_or_model


def second_copy(rows: torch.Tensor) -> torch.Tensor:
    """(n, T) bool: input position t's token appeared earlier in its row."""
    x = rows[:, :-1]
    eq = x[:, :, None] == x[:, None, :]  # (n, T, T): [t, s] same id
    return torch.tril(eq, diagonal=-1).any(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--head", type=int, required=True, help="the induction head of --layer")
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    loaded = load_run_or_model(a.run, None, "cpu", None)
    out = a.out or Path(tempfile.mkdtemp()) / "sae"
    from minigpt.features.store import finished, load_sae

    if not finished(out):  # an SAE already there (same flags): measured again, not retrained
        t0 = time.monotonic()
        train_features(Source(loaded, a.layer, tokens=a.tokens, held_out=16384),
                       SaeSettings(a.width, a.k, a.steps, 1024, 0, a.seed), out)
        print(f"trained in {time.monotonic() - t0:.0f} s")
    sae, _, info = load_sae(out)
    q, ce = info["quality"], info["ce"]
    print(f"SAE: width {sae.d_sae}, k {sae.k}, {info['settings']['steps']} steps, seed "
          f"{info['settings']['seed']}: L0 {q['l0']:.1f}, variance explained "
          f"{q['variance_explained']:.3f}, dead {100 * q['dead_fraction']:.1f}%, "
          f"CE recovered {100 * ce['recovered']:.1f}%")
    rows = collect.draw_rows(collect.run_rows(loaded, None), "val", 16384, a.seed + 7)
    z = collect.collect(loaded.model, rows, a.layer)
    acts = sae.encode(z).detach()
    copy = second_copy(rows).reshape(-1)
    fr = head_fractions(sae, loaded.cfg.model.n_head)
    on = acts > 0
    fires = on.sum(0).clamp_min(1)
    precision = (on & copy[:, None]).sum(0) / fires
    mass = (acts * copy[:, None]).sum(0) / acts.sum(0).clamp_min(1e-12)
    nxt = rows[:, 1:].reshape(-1)
    vocab = int(rows.max()) + 1
    # per feature: how its firings spread over the next token (what the copy predicts)
    counts = torch.zeros(acts.shape[1], vocab).index_add_(1, nxt, on.T.float())
    purity = counts.max(1).values / fires
    favourite = counts.argmax(1)
    print(f"second-copy positions: {100 * copy.float().mean():.1f}% of held-out tokens")
    order = fr[:, a.head].argsort(descending=True)
    n_head = fr.shape[1]
    print("| feature | density | " + " | ".join(f"L{a.layer}.H{h}" for h in range(n_head))
          + " | firings on second copies | activation mass there | most common next token: "
          "share of firings |")
    print("|---" * (n_head + 5) + "|")
    for f in order[:12].tolist():
        if on[:, f].sum() == 0:
            continue
        print(f"| {f} | {float(on[:, f].float().mean()):.4f} | "
              + " | ".join(f"{float(v):.2f}" for v in fr[f])
              + f" | {100 * float(precision[f]):.1f}% | {100 * float(mass[f]):.1f}% | "
              f"id {int(favourite[f])}: {100 * float(purity[f]):.1f}% |")
    d_head = z.shape[1] // n_head
    norm = z.view(-1, n_head, d_head)[:, a.head].norm(dim=-1)
    print(f"L{a.layer}.H{a.head}'s output norm: mean {float(norm[copy].mean()):.2f} on second "
          f"copies, {float(norm[~copy].mean()):.2f} elsewhere")
    dense = on.float().mean(0) >= 0.005
    print("most second-copy-selective features (density >= 0.5%): "
          + "; ".join(f"{f}: {100 * float(precision[f]):.0f}% on copies, heads "
                      + "/".join(f"{float(v):.2f}" for v in fr[f])
                      for f in (precision * dense).argsort(descending=True)[:5].tolist()))
    alive = on.sum(0) > 0
    writers = (fr[:, a.head] >= 0.5) & alive
    for name, sel in (("written >= 50% by the head", writers), ("the others", alive & ~writers)):
        print(f"{name}: {int(sel.sum())} features; median share of firings on second copies "
              f"{100 * float(precision[sel].median()):.1f}%, median share on their most common "
              f"next token {100 * float(purity[sel].median()):.1f}%")
    hits = writers & (precision >= 0.9)
    print(f"features with >= 50% of their decoder norm in L{a.layer}.H{a.head}: "
          f"{int(writers.sum())}; of them firing >= 90% on second copies: {int(hits.sum())}"
          f" (together active on {100 * float(on[:, hits].any(1).float().mean()):.1f}% of "
          "tokens)")


if __name__ == "__main__":
    main()
