"""`minigpt runs` (minigpt.run.listing): where each column comes from, every status, damaged
metrics, bad input; through the library and typer's CliRunner (the installed command in
test_cli_real.py). Listing never changes a file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import error_line
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.errors import MinigptError
from minigpt.run import load_run
from minigpt.run.listing import list_runs, read_row
from minigpt.run.lock import RunLock


def tree(root: Path) -> dict[str, tuple]:
    """Every path under root with its bytes (or link target) and mtime: listing changes none."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        body = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else b"")
        out[str(p.relative_to(root))] = (body, st.st_mtime_ns)
    return out


@pytest.fixture
def runs(trained_runs, tmp_path) -> Path:
    """A runs/ directory with a run in every state, copied from the session's trained runs."""
    root = tmp_path / "runs"
    root.mkdir()
    for name in ("finished", "stopped"):
        shutil.copytree(trained_runs[name]["dir"], root / name, symlinks=True)
    shutil.copytree(root / "stopped", root / "killed", symlinks=True)
    (root / "killed" / "summary.md").unlink()  # kill -9: no summary written
    shutil.copytree(root / "stopped", root / "training", symlinks=True)
    (root / "nothing-saved").mkdir()
    RunLock(root / "nothing-saved").acquire().release()
    shutil.copytree(root / "finished", root / "damaged", symlinks=True)
    (root / "damaged" / "checkpoints" / "latest").unlink()
    os.symlink("../../elsewhere", root / "damaged" / "checkpoints" / "latest")
    (root / "not-a-run").mkdir()  # someone's notes: not listed
    (root / "not-a-run" / "notes.txt").write_text("mine\n")
    return root


def test_every_status_and_where_the_columns_come_from(runs, trained_runs):
    with RunLock(runs / "training"):  # a trainer at work
        before = tree(runs)
        rows = {r.name: r for r in list_runs(runs)}
        assert tree(runs) == before  # the probe wrote no file, changed no time stamp
    assert {n: r.status for n, r in rows.items()} == {
        "damaged": "damaged", "finished": "finished", "killed": "killed",
        "nothing-saved": "no checkpoint", "stopped": "stopped", "training": "training"}
    done = trained_runs["finished"]["done"]
    fin = rows["finished"]
    assert (fin.step, fin.max_steps) == (6, 6)
    assert fin.best_val_bpb == pytest.approx(done.best_val_bpb, rel=1e-12)
    assert fin.params == load_run(runs / "finished").model.num_params()["total"] == done.params
    last = json.loads((runs / "finished" / "metrics.jsonl").read_text().splitlines()[-1])
    assert fin.wall_time == last["elapsed"]
    assert fin.last_change == max(p.lstat().st_mtime for p in (
        runs / "finished", runs / "finished" / "metrics.jsonl", runs / "finished" / "summary.md",
        runs / "finished" / "config.yaml", runs / "finished" / "checkpoints" / "latest"))
    assert (rows["stopped"].step, rows["stopped"].max_steps) == (4, 6)
    empty = rows["nothing-saved"]
    assert (empty.step, empty.max_steps, empty.params, empty.best_val_bpb) == (0, None, None,
                                                                                None)


def test_a_damaged_metrics_log_is_read_around_and_counted(runs):
    log = runs / "finished" / "metrics.jsonl"
    good = read_row(runs / "finished")
    lines = log.read_text().splitlines()
    log.write_text("\n".join(["garbage{", *lines[:3], "\x00\x01", *lines[3:], '{"kind": "tr'])
                   + "\n")
    row = read_row(runs / "finished")
    assert row.skipped_lines == 3
    assert (row.step, row.best_val_bpb, row.wall_time) == (good.step, good.best_val_bpb,
                                                           good.wall_time)
    r = CliRunner().invoke(app, ["runs", str(runs / "finished")])
    assert r.exit_code == 0, r.stderr
    assert r.stderr.strip() == f"note: {log}: skipped 3 damaged lines"


def test_runs_table_and_json(runs):
    r = CliRunner().invoke(app, ["runs", str(runs)])
    assert r.exit_code == 0, r.stderr
    header = next(x for x in r.stdout.splitlines() if "name" in x)
    for column in ("name", "status", "step", "val bits/byte: best (step), last", "parameters",
                   "wall time", "last change"):
        assert column in header
    finished = next(x for x in r.stdout.splitlines() if " finished " in x)
    row = read_row(runs / "finished")
    assert "6/6" in finished and f"{row.best_val_bpb:.4f} ({row.best_step})" in finished
    assert f"{row.params:,}" in finished
    assert "not-a-run" not in r.stdout
    j = CliRunner().invoke(app, ["runs", str(runs), "--json"])
    doc = json.loads(j.stdout)
    assert [x["name"] for x in doc["runs"]] == sorted(
        ["damaged", "finished", "killed", "nothing-saved", "stopped", "training"])
    assert {x["name"]: x["status"] for x in doc["runs"]}["training"] == "stopped"  # unlocked


def test_default_directory_is_runs_under_the_working_directory(runs, monkeypatch):
    monkeypatch.chdir(runs.parent)
    r = CliRunner().invoke(app, ["runs", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["directory"] == "runs"


@pytest.mark.parametrize("what", ["empty", "missing", "a-file"])
def test_no_runs_is_one_line_saying_where_it_looked(tmp_path, what):
    target = tmp_path / "there"
    if what == "empty":
        target.mkdir()
        (target / "notes").mkdir()
    elif what == "a-file":
        target.write_text("x")
    with pytest.raises(MinigptError):
        list_runs(target)
    r = CliRunner().invoke(app, ["runs", str(target)])
    line = error_line(r)
    assert str(target) in line
    if what == "empty":
        assert "no runs under" in line and "config.yaml" in line


# --------------------------------------------------------------------------------------------
# Runs from elsewhere (issue 26): a metrics.jsonl or train.lock that is a FIFO, /dev/zero or a
# directory, a run or a log that cannot be read. The listing lists every other run as usual
# and marks the bad one `unreadable`, with a note naming the file; through the installed
# command, time and memory capped (a hang or a runaway read fails the test, not the machine).


def test_a_run_with_files_it_cannot_read_is_marked_and_the_others_listed(tmp_path):
    from cli_world import run_minigpt, unprivileged_prefix
    from conftest import in_process, make_run

    prefix = unprivileged_prefix()
    root = tmp_path / "runs"
    root.mkdir(parents=True)
    good = make_run(root / "good", top_files=True)
    (good / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 3, "loss": 2.0,
                                                    "lr": 1e-3, "elapsed": 1.5}) + "\n")
    bad = {}
    for name in ("metrics-fifo", "metrics-dev-zero", "metrics-dir", "lock-fifo"):
        bad[name] = root / name
        shutil.copytree(good, bad[name], symlinks=True)
    os.unlink(bad["metrics-fifo"] / "metrics.jsonl")
    os.mkfifo(bad["metrics-fifo"] / "metrics.jsonl")
    os.unlink(bad["metrics-dev-zero"] / "metrics.jsonl")
    os.symlink("/dev/zero", bad["metrics-dev-zero"] / "metrics.jsonl")
    os.unlink(bad["metrics-dir"] / "metrics.jsonl")
    (bad["metrics-dir"] / "metrics.jsonl").mkdir()
    os.mkfifo(bad["lock-fifo"] / "train.lock")
    why = {"metrics-fifo": "metrics.jsonl: not a regular file (a FIFO)",
           "metrics-dev-zero": "metrics.jsonl: not a regular file (a character device)",
           "metrics-dir": "metrics.jsonl: not a regular file (a directory)",
           "lock-fifo": "train.lock: not a regular file (a FIFO)"}
    if prefix is not None:  # permissions apply to this process (see unprivileged_prefix)
        for name in ("metrics-unreadable", "run-unreadable"):
            bad[name] = root / name
            shutil.copytree(good, bad[name], symlinks=True)
        (bad["metrics-unreadable"] / "metrics.jsonl").chmod(0)
        bad["run-unreadable"].chmod(0)
        why |= {"metrics-unreadable": "metrics.jsonl: permission denied",
                "run-unreadable": "run-unreadable: permission denied"}
    before = tree(root)
    r = run_minigpt(["runs", str(root), "--json"], tmp_path, tuple(prefix or ()))
    assert r.returncode == 0, r.stderr
    rows = {x["name"]: x for x in json.loads(r.stdout)["runs"]}
    assert set(rows) == {"good", *bad}
    assert (rows["good"]["status"], rows["good"]["step"]) == ("killed", 7)
    assert rows["good"]["problem"] is None and rows["good"]["wall_time_s"] == 1.5
    notes = r.stderr.strip().splitlines()
    for name, text in why.items():
        assert rows[name]["status"] == "unreadable", rows[name]
        assert rows[name]["problem"].endswith(text) and name in rows[name]["problem"]
        assert f"note: {rows[name]['problem']}" in notes
    assert len(notes) == len(why), r.stderr
    # the table of the same listing, by the app in this process (a process: ~2 CPU-s more)
    table = in_process(["runs", str(root)], cwd=tmp_path)
    assert table.returncode == 0 and "unreadable" in table.stdout, table.stderr
    assert tree(root) == before  # the listing read what it could and changed nothing


def test_runs_on_a_directory_it_cannot_read_is_one_line(tmp_path):
    from cli_world import run_minigpt, unprivileged_prefix

    prefix = unprivileged_prefix()
    if prefix is None:
        pytest.skip("running as root without a way to drop CAP_DAC_OVERRIDE (setpriv): file "
                    "permissions do not apply here")
    closed = tmp_path / "closed"
    closed.mkdir(mode=0)
    r = run_minigpt(["runs", str(closed)], tmp_path, tuple(prefix))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert str(closed) in r.stderr
    assert "not readable" in r.stderr or "permission denied" in r.stderr


def test_an_induction_run_has_no_bits_per_byte_and_a_refused_checkpoint_is_damaged(tmp_path):
    """A run on synthetic induction ids reports the copies predicted, never a bits-per-byte
    figure (`runs --json` said best_val_bpb 3.77 of ids that stand for no bytes); a finished
    run whose checkpoint every loading command refuses (a listed file missing, another size, an
    unsound weights header) is `damaged`, not `finished`."""
    from conftest import make_run

    from minigpt.config import from_dict, to_yaml

    run = make_run(tmp_path / "ind", top_files=True)
    cfg = from_dict({"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                               "vocab_size": 257}, "tokenizer": {"vocab_size": 256},
                     "data": {"source": "induction"}, "train": {"max_steps": 7}})
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "metrics.jsonl").write_text(json.dumps(
        {"kind": "eval", "step": 7, "val_loss": 2.6, "val_bpb": 3.77, "copy_accuracy": 0.87,
         "elapsed": 3.0}) + "\n")
    row = read_row(run)
    assert row.best_val_bpb is None and row.last_val_bpb is None
    assert row.copy_accuracy == 0.87 and row.status == "finished"
    ckpt = (run / "checkpoints" / "latest").resolve()
    for damage in ("missing", "shorter", "header"):
        bad = tmp_path / damage
        shutil.copytree(run, bad, symlinks=True)
        weights = (bad / "checkpoints" / ckpt.name / "model.safetensors")
        if damage == "missing":
            weights.unlink()
        elif damage == "shorter":
            weights.write_bytes(weights.read_bytes()[:-8])
        else:
            data = bytearray(weights.read_bytes())
            data[8:9] = b"["  # the header is no JSON object: the same size, unsound
            weights.write_bytes(bytes(data))
        assert read_row(bad).status == "damaged", damage
