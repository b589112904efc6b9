"""Run-directory plumbing shared by checkpointing and training: durable atomic writes, the
run lock, and the "never overwrite an existing run" rule. Standard library only.

Durable write = temp file in the same directory, flush + fsync, os.replace, fsync the
directory: after a crash (kill -9, power loss) a reader sees either the old file or the new
one, never a torn mix.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from minigpt.config import MinigptError

LOCK_NAME = "train.lock"


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` (no rename) and fsync it; used inside a not-yet-committed dir."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (temp file, fsync, rename, fsync dir)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_file_synced(tmp, data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise disk_error(e, path) from None
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def disk_error(e: OSError, path: Path) -> MinigptError:
    """Turn an OSError from a write into a one-line user error naming the path."""
    if e.errno == errno.ENOSPC:
        return MinigptError(f"no space left on device while writing {path}; free some space "
                            "(nothing already saved was changed)")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MinigptError(f"cannot write {path}: {e.strerror}; choose a writable --out")
    return MinigptError(f"cannot write {path}: {e.strerror or e}")


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run may only go into a missing or empty directory: never overwrite a run."""
    if run_dir.exists() and not run_dir.is_dir():
        raise MinigptError(f"--out {run_dir}: exists and is not a directory; choose another --out")
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
            return int(json.loads(self.path.read_text() or "{}").get("pid", 0)) or None
        except (OSError, ValueError, AttributeError):
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
