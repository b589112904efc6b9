"""What a training session tells, and to whom: every event goes to rank 0's run files
(outputs.py: metrics.jsonl, the pictures, the summary), then the TensorBoard log
(tensorboard.py, with train.tensorboard) and then the caller's `on_event`, in that order. The
events are made here: the start, each logged step (with the clock's tokens/s and training
seconds: clock.py), each evaluation (the validation loss the weights measured, bits per byte,
the best so far, the samples, and for synthetic induction rows the copy metrics: copies.py),
the head measurements (heads/timeline.py, rank 0, every `train.head_scores_interval` steps,
with train.stop_when_formed's answer agreed by every rank) and the end.

Another output is one more consumer in `Reporting.build`'s list: a callable taking the same
events in the same order. `preflight` refuses, before anything is made, an output the config
asks for that cannot be made.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt.config import Config, TrainConfig, head_scores_every
from minigpt.core.generate import generate
from minigpt.data.tokenizer import Tokenizer
from minigpt.events import (
    DoneEvent,
    EvalEvent,
    OnEvent,
    StartEvent,
    StepEvent,
    UnreadLinesKept,
)
from minigpt.heads.timeline import HeadWatch, all_formed
from minigpt.run.state import TrainerState
from minigpt.train.batches import Batches
from minigpt.train.clock import Clock
from minigpt.train.copies import copy_metrics
from minigpt.train.distributed import DistInfo, agree
from minigpt.train.outputs import RunOutputs
from minigpt.train.tensorboard import require_tensorboard, tensorboard_log


def preflight(t: TrainConfig) -> None:
    """Refuse now, on every rank and before the run directory is touched, an output that
    cannot be made: train.tensorboard without the tensorboard package (one line)."""
    if t.tensorboard:
        require_tensorboard()


class Reporting:
    """The events of one session and their consumers (the module docstring)."""

    def __init__(self, cfg: Config, info: DistInfo, consumers: list[Callable[[object], object]],
                 outputs: RunOutputs | None, heads: HeadWatch | None, head_every: int) -> None:
        self.cfg, self.info, self.consumers = cfg, info, consumers
        self.outputs = outputs      # rank 0's run files, the first consumer
        self.heads = heads          # head scores every `head_every` steps (rank 0)
        self.head_every = head_every
        self.clock: Clock | None = None   # from the start event on
        self.last_eval: EvalEvent | None = None  # this session's last evaluation

    @classmethod
    def build(cls, cfg: Config, run_dir: Path, tokenizer: Tokenizer, model: torch.nn.Module,
             info: DistInfo, on_event: OnEvent, *, resumed_at: int | None) -> Reporting:
        """The consumers of a session in `run_dir` (its directory exists by now; `resumed_at`:
        the step a resumed session continues from, 0 when nothing was saved, None for a fresh
        run) and the head watch
        over `model`, the weights evaluations read. Rank 0 writes; every rank measures time
        and agrees on train.stop_when_formed."""
        main = info.is_main
        board = tensorboard_log(cfg.train, run_dir, fresh=resumed_at is None, main=main)
        every = head_scores_every(cfg.train)
        outputs = RunOutputs(run_dir, cfg, tokenizer, resumed_at=resumed_at,
                             heads_png=every > 0) if main else None
        if outputs is not None and outputs.unread:
            on_event(UnreadLinesKept(outputs.path, outputs.unread))
        heads = HeadWatch(model, cfg, tokenizer, outputs.heads) if every and main else None
        consumers = [c for c in (outputs, board, on_event) if c is not None]
        return cls(cfg, info, consumers, outputs, heads, every)

    def emit(self, event: object) -> None:
        for consume in self.consumers:
            consume(event)

    def start(self, event: StartEvent, elapsed: float) -> None:
        """The session starts (the clock too, from the run's training seconds so far)."""
        self.clock = Clock(elapsed, event.start_step)
        self.emit(event)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, tokens_seen: int) -> None:
        t = self.cfg.train
        self.emit(StepEvent(step, t.max_steps, loss, lr, grad_norm,
                            self.clock.tokens_per_s(step, self.cfg.tokens_per_step),
                            self.clock.elapsed(),
                            tokens_seen))

    def heads_formed(self, step: int, last: bool) -> bool:
        """At a head-score step (or the last): score the heads (rank 0) and report them; True
        when train.stop_when_formed names kinds, this is not the last step and this measurement
        found a head of each at the formed threshold (every rank gets rank 0's answer)."""
        if not self.head_every or (step % self.head_every and not last):
            return False
        kinds = self.cfg.train.stop_when_formed
        done = False
        if self.heads is not None:
            scores, formed = self.heads.measure(step)
            for event in (scores, *formed):
                self.emit(event)
            done = bool(kinds) and all_formed(scores.scores, kinds)
        return bool(kinds) and not agree(not done, self.info) and not last

    def evaluation(self, step: int, val: float, state: TrainerState, model: torch.nn.Module,
                   batches: Batches) -> None:
        """An evaluation of `model` (its validation loss `val`, finite): bits per byte, the best
        so far (kept in `state`), the samples and, for induction rows, the copy metrics."""
        bpb = val / math.log(2) / batches.rows.bytes_per_token  # nats/token -> bits/byte
        s = state
        if val < s.best_val_loss:
            s.best_val_loss, s.best_val_bpb, s.best_step = val, bpb, step
        samples = self.sample(model, batches.tokenizer, batches.device)
        copies = (math.nan, math.nan)
        if self.cfg.data.source == "induction" and self.info.is_main:  # copies.py
            copies = copy_metrics(model, batches.val(every_rank=True))
        self.last_eval = EvalEvent(step, val, math.exp(min(val, 700.0)), bpb, s.best_val_loss,
                                   s.best_val_bpb, self.clock.elapsed(), samples, s.tokens_seen,
                                   *copies, best_step=s.best_step)
        self.emit(self.last_eval)

    def sample(self, model: torch.nn.Module, tokenizer: Tokenizer,
               device: torch.device) -> list[tuple[str, str]]:
        """A short sample per prompt with a fixed seed (comparable from eval to eval); the
        global RNG is forked so sampling never changes the training trajectory."""
        t = self.cfg.train
        if t.sample_tokens <= 0 or not self.info.is_main:
            return []
        devices = [device] if device.type == "cuda" else []
        out = []
        with torch.random.fork_rng(devices=devices):
            gen = torch.Generator(device=device).manual_seed(self.cfg.run.seed + 2)
            for prompt in t.sample_prompts:
                ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
                new = list(generate(model, ids, t.sample_tokens, temperature=0.8,
                                    generator=gen))
                out.append((prompt, tokenizer.decode(new)))
        return out

    def before_commit(self) -> None:
        """Inside a checkpoint's commit: the run files' part (outputs.py)."""
        if self.outputs is not None:
            self.outputs.before_commit()

    def done(self, run_dir: Path, reason: str, signame: str, state: TrainerState, params: int,
             checkpoint: Path | None) -> DoneEvent:
        s, wall = state, self.clock.elapsed()
        done = DoneEvent(run_dir, s.step, self.cfg.train.max_steps, reason, signame, params,
                         s.tokens_seen, wall, s.tokens_seen / max(wall, 1e-9),
                         s.best_val_loss if math.isfinite(s.best_val_loss) else math.nan,
                         s.best_val_bpb if math.isfinite(s.best_val_bpb) else math.nan,
                         checkpoint, s.best_step, self.last_eval, self.cfg.data.source,
                         self.heads.last if self.heads is not None else None)
        self.emit(done)
        return done

    def close(self) -> None:
        if self.outputs is not None:
            self.outputs.close()
