"""A run directory: its layout (the one place that names its files), checkpoints and their
commit protocol, the run lock, the resume rules, the trainer state, the run's metrics read back,
its curves and the listing of runs. Nothing here unpickles. docs/internals.md lists
the modules.

What a training session writes besides checkpoints (metrics.jsonl, pictures, summary.md) is
written by the trainer's event consumers (minigpt/train/outputs.py).

The public entry points are re-exported here: `from minigpt.run import load_run`. They are
imported when first asked for, so a module of the package that needs no torch (lock.py,
layout.py, metrics.py, listing.py, curves.py) loads none: a process that only takes the run
lock starts in a tenth of a second, and `minigpt runs` in a few tenths.
"""

__all__ = ["LoadedRun", "find_latest_run", "load_run", "run_dir_for"]


def __getattr__(name: str):
    if name in ("LoadedRun", "find_latest_run", "load_run"):
        from minigpt.run import load

        return getattr(load, name)
    if name == "run_dir_for":
        from minigpt.run.resume import run_dir_for

        return run_dir_for
    raise AttributeError(f"module 'minigpt.run' has no attribute {name!r}")
