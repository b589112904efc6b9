"""How well a model trained on synthetic induction data (data.source: induction) copies: its
loss and accuracy on the predictions a copy makes possible.

The plain validation loss of such a run averages over every position, and about half of them
are the first occurrence of a random id, which no model can predict (their loss stays near
ln(induction_vocab)); bits per byte mean nothing for ids that stand for no text. So each
evaluation of an induction run also reports the loss and the top-1 accuracy on the copy
positions only: those whose target id already occurred earlier in the row (with
data.induction_distinct every repeat is a copy; without it a chance repeat counts too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from minigpt.core.gpt import eval_mode


def copy_mask(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: target y[b, t] occurs among the inputs x[b, 0..t] (a copy could predict it)."""
    T = x.shape[1]
    seen = (y.unsqueeze(2) == x.unsqueeze(1))  # (B, T query, T key): y[b, t] == x[b, j]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # keys j <= t
    return (seen & causal).any(-1)


@torch.no_grad()
def copy_metrics(model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[float, float]:
    """(mean loss in nats/token, top-1 accuracy) of `model` over the copy positions of the
    validation batches (x, y); (nan, nan) when there are none. The model's train/eval mode is
    restored."""
    loss_sum, right, n = 0.0, 0, 0
    with eval_mode(model):
        for x, y in batches:
            mask = copy_mask(x, y)
            logits, _ = model(x)
            picked = logits[mask].float()  # (N, V)
            if not len(picked):
                continue
            target = y[mask]
            loss_sum += torch.nn.functional.cross_entropy(picked, target, reduction="sum").item()
            right += int((picked.argmax(-1) == target).sum())
            n += len(target)
    return (loss_sum / n, right / n) if n else (math.nan, math.nan)
