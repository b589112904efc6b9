"""The training loop: `train(cfg, run_dir, ...)` trains, evaluates, checkpoints and reports
progress through `on_event(event)` (dataclasses in events.py); it never prints. What a session
writes besides checkpoints is written by consumers of those events (outputs.py, tensorboard.py).

Reading order: `train` opens the run (for a resume: its checkpoint and trainer state, read
once); `set_up` builds the session in named steps (batch geometry, tokenizer, data, model and
optimizer, progress and RNG states, outputs) into one `Trainer`; `Trainer.run` loops over
`step` (this rank's batches through core/step.py's `train_step`), `evaluate` (core/step.py's
`evaluate`) / `sample` (core/generate.py) and `save`. The maths is core's; what stays here is the
session: batches, the learning rate, the all-reduce, the divergence message, the weight
average, events and checkpoints.

Batches: every optimizer step draws the GLOBAL batch of `train.batch_size` offsets from one
torch.Generator seeded by run.seed (identical on every rank); rank r takes the r-th contiguous
slice and splits it into micro-batches of `micro_batch_size`. Each micro-loss is divided by
the number of micro-batches per rank and DDP averages over ranks, so the gradient is the mean
over the global batch: a DDP run equals a single-process run up to float summation order.

Resume (`resume=True`, config from resume.resume_config): weights (with train.ema also their
average, ema.py), optimizer state (AdamW moments; with train.optimizer muon also Muon's
momentum buffers), RNG states, the data generator, counters and the metrics log are restored
from the committed checkpoint, so on CPU the rest of the run is bit-identical to an
uninterrupted one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import signal
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt.config import Config, TrainConfig, head_scores_every
from minigpt.core import step as core_step
from minigpt.core.generate import generate
from minigpt.core.gpt import GPT
from minigpt.data import Dataset, prepare_dataset
from minigpt.device import amp_dtype, autocast, resolve_device, training_threads
from minigpt.errors import ArgumentError, ConfigError, MinigptError, TrainingDiverged
from minigpt.events import (
    CheckpointEvent,
    DoneEvent,
    EvalEvent,
    NothingSavedEvent,
    StartEvent,
    StepEvent,
    no_events,
)
from minigpt.heads.timeline import HeadWatch, all_formed
from minigpt.induction import InductionData
from minigpt.run.checkpoint import save_checkpoint
from minigpt.run.load import load_optimizer_state
from minigpt.run.lock import RunLock
from minigpt.run.resume import Resumed, claim_fresh, open_run_dir
from minigpt.run.state import TrainerState, rng_state
from minigpt.tokenizer import Tokenizer, build_tokenizer
from minigpt.train.clock import Clock
from minigpt.train.copies import copy_metrics
from minigpt.train.distributed import DistInfo, agree, all_reduce_sum, main_first, setup, teardown
from minigpt.train.ema import WeightAverage
from minigpt.train.optim import build_optimizer, lr_at, set_lr
from minigpt.train.outputs import RunOutputs
from minigpt.train.safety import StopFlag, check_memory
from minigpt.train.tensorboard import tensorboard_log

__all__ = ["Trainer", "set_up", "train"]


def train(cfg: Config, run_dir: Path, *, resume: bool = False,
          on_event: Callable[[object], None] | None = None,
          stop_after: int | None = None) -> DoneEvent:
    """Train `cfg` into `run_dir` (fresh: the directory must be missing or empty; resume:
    continue from its committed checkpoint, or from step 0 if none was committed).

    `stop_after` stops cleanly (checkpoint, reason "stopped") after that step; so does the
    first head-score measurement that finds every kind in train.stop_when_formed (reason
    "formed"; the run may be resumed, with the option changed, to train on). SIGINT/SIGTERM
    save a checkpoint and return reason "interrupted". Raises MinigptError (TrainingDiverged
    on a non-finite loss) for anything the user can fix; nothing already saved is lost."""
    on_event = on_event or no_events
    cfg = copy.deepcopy(cfg)  # the trainer fills in model.vocab_size: never in the caller's
    run_dir = Path(run_dir)
    info, device = setup(resolve_device(cfg.run.device))
    lock = RunLock(run_dir)
    trainer = None
    try:
        start = main_first(lambda: open_run_dir(run_dir, resume, lock, info.is_main), info)
        if resume and start is None and info.is_main:
            on_event(NothingSavedEvent(run_dir))
        done = start.state.step if start is not None else 0
        if done >= cfg.train.max_steps:
            raise ArgumentError("resume", f"the run is already at step {done} of "
                                f"train.max_steps={cfg.train.max_steps}; raise it, e.g. --set "
                                f"train.max_steps={cfg.train.max_steps * 2}")
        with training_threads(cfg.train.threads if device.type == "cpu" else 0):
            trainer = set_up(cfg, run_dir, start, device, info, on_event,
                             claim=None if resume else lock)
            return trainer.run(stop_after)
    finally:
        if trainer is not None:
            trainer.close()
        lock.release()
        teardown(info)


# --------------------------------------------------------------------------------------------
# Set-up: one Trainer, built step by step.


def set_up(cfg: Config, run_dir: Path, start: Resumed | None, device: torch.device,
           info: DistInfo, on_event: Callable[[object], None], *,
           claim: RunLock | None) -> Trainer:
    """The training session of `cfg` in `run_dir`, continuing `start` (None: from step 0).
    `claim` is a fresh run's lock: its directory is created and locked only once the tokenizer
    and data are ready, so a bad corpus leaves no half-made run behind."""
    main = info.is_main
    report = on_event if main else no_events  # rank 0 reports the data preparation
    board = tensorboard_log(cfg.train, run_dir, fresh=claim is not None, main=main)  # may refuse
    micro, n_micro = batch_geometry(cfg.train, info)
    tokenizer = (Tokenizer.load(start.checkpoint.path) if start is not None
                 else main_first(lambda: build_tokenizer(cfg, report), info))
    fit_vocab(cfg, tokenizer)
    check_memory(cfg, micro, device)
    data = main_first(lambda: prepare_dataset(cfg, tokenizer, report), info)
    if claim is not None:
        main_first(lambda: claim_fresh(run_dir, claim, main), info)
    model, optimizer, names, average = build_model(cfg, device, start)
    state, data_gen = restore_progress(cfg, info, start)
    # Rank 0's run files consume every event first, then the caller's on_event. Rank 0
    # measures the heads; every rank knows when, to agree on train.stop_when_formed.
    head_every = head_scores_every(cfg.train)
    outputs = RunOutputs(run_dir, cfg, tokenizer, resumed_at=None if claim else state.step,
                         heads_png=head_every > 0) if main else None
    heads = HeadWatch(average.model, cfg, tokenizer, outputs.heads) if head_every and main else None
    t = cfg.train
    return Trainer(
        cfg=cfg, run_dir=run_dir, device=device, info=info, tokenizer=tokenizer, data=data,
        model=model, fwd=forward_module(model, t, device, info), optimizer=optimizer,
        names=names, average=average, micro=micro, n_micro=n_micro,
        amp=amp_dtype(t.precision, device),
        data_gen=data_gen, eval_offsets=validation_sample(data, t, cfg.run.seed), state=state,
        heads=heads, head_every=head_every, outputs=outputs,
        emit=_fan_out([c for c in (outputs, board, on_event) if c is not None]),
        last_ckpt=start.checkpoint.path if start is not None else None,
        saved_step=state.step if start is not None else -1)


def batch_geometry(t: TrainConfig, info: DistInfo) -> tuple[int, int]:
    """(sequences per forward pass, forward passes per step on each rank): the global batch of
    train.batch_size is cut into one slice per rank, each into micro-batches."""
    micro = t.micro_batch_size or t.batch_size // info.world_size
    if micro == 0 or t.batch_size % (info.world_size * micro):
        raise ConfigError(
            f"train.batch_size: {t.batch_size} must be a multiple of the world size "
            f"({info.world_size}) x train.micro_batch_size ({micro})")
    return micro, t.batch_size // (info.world_size * micro)


def fit_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    """model.vocab_size 0 = the tokenizer's size; a size below it is refused."""
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.n_vocab
    elif cfg.model.vocab_size < tokenizer.n_vocab:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer.n_vocab} ids; use 0 (automatic)")


def build_model(cfg: Config, device: torch.device, start: Resumed | None):
    """The model (initialised from run.seed), its optimizer with the parameter names in
    optimizer order, and its WeightAverage; on resume all restored from the checkpoint."""
    model = GPT.from_config(cfg, seed=cfg.run.seed).to(device)
    optimizer, names = build_optimizer(model, cfg.train, device)
    average = WeightAverage(model, cfg.train.ema)
    if start is not None:
        average.load(start.checkpoint)
        load_optimizer_state(optimizer, names, start.checkpoint)
    return model, optimizer, names, average


def restore_progress(cfg: Config, info: DistInfo, start: Resumed | None
                     ) -> tuple[TrainerState, torch.Generator]:
    """The counters and the data-order generator, with every RNG where the run left it: seeded
    from run.seed for a fresh run, the saved states on resume. Dropout differs per rank (rank
    0's stream is the saved one). The last thing before training that touches the RNGs."""
    data_gen = torch.Generator().manual_seed(cfg.run.seed)
    if start is None:
        state = TrainerState()
        torch.manual_seed(cfg.run.seed)
    else:
        state = dataclasses.replace(start.state)
        start.rng.restore(data_gen)
    if info.rank > 0:
        torch.manual_seed(cfg.run.seed + 7919 * info.rank + state.step)
    return state, data_gen


def validation_sample(data: Dataset | InductionData, t: TrainConfig, seed: int) -> torch.Tensor:
    """The offsets every evaluation uses, drawn once: evaluations compare like with like."""
    return data.sample_offsets("val", t.eval_batches * t.batch_size,
                               torch.Generator().manual_seed(seed + 1))


def forward_module(model: GPT, t: TrainConfig, device: torch.device,
                   info: DistInfo) -> torch.nn.Module:
    """What the training step calls: the model, maybe compiled, maybe under DDP."""
    fwd: torch.nn.Module = model
    if t.compile == "true" or (t.compile == "auto" and device.type == "cuda"):
        fwd = torch.compile(model)
    if info.enabled:
        fwd = torch.nn.parallel.DistributedDataParallel(
            fwd, device_ids=[device.index] if device.type == "cuda" else None)
    return fwd


def _fan_out(consumers: list[Callable[[object], object]]) -> Callable[[object], None]:
    def emit(event: object) -> None:
        for consume in consumers:
            consume(event)
    return emit


# --------------------------------------------------------------------------------------------
# The session.


@dataclasses.dataclass
class Trainer:
    """One training session, as `set_up` builds it; `run` trains it."""
    cfg: Config
    run_dir: Path
    device: torch.device
    info: DistInfo
    tokenizer: Tokenizer
    data: Dataset | InductionData
    model: GPT
    fwd: torch.nn.Module            # what train_step runs forward (forward_module)
    optimizer: object               # torch.optim.AdamW or train.optim.OptimizerChain
    names: list[str]                # parameter names in optimizer order (checkpoints)
    average: WeightAverage          # .model: what evaluations, samples and checkpoints use
    micro: int                      # sequences per forward pass
    n_micro: int                    # forward passes per step on this rank
    amp: torch.dtype | None         # autocast dtype (None: fp32)
    data_gen: torch.Generator       # the batches' order
    eval_offsets: torch.Tensor      # validation_sample
    state: TrainerState
    heads: HeadWatch | None         # head scores every `head_every` steps (rank 0)
    head_every: int
    outputs: RunOutputs | None      # rank 0's run files, the first consumer of `emit`
    emit: Callable[[object], object]  # every event to the outputs, then the caller's on_event
    last_ckpt: Path | None          # the last committed checkpoint
    saved_step: int                 # the step it holds (-1: none yet)
    last_eval: EvalEvent | None = None  # this session's last evaluation

    def run(self, stop_after: int | None) -> DoneEvent:
        t, state = self.cfg.train, self.state
        tokens_per_step = t.batch_size * self.cfg.model.block_size
        self.emit(StartEvent(self.run_dir, state.step, t.max_steps, self._params(),
                             str(self.device), self.info.world_size, tokens_per_step,
                             self.tokenizer.n_vocab, self.data.bytes_per_token,
                             torch.get_num_threads() if self.device.type == "cpu" else 0,
                             self.cfg.data.source))
        clock = Clock(state.elapsed, state.step)
        reason, signame = "finished", ""
        self.model.train()
        with StopFlag() as flag:
            while state.step < t.max_steps:
                loss, lr, grad_norm, stop = self.step(flag)
                step, last = state.step, state.step == t.max_steps
                if step % t.log_interval == 0 or last or step == 1:
                    self.emit(StepEvent(step, t.max_steps, loss, lr, grad_norm,
                                        clock.tokens_per_s(step, tokens_per_step),
                                        clock.elapsed(), state.tokens_seen))
                formed = False  # train.stop_when_formed: every kind it names has formed
                if self.head_every and (step % self.head_every == 0 or last):
                    formed = self.measure_heads(step) and not last
                end = last or formed
                if step % t.eval_interval == 0 or end:
                    self._evaluate_and_sample(step, clock)
                if step % t.checkpoint_interval == 0 or end or stop or step == stop_after:
                    self.save(clock.elapsed())
                if stop:
                    reason = "interrupted"
                    signame = signal.Signals(flag.signum or signal.SIGINT).name
                    break
                if formed:
                    reason = "formed"
                    break
                if step == stop_after:
                    reason = "stopped"
                    break
            if not agree(True, self.info):  # all ranks leave the loop together
                raise MinigptError("another rank failed")
        done = self._done(reason, signame, clock.elapsed())
        self.emit(done)
        return done

    def measure_heads(self, step: int) -> bool:
        """Score the heads (rank 0) and report them; True when train.stop_when_formed names
        kinds and this measurement found a head of each at the formed threshold (every rank
        gets rank 0's answer)."""
        kinds = self.cfg.train.stop_when_formed
        done = False
        if self.heads is not None:
            scores, formed = self.heads.measure(step)
            for event in (scores, *formed):
                self.emit(event)
            done = bool(kinds) and all_formed(scores.scores, kinds)
        return bool(kinds) and not agree(not done, self.info)

    def close(self) -> None:
        if self.outputs is not None:
            self.outputs.close()

    # -- one optimizer step -----------------------------------------------------------------
    def step(self, flag: StopFlag) -> tuple[float, float, float, bool]:
        """This rank's micro-batches through `core.step.train_step`. Returns (mean loss of the
        global batch, lr, grad norm before clipping, whether any rank was signalled)."""
        t, info, step = self.cfg.train, self.info, self.state.step
        lr = lr_at(step, t)
        set_lr(self.optimizer, lr)
        offsets = self.data.sample_offsets("train", t.batch_size, self.data_gen)  # global
        per_rank = self.n_micro * self.micro
        mine = offsets[info.rank * per_rank:(info.rank + 1) * per_rank]
        batches = (self.data.get_batch("train", mine[m * self.micro:(m + 1) * self.micro],
                                       self.device) for m in range(self.n_micro))
        stop = [False]

        def mean_loss(mine_mean: torch.Tensor) -> float:
            """One collective per step: the loss for the log and any rank's stop request."""
            stats = torch.stack([mine_mean, torch.tensor(float(flag.signum is not None))])
            all_reduce_sum(stats, info)
            stop[0] = stats[1].item() > 0
            return stats[0].item() / info.world_size

        r = core_step.train_step(self.model, self.optimizer, batches, n_micro=self.n_micro,
                                 grad_clip=t.grad_clip, fwd=self.fwd, precision=self._precision,
                                 no_sync=self.fwd.no_sync if info.enabled else None, mean_loss=mean_loss)
        if not r.stepped:
            what = "the training loss" if not math.isfinite(r.loss) else "the gradient norm"
            raise self._diverged(step + 1, what)
        self.average.update(step + 1)
        self.state.step = step + 1
        self.state.tokens_seen += t.batch_size * self.cfg.model.block_size
        return r.loss, lr, r.grad_norm, stop[0]

    def _precision(self):
        return autocast(self.device, self.amp)

    def _diverged(self, step: int, what: str) -> TrainingDiverged:
        t, ck = self.cfg.train, self.last_ckpt
        kept = (f"the last good checkpoint ({ck.name}) is kept in {ck.parent.parent}" if ck
                else "no checkpoint had been saved yet")
        return TrainingDiverged(
            f"{what} is not finite at step {step}: lower train.learning_rate (now "
            f"{t.learning_rate:g}), set train.precision=fp32 (now {t.precision}) or a tighter "
            f"train.grad_clip (now {t.grad_clip:g}); {kept}")

    # -- evaluation and samples -------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean val loss over the fixed eval offsets (split across ranks, summed back)."""
        mine = self.eval_offsets[self.info.rank::self.info.world_size]
        batches = (self.data.get_batch("val", mine[i:i + self.micro], self.device)
                   for i in range(0, len(mine), self.micro))
        total = core_step.evaluate(self.average.model, batches, precision=self._precision)
        all_reduce_sum(total, self.info)  # (sum of loss x rows, rows) over every rank
        self.model.train()
        return (total[0] / total[1]).item()

    def sample(self) -> list[tuple[str, str]]:
        """A short sample per prompt with a fixed seed (comparable from eval to eval); the
        global RNG is forked so sampling never changes the training trajectory."""
        t = self.cfg.train
        if t.sample_tokens <= 0 or not self.info.is_main:
            return []
        devices = [self.device] if self.device.type == "cuda" else []
        out = []
        with torch.random.fork_rng(devices=devices):
            gen = torch.Generator(device=self.device).manual_seed(self.cfg.run.seed + 2)
            for prompt in t.sample_prompts:
                ids = self.tokenizer.encode(prompt) or [self.tokenizer.eot_id]
                new = list(generate(self.average.model, ids, t.sample_tokens, temperature=0.8,
                                    generator=gen))
                out.append((prompt, self.tokenizer.decode(new)))
        return out

    def _evaluate_and_sample(self, step: int, clock: Clock) -> None:
        val = self.evaluate()
        if not math.isfinite(val):
            raise self._diverged(step, "the validation loss")
        bpb = val / math.log(2) / self.data.bytes_per_token  # nats/token -> bits/byte
        s = self.state
        if val < s.best_val_loss:
            s.best_val_loss, s.best_val_bpb, s.best_step = val, bpb, step
        samples = self.sample()
        copies = (math.nan, math.nan)
        if self.cfg.data.source == "induction" and self.info.is_main:  # copies.py
            copies = copy_metrics(self.average.model, self.data, self.eval_offsets, self.micro,
                                  self.device)
        self.last_eval = EvalEvent(step, val, math.exp(min(val, 700.0)), bpb, s.best_val_loss,
                                   s.best_val_bpb, clock.elapsed(), samples, s.tokens_seen,
                                   *copies, best_step=s.best_step)
        self.emit(self.last_eval)

    # -- checkpoints and the end ------------------------------------------------------------
    def save(self, elapsed: float) -> None:
        """Commit a checkpoint of the current step (rank 0; once per step)."""
        step = self.state.step
        if self.info.is_main and step != self.saved_step:
            self.state.elapsed = elapsed
            self.last_ckpt = save_checkpoint(
                self.run_dir, step=step, model=self.average.model, cfg=self.cfg,
                tokenizer=self.tokenizer, optimizer=self.optimizer, param_names=self.names,
                trainer_state=self.state.as_json(rng_state(self.data_gen)),
                keep=self.cfg.train.keep_checkpoints, before_commit=self.outputs.before_commit,
                train_weights=self.average.train_weights)
            self.emit(CheckpointEvent(step, self.last_ckpt))
        self.saved_step = step

    def _params(self) -> int:
        return self.model.num_params()["total"]

    def _done(self, reason: str, signame: str, wall: float) -> DoneEvent:
        s = self.state
        return DoneEvent(self.run_dir, s.step, self.cfg.train.max_steps, reason, signame,
                         self._params(), s.tokens_seen, wall, s.tokens_seen / max(wall, 1e-9),
                         s.best_val_loss if math.isfinite(s.best_val_loss) else math.nan,
                         s.best_val_bpb if math.isfinite(s.best_val_bpb) else math.nan,
                         self.last_ckpt, s.best_step, self.last_eval, self.cfg.data.source,
                         self.heads.last if self.heads is not None else None)
