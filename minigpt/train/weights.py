"""The weights a training session trains: the model, its optimizer and learning-rate schedule,
the weight average it evaluates and saves (ema.py), and one optimizer step. `Weights.build`
makes them in set-up (restored from the checkpoint on resume); `Weights.step` is the step.

One step (`Weights.step`): the learning rate of the update (`lr_at`) set on every optimizer
group (`set_lr`), then core/step.py's `train_step` over this rank's micro-batches (forward,
backward, clip, optimizer step); with DDP one all-reduce per step carries the mean loss and any
rank's stop request. The average folds the new weights in after the update.

Step numbering: `it` counts optimizer updates from 0; update `it` uses `lr_at(it)`. The
schedule is a pure function of `it` and the config, so a resumed run recomputes it exactly.

`train.optimizer: adamw` is one AdamW over every parameter. `muon` is two optimizers over
disjoint parameters, stepped together as one `OptimizerChain`: Muon (train/muon.py's
BatchedMuon: torch.optim.Muon's arithmetic, batched by shape) for the 2-D weight matrices
inside the blocks (attention and MLP projections), AdamW for everything else
(token/position embeddings, an untied LM head, norm and QK-norm gains, biases). Muon
orthogonalises each matrix's momentum (Newton-Schulz), which suits hidden-layer matrices but
not embeddings (a lookup, not a linear map of the residual stream) or vectors.

RNGs: the model's initialisation draws from its own generator seeded by run.seed; the global
generators (dropout) are seeded by run.seed for a fresh run, or set to the states the
checkpoint saved, as the last thing set-up does with them (`seed_rngs`). Dropout differs per
rank (rank 0's stream is the saved one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from minigpt.config import Config, TrainConfig
from minigpt.core import step as core_step
from minigpt.core.gpt import GPT
from minigpt.device import forward_context, use_compile_cache
from minigpt.run.load import load_optimizer_state
from minigpt.run.resume import Resumed
from minigpt.train.distill import Teachers, open_teachers
from minigpt.train.distributed import DistInfo, all_reduce_sum
from minigpt.train.ema import WeightAverage
from minigpt.train.muon import BatchedMuon


def lr_at(it: int, t: TrainConfig) -> float:
    """The AdamW learning rate of update `it` (Muon's is this x muon_lr / learning_rate).

    Both schedules warm up linearly from lr/(warmup+1) to lr over `warmup_steps` updates
    (update `warmup_steps` is the first at the peak) and reach min_lr at the last update
    (it = max_steps - 1), staying there after it. In between:
    - cosine: cosine decay from learning_rate to min_lr.
    - wsd (warm-up, stable, decay): learning_rate until the last n = round(decay_fraction *
      max_steps) updates (never before the warm-up ends), which step down linearly:
      the j-th of them (j = 1..n) gets learning_rate - j/n * (learning_rate - min_lr).
      decay_fraction 0 keeps the peak to the end."""
    if it < t.warmup_steps:
        return t.learning_rate * (it + 1) / (t.warmup_steps + 1)
    if t.schedule == "wsd":
        start = max(t.warmup_steps, t.max_steps - round(t.decay_fraction * t.max_steps))
        if it < start:
            return t.learning_rate
        ratio = min(1.0, (it - start + 1) / max(1, t.max_steps - start))  # (0, 1]
        return t.learning_rate - ratio * (t.learning_rate - t.min_lr)
    span = max(1, t.max_steps - 1 - t.warmup_steps)
    ratio = min(1.0, (it - t.warmup_steps) / span)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return t.min_lr + coeff * (t.learning_rate - t.min_lr)


class OptimizerChain:
    """Several torch optimizers over disjoint parameters, used as one: `step`, `zero_grad`,
    `param_groups` (every part's groups, in order; the dicts are the parts' own, so setting a
    group's lr reaches its optimizer) and `state` (a merged {param: state} snapshot for
    reading). Checkpoints save and restore each part (`parts`, see run/checkpoint.py's
    optimizer_tensors and run/load.py's load_optimizer_state)."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = list(parts)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.parts for p, s in opt.state.items()}

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)


def build_optimizer(model: torch.nn.Module, t: TrainConfig, device: torch.device
                    ) -> tuple[torch.optim.AdamW | OptimizerChain, list[str]]:
    """The optimizer of `train.optimizer` at update 0's learning rate, and the parameter names
    in optimizer order (every part's param_groups concatenated; for checkpoints).

    AdamW has two groups: weight decay on matrices (dim >= 2: linear weights and the token
    embedding, which is also the tied LM head), none on norms and biases (decaying a gain
    towards 0 only hurts). Tied parameters appear once. Fused kernel on CUDA and CPU (on CPU
    it made a small-model step ~10-25% faster than the default foreach kernel).

    muon: an OptimizerChain of [Muon over the blocks' 2-D matrices, the AdamW above over the
    rest]. Every group carries `lr_scale`, its peak over learning_rate (1 for AdamW,
    muon_lr / learning_rate for Muon), which `set_lr` multiplies in."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    to_muon = [t.optimizer == "muon" and is_block_matrix(n, p) for n, p in named]
    muon = [np_ for np_, m in zip(named, to_muon) if m]
    rest = [np_ for np_, m in zip(named, to_muon) if not m]
    groups, names = adamw_groups(rest, t.weight_decay)
    extra = {"fused": True} if device.type in ("cuda", "cpu") else {}
    adamw = torch.optim.AdamW(groups, lr=lr_at(0, t), betas=(t.beta1, t.beta2), **extra)
    if t.optimizer == "adamw":
        return adamw, names
    scale = t.muon_lr / t.learning_rate
    opt = BatchedMuon([{"params": [p for _, p in muon], "lr_scale": scale}],
                           lr=lr_at(0, t) * scale, weight_decay=t.muon_weight_decay,
                           momentum=t.muon_momentum, nesterov=True)
    return OptimizerChain([opt, adamw]), [n for n, _ in muon] + names


def is_block_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (W_QKV, W_O, MLP in and out): Muon's share."""
    return name.startswith("blocks.") and p.dim() == 2


def adamw_groups(named: list[tuple[str, torch.Tensor]], weight_decay: float
                 ) -> tuple[list[dict], list[str]]:
    """AdamW's two groups over `named` (name, parameter) pairs: [decayed matrices (dim >= 2),
    undecayed norms and biases], and the parameter names in that order."""
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    groups = [{"params": [p for _, p in decay], "weight_decay": weight_decay, "lr_scale": 1.0},
              {"params": [p for _, p in no_decay], "weight_decay": 0.0, "lr_scale": 1.0}]
    return groups, [n for n, _ in decay] + [n for n, _ in no_decay]


def set_lr(optimizer: torch.optim.Optimizer | OptimizerChain, lr: float) -> None:
    """Set every group to `lr` (the AdamW rate of `lr_at`) times its `lr_scale`, so each
    optimizer keeps its ratio to its own peak."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # x 1.0 is exact: AdamW runs unchanged


# --------------------------------------------------------------------------------------------
# The session's weights.

Context = Callable[[], AbstractContextManager]


@dataclass
class Weights:
    """What one session trains, as `Weights.build` makes it (the module docstring)."""

    settings: TrainConfig
    model: GPT                      # the live weights the optimizer updates
    fwd: torch.nn.Module            # what runs the forward pass (`forward_module`)
    optimizer: torch.optim.AdamW | OptimizerChain
    names: list[str]                # parameter names in optimizer order (checkpoints)
    average: WeightAverage          # .model: what evaluations, samples and checkpoints use
    dtype: torch.dtype | None       # the autocast dtype train.precision resolved to (None: fp32)
    precision: Context              # the context of every forward pass (autocast or none)
    no_sync: Context | None         # DDP: the context of every micro-batch but the last
    info: DistInfo
    teachers: Teachers | None = None  # train.distill_from (distill.py)

    @classmethod
    def build(cls, cfg: Config, device: torch.device, start: Resumed | None,
              info: DistInfo, dtype: torch.dtype | None, tokenizer=None) -> Weights:
        """The model (initialised from run.seed), its optimizer at update 0's learning rate and
        its WeightAverage, restored from the checkpoint on resume; what runs the forward pass;
        the teachers of train.distill_from (checked against `tokenizer`, the run's); then the
        RNGs seeded or restored (`seed_rngs`)."""
        t = cfg.train
        teachers = open_teachers(cfg, tokenizer, device) if t.distill_from else None
        model = GPT.from_config(cfg, seed=cfg.run.seed).to(device)
        optimizer, names = build_optimizer(model, t, device)
        average = WeightAverage(model, t.ema)
        if start is not None:
            average.load(start.checkpoint)
            load_optimizer_state(optimizer, names, start.checkpoint)
        fwd = forward_module(model, t, device, info, cfg.data.cache_dir)
        weights = cls(t, model, fwd, optimizer, names, average, dtype,
                      forward_context(device, dtype),
                      fwd.no_sync if info.enabled else None, info, teachers)
        seed_rngs(cfg.run.seed, info, start)
        return weights

    def step(self, it: int, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], n_micro: int,
             flag) -> tuple[core_step.StepResult, float, bool]:
        """Update `it` (0-based) over this rank's `n_micro` micro-batches: (core's StepResult,
        the learning rate, whether any rank was signalled: its `flag.signum` set). The average
        folds the new weights in when the optimizer stepped."""
        lr = lr_at(it, self.settings)
        set_lr(self.optimizer, lr)
        stop = [False]

        def mean_loss(mine: torch.Tensor) -> float:
            """The loss for the log and any rank's stop request: one collective (DDP)."""
            stats = torch.stack([mine, torch.tensor(float(flag.signum is not None))])
            if self.info.world_size > 1:
                all_reduce_sum(stats, self.info)
            stop[0] = stats[1].item() > 0
            return stats[0].item() / self.info.world_size

        r = core_step.train_step(self.model, self.optimizer, batches, n_micro=n_micro,
                                 grad_clip=self.settings.grad_clip, fwd=self.fwd,
                                 precision=self.precision, no_sync=self.no_sync,
                                 mean_loss=mean_loss,
                                 loss_of=self.teachers.loss if self.teachers else None)
        if r.stepped:
            self.average.update(it + 1)
        return r, lr, stop[0]

    def evaluate(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The average's mean loss over this rank's evaluation batches and every other rank's."""
        total = core_step.evaluate(self.average.model, batches, precision=self.precision)
        all_reduce_sum(total, self.info)  # (sum of loss x rows, rows) over every rank
        self.model.train()
        return (total[0] / total[1]).item()


def forward_module(model: GPT, t: TrainConfig, device: torch.device, info: DistInfo,
                   cache_dir: str = "") -> torch.nn.Module:
    """What the training step calls: the model, maybe compiled (`compiles`; inductor's caches
    in `compile_cache_dir(cache_dir)`), maybe under DDP."""
    fwd: torch.nn.Module = model
    if compiles(t.compile, device):
        use_compile_cache(cache_dir)
        fwd = torch.compile(model)
    if info.enabled:
        fwd = torch.nn.parallel.DistributedDataParallel(
            fwd, device_ids=[device.index] if device.type == "cuda" else None)
    return fwd


# `train.compile: auto` per device type, from whole-process measurements (compile included) of
# the speedrun and default configs: benchmarks/step_ratio.md. On CPU the compiled step is 3-15%
# faster, but a first run (an empty compile cache, or any change to the model or the shapes)
# pays ~100 s of compiling before its first step, more than a 5-minute run wins back, so auto
# leaves CPU eager.
AUTO_COMPILE = {"cuda": True, "cpu": False}


def compiles(setting: str, device: torch.device) -> bool:
    """Whether `train.compile` (auto / true / false) compiles the model on `device`."""
    if setting == "auto":
        return AUTO_COMPILE.get(device.type, False)
    return setting == "true"


def seed_rngs(seed: int, info: DistInfo, start: Resumed | None) -> None:
    """The global generators where the run left them (the module docstring): seeded from
    run.seed for a fresh run, the saved states on resume. The last thing set-up does with any
    RNG (what it builds after the weights draws nothing)."""
    if start is None:
        torch.manual_seed(seed)
    else:
        start.rng.restore()
    if info.rank > 0:
        torch.manual_seed(seed + 7919 * info.rank + (start.state.step if start else 0))
