"""The run lock and the "never overwrite an existing run" rule. Standard library only."""

from __future__ import annotations

import json
import os
from pathlib import Path

from minigpt.errors import ArgumentError, MinigptError
from minigpt.files import check_replaceable, disk_error, parse_json, read_file
from minigpt.run.layout import LOCK_NAME


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run may only go into a missing or empty directory: never overwrite a run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ArgumentError("out", "exists and is not a directory; choose another {name}",
                            subject=run_dir)
    # A dir holding only a train.lock nobody holds is what a kill right after creating the run
    # left behind: nothing to lose, so it counts as empty (a held lock refuses, below).
    if run_dir.is_dir() and any(p.name != LOCK_NAME for p in run_dir.iterdir()):
        raise MinigptError(
            f"run directory {run_dir} already exists and is not empty: continue it with "
            f"`minigpt train --out {run_dir} --resume`, or choose another --out / run.name")


class RunLock:
    """An exclusive lock on a run directory (`train.lock`), held for the whole training run.

    Uses fcntl.flock, which the kernel releases when the process dies (also on kill -9), so a
    crashed trainer never leaves the run locked; the file records the holder's pid for the
    message. Where fcntl is missing (Windows) the pid is checked for liveness instead."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fh = None

    def acquire(self) -> RunLock:
        check_replaceable(self.path)  # a FIFO or a device there is never opened for writing
        try:
            fh = open(self.path, "a+")  # noqa: SIM115 - held until release()
        except OSError as e:
            raise disk_error(e, self.path) from None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX fallback
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                fh.close()
                raise self._busy(self._holder()) from None
        else:  # pragma: no cover
            holder = self._holder()
            if holder and holder != os.getpid() and _pid_alive(holder):
                fh.close()
                raise self._busy(holder)
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid()}) + "\n")
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # closing the descriptor drops the flock
            self._fh = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _holder(self) -> int | None:
        try:
            return int(parse_json(read_file(self.path, 4096) or b"{}").get("pid", 0)) or None
        except (MinigptError, ValueError, AttributeError, TypeError):
            return None

    def _busy(self, pid: int | None) -> MinigptError:
        who = f"process {pid}" if pid else "another process"
        return MinigptError(
            f"run directory {self.path.parent} is in use by {who} (another `minigpt train`); "
            "wait for it to finish or stop it, or choose another --out")


def _pid_alive(pid: int) -> bool:  # pragma: no cover - only the non-fcntl fallback uses it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
