"""What keeps a training session safe: Ctrl-C / SIGTERM only raise a flag that the loop reads
after each step (so it can save a checkpoint first), and a model or batch too big for the
machine, or a session that cannot end within a week, is refused before anything is allocated
(`check_training`, core.budget's one rule; `minigpt train --force` trains anyway)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, replace

import torch

from minigpt.config import Config
from minigpt.core.budget import FLOOR_RATE, TRAIN_LIMIT_S, Cost, check_cost, matmul_rate
from minigpt.core.gpt import flops_per_token
from minigpt.device import amp_dtype


class StopFlag:
    """SIGINT/SIGTERM handlers that only set a flag; the loop checks it after each step. A
    second signal stops at once (KeyboardInterrupt; the last committed checkpoint stays)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


@dataclass(frozen=True)
class Session:
    """What a session's cost depends on beyond its config: the step it starts from, the step
    `--stop-after` ends it at (None: train.max_steps), its ranks, and `--force` (train
    whatever the estimate)."""
    start: int = 0
    stop_after: int | None = None
    world: int = 1
    force: bool = False

    def steps(self, max_steps: int) -> int:
        end = max_steps if self.stop_after is None else min(max_steps, self.stop_after)
        return max(0, end - self.start)


def _with(cfg: Config, changes: dict[str, int]) -> Config:
    """`cfg` with each setting of `changes` (section.name: value) changed."""
    for key, value in changes.items():
        section, name = key.split(".")
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return cfg


def training_bytes(cfg: Config, world: int = 1, micro: int | None = None,
                   evals: bool = True) -> float:
    """A rough fp32 estimate of what a session holds: weights, gradients and two AdamW
    moments (4 copies of the parameters); per micro-batch token, ~16 n_embd floats of
    activations per layer plus ~3 vocab-sized rows (logits, softmax, gradient); every
    evaluation's offsets (drawn at once; with `evals`)."""
    m, t = cfg.model, cfg.train
    micro = micro if micro is not None else t.micro_batch_size or max(1, t.batch_size // world)
    params = (m.vocab_size * m.n_embd * (1 if m.tie_weights else 2)
              + m.n_layer * 12 * m.n_embd ** 2 + m.block_size * m.n_embd)
    acts = 4 * micro * m.block_size * (m.n_layer * 16 * m.n_embd + 3 * m.vocab_size)
    return 16.0 * params + acts + (8.0 * t.eval_batches * t.batch_size if evals else 0.0)


def training_flops(cfg: Config, steps: int) -> float:
    """The FLOPs of `steps` optimizer steps (core.gpt.flops_per_token: forward and backward)
    and of the evaluations among them (every train.eval_interval steps and at the end: the
    validation batches and the sampled tokens, forward only, a third of a step's per token)."""
    m, t = cfg.model, cfg.train
    per_token = flops_per_token(m, m.block_size)
    evals = steps // t.eval_interval + 1
    forward = (t.eval_batches * t.batch_size * m.block_size
               + len(t.sample_prompts) * t.sample_tokens) * per_token / 3
    return steps * t.batch_size * m.block_size * per_token + evals * forward


def check_training(cfg: Config, session: Session, device: torch.device) -> None:
    """Refuse, before anything is allocated or trained, a session that cannot fit in memory
    or cannot end within TRAIN_LIMIT_S, each through core.budget.check_cost: one line naming
    the setting, the estimate and the largest value that fits, unless `session.force`.
    model.vocab_size must be set (the tokenizer's)."""
    if not session.force:
        _check_memory(cfg, session, device)
        _check_time(cfg, session, device)


# The model's size settings and what the bundled configs use: the one furthest above its usual
# value is the one a memory refusal names (with the largest value that fits).
USUAL = {"model.n_layer": 4, "model.n_embd": 128, "model.vocab_size": 1024,
         "model.block_size": 128}


def _check_memory(cfg: Config, session: Session, device: torch.device) -> None:
    """The weights (named: the size setting furthest above its usual value, USUAL), then one
    sequence (model.block_size), the micro-batch (train.micro_batch_size or train.batch_size,
    with one evaluation batch), then the evaluations' offsets (train.eval_batches)."""
    m, t = cfg.model, cfg.train
    memory = {"device": device, "setting": True, "basis": "a rough fp32 estimate of the "
              "weights, their gradients and AdamW state and a micro-batch's activations"}
    key = max(USUAL, key=lambda k: getattr(m, k.split(".")[1]) / USUAL[k])
    H = m.n_head
    whole = (lambda v: -(-v // H) * H) if key == "model.n_embd" else (lambda v: v)
    others = ", ".join(f"{k} ({getattr(m, k.split('.')[1]):,})" for k in USUAL if k != key)
    check_cost(key, getattr(m, key.split(".")[1]),
               lambda v: Cost(0.0, training_bytes(_with(cfg, {key: whole(v)}), session.world, 0,
                                                  False)),
               what=f"a model of {m.n_layer:,} layers x {m.n_embd:,} wide, vocabulary "
               f"{m.vocab_size:,}, context {m.block_size:,}", none_fit=f"lower {others}", **memory)
    check_cost("model.block_size", m.block_size,
               lambda v: Cost(0.0, training_bytes(_with(cfg, {"model.block_size": v}),
                                                  session.world, 1, False)),
               what=f"one sequence of {m.block_size:,} tokens", minimum=2, **memory)
    key = "train.micro_batch_size" if t.micro_batch_size else "train.batch_size"
    check_cost(key, getattr(t, key.split(".")[1]),
               lambda v: Cost(0.0, training_bytes(_with(cfg, {key: v, "train.eval_batches": 1}),
                                                  session.world)),
               what=f"a micro-batch of {t.micro_batch_size or t.batch_size // session.world:,} "
               f"sequences x {m.block_size:,} tokens", **memory)
    check_cost("train.eval_batches", t.eval_batches,
               lambda v: Cost(0.0, training_bytes(_with(cfg, {"train.eval_batches": v}),
                                                  session.world)),
               what=f"{t.eval_batches:,} evaluation batches of {t.batch_size:,} sequences",
               **memory)


def _check_time(cfg: Config, session: Session, device: torch.device) -> None:
    """The session's steps (train.max_steps, with the least evaluation), then its evaluations
    (train.eval_batches, then train.sample_tokens): their FLOPs at this machine's measured
    matmul rate (a lower bound), measured only when the FLOPs could take that long at
    core.budget.FLOOR_RATE."""
    m, t = cfg.model, cfg.train
    steps = session.steps(t.max_steps)
    if training_flops(cfg, steps) <= TRAIN_LIMIT_S * FLOOR_RATE:
        return  # fits at any speed this runs at: nothing to measure
    rate = matmul_rate(device, amp_dtype(t.precision, device) or torch.float32)
    timed = {"device": device, "setting": True, "limit_s": TRAIN_LIMIT_S,
             "limit_what": "a training session may take", "basis": "the model's FLOPs at this "
             f"machine's measured matmul rate, {rate / 1e9:.3g} GFLOP/s: a lower bound"}

    def cost(changes: dict, n: int) -> Cost:
        c = _with(cfg, changes)
        return Cost(training_flops(c, n) / rate, training_bytes(c, session.world))

    least = {"train.eval_batches": 1, "train.sample_tokens": 0}
    evals = steps // t.eval_interval + 1
    check_cost("train.max_steps", t.max_steps,
               lambda v: cost({**least, "train.max_steps": v}, session.steps(v)),
               what=f"{steps:,} steps of {t.batch_size * m.block_size:,} tokens",
               minimum=session.start + 1, none_fit="shrink the model or the batch", **timed)
    check_cost("train.eval_batches", t.eval_batches,
               lambda v: cost({"train.eval_batches": v, "train.sample_tokens": 0}, steps),
               what=f"{evals:,} evaluations of {t.eval_batches:,} batches", **timed)
    check_cost("train.sample_tokens", t.sample_tokens,
               lambda v: cost({"train.sample_tokens": v}, steps), minimum=0,
               what=f"{t.sample_tokens:,} tokens sampled at each of {evals:,} evaluations",
               **timed)
