"""The training loop: `train(cfg, run_dir, ...)` trains, evaluates, checkpoints and reports
progress through `on_event(event)` (the dataclasses below); it never prints.

Batches: every optimizer step draws the GLOBAL batch of `train.batch_size` offsets from one
torch.Generator seeded by run.seed (identical on every rank); rank r takes the r-th contiguous
slice and splits it into micro-batches of `micro_batch_size`. Each micro-loss is divided by
the number of micro-batches per rank and DDP averages over ranks, so the gradient is the mean
over the global batch: a DDP run equals a single-process run up to float summation order.

Resume: `resume_config` decides what may change (see RESUME_SAFE); `train(..., resume=True)`
restores weights, AdamW moments, RNG states, the data generator, counters and the metrics log
from the committed checkpoint, so on CPU the rest of the run is bit-identical.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from minigpt import __version__
from minigpt.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    find_checkpoint,
    latest_checkpoint_dir,
    load_model_weights,
    load_optimizer_state,
    read_trainer_state,
    save_checkpoint,
)
from minigpt.config import (
    Config,
    ConfigError,
    MinigptError,
    apply_overrides,
    from_dict,
    parse_override,
    parse_yaml,
    to_yaml,
)
from minigpt.data import prepare_dataset
from minigpt.device import resolve_device
from minigpt.distributed import DistInfo, agree, all_reduce_sum, main_first, setup, teardown
from minigpt.model import GPT
from minigpt.rundir import LOCK_NAME, RunLock, atomic_write_text, check_fresh_run_dir
from minigpt.runstate import (
    METRICS_FILE,
    SUMMARY_FILE,
    MetricsLog,
    rng_state,
    set_rng_state,
    truncate_metrics,
    write_summary,
)
from minigpt.schedule import build_optimizer, lr_at, set_lr
from minigpt.tokenizer import Tokenizer, build_tokenizer

# --------------------------------------------------------------------------------------------
# Events (the CLI renders them; tests collect them).


@dataclasses.dataclass
class StartEvent:
    run_dir: Path
    start_step: int          # steps already done (0 for a fresh run)
    max_steps: int
    params: int              # distinct parameters (tied weights once)
    device: str
    world_size: int
    tokens_per_step: int     # batch_size * block_size
    n_vocab: int
    bytes_per_token: float


@dataclasses.dataclass
class StepEvent:
    step: int                # optimizer steps completed
    max_steps: int
    loss: float              # mean train loss of this step's global batch
    lr: float
    grad_norm: float         # before clipping
    tokens_per_s: float      # over the last log interval
    elapsed: float           # training seconds so far (all sessions)
    tokens_seen: int


@dataclasses.dataclass
class EvalEvent:
    step: int
    val_loss: float
    val_ppl: float
    val_bpb: float           # bits per byte = val_loss / ln 2 / bytes_per_token
    best_val_loss: float
    best_val_bpb: float
    elapsed: float
    samples: list[tuple[str, str]]  # (prompt, generated text)


@dataclasses.dataclass
class CheckpointEvent:
    step: int
    path: Path


@dataclasses.dataclass
class DoneEvent:
    run_dir: Path
    step: int
    max_steps: int
    reason: str              # finished | interrupted | stopped
    signal: str              # SIGINT / SIGTERM when interrupted, else ""
    params: int
    tokens_seen: int
    wall_time: float         # training seconds (all sessions)
    tokens_per_s: float
    best_val_loss: float     # nan if never evaluated
    best_val_bpb: float
    checkpoint: Path | None


class TrainingDiverged(MinigptError):
    """The loss or gradient became NaN/inf (exit code 2, last good checkpoint kept)."""


# --------------------------------------------------------------------------------------------
# Which settings may change on --resume: anything that does not change what the checkpoint
# holds or which batches come next. Changing the schedule (max_steps, lr) is allowed: the rest
# of the run follows the new schedule from the current step.
RESUME_SAFE = {("run", "device")} | {
    ("train", k) for k in ("max_steps", "learning_rate", "min_lr", "warmup_steps", "weight_decay",
                           "beta1", "beta2", "grad_clip", "eval_interval", "eval_batches",
                           "log_interval", "checkpoint_interval", "sample_tokens",
                           "sample_prompts", "precision", "compile", "micro_batch_size")}


def run_dir_for(cfg: Config, out: str | Path | None) -> Path:
    """--out, else <run.out_dir>/<run.name>."""
    return Path(out) if out else Path(cfg.run.out_dir) / cfg.run.name


def resume_config(run_dir: Path, overrides: list[str], device: str | None = None) -> Config:
    """The config of the run being resumed (its config.yaml) with the allowed `--set`s."""
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise MinigptError(f"--resume: run directory {run_dir} does not exist; start it with "
                           f"`minigpt train --out {run_dir}` (without --resume)")
    if not path.is_file():
        raise MinigptError(f"--resume: {path} is missing, so {run_dir} is not a minigpt run "
                           "(or its first write was interrupted); start a new run elsewhere")
    for text in overrides:
        section, key, _ = parse_override(text)
        if (section, key) not in RESUME_SAFE:
            raise ConfigError(
                f"--set {section}.{key} cannot change on --resume (the checkpoint was trained "
                "with the stored value); only train.* except train.batch_size, and run.device, "
                "may change; start a new run to change it")
    raw = parse_yaml(path.read_text(encoding="utf-8", errors="replace"), str(path))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a config mapping; the run directory is damaged")
    raw = apply_overrides(raw, overrides)
    if device:
        raw.setdefault("run", {})["device"] = device
    return from_dict(raw, str(path))


# --------------------------------------------------------------------------------------------
# Signals: the handler only sets a flag; the loop checks it after each step.


class _StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # second signal: stop now (the last commit stays valid)
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


# --------------------------------------------------------------------------------------------


def _precision(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    p = cfg.train.precision
    if p == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() \
            else None
    return torch.bfloat16 if p == "bf16" else None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _sample(model: GPT, tokenizer: Tokenizer, cfg: Config) -> list[tuple[str, str]]:
    """A short sample per prompt with a fixed seed (same at every eval, so they compare);
    the global RNG is forked so sampling never changes the training trajectory."""
    if cfg.train.sample_tokens <= 0:
        return []
    from minigpt.sample import generate  # lazily: sample sits beside train in the import flow

    device = next(model.parameters()).device
    out = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        gen = torch.Generator(device=device).manual_seed(cfg.run.seed + 2)
        for prompt in cfg.train.sample_prompts:
            ids = tokenizer.encode(prompt) or [tokenizer.eot_id]
            new = list(generate(model, ids, cfg.train.sample_tokens, temperature=0.8,
                                generator=gen))
            out.append((prompt, tokenizer.decode(new)))
    return out


@torch.no_grad()
def _evaluate(model: GPT, dataset, offsets: torch.Tensor, micro: int, device: torch.device,
              amp: torch.dtype | None, info: DistInfo) -> float:
    """Mean val loss over the fixed eval offsets (split across ranks, summed back)."""
    was = model.training
    model.eval()
    mine = offsets[info.rank::info.world_size]
    total = torch.zeros(2, dtype=torch.float64)  # (sum of loss * n, n)
    for i in range(0, len(mine), micro):
        chunk = mine[i:i + micro]
        x, y = dataset.get_batch("val", chunk, device)
        with _autocast(device, amp):
            _, loss = model(x, y)
        total += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
    all_reduce_sum(total, info)
    model.train(was)
    return (total[0] / total[1]).item()


def _diverged(step: int, what: str, cfg: Config, ckpt: Path | None) -> TrainingDiverged:
    kept = (f"the last good checkpoint ({ckpt.name}) is kept in {ckpt.parent.parent}"
            if ckpt else "no checkpoint had been saved yet")
    return TrainingDiverged(
        f"{what} is not finite at step {step}: lower train.learning_rate (now "
        f"{cfg.train.learning_rate:g}), set train.precision=fp32 (now {cfg.train.precision}) or "
        f"a tighter train.grad_clip (now {cfg.train.grad_clip:g}); {kept}")


def train(cfg: Config, run_dir: Path, *, resume: bool = False,
          on_event: Callable[[object], None] | None = None,
          stop_after: int | None = None) -> DoneEvent:
    """Train `cfg` into `run_dir` (fresh: the directory must be missing or empty; resume:
    continue from its committed checkpoint, or from step 0 if none was committed).

    `stop_after` stops cleanly (checkpoint, reason "stopped") after that step. SIGINT/SIGTERM
    save a checkpoint and return reason "interrupted". Raises MinigptError (TrainingDiverged
    on a non-finite loss) for anything the user can fix; nothing already saved is lost."""
    emit = on_event or (lambda e: None)
    run_dir = Path(run_dir)
    info, device = setup(resolve_device(cfg.run.device))
    lock = RunLock(run_dir)
    try:
        ckpt = main_first(lambda: _open_run_dir(run_dir, resume, lock, info), info)
        done = read_trainer_state(ckpt)["step"] if ckpt is not None else 0
        if done >= cfg.train.max_steps:
            raise MinigptError(f"--resume: the run is already at step {done} of "
                               f"train.max_steps={cfg.train.max_steps}; raise it, e.g. --set "
                               f"train.max_steps={cfg.train.max_steps * 2}")
        claim = (lambda: None) if resume else (lambda: _claim_fresh(run_dir, lock, info))
        return _train(cfg, run_dir, ckpt, device, info, emit, stop_after, claim)
    finally:
        lock.release()
        teardown(info)


def _open_run_dir(run_dir: Path, resume: bool, lock: RunLock, info: DistInfo):
    """Resume: rank 0 locks the run dir, every rank finds the checkpoint (None = none yet).
    Fresh: only a read-only check here; the directory is created by _claim_fresh once the
    tokenizer and data are ready, so a bad corpus leaves no half-made run behind."""
    if not resume:
        if info.is_main:
            check_fresh_run_dir(run_dir)
        return None
    if info.is_main:
        if not run_dir.is_dir():
            raise MinigptError(f"--resume: run directory {run_dir} does not exist")
        lock.acquire()
    if latest_checkpoint_dir(run_dir) is not None:
        return find_checkpoint(run_dir, need=(MODEL_FILE, OPTIM_FILE))
    return None


def _claim_fresh(run_dir: Path, lock: RunLock, info: DistInfo) -> None:
    """Create and lock a fresh run dir; re-check it under the lock (another trainer may have
    started in it meanwhile)."""
    if info.is_main:
        check_fresh_run_dir(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MinigptError(f"cannot create run directory {run_dir}: {e.strerror}; "
                               "choose a writable --out") from None
        lock.acquire()
        if any(p.name != LOCK_NAME for p in run_dir.iterdir()):
            check_fresh_run_dir(run_dir)


def _train(cfg: Config, run_dir: Path, ckpt, device: torch.device, info: DistInfo, emit,
           stop_after: int | None, claim: Callable[[], None]) -> DoneEvent:
    t = cfg.train
    seed = cfg.run.seed
    torch.manual_seed(seed)
    main = info.is_main

    # Batch geometry: global batch -> per rank -> micro-batches.
    micro = t.micro_batch_size or t.batch_size // info.world_size
    if micro == 0 or t.batch_size % (info.world_size * micro):
        raise ConfigError(
            f"train.batch_size: {t.batch_size} must be a multiple of world size "
            f"({info.world_size}) x train.micro_batch_size ({micro or t.micro_batch_size})")
    n_micro = t.batch_size // (info.world_size * micro)

    # Tokenizer and data (cached by their modules; rank 0 fills the caches first).
    if ckpt is not None:
        tokenizer = Tokenizer.load(ckpt.path)
    else:
        tokenizer = main_first(lambda: build_tokenizer(cfg, emit if main else None), info)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.n_vocab
    elif cfg.model.vocab_size < tokenizer.n_vocab:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer.n_vocab} ids; set it to 0 (automatic)")
    dataset = main_first(lambda: prepare_dataset(cfg, tokenizer, emit if main else None), info)
    main_first(claim, info)  # only now does a fresh run dir appear

    T = cfg.model.block_size

    model = GPT.from_config(cfg, seed=seed).to(device)
    optimizer, names = build_optimizer(model, t, device)
    data_gen = torch.Generator().manual_seed(seed)
    eval_offsets = dataset.sample_offsets(
        "val", t.eval_batches * t.batch_size, torch.Generator().manual_seed(seed + 1))
    state = {"step": 0, "tokens_seen": 0, "elapsed": 0.0, "best_val_loss": math.inf,
             "best_val_bpb": math.inf, "best_step": 0}
    if ckpt is not None:
        load_model_weights(model, ckpt)
        load_optimizer_state(optimizer, names, ckpt)
        saved = read_trainer_state(ckpt)
        state.update({k: saved[k] for k in state if k in saved})
        set_rng_state(saved["rng"], data_gen)
        if info.enabled:  # other ranks' dropout streams: offset from rank 0's
            torch.manual_seed(seed + 7919 * info.rank + state["step"])
    elif info.enabled:
        torch.manual_seed(seed + 7919 * info.rank)

    if main:  # the resolved config, tokenizer and (on resume) the metrics log up to the step
        atomic_write_text(run_dir / CONFIG_FILE, to_yaml(cfg))
        tokenizer.save(run_dir)
        truncate_metrics(run_dir / METRICS_FILE, state["step"])
    metrics = MetricsLog(run_dir / METRICS_FILE, enabled=main)

    fwd = model
    if t.compile == "true" or (t.compile == "auto" and device.type == "cuda"):
        fwd = torch.compile(model)
    if info.enabled:
        fwd = torch.nn.parallel.DistributedDataParallel(
            fwd, device_ids=[device.index] if device.type == "cuda" else None)
    amp = _precision(cfg, device)
    params = model.num_params()["total"]
    emit(StartEvent(run_dir, state["step"], t.max_steps, params, str(device), info.world_size,
                    t.batch_size * T, tokenizer.n_vocab, dataset.bytes_per_token))

    last_ckpt = ckpt.path if ckpt is not None else None
    saved_step = state["step"] if ckpt is not None else -1
    samples: list[tuple[str, str]] = []

    def checkpoint(step: int) -> None:
        nonlocal last_ckpt, saved_step
        if main and step != saved_step:
            metrics.sync()
            state["elapsed"] = elapsed()
            trainer_state = {
                "format": 1, "minigpt_version": __version__, **state, "max_steps": t.max_steps,
                "schedule": {"warmup_steps": t.warmup_steps, "learning_rate": t.learning_rate,
                             "min_lr": t.min_lr, "next_lr": lr_at(step, t)},
                "batch_size": t.batch_size, "world_size": info.world_size,
                "bytes_per_token": dataset.bytes_per_token, "rng": rng_state(data_gen)}
            trainer_state = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                             for k, v in trainer_state.items()}
            last_ckpt = save_checkpoint(run_dir, step=step, model=model, cfg=cfg,
                                        tokenizer=tokenizer, trainer_state=trainer_state,
                                        optimizer=optimizer, param_names=names)
            emit(CheckpointEvent(step, last_ckpt))
        saved_step = step

    session_start = time.perf_counter()
    base_elapsed = state["elapsed"]

    def elapsed() -> float:
        return base_elapsed + time.perf_counter() - session_start

    for key in ("best_val_loss", "best_val_bpb"):
        state[key] = math.inf if state[key] is None else state[key]
    reason, signame = "finished", ""
    interval_start, interval_tokens = time.perf_counter(), 0
    tps = 0.0
    model.train()
    with _StopFlag() as flag:
        step = state["step"]
        while step < t.max_steps:
            lr = lr_at(step, t)
            set_lr(optimizer, lr)
            offsets = dataset.sample_offsets("train", t.batch_size, data_gen)  # global batch
            mine = offsets[info.rank * n_micro * micro:(info.rank + 1) * n_micro * micro]
            loss_sum = torch.zeros((), device=device)
            for m in range(n_micro):
                x, y = dataset.get_batch("train", mine[m * micro:(m + 1) * micro], device)
                sync = fwd.no_sync() if info.enabled and m < n_micro - 1 \
                    else contextlib.nullcontext()
                with sync:
                    with _autocast(device, amp):
                        _, loss = fwd(x, y)
                    (loss / n_micro).backward()
                loss_sum += loss.detach().float()
            # One collective per step: the mean loss and whether any rank was signalled.
            stats = torch.stack([loss_sum.cpu() / n_micro,
                                 torch.tensor(float(flag.signum is not None))])
            all_reduce_sum(stats, info)
            loss_val = stats[0].item() / info.world_size
            if not math.isfinite(loss_val):
                raise _diverged(step + 1, "the training loss", cfg, last_ckpt)
            clip = t.grad_clip if t.grad_clip > 0 else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
            if not math.isfinite(grad_norm):
                raise _diverged(step + 1, "the gradient norm", cfg, last_ckpt)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            state["step"] = step
            state["tokens_seen"] += t.batch_size * T
            interval_tokens += t.batch_size * T

            last = step == t.max_steps
            if step % t.log_interval == 0 or last or step == 1:
                now = time.perf_counter()
                tps = interval_tokens / max(now - interval_start, 1e-9)
                interval_start, interval_tokens = now, 0
                ev = StepEvent(step, t.max_steps, loss_val, lr, grad_norm, tps, elapsed(),
                               state["tokens_seen"])
                metrics.write({"kind": "train", "step": step, "loss": loss_val, "lr": lr,
                               "grad_norm": grad_norm, "tokens_per_s": tps,
                               "elapsed": ev.elapsed, "tokens_seen": ev.tokens_seen})
                emit(ev)
            if step % t.eval_interval == 0 or last:
                val = _evaluate(model, dataset, eval_offsets, micro, device, amp, info)
                if not math.isfinite(val):
                    raise _diverged(step, "the validation loss", cfg, last_ckpt)
                bpb = val / math.log(2) / dataset.bytes_per_token
                if val < state["best_val_loss"]:
                    state.update(best_val_loss=val, best_val_bpb=bpb, best_step=step)
                samples = _sample(model, tokenizer, cfg) if main else []
                ev = EvalEvent(step, val, math.exp(min(val, 700.0)), bpb, state["best_val_loss"],
                               state["best_val_bpb"], elapsed(), samples)
                metrics.write({"kind": "eval", "step": step, "val_loss": val,
                               "val_ppl": ev.val_ppl, "val_bpb": bpb, "elapsed": ev.elapsed,
                               "tokens_seen": state["tokens_seen"]})
                emit(ev)
            stop = stats[1].item() > 0
            if step % t.checkpoint_interval == 0 or last or stop or step == stop_after:
                checkpoint(step)
            if stop:
                reason = "interrupted"
                signame = signal.Signals(flag.signum or signal.SIGINT).name
                break
            if step == stop_after:
                reason = "stopped"
                break
        if not agree(True, info):  # keep ranks in step before leaving
            raise MinigptError("another rank failed")
    metrics.close()

    wall = elapsed()
    done = DoneEvent(run_dir, state["step"], t.max_steps, reason, signame, params,
                     state["tokens_seen"], wall, state["tokens_seen"] / max(wall, 1e-9),
                     state["best_val_loss"] if math.isfinite(state["best_val_loss"]) else math.nan,
                     state["best_val_bpb"] if math.isfinite(state["best_val_bpb"]) else math.nan,
                     last_ckpt)
    if main:
        write_summary(run_dir / SUMMARY_FILE, summary_rows(done), samples)
    emit(done)
    return done


def summary_rows(d: DoneEvent) -> list[tuple[str, str]]:
    """The end-of-run figures (summary.md and the CLI's table share them)."""
    return [
        ("status", f"{d.reason} at step {d.step}/{d.max_steps}"),
        ("parameters", f"{d.params:,}"),
        ("tokens seen", f"{d.tokens_seen:,}"),
        ("wall time", f"{d.wall_time:.1f} s"),
        ("tokens/s", f"{d.tokens_per_s:,.0f}"),
        ("best val loss", f"{d.best_val_loss:.4f}" if math.isfinite(d.best_val_loss) else "n/a"),
        ("best val bits/byte", f"{d.best_val_bpb:.4f}" if math.isfinite(d.best_val_bpb)
         else "n/a"),
        ("run directory", str(d.run_dir)),
        ("sample", f"minigpt sample --run {d.run_dir}"),
    ]
