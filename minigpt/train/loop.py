"""The training loop: `train(cfg, run_dir, ...)` trains, evaluates, checkpoints and reports
progress through `on_event(event)` (dataclasses in events.py); it never prints.

Batches: every optimizer step draws the GLOBAL batch of `train.batch_size` offsets from one
torch.Generator seeded by run.seed (identical on every rank); rank r takes the r-th contiguous
slice and splits it into micro-batches of `micro_batch_size`. Each micro-loss is divided by
the number of micro-batches per rank and DDP averages over ranks, so the gradient is the mean
over the global batch: a DDP run equals a single-process run up to float summation order.

Resume (`resume=True`, config from resume.resume_config): weights, optimizer state (AdamW
moments; with train.optimizer muon also Muon's momentum buffers), RNG states, the data
generator, counters and the metrics log are restored from the committed checkpoint, so on CPU
the rest of the run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt import __version__
from minigpt.config import Config, head_scores_every, to_yaml
from minigpt.data import DATA_SPLIT, Dataset, prepare_dataset
from minigpt.device import amp_dtype, autocast, resolve_device
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
from minigpt.files import atomic_write_bytes, atomic_write_text
from minigpt.heads.timeline import HeadWatch, draw_timeline
from minigpt.model import GPT
from minigpt.run.checkpoint import Checkpoint, save_checkpoint
from minigpt.run.curves import write_curves
from minigpt.run.layout import CONFIG_FILE, HEADS_PNG, METRICS_FILE, SUMMARY_FILE
from minigpt.run.load import load_model_weights, load_optimizer_state, read_trainer_state
from minigpt.run.lock import RunLock
from minigpt.run.resume import claim_fresh, open_run_dir
from minigpt.run.state import (
    MetricsLog,
    read_metrics,
    rng_state,
    set_rng_state,
    truncate_metrics,
    write_summary,
)
from minigpt.tokenizer import Tokenizer, build_tokenizer
from minigpt.train.distributed import DistInfo, agree, all_reduce_sum, main_first, setup, teardown
from minigpt.train.optim import build_optimizer, lr_at, set_lr
from minigpt.train.safety import StopFlag, check_memory

__all__ = ["train"]


def train(cfg: Config, run_dir: Path, *, resume: bool = False,
          on_event: Callable[[object], None] | None = None,
          stop_after: int | None = None) -> DoneEvent:
    """Train `cfg` into `run_dir` (fresh: the directory must be missing or empty; resume:
    continue from its committed checkpoint, or from step 0 if none was committed).

    `stop_after` stops cleanly (checkpoint, reason "stopped") after that step. SIGINT/SIGTERM
    save a checkpoint and return reason "interrupted". Raises MinigptError (TrainingDiverged
    on a non-finite loss) for anything the user can fix; nothing already saved is lost."""
    emit = on_event or no_events
    cfg = copy.deepcopy(cfg)  # the trainer fills in model.vocab_size: never in the caller's
    run_dir = Path(run_dir)
    info, device = setup(resolve_device(cfg.run.device))
    lock = RunLock(run_dir)
    try:
        ckpt = main_first(lambda: open_run_dir(run_dir, resume, lock, info.is_main), info)
        if resume and ckpt is None and info.is_main:
            emit(NothingSavedEvent(run_dir))
        done = read_trainer_state(ckpt)["step"] if ckpt is not None else 0
        if done >= cfg.train.max_steps:
            raise ArgumentError("resume", f"the run is already at step {done} of "
                                f"train.max_steps={cfg.train.max_steps}; raise it, e.g. --set "
                                f"train.max_steps={cfg.train.max_steps * 2}")
        claim = (lambda: None) if resume else (lambda: claim_fresh(run_dir, lock, info.is_main))
        trainer = _Trainer(cfg, run_dir, ckpt, device, info, emit, claim)
        try:
            return trainer.run(stop_after)
        finally:
            trainer.metrics.close()
    finally:
        lock.release()
        teardown(info)


class _Trainer:
    """One training session: set-up in __init__, then run()."""

    def __init__(self, cfg: Config, run_dir: Path, ckpt: Checkpoint | None,
                 device: torch.device, info: DistInfo, emit, claim: Callable[[], None]):
        t = cfg.train
        self.cfg, self.run_dir, self.device, self.info, self.emit = cfg, run_dir, device, info, emit
        main = info.is_main
        torch.manual_seed(cfg.run.seed)
        # Batch geometry: global batch -> this rank's slice -> micro-batches.
        self.micro = t.micro_batch_size or t.batch_size // info.world_size
        if self.micro == 0 or t.batch_size % (info.world_size * self.micro):
            raise ConfigError(
                f"train.batch_size: {t.batch_size} must be a multiple of the world size "
                f"({info.world_size}) x train.micro_batch_size ({self.micro})")
        self.n_micro = t.batch_size // (info.world_size * self.micro)
        self.metrics = MetricsLog(run_dir / METRICS_FILE, enabled=False)

        # Tokenizer and data (cached by their modules; rank 0 fills the caches first).
        if ckpt is not None:
            self.tokenizer = Tokenizer.load(ckpt.path)
        else:
            self.tokenizer = main_first(lambda: build_tokenizer(cfg, emit if main else no_events),
                                        info)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.tokenizer.n_vocab
        elif cfg.model.vocab_size < self.tokenizer.n_vocab:
            raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                              f"tokenizer's {self.tokenizer.n_vocab} ids; use 0 (automatic)")
        check_memory(cfg, self.micro, device)
        self.data: Dataset = main_first(
            lambda: prepare_dataset(cfg, self.tokenizer, emit if main else no_events), info)
        main_first(claim, info)  # only now does a fresh run directory appear

        self.model = GPT.from_config(cfg, seed=cfg.run.seed).to(device)
        self.optimizer, self.names = build_optimizer(self.model, t, device)
        self.data_gen = torch.Generator().manual_seed(cfg.run.seed)
        # A fixed validation sample, drawn once: evaluations compare like with like.
        self.eval_offsets = self.data.sample_offsets(
            "val", t.eval_batches * t.batch_size, torch.Generator().manual_seed(cfg.run.seed + 1))
        self.state = {"step": 0, "tokens_seen": 0, "elapsed": 0.0, "best_val_loss": math.inf,
                      "best_val_bpb": math.inf, "best_step": 0}
        if ckpt is not None:
            load_model_weights(self.model, ckpt)
            load_optimizer_state(self.optimizer, self.names, ckpt)
            saved = read_trainer_state(ckpt)
            self.state.update({k: saved[k] for k in self.state if saved.get(k) is not None})
            try:
                set_rng_state(saved["rng"], self.data_gen)
            except (KeyError, TypeError, ValueError, IndexError, RuntimeError):
                raise MinigptError(
                    f"{ckpt.path / 'trainer_state.json'}: the RNG and data-order state is "
                    "missing or damaged, so the run cannot be resumed; start a new run (the "
                    "weights can still be sampled)") from None
        if info.rank > 0:  # dropout differs per rank (rank 0's stream is the saved one)
            torch.manual_seed(cfg.run.seed + 7919 * info.rank + self.state["step"])
        self.last_ckpt = ckpt.path if ckpt is not None else None
        self.saved_step = self.state["step"] if ckpt is not None else -1

        if main:  # the resolved config, tokenizer and (on resume) the metrics up to the step
            atomic_write_text(run_dir / CONFIG_FILE, to_yaml(cfg))
            self.tokenizer.save(run_dir)
            truncate_metrics(run_dir / METRICS_FILE, self.state["step"])
        self.metrics = MetricsLog(run_dir / METRICS_FILE, enabled=main)
        self.head_every = head_scores_every(t) if main else 0
        self.heads = HeadWatch(self.model, cfg, self.tokenizer, read_metrics(
            run_dir / METRICS_FILE)[0]) if self.head_every else None

        self.fwd = self.model  # what the training step calls: maybe compiled, maybe DDP
        if t.compile == "true" or (t.compile == "auto" and device.type == "cuda"):
            self.fwd = torch.compile(self.model)
        if info.enabled:
            self.fwd = torch.nn.parallel.DistributedDataParallel(
                self.fwd, device_ids=[device.index] if device.type == "cuda" else None)
        self.amp = amp_dtype(cfg.train.precision, device)
        self.samples: list[tuple[str, str]] = []

    # -- one optimizer step -----------------------------------------------------------------
    def step(self, flag: StopFlag) -> tuple[float, float, float, bool]:
        """Forward/backward over this rank's micro-batches, clip, optimizer. Returns (mean loss of
        the global batch, lr, grad norm before clipping, whether any rank was signalled)."""
        t, info, step = self.cfg.train, self.info, self.state["step"]
        lr = lr_at(step, t)
        set_lr(self.optimizer, lr)
        offsets = self.data.sample_offsets("train", t.batch_size, self.data_gen)  # global
        per_rank = self.n_micro * self.micro
        mine = offsets[info.rank * per_rank:(info.rank + 1) * per_rank]
        loss_sum = torch.zeros((), device=self.device)
        for m in range(self.n_micro):
            x, y = self.data.get_batch("train", mine[m * self.micro:(m + 1) * self.micro],
                                       self.device)
            # DDP all-reduces gradients only on the last micro-batch.
            sync = self.fwd.no_sync() if info.enabled and m < self.n_micro - 1 \
                else contextlib.nullcontext()
            with sync:
                with autocast(self.device, self.amp):
                    _, loss = self.fwd(x, y)
                (loss / self.n_micro).backward()
            loss_sum += loss.detach().float()
        # One collective per step: the loss for the log and any rank's stop request.
        stats = torch.stack([loss_sum.cpu() / self.n_micro,
                             torch.tensor(float(flag.signum is not None))])
        all_reduce_sum(stats, info)
        loss_val = stats[0].item() / info.world_size
        if not math.isfinite(loss_val):
            raise self._diverged(step + 1, "the training loss")
        clip = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).item()
        if not math.isfinite(grad_norm):
            raise self._diverged(step + 1, "the gradient norm")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state["step"] = step + 1
        self.state["tokens_seen"] += t.batch_size * self.cfg.model.block_size
        return loss_val, lr, grad_norm, stats[1].item() > 0

    def _diverged(self, step: int, what: str) -> TrainingDiverged:
        t, ck = self.cfg.train, self.last_ckpt
        kept = (f"the last good checkpoint ({ck.name}) is kept in {ck.parent.parent}" if ck
                else "no checkpoint had been saved yet")
        return TrainingDiverged(
            f"{what} is not finite at step {step}: lower train.learning_rate (now "
            f"{t.learning_rate:g}), set train.precision=fp32 (now {t.precision}) or a tighter "
            f"train.grad_clip (now {t.grad_clip:g}); {kept}")

    # -- evaluation, samples, checkpoints ---------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean val loss over the fixed eval offsets (split across ranks, summed back)."""
        self.model.eval()
        mine = self.eval_offsets[self.info.rank::self.info.world_size]
        total = torch.zeros(2, dtype=torch.float64)  # (sum of loss x rows, rows)
        for i in range(0, len(mine), self.micro):
            chunk = mine[i:i + self.micro]
            x, y = self.data.get_batch("val", chunk, self.device)
            with autocast(self.device, self.amp):
                _, loss = self.model(x, y)
            total += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
        all_reduce_sum(total, self.info)
        self.model.train()
        return (total[0] / total[1]).item()

    def sample(self) -> list[tuple[str, str]]:
        """A short sample per prompt with a fixed seed (comparable from eval to eval); the
        global RNG is forked so sampling never changes the training trajectory."""
        t = self.cfg.train
        if t.sample_tokens <= 0 or not self.info.is_main:
            return []
        from minigpt.sample import generate  # lazily: sample sits beside train in the flow

        devices = [self.device] if self.device.type == "cuda" else []
        out = []
        with torch.random.fork_rng(devices=devices):
            gen = torch.Generator(device=self.device).manual_seed(self.cfg.run.seed + 2)
            for prompt in t.sample_prompts:
                ids = self.tokenizer.encode(prompt) or [self.tokenizer.eot_id]
                new = list(generate(self.model, ids, t.sample_tokens, temperature=0.8,
                                    generator=gen))
                out.append((prompt, self.tokenizer.decode(new)))
        return out

    def checkpoint(self, elapsed: float) -> None:
        step, t = self.state["step"], self.cfg.train
        if self.info.is_main and step != self.saved_step:
            self.metrics.sync()
            self.state["elapsed"] = elapsed
            trainer_state = {
                "format": 1, "minigpt_version": __version__, **self.state,
                "max_steps": t.max_steps, "batch_size": t.batch_size,
                "world_size": self.info.world_size, "bytes_per_token": self.data.bytes_per_token,
                "data_split": DATA_SPLIT,
                "schedule": {"kind": t.schedule, "warmup_steps": t.warmup_steps,
                             "learning_rate": t.learning_rate, "min_lr": t.min_lr,
                             "next_lr": lr_at(step, t)},
                "rng": rng_state(self.data_gen)}
            trainer_state = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                             for k, v in trainer_state.items()}  # JSON has no inf
            self.last_ckpt = save_checkpoint(
                self.run_dir, step=step, model=self.model, cfg=self.cfg,
                tokenizer=self.tokenizer, trainer_state=trainer_state,
                optimizer=self.optimizer, param_names=self.names, keep=t.keep_checkpoints)
            self.emit(CheckpointEvent(step, self.last_ckpt))
        self.saved_step = step

    # -- the loop ---------------------------------------------------------------------------
    def run(self, stop_after: int | None) -> DoneEvent:
        t, state, emit = self.cfg.train, self.state, self.emit
        T = self.cfg.model.block_size
        params = self.model.num_params()["total"]
        emit(StartEvent(self.run_dir, state["step"], t.max_steps, params, str(self.device),
                        self.info.world_size, t.batch_size * T, self.tokenizer.n_vocab,
                        self.data.bytes_per_token))
        start, base = time.perf_counter(), state["elapsed"]

        def elapsed() -> float:  # training seconds over all sessions of this run
            return base + time.perf_counter() - start

        reason, signame = "finished", ""
        mark, mark_step = time.perf_counter(), state["step"]
        self.model.train()
        with StopFlag() as flag:
            while state["step"] < t.max_steps:
                loss, lr, grad_norm, stop = self.step(flag)
                step = state["step"]
                last = step == t.max_steps
                if step % t.log_interval == 0 or last or step == 1:
                    now = time.perf_counter()
                    tps = (step - mark_step) * t.batch_size * T / max(now - mark, 1e-9)
                    mark, mark_step = now, step
                    ev = StepEvent(step, t.max_steps, loss, lr, grad_norm, tps, elapsed(),
                                   state["tokens_seen"])
                    self.metrics.write({"kind": "train", "step": step, "loss": loss, "lr": lr,
                                        "grad_norm": grad_norm, "tokens_per_s": tps,
                                        "elapsed": ev.elapsed, "tokens_seen": ev.tokens_seen})
                    emit(ev)
                if self.heads is not None and (step % self.head_every == 0 or last):
                    self._score_heads(step)
                if step % t.eval_interval == 0 or last:
                    self._eval_and_sample(step, elapsed)
                if step % t.checkpoint_interval == 0 or last or stop or step == stop_after:
                    self.checkpoint(elapsed())
                if stop:
                    reason = "interrupted"
                    signame = signal.Signals(flag.signum or signal.SIGINT).name
                    break
                if step == stop_after:
                    reason = "stopped"
                    break
            if not agree(True, self.info):  # all ranks leave the loop together
                raise MinigptError("another rank failed")
        self.metrics.close()

        wall = elapsed()
        best_loss, best_bpb = state["best_val_loss"], state["best_val_bpb"]
        done = DoneEvent(self.run_dir, state["step"], t.max_steps, reason, signame, params,
                         state["tokens_seen"], wall, state["tokens_seen"] / max(wall, 1e-9),
                         best_loss if math.isfinite(best_loss) else math.nan,
                         best_bpb if math.isfinite(best_bpb) else math.nan, self.last_ckpt)
        if self.info.is_main:
            write_summary(self.run_dir / SUMMARY_FILE, done.summary_rows(), self.samples)
            if reason != "finished":  # a finished run drew its last evaluation already
                self._draw_pictures()
        emit(done)
        return done

    def _eval_and_sample(self, step: int, elapsed: Callable[[], float]) -> None:
        state = self.state
        val = self.evaluate()
        if not math.isfinite(val):
            raise self._diverged(step, "the validation loss")
        bpb = val / math.log(2) / self.data.bytes_per_token  # nats/token -> bits/byte
        if val < state["best_val_loss"]:
            state.update(best_val_loss=val, best_val_bpb=bpb, best_step=step)
        self.samples = self.sample()
        ev = EvalEvent(step, val, math.exp(min(val, 700.0)), bpb, state["best_val_loss"],
                       state["best_val_bpb"], elapsed(), self.samples)
        self.metrics.write({"kind": "eval", "step": step, "val_loss": val, "val_ppl": ev.val_ppl,
                            "val_bpb": bpb, "elapsed": ev.elapsed,
                            "tokens_seen": state["tokens_seen"]})
        if self.info.is_main:  # drawn before the event, so a listener sees this evaluation
            self._draw_pictures()
        self.emit(ev)

    def _score_heads(self, step: int) -> None:
        """Every head's probe scores to metrics.jsonl; say which heads formed."""
        record, formed = self.heads.measure(step)
        self.metrics.write(record)
        for ev in formed:
            self.emit(ev)

    def _draw_pictures(self) -> None:
        """curves.png and heads.png from every record of the run (earlier sessions included),
        each rewritten atomically."""
        write_curves(self.run_dir)
        if self.heads is not None:
            records, _ = read_metrics(self.run_dir / METRICS_FILE)
            png = draw_timeline(records, f"{self.run_dir.name}: head scores on the built-in "
                                "probes")
            if png is not None:
                atomic_write_bytes(self.run_dir / HEADS_PNG, png)
