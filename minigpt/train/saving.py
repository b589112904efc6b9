"""Where a training session saves: its run directory, the run lock, the checkpoints it commits
and the progress they record.

The directory is opened (a resume's committed checkpoint and its progress, read once) or
claimed (a fresh directory, created and locked only once the tokenizer and data are ready, so
a bad corpus leaves no half-made run behind); the lock is held for the session (run/lock.py);
each checkpoint is committed by run/checkpoint.py's protocol, with the run files'
`before_commit` inside it (outputs.py); the progress (`state`, a TrainerState: the step, the
tokens seen, the best evaluation, the training seconds) is what trainer_state.json records."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt.config import Config
from minigpt.data.tokenizer import Tokenizer
from minigpt.events import CheckpointEvent, NothingSavedEvent, OnEvent
from minigpt.run.checkpoint import save_checkpoint
from minigpt.run.lock import RunLock
from minigpt.run.resume import Resumed, claim_fresh, open_run_dir
from minigpt.run.state import TrainerState, rng_state
from minigpt.train.distributed import DistInfo, main_first
from minigpt.train.weights import Weights


class Saving:
    """The run directory of one session (the module docstring). `resume`: continue the run in
    `run_dir`; else start a fresh one there."""

    def __init__(self, run_dir: Path, info: DistInfo, *, resume: bool) -> None:
        self.run_dir, self.info, self.resume = Path(run_dir), info, resume
        self.lock = RunLock(self.run_dir)
        self.state = TrainerState()
        self.last: Path | None = None  # the last committed checkpoint
        self.saved_step = -1           # the step it holds (-1: none yet)

    def prepare(self, on_event: OnEvent) -> Resumed | None:
        """Resume: rank 0 locks the run and every rank reads its committed checkpoint and
        progress (None: nothing was committed yet, the run starts at step 0 and says so).
        Fresh: a read-only check that the directory may hold a new run; nothing is written."""
        main = self.info.is_main
        start = main_first(lambda: open_run_dir(self.run_dir, self.resume, self.lock, main),
                           self.info)
        if self.resume and start is None and main:
            on_event(NothingSavedEvent(self.run_dir))
        if start is not None:
            self.state = dataclasses.replace(start.state)
            self.last, self.saved_step = start.checkpoint.path, start.state.step
        return start

    def claim(self) -> None:
        """A fresh run's directory, created and locked (re-checked under the lock)."""
        if not self.resume:
            main_first(lambda: claim_fresh(self.run_dir, self.lock, self.info.is_main),
                       self.info)

    def commit(self, cfg: Config, weights: Weights, tokenizer: Tokenizer,
               generator: torch.Generator, elapsed: float,
               before_commit: Callable[[], None] | None) -> CheckpointEvent | None:
        """Commit a checkpoint of the current step (rank 0; once per step): the averaged and
        live weights, the optimizer state, the config, the tokenizer, the progress with every
        RNG state (`generator`: the data order's). Returns its event (None when nothing was
        saved)."""
        step, event = self.state.step, None
        if self.info.is_main and step != self.saved_step:
            self.state.elapsed = elapsed
            self.last = save_checkpoint(
                self.run_dir, step=step, model=weights.average.model, cfg=cfg,
                tokenizer=tokenizer, optimizer=weights.optimizer, param_names=weights.names,
                trainer_state=self.state.as_json(rng_state(generator)),
                keep=cfg.train.keep_checkpoints, before_commit=before_commit,
                train_weights=weights.average.train_weights)
            event = CheckpointEvent(step, self.last)
        self.saved_step = step
        return event

    def kept(self) -> str:
        """What stays of the run when this session fails now, in words."""
        ck = self.last
        return (f"the last good checkpoint ({ck.name}) is kept in {ck.parent.parent}" if ck
                else "no checkpoint had been saved yet")

    def release(self) -> None:
        self.lock.release()
