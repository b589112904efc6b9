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
the directory and every file named `*tfevents*` in it are read as TensorBoard reads them
(each record's length and data checked against their CRC-32C, a length bounded before it is
read, one record held at a time), and the cuts below planned as byte ranges: a `tensorboard`
that is a file or cannot be written, or a file that is not an event file (a note, zeros,
random bytes, a record that fails its CRC or is no event), is one line with nothing changed;
a file minigpt cannot read is never cut or removed. At its first CheckpointEvent the run's
earlier event files are cut to the events of the steps up to the resumed step k (each file
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

import itertools
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from minigpt import display
from minigpt.config import TrainConfig
from minigpt.errors import ConfigError, MinigptError
from minigpt.events import CheckpointEvent, DoneEvent, StartEvent
from minigpt.files import atomic_file, disk_error, open_file
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

    def _plan_cut(self, step: int) -> list[_Cut]:
        """What cutting every event file already in the directory to the events of steps <=
        `step` takes (a torn last record goes too), read and checked now, before a resumed
        session's first commit, so that what `_apply` does after it cannot fail on what is
        there. A `tensorboard` that is no directory, cannot be written, or holds a file named
        `*tfevents*` that is not an event file (`_scan`) is one MinigptError line, and nothing
        is changed: a file minigpt cannot read as TensorBoard does is never cut or removed."""
        where = self.dir
        if os.path.lexists(where) and not where.is_dir():
            raise MinigptError(f"{where} is not a directory, so the TensorBoard event files "
                               "cannot go there; move it away or set train.tensorboard: false")
        if not os.access(where if where.is_dir() else where.parent, os.W_OK | os.X_OK):
            raise MinigptError(f"cannot write {where} (permission denied); make it writable "
                               "or set train.tensorboard: false")
        plan = []
        for path in sorted(where.glob("*tfevents*")) if where.is_dir() else []:
            cut = self._plan_file(path, step)
            if cut is not None:
                plan.append(cut)
        return plan

    def _plan_file(self, path: Path, step: int) -> _Cut | None:
        """The cut of one event file to the events of steps <= `step` (None: nothing to cut),
        holding the byte ranges of the records kept, never the records themselves."""
        keep: list[list[int]] = []
        kept_data = complete = False
        with open_file(path) as fh:
            st = os.fstat(fh.fileno())
            end = 0
            for at, data in _scan(fh, path, st.st_size):
                end = at + len(data) + 16
                try:
                    event = self.tb.Event.FromString(data)
                except Exception:  # noqa: BLE001 - protobuf's DecodeError (its module varies)
                    event = None
                if event is None or event.wall_time <= 0:
                    raise _not_events(path, f"the record at byte {at} is not an event")
                if event.step > step:
                    continue
                kept_data = kept_data or event.HasField("summary")
                if keep and keep[-1][1] == at:
                    keep[-1][1] = end
                elif len(keep) < MAX_PIECES:
                    keep.append([at, end])
                else:  # steps that go back and forth, record by record: no writer does that
                    raise _not_events(path, f"the records kept are in more than {MAX_PIECES:,} "
                                      "pieces")
            complete = end == st.st_size
        if st.st_size == 0 or (complete and keep == [[0, st.st_size]]):
            return None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        return _Cut(path, [tuple(r) for r in keep] if kept_data else None, stamp)

    def _apply(self, plan: list[_Cut]) -> None:
        for cut in plan:
            if cut.keep is not None:
                _rewrite(cut)
                continue
            try:
                cut.path.unlink()
            except OSError as e:
                raise disk_error(e, cut.path) from None


# -- reading event files as TensorBoard does -----------------------------------------------------
# A TFRecord file is a sequence of records, each: uint64 length (little-endian), the masked
# CRC-32C of those 8 bytes (uint32), `length` bytes of data (one serialized Event), the masked
# CRC-32C of the data. Both CRCs are checked, and a length is bounded before anything of that
# length is read: a file of zeros fails the first header's CRC after 12 bytes.
#
# The framing is the `tensorboard` package's: its RecordWriter writes every record and its
# `masked_crc32c` checks them here. The scan itself stays minigpt's, because a resume needs
# what the package's reader (PyRecordReader_New) does not give: each record's byte offset (a
# cut copies byte ranges), a torn last record told apart from a damaged file, and a length
# refused before it is read (the package reads whatever a header claims, up to the file's end).

MAX_RECORD = 64 << 20  # bytes one record may claim (minigpt's are ~100; an image a few MB)
MAX_PIECES = 1 << 16  # runs of kept records a cut may hold (a writer's steps rise: one run)
_COPY_CHUNK = 1 << 20


def _scan(fh, path: Path, size: int):
    """(offset, data) of each record of the open event file `fh` of `size` bytes, checked as
    TensorBoard's reader checks them, at most MAX_RECORD bytes held. A last record cut short
    (a killed writer: a partial header, or a header whose record runs past the end) ends the
    scan; a file with no whole record, a CRC that does not match, or a length past
    MAX_RECORD is a MinigptError naming the file and the byte."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    at = 0
    while at < size:
        header = fh.read(12)
        if len(header) < 12 and at > 0:
            return  # a torn header
        if len(header) < 12 or masked_crc32c(header[:8]) != int.from_bytes(header[8:],
                                                                             "little"):
            raise _not_events(path, f"the record header at byte {at} fails its CRC")
        n = int.from_bytes(header[:8], "little")
        if n > MAX_RECORD:
            raise _not_events(path, f"the record at byte {at} claims {n:,} bytes, more than "
                              f"the {display.size(MAX_RECORD)} minigpt reads")
        if at + 16 + n > size:
            if at > 0:
                return  # a torn record
            raise _not_events(path, "its first record runs past the end of the file")
        data, footer = fh.read(n), fh.read(4)
        if len(footer) < 4 or masked_crc32c(data) != int.from_bytes(footer, "little"):
            raise _not_events(path, f"the record at byte {at} fails its data CRC")
        yield at, data
        at += 16 + n


def _not_events(path: Path, why: str) -> MinigptError:
    return MinigptError(f"{path} is not a TensorBoard event file ({why}); move it out of the "
                        "run directory (nothing was changed)")


@dataclass
class _Cut:
    """One event file cut on resume: the byte ranges of the records kept, or None: remove it
    (no data is left); `stamp` (inode, size, mtime) is what the file was when checked."""

    path: Path
    keep: list[tuple[int, int]] | None
    stamp: tuple[int, int, int]


def _rewrite(cut: _Cut) -> None:
    """The file of `cut` replaced (atomically) by its kept records, copied from it a chunk at
    a time; MinigptError if the file changed since it was checked."""
    with open_file(cut.path) as src:
        st = os.fstat(src.fileno())
        if (st.st_ino, st.st_size, st.st_mtime_ns) != cut.stamp:
            raise MinigptError(f"{cut.path} changed while the resume ran; nothing of it was "
                               "cut: check what writes there")
        with atomic_file(cut.path) as out:
            for start, end in cut.keep:
                src.seek(start)
                while start < end:
                    chunk = src.read(min(_COPY_CHUNK, end - start))
                    if not chunk:  # shorter than when checked: the stamp would have changed
                        raise MinigptError(f"{cut.path} ended early while being cut")
                    out.write(chunk)
                    start += len(chunk)
