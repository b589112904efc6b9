"""One optimizer step and one evaluation, as plain functions of a model, its optimizer and
batches of token ids: what a training step computes, and nothing about where the batches come
from or what happens to the numbers.

The trainer (train/) owns the rest: which batches (train/batches.py: every rank's slice of the
global batch), the learning-rate schedule and the collective that sums the loss over DDP ranks
(train/weights.py, passed in as `mean_loss`), the weight average, the divergence message,
checkpoints and events.

    loss = mean over micro-batches of cross_entropy(model(x), y)        (forward, backward)
    grad_norm = clip_grad_norm_(parameters, grad_clip)                  (before clipping)
    optimizer.step(); optimizer.zero_grad()

Each micro-loss is divided by the number of micro-batches before `backward`, so the gradients
add up to the gradient of the mean loss. Nothing is stepped when the loss or the gradient norm
is not finite: `StepResult.stepped` is False and the caller decides what to say.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from minigpt.core.gpt import device_of, eval_mode

Context = Callable[[], AbstractContextManager]


@dataclass(frozen=True)
class StepResult:
    loss: float  # the mean loss over the batch (every rank's, through `mean_loss`)
    grad_norm: float  # the gradient norm before clipping (NaN when the loss was not finite)
    stepped: bool  # False: a non-finite loss or gradient norm, the weights are unchanged


def train_step(model: nn.Module, optimizer, batches: Iterable[tuple[Tensor, Tensor]], *,
               n_micro: int, grad_clip: float, fwd: nn.Module | None = None,
               precision: Context = contextlib.nullcontext, no_sync: Context | None = None,
               mean_loss: Callable[[Tensor], float] | None = None,
               loss_of: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
               ) -> StepResult:
    """Forward and backward over `n_micro` micro-batches (x, y), clip, optimizer step.

    `fwd` is what runs the forward pass (the model, compiled or wrapped in DDP; default the
    model); `precision()` the context each forward runs in (autocast); `no_sync()` the context
    of every micro-batch but the last (DDP: gradients are reduced once, on the last);
    `mean_loss(t)` turns this process's mean micro-loss t (a 0-dim CPU tensor) into the batch's
    mean loss (the trainer's all-reduce; default: `t.item()`); `loss_of(x, y, logits, loss)`,
    when given, the loss to minimise instead of the model's (distillation). `grad_clip` <= 0 =
    no clipping.
    The optimizer's learning rate is the caller's to set beforehand."""
    fwd = model if fwd is None else fwd  # never `fwd or model`: a wrapper may refuse bool()
    loss_sum = torch.zeros((), device=device_of(model))
    for m, (x, y) in enumerate(batches):
        sync = no_sync() if no_sync is not None and m < n_micro - 1 else contextlib.nullcontext()
        with sync:
            with precision():
                logits, loss = fwd(x, y)  # (B, T) ids -> mean cross-entropy, a 0-dim tensor
                if loss_of is not None:
                    loss = loss_of(x, y, logits, loss)
            (loss / n_micro).backward()  # gradients accumulate over the micro-batches
        loss_sum += loss.detach().float()
    mean = loss_sum.cpu() / n_micro
    loss_val = mean_loss(mean) if mean_loss is not None else mean.item()
    if not math.isfinite(loss_val):
        return StepResult(loss_val, math.nan, False)
    clip = grad_clip if grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    if not math.isfinite(grad_norm):
        return StepResult(loss_val, grad_norm, False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_val, grad_norm, True)


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], *,
             precision: Context = contextlib.nullcontext) -> Tensor:
    """The model's loss on batches (x, y) in eval mode (restored afterwards): a float64 tensor
    (sum over batches of mean loss x rows, rows). The mean loss is the first divided by the
    second; sums, not a mean, so that ranks can add theirs before dividing."""
    total = torch.zeros(2, dtype=torch.float64)
    with eval_mode(model):
        for x, y in batches:
            with precision():
                _, loss = model(x, y)
            total += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64)
    return total
