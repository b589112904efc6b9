"""A run's records are append-only for the tool (issue 50): `train --resume` keeps every line
of metrics.jsonl it cannot read where it stands, byte for byte (a damaged line, a note after
the last record, bytes that are not UTF-8, a file of random bytes) and says so in one note;
only the stopped session's records after the resumed step are replaced."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import pictures_off
from test_train import tiny_sets

from minigpt.config import load_config
from minigpt.events import UnreadLinesKept
from minigpt.run.metrics import read_metrics
from minigpt.run.resume import resume_config
from minigpt.train import train


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A tiny run stopped after step 4 (committed at step 3: records 4 are replayed)."""
    tmp = tmp_path_factory.mktemp("kept")
    with pictures_off():
        train(load_config(None, tiny_sets(tmp)), tmp / "run", stop_after=4)
    return tmp / "run"


def _damage(metrics: Path, how: str) -> list[bytes]:
    """Damage `metrics` as the issue did; the lines that are not records it now holds."""
    lines = metrics.read_bytes().split(b"\n")
    if how == "not-json":
        bad = [b"not json {"]
        lines.insert(2, bad[0])
    elif how == "not-utf8":
        bad = [b'{"kind": "note", "text": "caf\xe9 \xff"}']
        lines.insert(1, bad[0])
    elif how == "note-after":
        bad = [b"# note: lr looked too high here"]
        lines = [x for x in lines if x] + bad
    else:  # random bytes for the whole file
        data = random.Random(5).randbytes(4096)
        metrics.write_bytes(data)
        return [x for x in data.split(b"\n") if x.strip()]
    metrics.write_bytes(b"\n".join(lines))
    return bad


def _resume(run: Path, events: list | None = None) -> None:
    with pictures_off():
        train(resume_config(run, []), run, resume=True,
              on_event=(events.append if events is not None else None) or (lambda e: None))


@pytest.mark.parametrize("how", ["not-json", "not-utf8", "note-after", "random"])
def test_resume_keeps_every_line_it_cannot_read(stopped, tmp_path, how):
    run = Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))
    metrics = run / "metrics.jsonl"
    bad = _damage(metrics, how)
    events: list = []
    _resume(run, events)
    after = metrics.read_bytes().split(b"\n")
    # every line it could not read is still there, byte for byte, in its order
    kept = [x for x in after if x in bad]
    assert kept == bad, how
    notes = [e for e in events if isinstance(e, UnreadLinesKept)]
    assert len(notes) == 1 and notes[0].lines == len(bad) and notes[0].path == metrics
    records, skipped = read_metrics(metrics)
    assert skipped == len(bad)
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    assert steps[-1] == 6 and steps == sorted(steps) and len(steps) == len(set(steps)) or \
        how == "random"  # random bytes held no record: the resumed session's steps only


def test_a_clean_log_gets_no_note(stopped, tmp_path):
    run = Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))
    events: list = []
    _resume(run, events)
    assert not [e for e in events if isinstance(e, UnreadLinesKept)]
    assert read_metrics(run / "metrics.jsonl")[1] == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["not-json", "not-utf8", "note-after", "random"])
def test_installed_resume_keeps_a_damaged_line_and_says_so(stopped, tmp_path, how):
    """Issue 50's cause 3, each way it was seen, as typed: `train --resume` keeps every line
    it cannot read, byte for byte, and says so in one note naming the file."""
    run = Path(shutil.copytree(stopped, tmp_path / "run", symlinks=True))
    metrics = run / "metrics.jsonl"
    bad = _damage(metrics, how)
    r = subprocess.run([shutil.which("minigpt"), "train", "--out", str(run), "--resume"],
                       capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert [x for x in metrics.read_bytes().split(b"\n") if x in bad] == bad, how
    kept = f"kept {len(bad)} line{'s' if len(bad) != 1 else ''} "
    notes = [x for x in r.stderr.splitlines() if x.startswith("note: ") and kept in x]
    assert len(notes) == 1 and str(metrics) in notes[0], r.stderr
