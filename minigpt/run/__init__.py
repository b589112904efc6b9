"""A run directory: its layout, checkpoints and their commit protocol, the run lock, the
resume rules, the trainer state and the pictures of a run. Nothing here unpickles.

    layout.py          file names and the directory layout; which checkpoint is committed
    checkpoint.py      the on-disk commit protocol: save, verify, find
    load.py            weights and optimizer state into live objects; `load_run` for inference
    resume.py          a train command's config and run directory, the config of a resumed run,
                       opening a run to resume it, claiming a fresh one
    lock.py            one trainer per run directory (flock)
    state.py           trainer_state.json (counters, RNG states as JSON)
    metrics.py         metrics.jsonl read back; `finite`, a run's one meaning of a number
    curves.py          curves.png and `minigpt curves`
    listing.py         `minigpt runs`
    safetensors_io.py  safetensors read defensively (header checked before any tensor)

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
