"""Training a TopK SAE (`interp.sae`) on a `[n, d_in]` set of activations: Adam, batches drawn
from a generator seeded by `seed`, decoder rows renormalised after every step, dead features
(no activation for `dead_after` training rows) fed by AuxK. Progress goes to `on_event`
(`events.SaeStep` every `report_every` steps). Every `save_every` steps, and at the end,
`save(state)` gets the whole training state as tensors (`TrainState`: the SAE, Adam's moments, each
feature's rows since it last fired, the generator's state), so an interrupted training
resumes where it was and ends with the same weights as an uninterrupted one (same machine,
same thread count).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from minigpt.core.sampling import check_seed
from minigpt.errors import ArgumentError, MinigptError
from minigpt.events import SaeStep
from minigpt.interp.sae import TopKSAE, default_lr, losses

FEATURES_PER_INPUT = 8  # the automatic width: 8 features per dimension of the input
MAX_LR = 1.0  # Adam's steps are about lr in size: a unit-norm dictionary is lost far below it
MEAN_DENSITY = 1 / 64  # what the automatic k makes a feature's mean density: k / width
MAX_DEFAULT_K = 32


class Diverged(MinigptError):
    """The SAE's loss stopped being a finite number (nothing of that step is kept)."""


def default_width(d_in: int) -> int:
    """The SAE's width when --width is not given: FEATURES_PER_INPUT x the input's width."""
    return FEATURES_PER_INPUT * d_in


def default_k(width: int) -> int:
    """`--k 0`: width / 64 (a feature active on 1 token in 64 on average), at most 32: 16 on
    the default run's layers (width 1024), 8 on the induction config's (512). Measured on the
    induction run's layer 1 (benchmarks/README.md, "Sparse autoencoders on attention outputs"):
    k 16 there made 6.7% of the features dense (active on more than 10% of the tokens), k 8
    1.6%, for a variance explained of 0.981 against 0.973."""
    return max(1, min(MAX_DEFAULT_K, int(width * MEAN_DENSITY)))


@dataclass(frozen=True)
class SaeSettings:
    """What an SAE is trained with; `check` words every bad value as the flag's error."""

    width: int | None     # features (d_sae); None = default_width(d_in)
    k: int                # active features per row; 0 = default_k(width)
    steps: int            # optimizer steps
    batch_size: int       # rows per step
    lr: float             # Adam's learning rate; 0 = interp.sae.default_lr(width)
    seed: int
    aux_k: int = 0        # AuxK's features; 0 = d_in // 2
    dead_after: int = 0   # rows without firing before a feature counts as dead; 0 = automatic

    def check(self) -> None:
        """Every value that does not depend on the input (--k against a --width given, too),
        checked before anything loads."""
        for name in ("width", "steps", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ArgumentError(name, f"must be a positive number, got {value}")
        if self.k < 0:
            raise ArgumentError("k", f"must be a positive number (0 = automatic), got {self.k}")
        if self.width is not None:
            self._check_k(self.width)
        if not 0 <= self.lr <= MAX_LR:  # NaN and inf included
            raise ArgumentError("lr", f"must be from 0 (automatic) to {MAX_LR:g}, got {self.lr}")
        check_seed(self.seed)

    def _check_k(self, width: int, d_in: int | None = None) -> None:
        """At most `width` features can be active (the automatic width's when `d_in`)."""
        if self.k > width:
            what = (f"--width {width}" if d_in is None else f"the width {width} "
                    f"({FEATURES_PER_INPUT} x the input's {d_in})")
            raise ArgumentError("k", f"{self.k} exceeds {what}: at most width features can "
                                "be active; lower --k or raise --width")

    def resolved(self, d_in: int) -> SaeSettings:
        """The settings with every automatic value filled in for inputs of width d_in (--k
        checked against the automatic width)."""
        width = self.width or default_width(d_in)
        self._check_k(width, None if self.width else d_in)
        return SaeSettings(width, self.k or default_k(width), self.steps, self.batch_size,
                           self.lr or default_lr(width), self.seed,
                           self.aux_k or max(1, d_in // 2),
                           self.dead_after or max(10_000, 10 * self.batch_size))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class TrainState:
    """Everything a training needs to go on: the SAE, Adam, `since` (each feature's training
    rows since it last fired), the batch generator and the step."""

    sae: TopKSAE
    optimizer: torch.optim.Adam
    since: Tensor
    generator: torch.Generator
    step: int = 0

    def tensors(self) -> dict[str, Tensor]:
        """The state as named CPU tensors (safetensors: no pickle)."""
        out = {f"sae.{k}": v for k, v in self.sae.state_dict().items()}
        for name, p in self.sae.named_parameters():
            st = self.optimizer.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    out[f"adam.{name}.{key}"] = st[key]
            if "step" in st:
                out[f"adam.{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32
                                                           ).reshape(1)
        out["since"] = self.since
        out["generator"] = self.generator.get_state()
        out["step"] = torch.tensor([self.step], dtype=torch.int64)
        return out

    def saved_form(self) -> dict[str, Tensor]:
        """What `tensors()` holds once a step was taken (Adam's moments and step count beside
        each parameter): the dtypes and shapes a saved state must have."""
        out = self.tensors()
        for name, p in self.sae.named_parameters():
            out[f"adam.{name}.exp_avg"] = torch.empty_like(p)
            out[f"adam.{name}.exp_avg_sq"] = torch.empty_like(p)
            out[f"adam.{name}.step"] = torch.empty(1, dtype=torch.float32)
        return out

    def load(self, tensors: dict[str, Tensor]) -> None:
        """Restore what `tensors()` gave (shapes checked by the caller's reader)."""
        self.sae.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("sae.")})
        for name, p in self.sae.named_parameters():
            if f"adam.{name}.exp_avg" in tensors:
                self.optimizer.state[p] = {
                    "step": tensors[f"adam.{name}.step"].reshape(()).clone(),
                    "exp_avg": tensors[f"adam.{name}.exp_avg"].clone(),
                    "exp_avg_sq": tensors[f"adam.{name}.exp_avg_sq"].clone()}
        self.since = tensors["since"].clone()
        self.generator.set_state(tensors["generator"].clone())
        self.step = int(tensors["step"][0])


def new_state(x: Tensor, s: SaeSettings) -> TrainState:
    """A fresh state for activations x (n, d_in) and resolved settings `s`: b_dec at the
    data's mean, the rest drawn from `s.seed`."""
    gen = torch.Generator().manual_seed(s.seed)
    sae = TopKSAE(x.shape[1], s.width, s.k, generator=gen)
    with torch.no_grad():
        sae.b_dec.copy_(x.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=s.lr, betas=(0.9, 0.999), eps=6.25e-10)
    return TrainState(sae, opt, torch.zeros(s.width, dtype=torch.int64), gen)


def fit_sae(x: Tensor, s: SaeSettings, state: TrainState, *,
            on_event: Callable[[object], None] | None = None,
            save: Callable[[TrainState], None] | None = None, save_every: int = 500,
            report_every: int = 10, stop: Callable[[], bool] | None = None) -> TrainState:
    """Train `state` on x (n, d_in) to `s.steps` steps (module docstring); when `stop()` says
    so after a step, save and return early (the caller reads `state.step`). Diverged, with
    nothing of that step saved, when the loss is not finite."""
    t0 = time.monotonic()
    sae, opt = state.sae, state.optimizer
    n = x.shape[0]
    while state.step < s.steps:
        idx = torch.randint(n, (s.batch_size,), generator=state.generator)
        dead = state.since >= s.dead_after
        out = losses(sae, x[idx], dead, s.aux_k)
        if not torch.isfinite(out.total):
            raise Diverged(f"the SAE's loss is {float(out.total)} at step {state.step + 1}: "
                           "the training diverged; lower --lr (0 = automatic) or scale the "
                           "activations")
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        sae.remove_parallel_grad()
        opt.step()
        sae.normalize_decoder()
        state.since += s.batch_size
        state.since[out.fired] = 0
        state.step += 1
        if on_event is not None and (state.step % report_every == 0 or state.step == s.steps):
            on_event(SaeStep(state.step, s.steps, out.mse, out.aux,
                             float(dead.float().mean()), time.monotonic() - t0))
        stopping = stop is not None and stop()
        if save is not None and (state.step % save_every == 0 or state.step == s.steps
                                 or stopping):
            save(state)
        if stopping:
            break
    return state
