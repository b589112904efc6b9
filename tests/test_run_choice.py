"""Which run `sample`, `export` and `inspect-heads` use without `--run` (minigpt.run.choice,
one rule): the latest finished run the command can use, named on stderr, with every newer
run it passed over and why; a run still training is never used without a word. On tiny runs
made in place (a held train.lock is a run still training), through the command in this process
(the quick tier) and through the installed command (the slow tier; one case quick, with the
lock held by another process than the command's)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import in_process, make_run

MINIGPT = shutil.which("minigpt")


def aged_run(root: Path, name: str, age: float, *, finished: bool = True,
             source: str = "text", **model) -> Path:
    """conftest.make_run's committed step-4 checkpoint of a random 1-layer byte model under
    root/runs/name, committed `age` seconds ago; `finished`: train.max_steps 4 (else 400, and
    no summary: `killed`); `source` only as config.yaml says it."""
    run = make_run(root / "runs" / name, n_layer=1, n_embd=16, step=4, **model,
                   sections={"train": {"max_steps": 4 if finished else 400}})
    text = (run / "checkpoints" / "latest" / "config.yaml").read_text()
    if source != "text":
        text = text.replace("source: text", f"source: {source}")
    (run / "config.yaml").write_text(text)
    when = time.time() - age
    os.utime(run / "checkpoints" / "latest", (when, when), follow_symlinks=False)
    return run


def held(run: Path):
    """The run's train.lock held as a trainer holds it (the run shows as `training`)."""
    fh = open(run / "train.lock", "a+")  # noqa: SIM115 - closed by the caller
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fh


def installed(cwd: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess:
    """`minigpt ARGS` through the installed console script, in `cwd`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINIGPT_CACHE": str(cwd / "cache")}
    r = subprocess.run([MINIGPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, r.stderr
    return r


def here(cwd: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess:
    """The same command run by the app in this process, in `cwd`."""
    r = in_process(list(args), cwd=cwd, MINIGPT_CACHE=str(cwd / "cache"))
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, r.stderr
    return r


# Each rule in this process in the quick tier; through the installed command in the slow tier.
HOW = [pytest.param(here, id="in-process"),
       pytest.param(installed, id="installed", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """runs/: `done` (finished, the oldest), `killed` (newer, stopped short, no summary),
    `speed` (newer, finished, a QK-norm model no export format holds), `busy` (the newest,
    its lock held while the tests run)."""
    root = tmp_path_factory.mktemp("choice")
    aged_run(root, "done", 400)
    aged_run(root, "killed", 300, finished=False)
    aged_run(root, "speed", 200, qk_norm=True)
    busy = aged_run(root, "busy", 100)
    fh = held(busy)
    yield root
    fh.close()


@pytest.mark.parametrize("minigpt", HOW)
def test_export_takes_the_latest_finished_run_it_can_hold_and_says_what_it_passed(place, minigpt,
                                                                                  tmp_path):
    r = minigpt(place, "export", "--out", str(tmp_path / "hf"))
    err = r.stderr
    assert "exporting the latest finished run, runs/done (step 4)" in err
    assert "passing over runs/busy (still training (step 4 of 4 committed))" in err
    assert "passing over runs/speed (model.qk_norm is true: GPT-2 and GPT-NeoX do not " \
        "normalise queries and keys)\n" in err  # no "give --run": it cannot be exported
    assert "passing over runs/killed (killed at step 4 of 400)" in err
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize("minigpt", HOW)
def test_inspect_heads_takes_any_finished_run_and_says_its_kind(place, minigpt):
    r = minigpt(place, "inspect-heads", "--json", "--max-tokens", "8")
    assert "using the latest finished run, runs/speed (step 4), trained on text, bytes" \
        in r.stderr
    assert "passing over runs/busy (still training" in r.stderr
    assert "runs/killed" not in r.stderr  # older than the pick: not passed over


@pytest.mark.slow  # a process (~3 CPU-s); quick: test_a_run_still_training_is_used_only_with_a_word
def test_sample_passes_over_a_run_still_training(place):
    """Through the installed command: the lock is another process's."""
    minigpt = installed
    r = minigpt(place, "sample", "-n", "4", "--seed", "1")
    assert "sampling from the latest finished run trained on text, runs/speed (step 4)" \
        in r.stderr
    assert "passing over runs/busy (still training" in r.stderr


@pytest.mark.parametrize("minigpt", HOW)
def test_a_run_still_training_is_used_only_with_a_word(tmp_path, minigpt):
    fh = held(aged_run(tmp_path, "busy", 10))
    try:
        r = minigpt(tmp_path, "sample", "-n", "4", "--seed", "1")
    finally:
        fh.close()
    assert ("sampling from the latest run trained on text, still training (step 4 of 4 "
            "committed): runs/busy (step 4)") in r.stderr


@pytest.mark.parametrize("minigpt", HOW)
def test_sample_takes_text_over_a_newer_induction_run_and_falls_back_to_it(tmp_path, minigpt):
    aged_run(tmp_path, "text", 300)
    aged_run(tmp_path, "ind", 100, source="induction")
    r = minigpt(tmp_path, "sample", "-n", "4", "--seed", "1")
    assert "passing over runs/ind (trained on synthetic induction data, not text)" in r.stderr
    assert "runs/text (step 4)" in r.stderr
    shutil.rmtree(tmp_path / "runs" / "text")
    r = minigpt(tmp_path, "sample", "-n", "4", "--seed", "1")
    assert ("sampling from the latest run (trained on synthetic induction data, not text), "
            "runs/ind (step 4)") in r.stderr


@pytest.mark.parametrize("minigpt", HOW)
def test_export_with_nothing_it_can_hold_is_one_line(tmp_path, minigpt):
    aged_run(tmp_path, "speed", 10, activation="relu2")
    r = minigpt(tmp_path, "export", "--out", "hf", code=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no run under runs/ is a model GPT-2 "
                                                   "or GPT-NeoX can hold: runs/speed")
    assert "give --run DIR" in lines[0] and not (tmp_path / "hf").exists()


def test_the_pick_follows_the_runs_status_column(place):
    """The one rule: the status the pick reads is the one `minigpt runs` shows."""
    from minigpt.run.choice import pick_run
    from minigpt.run.listing import list_runs

    shown = {row.name: row.status for row in list_runs(place / "runs")}
    assert shown == {"done": "finished", "killed": "killed", "speed": "finished",
                     "busy": "training"}
    pick = pick_run(root=place / "runs")
    assert pick.run_dir.name == "speed" and pick.status.status == shown["speed"]
    assert [(d.name, why.split(" (")[0], usable) for d, why, usable in pick.passed] == [
        ("busy", "still training", True)]


def test_run_names_a_run_under_runs_in_every_command_with_a_did_you_mean(tmp_path):
    """`--run NAME` is runs/NAME in every command that takes a run, and a run in neither place
    is one line naming the nearest run by name (`inspect-heads --run default` said the
    directory did not exist though runs/default did; `--run runs/defualt` had no hint)."""
    import typer.main

    from minigpt.cli import app

    aged_run(tmp_path, "default", age=10)
    tree = typer.main.get_command(app)
    takers = []
    for name, cmd in tree.commands.items():
        for sub, c in (getattr(cmd, "commands", None) or {None: cmd}).items():
            if any("--run" in p.opts for p in c.params):
                takers.append([name] + ([sub] if sub else []))
    assert {" ".join(t) for t in takers} >= {"sample", "inspect-heads", "circuit", "export",
                                             "features train", "features show", "runs",
                                             "curves"}
    extra = {"features show": ["--sae", "nowhere"], "features train": ["--layer", "0"],
             "curves": ["-o", "c.png"], "export": ["-o", "out"]}
    for cmd in takers:
        for typo in ("defualt", "runs/defualt"):
            r = in_process([*cmd, "--run", typo, *extra.get(" ".join(cmd), [])], cwd=tmp_path)
            line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
            if " ".join(cmd) == "features show":  # the SAE is read first: its own line
                assert r.returncode == 2 and "nowhere" in line, (cmd, r.stderr)
                continue
            assert r.returncode == 2 and "did you mean runs/default?" in line, (cmd, r.stderr)
    for cmd in (["inspect-heads", "--text", "abcdefgh"], ["runs"], ["sample", "-n", "2"]):
        r = in_process([*cmd, "--run", "default"], cwd=tmp_path)
        assert r.returncode == 0, (cmd, r.stderr)
