"""The run directory: what lives where, by name. Every module under `minigpt.run` (and the
trainer) names files through these constants; nothing else hard-codes a run-dir path.

    <run>/config.yaml, tokenizer.tiktoken, tokenizer.json    resolved config + tokenizer
    <run>/metrics.jsonl, summary.md, train.lock                logs, end summary, the run lock
    <run>/truth.json                                           a compiled program's known
                                                               circuit (minigpt compile)
    <run>/tensorboard/events.out.tfevents.*                    TensorBoard event files
                                                               (train.tensorboard)
    <run>/checkpoints/step-000500/                             one complete, self-contained
                                                               checkpoint:
        model.safetensors  optimizer.safetensors  trainer_state.json  config.yaml
        tokenizer.tiktoken  tokenizer.json  manifest.json   (sha256 of every other file)
        [train_weights.safetensors]                        with train.ema: the live weights
    <run>/checkpoints/latest -> step-000500                    symlink: THE commit pointer
    <run>/model.safetensors, optimizer.safetensors, trainer_state.json, manifest.json
                                                               symlinks into checkpoints/latest/

How a checkpoint is committed is in `checkpoint.py`; which one is committed is read here (no
torch: `minigpt runs` finds checkpoints without loading it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from minigpt.errors import MinigptError

CKPT_DIR = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
TRAIN_WEIGHTS_FILE = "train_weights.safetensors"  # with train.ema: the live weights (train/ema.py)
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.md"
HEADS_PNG = "heads.png"
TRUTH_FILE = "truth.json"  # a compiled program's known circuit (minigpt.truth.store)
TENSORBOARD_DIR = "tensorboard"  # TensorBoard event files (train.tensorboard)
LOCK_NAME = "train.lock"
FORMAT = "minigpt-checkpoint-1"
# Convenience links at the top of the run dir, so plain `safetensors` finds <run>/model.safetensors.
TOP_LINKS = (MODEL_FILE, OPTIM_FILE, STATE_FILE, MANIFEST_FILE)
DEFAULT_RUNS = Path("runs")  # where `--run` defaults look for the latest run


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _latest_target(root: Path) -> str | None:
    """What `root/latest` points to (the committed step directory's name), or None."""
    try:
        return os.readlink(root / LATEST)
    except OSError:  # missing, or not a link (a copy made without links)
        return None


def step_of(name: str) -> int | None:
    """The step of a `step-NNNNNN` directory name; None for any other name."""
    return int(name[5:]) if re.fullmatch(r"step-\d{6,}", name) else None


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every step directory holding a manifest, oldest first."""
    if not root.is_dir():
        return []
    return sorted((s, p) for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                  and (s := step_of(p.name)) is not None and (p / MANIFEST_FILE).is_file())


def latest_checkpoint_dir(run_dir: Path) -> Path | None:
    """The committed checkpoint directory of a run, or None if none was ever committed: the
    target of `checkpoints/latest`, or, where that link is missing or is not a link (a copy
    made without links), the newest step directory holding a manifest (verified on loading)."""
    root = Path(run_dir) / CKPT_DIR
    target = _latest_target(root)
    if target is None:
        complete = complete_steps(root)
        return complete[-1][1] if complete else None
    if step_of(target) is None:  # never follow a pointer out of the run
        raise MinigptError(f"{root / LATEST} points to '{target}', not a step-NNNNNN directory; "
                           "the run directory was tampered with")
    return root / target
