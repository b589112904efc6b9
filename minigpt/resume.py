"""Where a run lives and how it is (re)opened: the run directory from the config, the config
of a run being resumed (and which `--set`s may change it), and claiming the directory
(never overwriting an existing run; the lock keeps a second trainer out)."""

from __future__ import annotations

from pathlib import Path

from minigpt.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    Checkpoint,
    find_checkpoint,
    latest_checkpoint_dir,
)
from minigpt.config import (
    Config,
    ConfigError,
    MinigptError,
    apply_overrides,
    from_dict,
    parse_override,
    parse_yaml,
)
from minigpt.distributed import DistInfo
from minigpt.rundir import LOCK_NAME, RunLock, check_fresh_run_dir

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


def open_run_dir(run_dir: Path, resume: bool, lock: RunLock,
                 info: DistInfo) -> Checkpoint | None:
    """Resume: rank 0 locks the run dir, every rank finds the checkpoint (None = none yet).
    Fresh: only a read-only check here; the directory is created by claim_fresh once the
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


def claim_fresh(run_dir: Path, lock: RunLock, info: DistInfo) -> None:
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
