"""GPT-2 small's head census, checked against the published one (Wang et al. 2022, the IOI
circuit): induction heads 5.5 and 6.9, previous-token heads 2.2 and 4.11, duplicate-token heads
0.1, 0.10 and 3.0.

    pip install -e '.[hf]'
    python benchmarks/gpt2_census.py [--model hf:gpt2] [--tokens 101] [--seeds 0,1,2]

Runs inspect-heads' probes on the model (`minigpt.hf.load_model`, inputs starting with
<|endoftext|> as in its training, see README "Hugging Face models") for each seed, averages
each head's score over the seeds, and prints, per score, the heads ranked first. A published
head passes when it ranks among the top `--top` (default 3) heads of its score. Exit status 0
when all of them pass. Needs the network once (or a local copy of gpt2: --model DIR).
"""

from __future__ import annotations

import argparse
import sys

import torch

from minigpt.heads.inspection import inspect
from minigpt.heads.probes import prepare_input
from minigpt.hf import load_model

PUBLISHED = {"induction": [(5, 5), (6, 9)], "previous": [(2, 2), (4, 11)],
             "duplicate": [(0, 1), (0, 10), (3, 0)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="hf:gpt2")
    ap.add_argument("--tokens", type=int, default=101, help="probe length incl. <|endoftext|>")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(args.model, "cpu")
    seeds = [int(s) for s in args.seeds.split(",")]
    ok = True
    for score, heads in PUBLISHED.items():
        total = None
        for seed in seeds:
            inp = prepare_input(loaded.cfg, loaded.tokenizer, probe=score,
                                max_tokens=args.tokens, seed=seed, eot_first=loaded.eot_first)
            s = inspect(loaded.model, inp).scores[score]
            total = s if total is None else total + s
        mean = torch.nan_to_num(total / len(seeds), nan=-1.0)  # (n_layer, n_head)
        n_head = mean.shape[1]
        order = [divmod(int(i), n_head) for i in mean.flatten().argsort(descending=True)]
        top = order[:max(args.top, len(heads))]
        line = ", ".join(f"{la}.{h} {mean[la, h]:.2f}" for la, h in order[:6])
        print(f"{score} probe ({len(seeds)} seeds, {args.tokens} tokens): top heads {line}")
        for la, h in heads:
            if (la, h) not in order:
                print(f"  published {la}.{h}: this model has no such head")
                ok = False
                continue
            rank = order.index((la, h)) + 1
            passed = (la, h) in top
            ok &= passed
            print(f"  published {la}.{h}: score {mean[la, h]:.2f}, rank {rank} "
                  f"{'ok' if passed else 'NOT in the top ' + str(len(top))}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
