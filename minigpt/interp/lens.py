"""The logit lens: what the model would predict if it stopped after a layer (nostalgebraist
2020, "interpreting GPT: the logit lens").

`logit_lens(model, tokens, positions, targets)` reads the residual stream at n_layer + 1
points, the one after the embedding and the one after each layer (`GPT.residual_stream`, one
forward pass; the last point is the stream the model's own logits come from), through the
model's own readout (`GPT.unembed`: the final norm, the LM head and the soft-cap, if any), at
the scored positions. The final norm normalises each point with that point's own mean and
variance (its gain and bias are the model's): the lens asks "what would the final norm and the
unembedding make of the stream as it is here", so the last point gives exactly the model's
logits. Per point and position it keeps the target's logit, its probability (softmax over the
whole vocabulary) and its rank (the number of tokens with a strictly larger logit: 0 = the
model's top choice), and the top token with its probability.

This is TransformerLens 4.3's `tools.analysis.logit_lens(model, tokens, positions=None,
targets=...)`: its stack is `accumulated_resid` (every block's `hook_resid_pre`, then the last
block's `hook_resid_post`), normalised by `apply_ln_to_stack(recompute_ln=True)` (each entry's
own statistics, through `ln_final`), read through W_U and b_U; its `target_ranks` count strictly
larger logits. tests/test_transformer_lens.py checks the numbers against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minigpt.core.gpt import device_of, eval_mode


def point_names(n_layer: int) -> list[str]:
    """The lens's points: "embed" (after the embedding), then "L0" .. "L{n-1}" (after that
    layer; the last is the model's final residual stream)."""
    return ["embed"] + [f"L{la}" for la in range(n_layer)]


@dataclass
class Lens:
    """The logit lens on one input. Every tensor is (n_points, P): points as `points`, columns
    the scored `positions` (query positions), whose token to predict is `targets`.

    logit: the target's logit; prob: its probability; rank: how many tokens have a larger
    logit (0 = the top token); top: the top token's id; top_prob: its probability."""

    points: list[str]
    positions: list[int]
    targets: list[int]
    logit: Tensor
    prob: Tensor
    rank: Tensor
    top: Tensor
    top_prob: Tensor

    def records(self, digits: int = 6, token_str=None) -> list[dict]:
        """The JSON list: one record per (point, position), points in order. `token_str(id)`,
        if given, adds each token's text."""
        out = []
        for i, point in enumerate(self.points):
            for j, pos in enumerate(self.positions):
                rec = {"point": point, "after_layer": None if i == 0 else i - 1,
                       "position": pos,
                       "target": self.targets[j], "logit": round(float(self.logit[i, j]), digits),
                       "prob": round(float(self.prob[i, j]), digits),
                       "rank": int(self.rank[i, j]), "top": int(self.top[i, j]),
                       "top_prob": round(float(self.top_prob[i, j]), digits)}
                if token_str is not None:
                    rec["target_str"] = token_str(self.targets[j])
                    rec["top_str"] = token_str(int(self.top[i, j]))
                out.append(rec)
        return out

    def summary(self) -> list[dict]:
        """Per point, over the positions: the mean target logit and probability, the median
        rank, and the fraction of positions whose top token is the target."""
        return [{"point": p, "logit": float(self.logit[i].mean()),
                 "prob": float(self.prob[i].mean()),
                 "median_rank": float(self.rank[i].double().median()),
                 "top_is_target": float((self.rank[i] == 0).double().mean())}
                for i, p in enumerate(self.points)]


@torch.no_grad()
def logit_lens(model, tokens: Sequence[int], positions: Sequence[int] | None = None,
               targets: Sequence[int] | None = None) -> Lens:
    """The logit lens (module docstring) of `model` on `tokens` (one sequence within
    block_size) at `positions` (None: every position with a next token), reading the logit of
    `targets` (one id per position; None: the next token at each). Eval mode, restored after."""
    pos = list(range(len(tokens) - 1)) if positions is None else list(positions)
    tgt = [tokens[p + 1] for p in pos] if targets is None else list(targets)
    if not pos or len(tgt) != len(pos):
        raise ValueError(f"{len(pos)} positions and {len(tgt)} targets: one target each, "
                         "at least one position")
    with eval_mode(model):
        idx = torch.tensor([list(tokens)], dtype=torch.long, device=device_of(model))  # (1, T)
        stream = model.residual_stream(idx)  # n_layer + 1 x (1, T, C)
        target = torch.tensor(tgt, device=idx.device)[:, None]  # (P, 1)
        rows = {k: [] for k in ("logit", "prob", "rank", "top", "top_prob")}
        for x in stream:  # one point at a time: P x V logits, not n_points x P x V
            logits = model.unembed(x[0, pos])  # (P, V) float32
            logp = logits.log_softmax(-1)
            mine = logits.gather(1, target)  # (P, 1)
            top = logits.argmax(-1, keepdim=True)  # (P, 1)
            rows["logit"].append(mine[:, 0])
            rows["prob"].append(logp.gather(1, target)[:, 0].exp())
            rows["rank"].append((logits > mine).sum(-1))
            rows["top"].append(top[:, 0])
            rows["top_prob"].append(logp.gather(1, top)[:, 0].exp())
    t = {k: torch.stack(v).cpu() for k, v in rows.items()}  # (n_points, P) each
    return Lens(point_names(len(stream) - 1), pos, tgt, t["logit"], t["prob"], t["rank"],
                t["top"], t["top_prob"])
