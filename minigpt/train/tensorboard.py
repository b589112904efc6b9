"""TensorBoard event files of a run (`train.tensorboard: true`): `<run>/tensorboard/`, written
by one more consumer of the trainer's events (reporting.py), on rank 0 only.

What it logs, one scalar per tag and optimizer step, from the same records metrics.jsonl holds
(`metrics_record`), stored as TensorBoard stores scalars (float32):

    train/loss  train/lr  train/grad_norm  train/tokens_per_s     each logged step (StepEvent)
    val/loss  val/bits_per_byte                                    each evaluation (EvalEvent)
    heads/<score>/layer<i>   the best score among layer i's heads on the built-in probes, for
                             <score> = induction, previous, duplicate, first   (HeadScoresEvent)

Per layer, as heads.png draws them: per head would be n_layer x n_head x 4 charts; every
head's score stays in metrics.jsonl.

Sessions and resume. Each session writes its own event file, records written and flushed as
they come. A fresh session opens it at its StartEvent (its run directory exists by then). A
resumed session, like metrics.jsonl, writes nothing before its first checkpoint is committed:
its records wait in memory with the time each arrived. At its StartEvent (before any commit)
the directory and every event file in it are read and checked, and the cuts below planned in
memory: a `tensorboard` that is a file or cannot be written, or a record that is no event, is
one line with nothing changed. At its first CheckpointEvent the run's earlier event files are
cut to the events of the steps up to the resumed step k (each file
rewritten atomically; one left without data is removed), so records a killed session wrote
past its last checkpoint are gone; then the session's own file opens with TensorBoard's
"restarted at step k+1" marker (SessionLog START, which makes TensorBoard's readers drop
anything later still) and the held records. The directory then holds one value per tag and
step: the committed history, whatever reads it. (A kill between a commit and its
CheckpointEvent, where no work is done, loses that session's held records here; metrics.jsonl
has them.)

The `tensorboard` package is an optional extra, imported only here and only when the option
is on; `tensorboard_log` refuses in one line, before anything is made, when it is missing.
"""

from __future__ import annotations

import io
import itertools
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

from minigpt.config import TrainConfig
from minigpt.errors import ConfigError, MinigptError
from minigpt.events import CheckpointEvent, DoneEvent, StartEvent
from minigpt.files import LARGE_CAP, atomic_write_bytes, disk_error, read_file
from minigpt.run.layout import TENSORBOARD_DIR
from minigpt.train.outputs import metrics_record

__all__ = ["TensorBoardLog", "require_tensorboard", "scalars", "tensorboard_log"]

# (record kind, record key) -> tag
TAGS = {("train", "loss"): "train/loss", ("train", "lr"): "train/lr",
        ("train", "grad_norm"): "train/grad_norm", ("train", "tokens_per_s"): "train/tokens_per_s",
        ("eval", "val_loss"): "val/loss", ("eval", "val_bpb"): "val/bits_per_byte"}
_FILE_NUMBER = itertools.count()  # event files this process opened: unique names in a second


def require_tensorboard() -> SimpleNamespace:
    """The pieces of the `tensorboard` package the log uses, or a one-line ConfigError."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        raise ConfigError("train.tensorboard: true needs the tensorboard package, the optional "
                          "extra: pip install 'minigpt-lab[tensorboard]' (or set "
                          "train.tensorboard: false)") from None
    return SimpleNamespace(Event=Event, SessionLog=SessionLog, Summary=Summary,
                           RecordWriter=RecordWriter)


def tensorboard_log(t: TrainConfig, run_dir: Path, *, fresh: bool,
                    main: bool) -> TensorBoardLog | None:
    """The TensorBoard consumer of a session when `train.tensorboard` is on: for rank 0, None on
    the other ranks and when it is off. Every rank checks that the package is installed, so a
    missing one is refused on all ranks alike; it touches no file (call it before the run
    directory is made). `fresh`: a new run (not a resume)."""
    if not t.tensorboard:
        return None
    tb = require_tensorboard()
    return TensorBoardLog(run_dir, tb, fresh=fresh) if main else None


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of one metrics.jsonl record (see the module docstring)."""
    kind = record.get("kind")
    if kind == "heads":
        out = {}
        for score, rows in record["scores"].items():
            for layer, row in enumerate(rows):
                values = [v for v in row if v is not None]
                if values:
                    out[f"heads/{score}/layer{layer}"] = max(values)
        return out
    return {tag: record[key] for (k, key), tag in TAGS.items() if k == kind and key in record}


class TensorBoardLog:
    """`<run>/tensorboard/`, written from the events of one session (see the docstring)."""

    def __init__(self, run_dir: Path, tb: SimpleNamespace, *, fresh: bool) -> None:
        self.dir, self.tb, self.fresh = Path(run_dir) / TENSORBOARD_DIR, tb, fresh
        self.resumed_at = 0
        self._held: list[bytes] | None = None if fresh else []  # until the first commit
        self._file = None
        self._writer = None
        self._plan: list[tuple[Path, bytes | None]] = []  # a resume's cuts (`_plan_cut`)
        self.path: Path | None = None  # this session's event file, once open

    def __call__(self, event: object) -> None:
        if isinstance(event, StartEvent):
            self.resumed_at = event.start_step
            if self.fresh:
                self._open()
            else:  # before the first commit: what it will do is checked, nothing written
                self._plan = self._plan_cut(self.resumed_at)
        record = metrics_record(event)
        if record is not None:
            values = scalars(record)
            if values:
                self._write(self._summary(record["step"], values))
        elif isinstance(event, CheckpointEvent):
            if self._held is not None:  # the session's first commit: its records are the run's
                held, self._held = self._held, None
                self._apply(self._plan)
                self._open(restart_at=self.resumed_at + 1)
                for data in held:
                    self._write(data)
            self._sync()
        elif isinstance(event, DoneEvent):
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._sync()
            self._file.close()
            self._file = self._writer = None

    # -- the files ----------------------------------------------------------------------------
    def _summary(self, step: int, values: dict[str, float]) -> bytes:
        tb = self.tb
        summary = tb.Summary(value=[tb.Summary.Value(tag=tag, simple_value=float(v))
                                    for tag, v in values.items()])
        return tb.Event(wall_time=time.time(), step=step, summary=summary).SerializeToString()

    def _open(self, restart_at: int | None = None) -> None:
        """This session's event file, named as TensorBoard's writers name theirs, opened with
        the file-version event (and the restart marker of a resumed session)."""
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILE_NUMBER)}")
        self.path = self.dir / name
        try:
            self.dir.mkdir(exist_ok=True)
            self._file = open(self.path, "xb")  # noqa: SIM115 - kept open for the session
        except OSError as e:
            raise disk_error(e, self.path) from None
        self._writer = self.tb.RecordWriter(self._file)
        Event, now = self.tb.Event, time.time()
        self._write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        if restart_at is not None:
            start = self.tb.SessionLog(status=self.tb.SessionLog.START)
            self._write(Event(wall_time=now, step=restart_at, session_log=start)
                        .SerializeToString())

    def _write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
            return
        try:
            self._writer.write(data)
            self._file.flush()
        except OSError as e:
            raise disk_error(e, self.path) from None

    def _sync(self) -> None:
        try:
            os.fsync(self._file.fileno())
        except OSError as e:
            raise disk_error(e, self.path) from None

    def _plan_cut(self, step: int) -> list[tuple[Path, bytes | None]]:
        """What cutting every event file already in the directory to the events of steps <=
        `step` takes (a torn last record goes too): (path, its new bytes, or None: remove it,
        as it holds no data then), read and checked now, before a resumed session's first
        commit, so that what `_apply` does after it cannot fail on what is there. A
        `tensorboard` that is no directory, cannot be written, or holds a file that is not an
        event file is one MinigptError line, and nothing is changed."""
        tb, where = self.tb, self.dir
        if os.path.lexists(where) and not where.is_dir():
            raise MinigptError(f"{where} is not a directory, so the TensorBoard event files "
                               "cannot go there; move it away or set train.tensorboard: false")
        if not os.access(where if where.is_dir() else where.parent, os.W_OK | os.X_OK):
            raise MinigptError(f"cannot write {where} (permission denied); make it writable "
                               "or set train.tensorboard: false")
        plan = []
        for path in sorted(where.glob("*tfevents*")) if where.is_dir() else []:
            data = read_file(path, LARGE_CAP)
            records = _records(data)
            try:
                events = [tb.Event.FromString(r) for r in records]
            except Exception:  # noqa: BLE001 - protobuf's DecodeError (its module varies)
                events = None
            if events is None or any(e.wall_time <= 0 for e in events):
                raise MinigptError(f"{path} is not a TensorBoard event file (a record that is "
                                   "not an event); move it out of the run directory")
            keep = [r for r, e in zip(records, events, strict=True) if e.step <= step]
            if len(keep) == len(records) and len(data) == _size(records):
                continue
            if not any(tb.Event.FromString(r).HasField("summary") for r in keep):
                plan.append((path, None))
                continue
            buf = io.BytesIO()
            writer = tb.RecordWriter(buf)
            for r in keep:
                writer.write(r)
            plan.append((path, buf.getvalue()))
        return plan

    def _apply(self, plan: list[tuple[Path, bytes | None]]) -> None:
        for path, data in plan:
            if data is not None:
                atomic_write_bytes(path, data)
                continue
            try:
                path.unlink()
            except OSError as e:
                raise disk_error(e, path) from None


def _records(data: bytes) -> list[bytes]:
    """The records of a TFRecord file's bytes (8-byte length, 4-byte CRC, the record, 4-byte
    CRC each); a last record cut short (a killed writer) is left out."""
    out, at = [], 0
    while at + 12 <= len(data):
        n = int.from_bytes(data[at: at + 8], "little")
        if at + 16 + n > len(data):
            break
        out.append(data[at + 12: at + 12 + n])
        at += 16 + n
    return out


def _size(records: list[bytes]) -> int:
    """Bytes a TFRecord file of `records` holds: a 12-byte header and a 4-byte footer each."""
    return sum(len(r) + 16 for r in records)
