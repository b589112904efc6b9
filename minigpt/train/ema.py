"""Weight averaging for evaluation (`train.ema`): an exponential moving average of the weights.

After optimizer update u (u = 1, 2, ...: the run's step count once the update is done), every
averaged weight a moves towards its live weight w:

    a <- a + (1 - d_u) (w - a),   d_u = min(train.ema, 1 - 1/u)

Until 1 / (1 - ema) updates have been made (the average's horizon: 200 steps at 0.995), d_u =
1 - 1/u makes `a` the plain mean of every update's weights so far (d_1 = 0: the first average is
the first update's weights, never the random initialisation); from then on it is the
exponential average with decay train.ema. d_u depends on u alone, so a resumed run continues
the same average bit for bit.

What the average is used for (checkpoint semantics): evaluations (val loss, bits/byte), the
samples and head scores during training, and the checkpoint's `model.safetensors`, so
`minigpt sample`, `inspect-heads` and `export` (hf and gguf) all use the weights the
evaluations measured. The live weights the optimizer updates are training state, saved beside
them as `train_weights.safetensors` and read only by --resume. With train.ema 0 there is no
average: the live model is evaluated and saved, and no train_weights.safetensors is written.
"""

from __future__ import annotations

import copy

import torch

from minigpt.core.gpt import GPT
from minigpt.run.checkpoint import Checkpoint
from minigpt.run.layout import MODEL_FILE, TRAIN_WEIGHTS_FILE
from minigpt.run.load import load_model_weights


def ema_decay(ema: float, update: int) -> float:
    """d_u: the weight the average keeps after update `update` (1-based), see the module."""
    return min(ema, 1.0 - 1.0 / update)


class WeightAverage:
    """The weights a run evaluates and saves (`.model`) beside the live ones it trains (`live`).

    With `ema` > 0, `.model` is an averaged copy of `live`: the same architecture, tied weights
    tied alike, initialised to the live weights, always in eval mode, never trained. With
    `ema` 0 it is `live` itself and `update` does nothing."""

    def __init__(self, live: GPT, ema: float) -> None:
        self.live, self.ema = live, ema
        self.model = copy.deepcopy(live).eval().requires_grad_(False) if ema else live
        # named_parameters yields a tied Parameter once, in the same order in both models
        self._avgs = [p for _, p in self.model.named_parameters()]
        self._lives = [p for _, p in live.named_parameters()]
        assert len(self._avgs) == len(self._lives)

    @property
    def train_weights(self) -> GPT | None:
        """What train_weights.safetensors holds: the live model when averaging, else None."""
        return self.live if self.ema else None

    @torch.no_grad()
    def update(self, update: int) -> None:
        """Fold the live weights in after optimizer update `update` (1-based)."""
        if not self.ema:
            return
        weight = 1.0 - ema_decay(self.ema, update)
        # avg + weight * (live - avg), each pair: one call over every tensor, the same numbers
        torch._foreach_lerp_(self._avgs, self._lives, weight)

    def load(self, ckpt: Checkpoint) -> None:
        """Restore both from a checkpoint (--resume). What it holds says which file is which:
        with train_weights.safetensors in its manifest, model.safetensors is an average. So
        train.ema may change on --resume: turned on, the average starts from the live
        weights; turned off, the average is dropped and training goes on from the live ones."""
        averaged = TRAIN_WEIGHTS_FILE in ckpt.files
        load_model_weights(self.live, ckpt, TRAIN_WEIGHTS_FILE if averaged else MODEL_FILE)
        if self.ema and averaged:
            load_model_weights(self.model, ckpt)
        elif self.ema:
            self.model.load_state_dict(self.live.state_dict())
