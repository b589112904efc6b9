"""A run directory: its layout, checkpoints and their commit protocol, the run lock, the
resume rules and what a run writes besides checkpoints. Nothing here unpickles.

    layout.py          file names and the directory layout
    checkpoint.py      the on-disk commit protocol: save, find, verify
    load.py            weights and optimizer state into live objects; `load_run` for inference
    resume.py          which run directory, the config of a resumed run, claiming a fresh one
    lock.py            one trainer per run directory (flock)
    state.py           RNG states as JSON, metrics.jsonl, summary.md
    safetensors_io.py  safetensors read defensively (header checked before any tensor)

The public entry points are re-exported here: `from minigpt.run import load_run`.
"""

from minigpt.run.load import LoadedRun, find_latest_run, load_run
from minigpt.run.resume import run_dir_for

__all__ = ["LoadedRun", "find_latest_run", "load_run", "run_dir_for"]
