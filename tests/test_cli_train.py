"""`minigpt train` through the CLI: --print-config, refusals, plain progress off a terminal, the
installed command resuming what it started, identical runs giving identical files, and (slow,
in subprocesses) SIGINT/SIGTERM and kill -9 in the middle of a checkpoint save."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import error_line, kill_trials, tiny_train_sets
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import load_config, to_yaml
from minigpt.run import load_run
from minigpt.run.lock import RunLock

# Trainings here draw no pictures (conftest.pictures_off: no test here reads curves.png or
# heads.png, and drawing is most of a tiny run's CPU time).
pytestmark = pytest.mark.usefixtures("no_pictures")


def tiny_sets(tmp: Path, **over) -> list[str]:
    """conftest's tiny byte model, sampling 2 tokens at each evaluation."""
    return tiny_train_sets(tmp, **{"train.sample_tokens": 2, **over})


MINIGPT = shutil.which("minigpt")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but \t and \n


def invoke(*args: str):
    return CliRunner().invoke(app, ["train", *args], catch_exceptions=False)


def with_sets(sets: list[str]) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def test_print_config_round_trips(tmp_path):
    sets = tiny_sets(tmp_path)
    r = invoke("--print-config", *with_sets(sets))
    assert r.exit_code == 0 and r.stderr == ""
    (tmp_path / "printed.yaml").write_text(r.stdout)
    again = load_config(tmp_path / "printed.yaml")
    assert to_yaml(again) == r.stdout == to_yaml(load_config(None, sets))
    assert not (tmp_path / "runs").exists()  # printing does no work


def test_non_tty_progress_is_plain_and_run_is_complete(tmp_path):
    run = tmp_path / "run"
    r = invoke("--out", str(run), *with_sets(tiny_sets(tmp_path)))
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""  # everything goes to stderr
    assert not CONTROL.search(r.stderr), repr(r.stderr)
    assert re.search(r"^step 6/6 \| loss \d+\.\d+ \| lr ", r.stderr, re.MULTILINE)
    assert re.search(r"^eval step 6: val loss .* bits/byte", r.stderr, re.MULTILINE)
    assert f"minigpt sample --run {run}" in r.stderr
    for name in ("config.yaml", "tokenizer.tiktoken", "tokenizer.json", "model.safetensors",
                 "optimizer.safetensors", "trainer_state.json", "manifest.json", "metrics.jsonl",
                 "summary.md"):
        assert (run / name).is_file(), name
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed"} <= recs[0].keys()
    ev = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in ev] == [3, 6] and {"val_loss", "val_ppl", "val_bpb"} <= ev[0].keys()
    cfg = load_config(run / "config.yaml")
    assert cfg.model.vocab_size == 257  # filled in from the tokenizer
    assert load_run(run, "cpu").step == 6
    # Finished run + --resume without raising max_steps: a clear refusal.
    line = error_line(invoke("--out", str(run), "--resume"))
    assert "already at step 6" in line and "train.max_steps" in line


def test_existing_run_dir_is_not_touched(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    line = error_line(invoke("--out", str(run), *with_sets(tiny_sets(tmp_path))))
    assert "already exists" in line and "--resume" in line
    assert [p.name for p in run.iterdir()] == ["notes.txt"]


def test_refusals(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(load_config(None, tiny_sets(tmp_path))))
    assert "model.n_embd cannot change on --resume" in error_line(
        invoke("--out", str(run), "--resume", "--set", "model.n_embd=64"))
    line = error_line(invoke("--out", str(run), "--resume", "--config", "bytes"))
    assert "--config bytes: model.n_layer cannot change on --resume" in line
    assert "model.n_layer=1" in line and "gives 4" in line
    assert "--device" in error_line(invoke("--out", str(run), "--device", "tpu"))
    assert "train.nope" in error_line(invoke("--set", "train.nope=1", "--print-config"))
    with RunLock(run):
        assert "in use by process" in error_line(invoke("--out", str(run), "--resume"))
    bad = tmp_path / "bad"  # a data error leaves no half-made run directory behind
    sets = tiny_sets(tmp_path, **{"data.corpus": str(tmp_path / "missing.txt")})
    assert "data.corpus" in error_line(invoke("--out", str(bad), *with_sets(sets)))
    assert not bad.exists()


def test_the_original_command_with_resume_appended_continues_the_run(tmp_path):
    """Issue #15 finding 4: re-running the command line with --resume appended works; a
    later --set of a resume-safe setting still changes it."""
    run, sets = tmp_path / "run", with_sets(tiny_sets(tmp_path))
    r = invoke("--out", str(run), *sets, "--stop-after", "3")
    assert r.exit_code == 0, r.stderr
    r = invoke("--out", str(run), *sets, "--resume", "--set", "train.max_steps=7")
    assert r.exit_code == 0, r.stderr
    assert "from step 3" in r.stderr and re.search(r"^step 7/7 ", r.stderr, re.MULTILINE)
    r = invoke("--out", str(run), *sets, "--set", "train.max_steps=9", "--resume",
               "--set", "model.n_embd=64")
    line = error_line(r)
    assert "model.n_embd cannot change on --resume" in line
    assert "model.n_embd=32" in line and "gives 64" in line
    assert load_run(run).step == 7  # the refusal changed nothing


def installed(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`minigpt ARGS` through the installed console script, as a user runs it."""
    return subprocess.run([MINIGPT, *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=600)


def in_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`minigpt ARGS` through the CLI in this process (CliRunner), shaped like `installed`."""
    r = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


@pytest.mark.parametrize("config, run_cli", [  # the processes: slow; the same rule in-process
    ("default", in_process), pytest.param("default", installed, marks=pytest.mark.slow),
    pytest.param("speedrun", installed, marks=pytest.mark.slow)])
def test_a_config_file_overridden_by_set_resumes_with_resume_appended(tmp_path, config, run_cli):
    """Issue 26 (3): `--config FILE --set model.n_layer=2 ...`, then the same command with
    --resume appended. The command's settings are resolved as the command resolves them (the
    file, then each --set), so the file's n_layer 4 is not held against the run's 2."""
    run = tmp_path / "run"
    sets = tiny_sets(tmp_path, **{"model.n_layer": 2, "train.max_steps": 4,
                                  "train.eval_interval": 2, "train.checkpoint_interval": 2})
    command = ["train", "--config", config, *with_sets(sets), "--out", str(run)]
    r = run_cli(*command, "--stop-after", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run_cli(*command, "--stop-after", "2", "--resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "from step 2" in r.stderr and re.search(r"^step 4/4 ", r.stderr, re.MULTILINE)
    assert load_run(run).cfg.model.n_layer == 2 and load_run(run).step == 4
    # A --set that really changes a model setting is still refused, naming the resolved value.
    r = run_cli(*command, "--set", "model.n_layer=3", "--resume", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --set: model.n_layer cannot change")
    assert "model.n_layer=2" in r.stderr and "gives 3" in r.stderr


def test_two_identical_runs_write_identical_files(place, real_env, tmp_path, monkeypatch):
    """Issue 26: the same training in two processes (the installed command's run of the
    documented commands, conftest's `place`, and the same command in the test process) gives
    byte-identical weights and optimizer state: safetensors metadata is written in a fixed
    order."""
    from conftest import REAL_TINY

    monkeypatch.chdir(tmp_path)  # the installed command's token cache, as it ran
    monkeypatch.setenv("MINIGPT_CACHE", real_env["MINIGPT_CACHE"])
    r = invoke("--out", str(tmp_path / "b"), *with_sets([f"{k}={v}" for k, v in
                                                         REAL_TINY.items()]))
    assert r.exit_code == 0, r.stderr
    digests = [[hashlib.sha256((run / f).read_bytes()).hexdigest()
                for f in ("model.safetensors", "optimizer.safetensors")]
               for run in (place / "runs" / "default", tmp_path / "b")]
    assert digests[0] == digests[1]


@pytest.mark.parametrize("left", ["lock", "config"])
def test_resume_where_nothing_was_saved_starts_at_step_0(tmp_path, left):
    """Issue #15 finding 5: a run killed during start-up left only train.lock, or config.yaml
    without a checkpoint: --resume starts it, with a note. (An empty directory: test_train.)"""
    run = tmp_path / "run"
    sets = tiny_sets(tmp_path, **{"train.max_steps": 2, "train.eval_interval": 2,
                                  "train.checkpoint_interval": 2})
    run.mkdir()
    if left == "lock":
        RunLock(run).acquire().release()
    if left == "config":
        resolved = load_config(None, sets)
        resolved.model.vocab_size = 257
        (run / "config.yaml").write_text(to_yaml(resolved))
        (run / "metrics.jsonl").write_text('{"kind": "train", "step": 5, "loss": 9.0}\n')
    r = invoke("--out", str(run), *with_sets(sets), "--resume")
    assert r.exit_code == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if x.startswith("note: ")]
    assert notes == [(f"note: {run} holds no saved checkpoint yet (the run stopped before its "
                     "first save); starting it from step 0")]
    assert load_run(run).step == 2
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 1 and steps == sorted(steps)  # the stale record (step 5) is gone


# --------------------------------------------------------------------------------------------
# Subprocesses: signals and kill -9.


def _spawn(tmp_path: Path, run: Path, sets: list[str], *extra: str,
           die_during_save: int | None = None):
    cmd = kill_trials().minigpt_command("train", "--out", str(run), *with_sets(sets), *extra,
                                        die_during_save=die_during_save)
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)


def _wait_for_line(proc, pattern: str, timeout: float = 120) -> list[str]:
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return seen
    raise AssertionError(f"never saw {pattern!r}; stderr: {''.join(seen)}")


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_checkpoint_and_resume_finishes(tmp_path, sig, code):
    run = tmp_path / "run"
    sets = tiny_sets(tmp_path, **{"train.max_steps": 100000, "train.checkpoint_interval": 100000,
                                  "train.eval_interval": 100000})
    proc = _spawn(tmp_path, run, sets)
    _wait_for_line(proc, r"^step 3/")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"minigpt train --out {run} --resume" in err and "checkpoint saved in" in err
    step = load_run(run, "cpu").step
    assert step >= 3
    r = invoke("--out", str(run), "--resume", "--set", f"train.max_steps={step + 2}")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == step + 2


@pytest.mark.slow
def test_kill_9_during_save_then_resume(tmp_path):
    """The process SIGKILLs itself in the middle of writing the step-4 checkpoint: the step-2
    checkpoint stays committed and loadable, and --resume finishes the run."""
    run = tmp_path / "run"
    sets = tiny_sets(tmp_path, **{"train.checkpoint_interval": 2})
    proc = _spawn(tmp_path, run, sets, die_during_save=4)
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p.name for p in (run / "checkpoints").iterdir()]
    assert any(n.startswith(".tmp-step-000004") for n in leftovers)  # the torn save
    assert load_run(run, "cpu").step == 2
    r = invoke("--out", str(run), "--resume")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-000006"]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["kind"]) for r in recs]
    steps = [k[0] for k in keys]
    assert steps == sorted(steps) and len(keys) == len(set(keys))  # no duplicates after resume
    # The final step writes its train record, then the head scores, then the evaluation.
    assert keys[-3:] == [(6, "train"), (6, "heads"), (6, "eval")]
