"""What keeps a training session safe: Ctrl-C / SIGTERM only raise a flag that the loop reads
after each step (so it can save a checkpoint first), and a model or batch too big for the
machine, or a session that cannot end within a week, is refused before anything is allocated
(`check_training`, cost's one rule; `minigpt train --force` trains anyway)."""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, replace

import torch

from minigpt.config import Config
from minigpt.core.gpt import flops_per_token
from minigpt.cost import TRAIN_LIMIT_S, Work, check_flops


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
    `--stop-after` ends it at (None: train.max_steps), its ranks, `--force` (train
    whatever the estimate) and the autocast dtype its steps run in."""
    start: int = 0
    stop_after: int | None = None
    world: int = 1
    force: bool = False
    dtype: torch.dtype | None = None  # train.precision resolved on the device (None: fp32)

    def steps(self, max_steps: int) -> int:
        end = max_steps if self.stop_after is None else min(max_steps, self.stop_after)
        return max(0, end - self.start)


def _with(cfg: Config, changes: dict[str, int]) -> Config:
    """`cfg` with each setting of `changes` (section.name: value) changed."""
    for key, value in changes.items():
        section, name = key.split(".")
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    return cfg


def training_bytes(cfg: Config, world: int = 1) -> float:
    """A rough fp32 estimate of what a session holds: weights, gradients and two AdamW
    moments (4 copies of the parameters); per micro-batch token, ~16 n_embd floats of
    activations per layer plus ~3 vocab-sized rows (logits, softmax, gradient); every
    evaluation's offsets (drawn at once)."""
    m, t = cfg.model, cfg.train
    micro = t.micro(world)
    params = (m.vocab_size * m.n_embd * (1 if m.tie_weights else 2)
              + m.n_layer * 12 * m.n_embd ** 2 + m.block_size * m.n_embd)
    acts = 4 * micro * m.block_size * (m.n_layer * 16 * m.n_embd + 3 * m.vocab_size)
    return 16.0 * params + acts + 8.0 * t.eval_batches * t.batch_size


def training_flops(cfg: Config, steps: int) -> float:
    """The FLOPs of `steps` optimizer steps (core.gpt.flops_per_token: forward and backward)
    and of the evaluations among them (every train.eval_interval steps and at the end: the
    validation batches and the sampled tokens, forward only, a third of a step's per token)."""
    m, t = cfg.model, cfg.train
    per_token = flops_per_token(m, m.block_size)
    evals = steps // t.eval_interval + 1
    forward = (t.eval_batches * cfg.tokens_per_step
               + len(t.sample_prompts) * t.sample_tokens) * per_token / 3
    return steps * cfg.tokens_per_step * per_token + evals * forward


# The settings that set a session's memory and length, and the values the bundled configs use:
# a refusal names the one furthest above its usual value (the one to change), and the largest
# value of it that fits with every other setting as given.
USUAL = {"model.n_layer": 4, "model.n_embd": 128, "model.vocab_size": 1025,  # BPE 1024 + EOT
         "model.block_size": 128, "train.batch_size": 16, "train.eval_batches": 20,
         "train.max_steps": 2000, "train.sample_tokens": 100}
MINIMUM = {"model.block_size": 2, "train.sample_tokens": 0}


def _culprit(cfg: Config, keys: tuple[str, ...]) -> tuple[str, int, str]:
    """(the setting of `keys` furthest above its usual value, its value, the others above
    theirs in words)."""
    def value(k: str) -> int:
        section, name = k.split(".")
        return getattr(getattr(cfg, section), name)

    key = max(keys, key=lambda k: value(k) / USUAL[k])
    others = ", ".join(f"{k} ({value(k):,})" for k in keys
                       if k != key and value(k) > USUAL[k])
    return key, value(key), others or "the model or the batch"


def check_training(cfg: Config, session: Session, device: torch.device) -> None:
    """Refuse, before anything is allocated or trained, a session that cannot fit in memory
    (`training_bytes`) or cannot end within TRAIN_LIMIT_S (`training_flops`: its steps, from
    its first to --stop-after, and its evaluations; cost.check_flops turns them into time in
    the session's autocast dtype): one line naming the setting furthest above its usual value
    (USUAL), the estimate and the largest value of it that fits with every other setting as
    given (model.n_embd's: a multiple of 2 x model.n_head), unless `session.force`.
    model.vocab_size must be set (the tokenizer's)."""
    m, t = cfg.model, cfg.train
    steps = session.steps(t.max_steps)
    key, value, others = _culprit(cfg, tuple(USUAL))
    step = 2 * m.n_head
    whole = (lambda v: -(-v // step) * step) if key == "model.n_embd" else (lambda v: v)

    def work_of(v: int) -> Work:
        changes = {key: whole(v)}
        if key == "train.batch_size" and t.micro_batch_size:  # micro-batches within the batch
            changes["train.micro_batch_size"] = min(t.micro_batch_size, whole(v))
        c = _with(cfg, changes)
        return Work(training_flops(c, session.steps(c.train.max_steps)),
                    training_bytes(c, session.world))

    minimum = session.start + 1 if key == "train.max_steps" else MINIMUM.get(key, 1)
    check_flops(key, value, work_of, device=device, dtype=session.dtype or torch.float32,
                force=session.force, setting=True, limit_s=TRAIN_LIMIT_S,
                limit_what="a training session may take", minimum=minimum,
                memory="a rough fp32 estimate of the weights, their gradients and AdamW state "
                "and a micro-batch's activations",
                what=f"{steps:,} steps of {t.batch_size:,} x {m.block_size:,} tokens and "
                f"{steps // t.eval_interval + 1:,} evaluations of {t.eval_batches:,} batches, "
                f"a model of {m.n_layer:,} layers x {m.n_embd:,} wide (vocabulary "
                f"{m.vocab_size:,})", none_fit=f"even {minimum} does not fit: lower {others}")
