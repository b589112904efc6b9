"""What `minigpt.train.train` reports through `on_event` (the CLI renders these; tests
collect them), and the end-of-run figures shared by summary.md and the CLI's table."""

from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path

from minigpt.config import MinigptError


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
        ("sample", f"minigpt sample --run {shlex.quote(str(d.run_dir))}"),
    ]
