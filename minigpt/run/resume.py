"""Where a run lives and how it is (re)opened: the run directory from the config, the config
of a run being resumed (and which `--set`s may change it), and claiming the directory
(never overwriting an existing run; the lock keeps a second trainer out)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from minigpt.config import (
    SECTIONS,
    Config,
    find_config,
    from_dict,
    load_config,
    parse_override,
)
from minigpt.errors import ArgumentError, ConfigError, MinigptError
from minigpt.fields import build_section
from minigpt.files import parse_yaml, read_text
from minigpt.run.checkpoint import (
    Checkpoint,
    discard_uncommitted,
    find_checkpoint,
    latest_checkpoint_dir,
)
from minigpt.run.layout import CONFIG_FILE, LOCK_NAME, MODEL_FILE, OPTIM_FILE
from minigpt.run.lock import RunLock, check_fresh_run_dir

# Which settings may change on --resume: anything that does not change what the checkpoint
# holds or which batches come next. Changing the schedule (max_steps, lr) is allowed: the rest
# of the run follows the new schedule from the current step.
RESUME_SAFE = {("run", "device")} | {
    ("train", k) for k in ("max_steps", "learning_rate", "min_lr", "warmup_steps", "weight_decay",
                           "beta1", "beta2", "grad_clip", "eval_interval", "eval_batches",
                           "log_interval", "checkpoint_interval", "sample_tokens",
                           "sample_prompts", "precision", "compile", "micro_batch_size",
                           "keep_checkpoints", "head_scores_interval", "schedule",
                           "decay_fraction", "muon_lr", "muon_momentum", "muon_weight_decay")}


def run_dir_for(cfg: Config, out: str | Path | None) -> Path:
    """--out, else <run.out_dir>/<run.name>."""
    return Path(out) if out else Path(cfg.run.out_dir) / cfg.run.name


def nothing_saved(run_dir: Path) -> bool:
    """True for a run directory that a start-up kill left with nothing in it but (maybe) the
    run lock: there is no config and no checkpoint to continue from."""
    return run_dir.is_dir() and all(p.name == LOCK_NAME for p in run_dir.iterdir())


def resume_config(run_dir: Path, overrides: list[str], device: str | None = None,
                  config: str | None = None) -> Config:
    """The config of the run being resumed, such that the command that started the run, with
    `--resume` appended, continues it.

    - The run's config.yaml is the config. The command's `--config` file (the keys it names)
      and `--set` values are checked against it, in that order: a value equal to the stored
      one changes nothing; a different value is applied if the setting is RESUME_SAFE and
      otherwise refused (ConfigError naming the setting, the stored and the given value).
      `model.vocab_size: 0` ("from the tokenizer") equals any stored size.
    - Nothing saved yet (`nothing_saved`: a kill during start-up): the config the same command
      without --resume uses, `load_config(config, overrides)`; the trainer then starts at
      step 0 (and says so)."""
    path = run_dir / CONFIG_FILE
    if not run_dir.is_dir():
        raise ArgumentError("resume", f"run directory {run_dir} does not exist; start it with "
                            f"`minigpt train --out {run_dir}` (without --resume)")
    if nothing_saved(run_dir):
        cfg = load_config(config, overrides)
    elif not path.is_file():
        raise ArgumentError("resume", f"{path} is missing, so {run_dir} is not a minigpt run "
                            "(it holds other files); start a new run elsewhere")
    else:
        raw = parse_yaml(path.read_text(encoding="utf-8", errors="replace"), str(path))
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: not a config mapping; the run directory is damaged")
        stored = from_dict(raw, str(path))
        given = ([] if config is None else _file_settings(config)) + [
            ("--set", *parse_override(text)) for text in overrides]
        merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
        for origin, section, key, value in given:
            if _changed(stored, path, origin, section, key, value):
                merged.setdefault(section, {})[key] = value  # typed already
        cfg = from_dict(merged, str(path))
    if device:
        cfg.run.device = device
    return cfg


def _file_settings(config: str) -> list[tuple[str, str, str, Any]]:
    """(origin, section, key, typed value) for every key the `--config` file names."""
    load_config(config)  # the file must be valid on its own (one-line errors)
    p = find_config(config)
    raw = parse_yaml(read_text(p, "config"), str(p))
    out = []
    for section, body in (raw or {}).items():
        typed = build_section(SECTIONS[section], section, body or {}, str(p))
        out += [(f"--config {config}", section, key, getattr(typed, key)) for key in body or {}]
    return out


def _changed(stored: Config, path: Path, origin: str, section: str, key: str,
             value: Any) -> bool:
    """Whether `value` changes the stored setting; raises if it may not change on --resume."""
    old = getattr(getattr(stored, section), key)
    if value == old or (section, key) == ("model", "vocab_size") and value == 0:
        return False
    if (section, key) not in RESUME_SAFE:
        raise ConfigError(
            f"{origin}: {section}.{key} cannot change on --resume: the run was trained with "
            f"{section}.{key}={_show(old)} ({path}), this command gives {_show(value)}; only "
            "train.* except train.batch_size and train.optimizer, and run.device, may change; give the stored "
            "value or leave it out, or start a new run (another --out) to change it")
    return True


def _show(value: Any) -> str:
    """A setting's value as YAML writes it (true, 0.001, 'text', [a, b])."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def open_run_dir(run_dir: Path, resume: bool, lock: RunLock,
                 is_main: bool = True) -> Checkpoint | None:
    """Resume: rank 0 locks the run dir, every rank finds the checkpoint (None = none yet).
    Fresh: only a read-only check here; the directory is created by claim_fresh once the
    tokenizer and data are ready, so a bad corpus leaves no half-made run behind."""
    if not resume:
        if is_main:
            check_fresh_run_dir(run_dir)
        return None
    if is_main:
        if not run_dir.is_dir():
            raise ArgumentError("resume", f"run directory {run_dir} does not exist")
        lock.acquire()
        discard_uncommitted(run_dir)
    if latest_checkpoint_dir(run_dir) is not None:
        return find_checkpoint(run_dir, need=(MODEL_FILE, OPTIM_FILE))
    return None


def claim_fresh(run_dir: Path, lock: RunLock, is_main: bool = True) -> None:
    """Create and lock a fresh run dir; re-check it under the lock (another trainer may have
    started in it meanwhile)."""
    if is_main:
        check_fresh_run_dir(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise MinigptError(f"cannot create run directory {run_dir}: {e.strerror}; "
                               "choose a writable --out") from None
        lock.acquire()
        if any(p.name != LOCK_NAME for p in run_dir.iterdir()):
            check_fresh_run_dir(run_dir)
