"""Distillation (`train.distill_from`): trained runs teach this one. Each training step mixes
the usual cross-entropy against the next tokens with the cross-entropy against the teachers'
mean next-token distribution (their probabilities averaged: the ensemble's prediction):

    loss = (1 - w) * CE(next tokens) + w * mean over positions of -sum_v p_teachers(v) log p(v)

with w = train.distill_weight. The teachers are the weights their runs evaluate and save
(model.safetensors of the latest checkpoint), run in eval mode and in the step's precision,
without gradients. They must read text as this run does (the same tokenizer, by its hash).
The run's config.yaml names them (train.distill_from, as absolute paths), so a distilled
model's run directory says which runs taught it; the student stays a plain minigpt model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from minigpt.config import Config
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import Tokenizer
from minigpt.errors import ConfigError


@dataclass
class Teachers:
    """The teacher models of `train.distill_from` and the weight of their loss."""

    models: list[GPT]
    weight: float

    def loss(self, x: Tensor, y: Tensor, logits: Tensor, loss: Tensor) -> Tensor:
        """The step's loss for inputs x (B, T), targets y (B, T) (-1 = ignored), the student's
        logits (B, T, V) and its cross-entropy `loss` (the module docstring)."""
        with torch.no_grad():
            probs = sum(torch.softmax(m(x)[0].float(), dim=-1) for m in self.models)
            probs = probs / len(self.models)  # (B, T, V)
        keep = (y != -1).reshape(-1)
        soft = -(probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).reshape(-1)[keep].mean()
        return (1.0 - self.weight) * loss + self.weight * soft


def open_teachers(cfg: Config, tokenizer: Tokenizer, device: torch.device) -> Teachers | None:
    """The teachers of `cfg.train.distill_from` on `device` (None when it is empty), each
    checked against this run's tokenizer; the paths in `cfg` become absolute."""
    from minigpt.run.load import load_run  # the run room, for a training-time option only

    t = cfg.train
    if not t.distill_from:
        return None
    models = []
    t.distill_from = [str(Path(p).expanduser().resolve()) for p in t.distill_from]
    for path in t.distill_from:
        run = load_run(Path(path), device)
        if run.tokenizer.hash != tokenizer.hash or run.cfg.model.vocab_size != cfg.model.vocab_size:
            raise ConfigError(f"train.distill_from: {path} reads text with another tokenizer "
                              f"({run.tokenizer.name}, {run.cfg.model.vocab_size} ids) than this "
                              "run; its teachers must be trained on the same corpus and "
                              "tokenizer settings")
        models.append(run.model.requires_grad_(False).eval())
    return Teachers(models, t.distill_weight)
