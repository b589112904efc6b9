"""Pictures of training (minigpt.run.curves): curves.png in every run directory, rewritten
atomically at each evaluation and when a session ends early, plotting what metrics.jsonl
holds; several runs overlaid (`minigpt curves`, through CliRunner; the installed command in
test_cli_real.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from conftest import error_line
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.run.curves import curves_figure, overlay_figure, read_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def not_blank(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 500 and img[..., :3].std() > 0.05


def test_every_evaluation_rewrites_curves_png_by_rename(trained_runs):
    """At each EvalEvent the picture is new (another inode: a renamed temp file, never a
    rewrite in place) and no temp file is left."""
    run = trained_runs["finished"]
    assert [e.step for e in run["evals"]] == [3, 6]
    inodes, hashes = zip(*run["pictures"], strict=True)
    assert len(set(inodes)) == len(set(hashes)) == 2
    png = run["dir"] / "curves.png"
    assert (png.stat().st_ino, hashlib.sha256(png.read_bytes()).hexdigest()) == run["pictures"][-1]
    not_blank(png)
    assert not [p.name for p in run["dir"].iterdir() if p.name.startswith(".curves.png")]


def test_a_session_that_ends_early_redraws_at_the_end(trained_runs):
    run = trained_runs["stopped"]
    assert run["done"].reason == "stopped" and [e.step for e in run["evals"]] == [3]
    png = run["dir"] / "curves.png"
    assert hashlib.sha256(png.read_bytes()).hexdigest() != run["pictures"][-1][1]
    assert max(read_series(run["dir"]).step) == 4  # the step after the last evaluation


def test_the_picture_plots_what_metrics_jsonl_holds(trained_runs):
    run = trained_runs["finished"]["dir"]
    recs = metrics(run)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    fig = curves_figure(read_series(run))
    top, bottom, lr_axis = fig.axes[0], fig.axes[1], fig.axes[2]
    lines = {ln.get_label(): ln.get_xydata().tolist() for ln in top.get_lines()}
    assert lines["train loss"] == [[r["step"], r["loss"]] for r in train]
    assert lines["val loss"] == [[r["step"], r["val_loss"]] for r in evals]
    assert lr_axis.get_lines()[0].get_xydata().tolist() == [[r["step"], r["lr"]] for r in train]
    assert bottom.get_lines()[0].get_xydata().tolist() == [[r["step"], r["val_bpb"]]
                                                           for r in evals]
    best = min(r["val_bpb"] for r in evals)
    assert f"best {best:.4f} bits/byte" in bottom.get_title()


def test_the_trainer_draws_from_its_records_and_never_reads_the_log_back(tmp_path,
                                                                        monkeypatch):
    """While it trains, the trainer reads metrics.jsonl once, on resume (the records up to the
    resumed step); every picture after that comes from the records it keeps in memory, and
    equals one drawn from the finished log."""
    from conftest import tiny_train_sets

    import minigpt.run.curves as curves_mod
    import minigpt.run.listing as listing_mod
    import minigpt.run.metrics as metrics_mod
    import minigpt.train.outputs as outputs_mod
    from minigpt.config import load_config
    from minigpt.run.resume import resume_config
    from minigpt.train import train

    def never(*args, **kwargs):
        raise AssertionError("metrics.jsonl read back while training")

    reads, upto = [], outputs_mod.metrics_upto
    with monkeypatch.context() as m:
        m.setattr(outputs_mod, "metrics_upto", lambda *a: reads.append(a[1]) or upto(*a))
        m.setattr(listing_mod, "read_metrics", never)
        m.setattr(metrics_mod, "read_metrics", never)
        m.setattr(outputs_mod, "draw_timeline", lambda *a, **k: None)  # heads.png: not read
        run = tmp_path / "a" / "run"
        train(load_config(None, tiny_train_sets(tmp_path, **{"train.max_steps": 9})), run,
              stop_after=4)
        assert reads == []
        train(resume_config(run, []), run, resume=True)
        assert reads == [4]
    again = tmp_path / "b" / "run"  # the same name: the title names the run
    again.mkdir(parents=True)
    curves_mod.write_curves(dataclasses.replace(read_series(run), run_dir=again))
    assert (again / "curves.png").read_bytes() == (run / "curves.png").read_bytes()


def test_damaged_and_null_records_are_skipped_or_gaps(tmp_path, trained_runs):
    run = tmp_path / "copy"
    shutil.copytree(trained_runs["finished"]["dir"], run, symlinks=True)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:15]  # torn
    lines.insert(4, "[1, 2]")  # JSON, not a record
    lines.append(json.dumps({"kind": "train", "step": 7, "loss": None, "lr": 0.001}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"kind\": \"ev")  # torn tail
    s = read_series(run)
    assert s.skipped == 3
    assert s.step[-1] == 7 and math.isnan(s.loss[-1])  # non-finite loss (null): a gap


def test_overlay_has_every_run_against_step_and_tokens_seen(trained_runs):
    runs = [read_series(trained_runs[n]["dir"]) for n in ("finished", "stopped")]
    fig = overlay_figure(runs)
    (by_step, by_time), (bpb_step, bpb_time) = [fig.axes[0:2], fig.axes[2:4]]
    for s, line_step, line_time in zip(runs, by_step.get_lines(), by_time.get_lines(),
                                       strict=True):
        assert line_step.get_label() == s.name
        assert line_step.get_xydata().tolist() == [list(p) for p in zip(s.step, s.loss,
                                                                        strict=True)]
        assert line_time.get_xydata().tolist() == [list(p) for p in zip(s.tokens, s.loss,
                                                                        strict=True)]
    assert len(bpb_step.get_lines()) == len(bpb_time.get_lines()) == 2
    assert "tokens seen" in bpb_time.get_xlabel()


def test_curves_command_writes_the_overlay(trained_runs, tmp_path):
    out = tmp_path / "both.png"
    r = CliRunner().invoke(app, ["curves", str(trained_runs["finished"]["dir"]),
                                 str(trained_runs["stopped"]["dir"]), "--out", str(out)])
    assert r.exit_code == 0, r.stderr
    assert r.stderr.strip() == f"wrote {out} (2 runs)"
    not_blank(out)


def test_curves_by_name_under_runs(trained_runs, monkeypatch, tmp_path):
    monkeypatch.chdir(trained_runs["finished"]["dir"].parent.parent)  # holds runs/
    r = CliRunner().invoke(app, ["curves", "finished", "--out", str(tmp_path / "one.png")])
    assert r.exit_code == 0, r.stderr
    not_blank(tmp_path / "one.png")


@pytest.mark.parametrize("what", ["unknown", "no-metrics", "not-png", "unwritable", "a-dir"])
def test_curves_bad_input_is_one_line_and_writes_nothing(trained_runs, tmp_path, what,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    good = str(trained_runs["finished"]["dir"])
    empty = tmp_path / "fresh"
    empty.mkdir()
    (empty / "train.lock").write_text("")  # a run that has not logged anything yet
    (tmp_path / "pics.png").mkdir()
    args, needles = {
        "unknown": ([good, "nope", "--out", "x.png"], ("unknown run 'nope'", "runs/nope",
                                                        "minigpt runs")),
        "no-metrics": ([good, str(empty), "--out", "x.png"], ("fresh", "no metrics yet")),
        "not-png": ([good, "--out", "x.jpg"], ("--out x.jpg", ".png")),
        "unwritable": ([good, "--out", "/proc/minigpt.png"], ("--out /proc/minigpt.png",
                                                               "cannot write")),
        "a-dir": ([good, "--out", "pics.png"], ("--out pics.png", "is a directory")),
    }[what]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = CliRunner().invoke(app, ["curves", *args])
    line = error_line(r)
    for needle in needles:
        assert needle in line
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_runs_and_curves_start_without_torch(trained_runs, tmp_path):
    """`minigpt runs` and `minigpt curves` read JSON, YAML and safetensors headers only: on
    trained runs (checkpoints, metrics) each command does its work without importing torch, so
    it starts in a few tenths of a second instead of the two seconds torch takes to load."""
    run = trained_runs["finished"]["dir"]
    code = ("import sys\nfrom minigpt.cli import main\nsys.argv = ['minigpt', *sys.argv[1:]]\n"
            "try:\n    main()\nfinally:\n    print('torch loaded:', 'torch' in sys.modules, "
            "file=sys.stderr)\n")
    out = {}
    for args in (["runs", str(run.parent), "--json"],
                 ["curves", str(run), "--out", str(tmp_path / "c.png")]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           check=False, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().splitlines()[-1] == "torch loaded: False", r.stderr
        out[args[0]] = r.stdout
    rows = {x["name"]: x for x in json.loads(out["runs"])["runs"]}
    assert rows["finished"]["step"] == 6 and rows["stopped"]["step"] == 4
    not_blank(tmp_path / "c.png")
