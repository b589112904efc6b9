"""`train.tensorboard: true`: TensorBoard event files under <run>/tensorboard/, read back with
TensorBoard's own reader (EventAccumulator) and compared with metrics.jsonl; a resumed run
holds each tag's steps once, as an uninterrupted run does, even after a session that died past
its last checkpoint; a missing `tensorboard` package is refused in one line before anything
is made; with the option off the package is never imported."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kill_trials, tiny_train_sets

from minigpt.config import ConfigError, load_config
from minigpt.events import StepEvent
from minigpt.paths import PROJECT_ROOT
from minigpt.train import train

# Trainings here draw no pictures (conftest.pictures_off: no test here reads curves.png or
# heads.png, and drawing is most of a tiny run's CPU time).
pytestmark = pytest.mark.usefixtures("no_pictures")

MINIGPT = shutil.which("minigpt")
# Tags whose values are the same in two runs of the same config (tokens/s is a timing).
DETERMINISTIC = re.compile(r"^(train/(loss|lr|grad_norm)|val/.*|heads/.*)$")


def accumulator(run: Path):
    """TensorBoard's own reader over the run's event files, loaded."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = ea.EventAccumulator(str(run / "tensorboard"), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    return acc


def board(run: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows the run."""
    acc = accumulator(run)
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def raw_points(run: Path) -> list[tuple[str, int]]:
    """(tag, step) of every scalar in every event file of the run, as written: no reader's
    purging in between (a duplicate left on disk shows here)."""
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    out = []
    for path in sorted((run / "tensorboard").iterdir()):
        for event in loader.EventFileLoader(str(path)).Load():
            out += [(v.tag, event.step) for v in event.summary.value]
    return out


def f32(x: float) -> float:
    """`x` as TensorBoard stores a scalar (float32)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def expected(run: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} computed here from the run's metrics.jsonl: the documented
    mapping of records to tags, heads as the best score of each layer."""
    keys = {"train": {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                      "tokens_per_s": "train/tokens_per_s"},
            "eval": {"val_loss": "val/loss", "val_bpb": "val/bits_per_byte"}}
    out: dict[str, list] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "heads":
            values = {f"heads/{s}/layer{la}": max(v for v in row if v is not None)
                      for s, rows in r["scores"].items()
                      for la, row in enumerate(rows)}
        else:
            values = {tag: r[k] for k, tag in keys[r["kind"]].items()}
        for tag, v in values.items():
            out.setdefault(tag, []).append((r["step"], f32(v)))
    return out


def installed(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MINIGPT, *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=600, env=env)


def with_sets(sets: list[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


@pytest.mark.slow  # in-process: test_resume_after_a_session_died_past_its_checkpoint and below
def test_tensorboard_run_and_resume_through_the_installed_command(tmp_path):
    """`minigpt train --set train.tensorboard=true`: TensorBoard sees every scalar metrics.jsonl
    has, with its values; 3 steps + `--resume` to 6 show the same steps, once each, and the same
    values as 6 steps straight (CPU: bit for bit; the straight run through the library),
    written as one event file per session."""
    pytest.importorskip("tensorboard")
    sets = with_sets(tiny_train_sets(tmp_path, **{"train.tensorboard": "true"}))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(load_config(None, [*tiny_train_sets(tmp_path), "train.tensorboard=true"]), straight)
    r = installed("train", *sets, "--out", str(resumed), "--stop-after", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [s for s, _ in board(resumed)["train/loss"]] == [1, 2, 3]
    r = installed("train", *sets, "--out", str(resumed), "--resume", cwd=tmp_path)
    assert r.returncode == 0 and "from step 3" in r.stderr, r.stderr

    a, b = board(straight), board(resumed)
    assert a == expected(straight) and b == expected(resumed)  # metrics.jsonl's values
    assert set(a) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                      "val/loss", "val/bits_per_byte", "heads/induction/layer0",
                      "heads/previous/layer0", "heads/duplicate/layer0", "heads/first/layer0"}
    assert [s for s, _ in a["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in a["val/loss"]] == [s for s, _ in a["heads/induction/layer0"]] == [3, 6]
    assert {t: [s for s, _ in v] for t, v in a.items()} == \
        {t: [s for s, _ in v] for t, v in b.items()}
    assert {t: v for t, v in a.items() if DETERMINISTIC.match(t)} == \
        {t: v for t, v in b.items() if DETERMINISTIC.match(t)}
    points = raw_points(resumed)
    assert len(points) == len(set(points))  # no step written twice, even before a reader
    assert len(list((resumed / "tensorboard").iterdir())) == 2  # one event file per session
    # The docs name every tag (docs/cli.md, "TensorBoard").
    section = (PROJECT_ROOT / "docs" / "cli.md").read_text().split("### TensorBoard")[1]
    for tag in a:
        assert f"`{re.sub(r'layer0$', 'layer<i>', tag)}`" in section, tag


def test_the_docs_name_every_tag_a_run_writes(tmp_path):
    """docs/cli.md ("TensorBoard") names every tag a run writes, and the run writes each
    scalar metrics.jsonl has (in-process; the installed command's run: the slow tier)."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    train(load_config(None, [*tiny_train_sets(tmp_path), "train.tensorboard=true"]), run)
    tags = board(run)
    assert tags == expected(run)
    section = (PROJECT_ROOT / "docs" / "cli.md").read_text().split("### TensorBoard")[1]
    for tag in tags:
        assert f"`{re.sub(r'layer0$', 'layer<i>', tag)}`" in section, tag


class Crash(Exception):
    """Stands for a session dying (kill -9, power cut) right after an event."""


def crash_after(step: int):
    def on_event(event):
        if isinstance(event, StepEvent) and event.step == step:
            raise Crash
    return on_event


def files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "tensorboard").iterdir())}


def test_resume_after_a_session_died_past_its_checkpoint(tmp_path):
    """A session dies at step 5 with step 3 committed: its event file holds steps 4 and 5 and a
    torn last record. A resume that dies again before its first commit changes no byte under
    tensorboard/. The resume that commits cuts what the dead sessions wrote past step 3; the
    run then shows every step once, with the values of an uninterrupted run."""
    pytest.importorskip("tensorboard")
    cfg = load_config(None, tiny_train_sets(tmp_path, **{"train.tensorboard": "true"}))
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(cfg, straight)
    with pytest.raises(Crash):
        train(cfg, run, on_event=crash_after(5))
    assert [s for s, _ in board(run)["train/loss"]] == [1, 2, 3, 4, 5]
    (first,) = (run / "tensorboard").iterdir()
    with first.open("ab") as fh:
        fh.write(b"\x2a\x00\x00\x00\x00\x00\x00\x00\x01\x02")  # a record cut short by the kill

    before = files(run)
    with pytest.raises(Crash):
        train(cfg, run, resume=True, on_event=crash_after(5))  # dies before committing step 6
    assert files(run) == before

    train(cfg, run, resume=True)
    points = raw_points(run)
    assert len(points) == len(set(points))
    steps = sorted(s for t, s in points if t == "train/loss")
    assert steps == [1, 2, 3, 4, 5, 6]
    assert board(run) == expected(run)
    a, b = board(straight), board(run)
    assert {t: v for t, v in a.items() if DETERMINISTIC.match(t)} == \
        {t: v for t, v in b.items() if DETERMINISTIC.match(t)}
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    kept = list(loader.RawEventFileLoader(str(first)).Load())
    assert first.stat().st_size == sum(len(x) + 16 for x in kept)  # the torn record is gone


def test_turned_on_at_resume_logs_from_the_resumed_step(tmp_path):
    """`--resume --set train.tensorboard=true` on a run trained without it: the event files
    start after the resumed step (nothing is made up for the steps before)."""
    pytest.importorskip("tensorboard")
    sets = tiny_train_sets(tmp_path)
    run = tmp_path / "run"
    train(load_config(None, sets), run, stop_after=3)
    assert not (run / "tensorboard").exists()
    train(load_config(None, [*sets, "train.tensorboard=true"]), run, resume=True)
    assert [s for s, _ in board(run)["train/loss"]] == [4, 5, 6]


def shadowed_tensorboard(tmp_path: Path) -> dict:
    """An environment in which `import tensorboard` fails as on a machine without it."""
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'tensorboard'\", name='tensorboard')\n")
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.mark.slow  # in-process: test_the_library_refuses_the_same_way_and_trains_without_...
def test_without_the_package_the_option_is_refused_before_anything_is_made(tmp_path):
    """No tensorboard installed: `--set train.tensorboard=true` is one error line naming the
    extra, exit 2, before the run directory or the token cache exist."""
    env = shadowed_tensorboard(tmp_path)
    sets = with_sets(tiny_train_sets(tmp_path))
    run = tmp_path / "run"
    r = installed("train", *sets, "--set", "train.tensorboard=true", "--out", str(run),
                  cwd=tmp_path, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [(
        "error: train.tensorboard: true needs the tensorboard package, the optional extra: pip "
        "install 'minigpt-lab[tensorboard]' (or set train.tensorboard: false)")]
    assert not run.exists() and not (tmp_path / "cache").exists()  # nothing made, nothing trained


def test_the_library_refuses_the_same_way_and_trains_without_it_when_off(tmp_path, monkeypatch):
    """`train()` itself: the missing package is a ConfigError before the run directory exists;
    with the option off the run trains (the package is imported only when asked for)."""
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now fails
    cfg = load_config(None, tiny_train_sets(tmp_path, **{"train.tensorboard": "true"}))
    with pytest.raises(ConfigError, match=r"minigpt-lab\[tensorboard\]"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    cfg.train.tensorboard, cfg.train.max_steps = False, 2
    assert train(cfg, tmp_path / "run").step == 2
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_resume_of_a_run_that_saved_nothing_drops_what_it_logged(tmp_path):
    """A session dies at step 2, before its first checkpoint: `--resume` starts from step 0 and
    its first commit removes the dead session's event file (it held only uncommitted steps)."""
    pytest.importorskip("tensorboard")
    cfg = load_config(None, tiny_train_sets(tmp_path, **{"train.tensorboard": "true"}))
    run = tmp_path / "run"
    with pytest.raises(Crash):
        train(cfg, run, on_event=crash_after(2))
    (dead,) = (run / "tensorboard").iterdir()
    train(cfg, run, resume=True)
    assert dead.name not in files(run) and len(files(run)) == 1
    assert board(run) == expected(run)
    assert [s for s, _ in board(run)["train/loss"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_kill_9_during_a_save_then_resume(tmp_path):
    """The installed command SIGKILLs itself while saving step 4 (step 2 committed; TensorBoard
    already has steps 3 and 4): `--resume` finishes the run, and TensorBoard shows what a
    straight run shows."""
    pytest.importorskip("tensorboard")
    over = {"train.tensorboard": "true", "train.checkpoint_interval": 2}
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(load_config(None, tiny_train_sets(tmp_path, **over)), straight)
    sets = with_sets(tiny_train_sets(tmp_path, **over))
    cmd = kill_trials().minigpt_command("train", "--out", str(run), *sets, die_during_save=4)
    killed = subprocess.run(cmd, cwd=tmp_path, capture_output=True, check=False, timeout=600)
    assert killed.returncode == -signal.SIGKILL
    assert [s for s, _ in board(run)["train/loss"]] == [1, 2, 3, 4]
    r = installed("train", "--out", str(run), "--resume", cwd=tmp_path)
    assert r.returncode == 0 and "from step 2" in r.stderr, r.stderr
    points = raw_points(run)
    assert len(points) == len(set(points))
    a, b = board(straight), board(run)
    assert b == expected(run)
    assert {t: v for t, v in a.items() if DETERMINISTIC.match(t)} == \
        {t: v for t, v in b.items() if DETERMINISTIC.match(t)}


# --------------------------------------------------------------------------------------------
# Reading event files as TensorBoard does (issue 39): both CRCs checked, a record's length
# bounded before it is read, one record held at a time; a file named *tfevents* that is not
# an event file is refused in one line and left as it was, never cut or removed.


def test_the_crc_the_scan_checks_gives_the_known_check_values():
    """The scan checks records with the tensorboard package's own masked CRC-32C (its writer's):
    its CRC-32C gives the known check values, and the mask is TFRecord's."""
    pywrap = pytest.importorskip("tensorboard.compat.tensorflow_stub.pywrap_tensorflow")
    crc32c = pywrap.crc32c
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 (iSCSI), appendix B.4
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    rng = random.Random(0)
    for n in (0, 1, 7, 8, 12, 100, 4099):
        data = rng.randbytes(n)
        c = crc32c(data)
        assert pywrap.masked_crc32c(data) == (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tensorboard_written(logdir: Path, steps: range) -> Path:
    """An event file written by the `tensorboard` package's own writer: one scalar per step."""
    efw = pytest.importorskip("tensorboard.summary.writer.event_file_writer")
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    writer = efw.EventFileWriter(str(logdir))
    for step in steps:
        summary = Summary(value=[Summary.Value(tag="x/loss", simple_value=1.0 / step)])
        writer.add_event(Event(wall_time=1.0e9 + step, step=step, summary=summary))
    writer.close()
    (path,) = logdir.glob("*tfevents*")
    return path


def session_log(run: Path):
    """The TensorBoard consumer of a resumed session of `run` (nothing trained)."""
    from minigpt.train.tensorboard import TensorBoardLog, require_tensorboard

    pytest.importorskip("tensorboard")
    return TensorBoardLog(run, require_tensorboard(), fresh=False)


def test_files_the_tensorboard_package_writes_are_read_and_cut_record_by_record(tmp_path):
    """The records `_scan` reads from a file TensorBoard wrote are TensorBoard's own reader's;
    cut to step 5 (a resume from step 5), TensorBoard reads steps 1..5 back, every value
    kept."""
    from minigpt.train.tensorboard import _scan

    path = tensorboard_written(tmp_path / "tensorboard", range(1, 11))
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    with path.open("rb") as fh:
        mine = [data for _, data in _scan(fh, path, path.stat().st_size)]
    assert mine == list(loader.RawEventFileLoader(str(path)).Load()) and len(mine) == 11
    log = session_log(tmp_path)
    log._apply(log._plan_cut(5))
    from tensorboard.compat.proto.event_pb2 import Event

    events = [Event.FromString(r) for r in loader.RawEventFileLoader(str(path)).Load()]
    assert [(e.step, e.summary.value[0].simple_value) for e in events if e.summary.value] == \
        [(s, pytest.approx(1.0 / s)) for s in range(1, 6)]
    assert events[0].file_version == "brain.Event:2"


def _record(data: bytes, *, crc_ok: bool = True) -> bytes:
    """One TFRecord framing `data`, with its two masked CRC-32Cs (the data's wrong if not
    `crc_ok`)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    head = len(data).to_bytes(8, "little")
    tail = masked_crc32c(data) ^ (0 if crc_ok else 1)
    return head + masked_crc32c(head).to_bytes(4, "little") + data + tail.to_bytes(4, "little")


def _not_event_files() -> dict[str, bytes]:
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    good = _record(Event(wall_time=1.0e9, file_version="brain.Event:2").SerializeToString())
    huge = (1 << 40).to_bytes(8, "little")
    return {
        "note": b"my notes about this run\n",
        "zeros": bytes(1 << 20),
        "random": random.Random(1).randbytes(4096),
        "short": b"abc",
        "not-an-event": _record(b"not an event"),
        "data-crc-fails": good + _record(b"\x08\x01", crc_ok=False),
        "claims-a-terabyte": good + huge + masked_crc32c(huge).to_bytes(4, "little") + b"x" * 64,
        "first-record-torn": good[:-3],
    }


@pytest.mark.parametrize("name", ["note", "zeros", "random", "short", "not-an-event",
                                  "data-crc-fails", "claims-a-terabyte", "first-record-torn"])
def test_a_file_that_is_not_an_event_file_is_refused_and_left_as_it_was(tmp_path, name):
    """A resume refuses (one MinigptError line naming the file, before its first commit) a
    `*tfevents*` file that is a text note, zeros, random bytes, a record whose data CRC
    fails, a length past the bound, a payload that is no event: nothing is cut or removed (the
    old reader deleted a note and read 1 GiB of zeros into 6 GB of memory)."""
    from minigpt.errors import MinigptError

    pytest.importorskip("tensorboard")
    where = tmp_path / "tensorboard"
    mine = tensorboard_written(where, range(1, 4))
    path = where / f"events.out.tfevents.{name}"
    path.write_bytes(_not_event_files()[name])
    before = files(tmp_path)
    with pytest.raises(MinigptError, match="is not a TensorBoard event file") as e:
        session_log(tmp_path)._plan_cut(1)
    assert str(path) in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300
    assert files(tmp_path) == before and mine.exists()


def test_zeros_and_a_huge_claimed_length_are_refused_after_12_bytes(tmp_path, monkeypatch):
    """A 1 GiB file of zeros (sparse: no disk) is refused after its first 12 bytes (the
    header CRC), and a header claiming 2^40 bytes with a valid CRC before any of them is
    read: what is read never depends on what a length claims."""
    import minigpt.train.tensorboard as tbmod
    from minigpt.errors import MinigptError

    pywrap = pytest.importorskip("tensorboard.compat.tensorflow_stub.pywrap_tensorflow")
    where = tmp_path / "tensorboard"
    where.mkdir()
    zeros = where / "events.out.tfevents.zeros"
    with zeros.open("wb") as fh:
        fh.truncate(1 << 30)
    read = []

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def read(self, n=-1):
            data = self.fh.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(tbmod, "open_file", lambda p: Counting(open(p, "rb")))  # noqa: SIM115
    with pytest.raises(MinigptError, match="header at byte 0 fails its CRC"):
        session_log(tmp_path)._plan_cut(1)
    assert sum(read) == 12
    zeros.unlink()
    huge = (1 << 40).to_bytes(8, "little")
    (where / "events.out.tfevents.huge").write_bytes(
        huge + pywrap.masked_crc32c(huge).to_bytes(4, "little") + bytes(1 << 16))
    read.clear()
    with pytest.raises(MinigptError, match="claims 1,099,511,627,776 bytes"):
        session_log(tmp_path)._plan_cut(1)
    assert sum(read) == 12


def test_a_record_cut_short_at_the_end_is_dropped_as_tensorboard_drops_it(tmp_path):
    """What a killed writer leaves at the end (a whole header whose record runs past the end
    of the file) is dropped on resume; every whole record before it is kept byte for byte."""
    pytest.importorskip("tensorboard")
    path = tensorboard_written(tmp_path / "tensorboard", range(1, 4))
    whole = path.read_bytes()
    from tensorboard.compat.proto.event_pb2 import Event

    torn = _record(Event(wall_time=2.0e9, step=2).SerializeToString())[:-6]
    path.write_bytes(whole + torn)
    log = session_log(tmp_path)
    log._apply(log._plan_cut(3))
    assert path.read_bytes() == whole
