"""The run directory: what lives where, by name. Every module under `minigpt.run` (and the
trainer) names files through these constants; nothing else hard-codes a run-dir path.

    <run>/config.yaml, tokenizer.tiktoken, tokenizer.json    resolved config + tokenizer
    <run>/metrics.jsonl, summary.md, train.lock                logs, end summary, the run lock
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

How a checkpoint is committed is in `checkpoint.py`.
"""

from __future__ import annotations

from pathlib import Path

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
TENSORBOARD_DIR = "tensorboard"  # TensorBoard event files (train.tensorboard)
LOCK_NAME = "train.lock"
FORMAT = "minigpt-checkpoint-1"
# Convenience links at the top of the run dir, so plain `safetensors` finds <run>/model.safetensors.
TOP_LINKS = (MODEL_FILE, OPTIM_FILE, STATE_FILE, MANIFEST_FILE)
DEFAULT_RUNS = Path("runs")  # where `--run` defaults look for the latest run


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"
