"""Where a run lives and how it is (re)opened: the config and run directory of a train command
(`train_config`), the config of a run being resumed and which settings may change
(`resume_config`), opening a run to continue it (its checkpoint and trainer state, read once)
and claiming a fresh directory (never overwriting an existing run; the lock keeps a second
trainer out)."""

from __future__ import annotations

import dataclasses
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from minigpt.config import (
    Config,
    RunConfig,
    config_from,
    from_dict,
    parse_override,
    read_config,
)
from minigpt.config.fields import parse_value
from minigpt.errors import ArgumentError, ConfigError, MinigptError
from minigpt.files import load_yaml, permission_denied_as_error
from minigpt.run.checkpoint import Checkpoint, listed_config, verify_checkpoint
from minigpt.run.layout import (
    CKPT_DIR,
    CONFIG_FILE,
    LATEST,
    LOCK_NAME,
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILE,
    latest_checkpoint_dir,
)
from minigpt.run.lock import RunLock, check_fresh_run_dir
from minigpt.run.state import RngStates, TrainerState, read_trainer_state

# Which settings may change on --resume: anything that does not change what the checkpoint
# holds or which batches come next. Changing the schedule (max_steps, lr) is allowed: the rest
# of the run follows the new schedule from the current step.
RESUME_SAFE = {("run", "device")} | {
    ("train", k) for k in ("max_steps", "learning_rate", "min_lr", "warmup_steps", "weight_decay",
                           "beta1", "beta2", "grad_clip", "eval_interval", "eval_batches",
                           "log_interval", "checkpoint_interval", "sample_tokens",
                           "sample_prompts", "precision", "compile", "micro_batch_size",
                           "keep_checkpoints", "head_scores_interval", "schedule",
                           "decay_fraction", "muon_lr", "muon_momentum", "muon_weight_decay",
                           "tensorboard", "ema", "stop_when_formed", "threads", "data_order",
                           "distill_from", "distill_weight")}


def run_dir_for(cfg: Config, out: str | Path | None) -> Path:
    """--out, else <run.out_dir>/<run.name>."""
    return Path(out) if out else Path(cfg.run.out_dir) / cfg.run.name


@permission_denied_as_error()
def train_config(config: str | None, sets: list[str], *, out: str | Path | None = None,
                 resume: bool = False, device: str | None = None) -> tuple[Config, Path]:
    """The config and run directory of `minigpt train [--config C] [--set ...] [--out DIR]
    [--resume] [--device D]`, reading the config file once. Fresh: the file with the --set
    overrides. Resume: the run directory is --out, else the file's run.out_dir/run.name with
    only the run.* overrides, and the config is `resume_config`'s."""
    if device is not None:
        device = parse_value(RunConfig, "device", device, "--device")
    command = _Command(*read_config(config), named_file=config is not None, sets=list(sets),
                       label=config)
    if not resume:
        cfg = command.resolved()
        if device:
            cfg.run.device = device
        return cfg, run_dir_for(cfg, out)
    run_dir = run_dir_for(command.located, out)
    return _resumed(run_dir, command, device), run_dir


@permission_denied_as_error()
def resume_config(run_dir: Path, overrides: list[str], device: str | None = None,
                  config: str | None = None) -> Config:
    """The config of the run being resumed, such that the command that started the run, with
    `--resume` appended, continues it.

    - The stored config is the config: the committed checkpoint's config.yaml (the run's
      top-level copy while nothing is committed). The settings the command names are resolved
      as the command itself resolves them (the `--config` file's keys, then each `--set` in
      order) and compared with the stored ones: a value equal to the stored one changes
      nothing; a different value is applied if the setting is RESUME_SAFE and otherwise
      refused (ConfigError naming the setting, the stored and the given value).
      `model.vocab_size: 0` ("from the tokenizer") equals any stored size.
    - Nothing saved yet (`nothing_saved`: a kill during start-up): the config the same command
      without --resume uses; the trainer then starts at step 0 (and says so)."""
    command = _Command(*read_config(config), named_file=config is not None,
                       sets=list(overrides), label=config)
    return _resumed(Path(run_dir), command, device)


@dataclasses.dataclass
class _Command:
    """A train command's settings: its config file (parsed once) and --set overrides."""
    path: Path
    raw: dict
    named_file: bool        # given with --config: its keys count as settings the command names
    sets: list[str]
    label: str | None       # the --config value, for messages

    @cached_property
    def located(self) -> Config:
        """The file with only the run.* overrides: what names the run directory."""
        return config_from(self.path, self.raw,
                           [s for s in self.sets if s.split("=", 1)[0].strip().startswith("run.")])

    def resolved(self) -> Config:
        """The file with every override: the config the command trains a new run with."""
        return config_from(self.path, self.raw, self.sets)

    def named(self) -> dict[tuple[str, str], tuple[str, Any]]:
        """{(section, key): (origin, typed value)} of every setting the command names, the
        --config file's keys first, each --set in order replacing what came before."""
        out: dict[tuple[str, str], tuple[str, Any]] = {}
        if self.named_file:
            typed = self.located
            for section, body in self.raw.items():
                for key in body or {}:
                    out[(section, key)] = (f"--config {self.label}",
                                           getattr(getattr(typed, section), key))
        for text in self.sets:
            section, key, value = parse_override(text)
            out[(section, key)] = ("--set", value)
        return out


def _resumed(run_dir: Path, command: _Command, device: str | None) -> Config:
    if not run_dir.is_dir():
        raise ArgumentError("resume", f"run directory {run_dir} does not exist; start it with "
                            f"`minigpt train --out {run_dir}` (without --resume)")
    path = _stored_config(run_dir)
    cfg = command.resolved() if path is None else _checked(path, command)
    if cfg.data.source == "program":  # before the lock: the run is left as it is
        raise ArgumentError("resume", f"{run_dir} is a compiled program (minigpt compile), "
                            "whose weights are its program: it is not trained")
    if device:
        cfg.run.device = device
    return cfg


def nothing_saved(run_dir: Path) -> bool:
    """True for a run directory that a start-up kill left with nothing in it but (maybe) the
    run lock: there is no config and no checkpoint to continue from."""
    return run_dir.is_dir() and all(p.name == LOCK_NAME for p in run_dir.iterdir())


def _stored_config(run_dir: Path) -> Path | None:
    """The config.yaml a run was trained with; None when nothing was saved."""
    ckpt = latest_checkpoint_dir(run_dir)
    if ckpt is not None:
        listed_config(ckpt)  # cut short, it would read as defaults and blame the command
    for path in ([ckpt / CONFIG_FILE] if ckpt is not None else []) + [run_dir / CONFIG_FILE]:
        if path.is_file():
            return path
    if nothing_saved(run_dir):
        return None
    raise ArgumentError("resume", f"{run_dir / CONFIG_FILE} is missing, so {run_dir} is not a "
                        "minigpt run (it holds other files); start a new run elsewhere")


def _checked(path: Path, command: _Command) -> Config:
    """The stored config with the command's RESUME_SAFE changes (see resume_config)."""
    raw = load_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a config mapping; the run directory is damaged")
    stored = from_dict(raw, str(path))
    merged = {k: dict(v) if isinstance(v, dict) else {} for k, v in raw.items()}
    for (section, key), (origin, value) in command.named().items():
        if _changed(stored, path, origin, section, key, value):
            merged.setdefault(section, {})[key] = value  # typed already
    return from_dict(merged, str(path))


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
            "train.* except train.batch_size and train.optimizer, and run.device, may change; "
            "give the stored value or leave it out, or start a new run (another --out) to "
            "change it")
    return True


def _show(value: Any) -> str:
    """A setting's value as YAML writes it (true, 0.001, 'text', [a, b])."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


# --------------------------------------------------------------------------------------------
# Opening and claiming.


@dataclasses.dataclass
class Resumed:
    """What a resumed run continues from, read once: the verified checkpoint, its trainer
    state and RNG states."""
    checkpoint: Checkpoint
    state: TrainerState
    rng: RngStates


@permission_denied_as_error()
def open_run_dir(run_dir: Path, resume: bool, lock: RunLock,
                 is_main: bool = True) -> Resumed | None:
    """Resume: rank 0 locks the run dir; every rank reads the committed checkpoint (None:
    nothing committed yet, the run starts at step 0). Fresh: only a read-only check here; the
    directory is created by claim_fresh once the tokenizer and data are ready, so a bad corpus
    leaves no half-made run behind. Nothing in the run directory is written here."""
    if not resume:
        if is_main:
            check_fresh_run_dir(run_dir)
        return None
    if is_main:
        if not run_dir.is_dir():
            raise ArgumentError("resume", f"run directory {run_dir} does not exist")
        lock.acquire()
    ckpt_dir = latest_checkpoint_dir(run_dir)
    link = run_dir / CKPT_DIR / LATEST
    if link.exists() and not link.is_symlink():  # its next commit could not replace it
        target = ckpt_dir.name if ckpt_dir is not None else "its step-NNNNNN directory"
        kind = "a directory" if link.is_dir() else "a regular file" if link.is_file() else \
            "not a link"
        raise MinigptError(
            f"{link} is {kind}, not the symbolic link to the committed checkpoint (was the "
            f"run copied without its links, e.g. by zip?); make it a link to {target} again "
            f"(e.g. mv {link} {link}.copy && ln -s {target} {link}), then resume")
    if ckpt_dir is None:
        return None
    ckpt = verify_checkpoint(ckpt_dir, need=(MODEL_FILE, OPTIM_FILE))
    return Resumed(ckpt, *read_trainer_state(ckpt.path / STATE_FILE))


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
