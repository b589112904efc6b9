"""The training loop: `train(cfg, run_dir, ...)` trains, evaluates, checkpoints and reports
progress through `on_event(event)` (dataclasses in events.py); it never prints.

Reading order. `train` opens the run (saving.py: for a resume its checkpoint and progress, read
once) and refuses what cannot work before anything is made; `set_up` builds the session from
four parts, each made once, in this order:

    batches.py    the tokenizer and the rows (token cache or synthetic induction rows), which
                  rows each step and each evaluation read, their copy to the device
    weights.py    the model, the optimizer and its learning-rate schedule, the weight average
                  (ema.py), the RNGs, the teachers of train.distill_from (distill.py); one
                  optimizer step through core/step.py
    saving.py     the run directory (a fresh one claimed now that the data and the weights are
                  ready), the run lock, the checkpoints and the progress they record
    reporting.py  every event to the run files (outputs.py), TensorBoard and the caller; the
                  clock, the evaluations' samples and copy metrics, the head measurements

`Trainer.run` loops over `step` (the next batches through the weights), the head measurements,
`evaluate` and `save`. The maths is core's; what stays here is when each thing happens, the
divergence message and how the session ends.

Resume (`resume=True`, config from resume.resume_config): weights (with train.ema also their
average, ema.py), optimizer state (AdamW moments; with train.optimizer muon also Muon's
momentum buffers), RNG states, the data generator, counters and the metrics log are restored
from the committed checkpoint, so on CPU the rest of the run is bit-identical to an
uninterrupted one.
"""

from __future__ import annotations

import copy
import math
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from minigpt.config import Config
from minigpt.device import amp_dtype, resolve_device, training_threads
from minigpt.errors import ArgumentError, MinigptError, TrainingDiverged
from minigpt.events import DoneEvent, StartEvent, no_events
from minigpt.train.batches import Batches, open_batches
from minigpt.train.distributed import DistInfo, agree, setup, teardown
from minigpt.train.reporting import Reporting, preflight
from minigpt.train.safety import Session, StopFlag
from minigpt.train.saving import Resumed, Saving
from minigpt.train.weights import Weights

__all__ = ["Trainer", "set_up", "train"]


def train(cfg: Config, run_dir: Path, *, resume: bool = False,
          on_event: Callable[[object], None] | None = None,
          stop_after: int | None = None, force: bool = False) -> DoneEvent:
    """Train `cfg` into `run_dir` (fresh: the directory must be missing or empty; resume:
    continue from its committed checkpoint, or from step 0 if none was committed).

    `stop_after` stops cleanly (checkpoint, reason "stopped") after that step; so does the
    first head-score measurement that finds every kind in train.stop_when_formed (reason
    "formed"; the run may be resumed, with the option changed, to train on). SIGINT/SIGTERM
    save a checkpoint and return reason "interrupted". Raises MinigptError (TrainingDiverged
    on a non-finite loss) for anything the user can fix; nothing already saved is lost. A
    session estimated not to fit in memory or not to end within a week is refused before
    anything is made (safety.check_training), unless `force`."""
    on_event = on_event or no_events
    cfg = copy.deepcopy(cfg)  # the trainer fills in model.vocab_size: never in the caller's
    info, device = setup(resolve_device(cfg.run.device))
    saving = Saving(Path(run_dir), info, resume=resume)
    trainer = None
    try:
        start = saving.prepare(on_event)
        if saving.state.step >= cfg.train.max_steps:
            raise ArgumentError("resume", f"the run is already at step {saving.state.step} of "
                                f"train.max_steps={cfg.train.max_steps}; raise it, e.g. --set "
                                f"train.max_steps={cfg.train.max_steps * 2}")
        preflight(cfg.train)
        with training_threads(cfg.train.threads if device.type == "cpu" else 0):
            session = Session(saving.state.step, stop_after, info.world_size, force)
            trainer = set_up(cfg, saving, start, device, info, on_event, session)
            return trainer.run(stop_after)
    finally:
        if trainer is not None:
            trainer.close()
            trainer = None  # the DDP wrapper holds the process group: let it go first
        saving.release()
        teardown(info)


def set_up(cfg: Config, saving: Saving, start: Resumed | None, device: torch.device,
           info: DistInfo, on_event: Callable[[object], None],
           session: Session | None = None) -> Trainer:
    """The training session of `cfg` in `saving`'s run directory, continuing `start` (None: from
    step 0): its four parts, each made once (the module docstring). train.precision is
    resolved on `device` here, once: the cost check, the forward passes and the first line
    all read this dtype."""
    dtype = amp_dtype(cfg.train.precision, device)
    session = replace(session or Session(world=info.world_size), dtype=dtype)
    batches = open_batches(cfg, start, device, info, on_event, session)
    weights = Weights.build(cfg, device, start, info, dtype, batches.tokenizer)
    saving.claim()
    report = Reporting.build(cfg, saving.run_dir, batches.tokenizer, weights.average.model,
                             info, on_event,
                             resumed_at=saving.state.step if saving.resume else None)
    return Trainer(cfg, info, batches, saving, weights, report)


@dataclass
class Trainer:
    """One training session, as `set_up` builds it; `run` trains it."""
    cfg: Config
    info: DistInfo
    batches: Batches
    saving: Saving       # .state: the progress (step, tokens seen, best evaluation)
    weights: Weights
    report: Reporting

    @property
    def state(self):
        return self.saving.state

    def run(self, stop_after: int | None) -> DoneEvent:
        t, state, b = self.cfg.train, self.state, self.batches
        self.report.start(StartEvent(
            self.saving.run_dir, state.step, t.max_steps, self._params(), str(b.device),
            b.world, self.cfg.tokens_per_step, b.tokenizer.n_vocab,
            b.rows.bytes_per_token, torch.get_num_threads() if b.device.type == "cpu" else 0,
            self.cfg.data.source, "bf16" if self.weights.dtype else "fp32"),
            state.elapsed)
        reason, signame = "finished", ""
        self.weights.model.train()
        with StopFlag() as flag:
            while state.step < t.max_steps:
                loss, lr, grad_norm, stop = self.step(flag)
                step, last = state.step, state.step == t.max_steps
                if step % t.log_interval == 0 or last or step == 1:
                    self.report.step(step, loss, lr, grad_norm, state.tokens_seen)
                # train.stop_when_formed: every kind it names has formed
                formed = self.report.heads_formed(step, last)
                end = last or formed
                if step % t.eval_interval == 0 or end:
                    self.evaluate(step)
                if step % t.checkpoint_interval == 0 or end or stop or step == stop_after:
                    self.save()
                if stop:
                    reason = "interrupted"
                    signame = signal.Signals(flag.signum or signal.SIGINT).name
                    break
                if formed or step == stop_after:
                    reason = "formed" if formed else "stopped"
                    break
            if not agree(True, self.info):  # all ranks leave the loop together
                raise MinigptError("another rank failed")
        return self.report.done(self.saving.run_dir, reason, signame, state, self._params(),
                                self.saving.last)

    def step(self, flag: StopFlag) -> tuple[float, float, float, bool]:
        """One optimizer step on this rank's share of the next global batch. Returns (mean loss
        of the global batch, lr, grad norm before clipping, whether any rank was signalled)."""
        step = self.state.step
        b = self.batches
        r, lr, stop = self.weights.step(step, b.train(step), b.n_micro, flag)
        if not r.stepped:
            what = "the training loss" if not math.isfinite(r.loss) else "the gradient norm"
            raise self._diverged(step + 1, what)
        self.state.step = step + 1
        self.state.tokens_seen += self.cfg.tokens_per_step
        return r.loss, lr, r.grad_norm, stop

    def evaluate(self, step: int) -> None:
        """Evaluate the weights the run saves (rank 0 also samples) and report it."""
        val = self.weights.evaluate(self.batches.val())
        if not math.isfinite(val):
            raise self._diverged(step, "the validation loss")
        self.report.evaluation(step, val, self.state, self.weights.average.model, self.batches)

    def save(self) -> None:
        """Commit a checkpoint of the current step (rank 0; once per step) and report it."""
        event = self.saving.commit(self.cfg, self.weights, self.batches.tokenizer,
                                   self.batches.generator, self.report.clock.elapsed(),
                                   self.report.before_commit)
        if event is not None:
            self.report.emit(event)

    def close(self) -> None:
        self.report.close()

    def _params(self) -> int:
        return self.weights.model.num_params()["total"]

    def _diverged(self, step: int, what: str) -> TrainingDiverged:
        t = self.cfg.train
        return TrainingDiverged(
            f"{what} is not finite at step {step}: lower train.learning_rate (now "
            f"{t.learning_rate:g}), set train.precision=fp32 (now {t.precision}) or a tighter "
            f"train.grad_clip (now {t.grad_clip:g}); {self.saving.kept()}")
