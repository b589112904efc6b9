"""Faults: kill -9 at random moments, signals, a full disk while saving, a resume whose first
save fails or whose commit link is missing or copied, and two trainers on one run directory.
Whatever happens, the last committed checkpoint loads, nothing already saved changes, and
`--resume` finishes the run. (benchmarks/kill_trials.py runs many more kill -9 trials.)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_world import tree_hash
from conftest import error_line, kill_trials
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.run import checkpoint as ckpt_mod
from minigpt.run.layout import CKPT_DIR, LATEST
from minigpt.run.load import load_run
from minigpt.run.lock import LOCK_NAME, RunLock
from minigpt.train.outputs import RunOutputs

ROOT = Path(__file__).resolve().parents[1]


kt = kill_trials()


@pytest.fixture
def corpus(tmp_path) -> Path:
    return kt.make_corpus(tmp_path / "corpus.txt")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))


def sets(corpus: Path, tmp: Path, max_steps: int = 6, every: int = 2) -> list[str]:
    out = kt.tiny_sets(corpus, tmp / "cache", max_steps)
    i = out.index(f"train.checkpoint_interval={kt.CKPT_EVERY}")
    out[i] = f"train.checkpoint_interval={every}"
    return out


def invoke(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / CKPT_DIR).iterdir())


# --------------------------------------------------------------------------------------------
# kill -9


@pytest.mark.slow
@pytest.mark.parametrize("kind,seed", [("random", 11), ("mid-save", 12), ("startup", 13)])
def test_kill_9_then_resume(tmp_path, corpus, kind, seed):
    work = tmp_path / "work"
    work.mkdir()
    tr = kt.run_trial(0, kind, random.Random(seed), work, corpus, tmp_path / "cache")
    assert tr.ok, tr


# --------------------------------------------------------------------------------------------
# Disk full while saving. (`no_pictures`, here and below: the test reads neither picture, and
# drawing them is most of a tiny run's CPU time; the tests whose "changes nothing" covers the
# pictures a resume would redraw, and the real full disk, draw them.)


def _assert_failed_save_left_a_good_run(run: Path, r, prev_step: int, corpus: Path,
                                        tmp: Path) -> None:
    line = error_line(r, after_progress=True)
    assert "no space left on device" in line.lower()
    assert f"step-{prev_step:06d}" in line and "intact" in line
    assert load_run(run, "cpu").step == prev_step  # the previous checkpoint is intact
    assert leftovers(run) == [LATEST, f"step-{prev_step:06d}"]  # nothing half-written
    r = invoke("--out", str(run), "--resume")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == 6


def test_disk_full_just_before_the_commit(tmp_path, corpus, monkeypatch, no_pictures):
    """ENOSPC at the last moment before the step-4 commit (the checkpoint is complete and
    renamed to step-000004, the metrics log is being made durable): the step dir and the
    temporary link are removed, step 2 stays committed."""
    run = tmp_path / "run"
    real = RunOutputs.before_commit

    def full(self):
        if "step-000004" in {p.name for p in (run / CKPT_DIR).iterdir()}:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run / "metrics.jsonl"))
        real(self)

    monkeypatch.setattr(RunOutputs, "before_commit", full)
    r = invoke("--out", str(run), *sets(corpus, tmp_path))
    monkeypatch.setattr(RunOutputs, "before_commit", real)
    _assert_failed_save_left_a_good_run(run, r, 2, corpus, tmp_path)


def test_disk_full_injected_in_the_write_helper(tmp_path, corpus, monkeypatch, no_pictures):
    """An independent injection: the durable-write helper raises ENOSPC on the step-4
    optimizer file (after the weights were written into the temporary directory)."""
    run = tmp_path / "run"
    real = ckpt_mod.write_file_synced

    def full(path, data):
        if "step-000004" in str(path) and Path(path).name == "optimizer.safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(ckpt_mod, "write_file_synced", full)
    r = invoke("--out", str(run), *sets(corpus, tmp_path))
    monkeypatch.setattr(ckpt_mod, "write_file_synced", real)
    _assert_failed_save_left_a_good_run(run, r, 2, corpus, tmp_path)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       check=False,
                       capture_output=True)
    return r.returncode == 0


def test_disk_full_on_a_real_tiny_filesystem(tmp_path, corpus):
    """A size-limited tmpfs (needs root and mount rights; skipped otherwise): the first
    checkpoint fits, the second does not. The filesystem really is full."""
    mnt = tmp_path / "small"
    if not _mount_tmpfs(mnt, "4m"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
    try:
        run = mnt / "run"
        r = invoke("--out", str(run), *sets(corpus, tmp_path), "--stop-after", "2")
        assert r.exit_code == 0, r.stderr
        st = os.statvfs(mnt)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        ckpt_bytes = sum(p.stat().st_size for p in (run / CKPT_DIR / "step-000002").iterdir())
        # Room for a bit more metrics, not for a second checkpoint next to the first.
        limit = used + ckpt_bytes // 2
        subprocess.run(["mount", "-o", f"remount,size={limit}", str(mnt)], check=True)
        r = invoke("--out", str(run), "--resume")
        line = error_line(r, after_progress=True)
        assert "no space left on device" in line.lower(), line
        assert load_run(run, "cpu").step == 2
        assert leftovers(run) == [LATEST, "step-000002"]
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)
        r = invoke("--out", str(run), "--resume")
        assert r.exit_code == 0, r.stderr
        assert load_run(run, "cpu").step == 6
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


# --------------------------------------------------------------------------------------------
# A resume never overwrites, loses or changes what a run saved (issue 26), through the
# installed `minigpt` command.

MINIGPT = shutil.which("minigpt")


def minigpt(*args: str, cwd: Path, patch: str = "") -> subprocess.CompletedProcess:
    """`minigpt ARGS` through the installed console script, as a user runs it; with `patch`
    (Python source: a fault to inject first; the package has no fault hooks) the same CLI in a
    `python -c` process."""
    code = (f"import sys\nsys.argv = ['minigpt', *sys.argv[1:]]\n{patch}\n"
            "from minigpt.cli import main\nmain()\n")
    cmd = [sys.executable, "-c", code, *args] if patch else [MINIGPT, *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=600, env={**os.environ, "MINIGPT_CACHE": str(cwd / "cache")})


def in_process(*args: str, cwd: Path, patch: str = "") -> subprocess.CompletedProcess:
    """`minigpt ARGS` through the CLI in this process (CliRunner), shaped like `minigpt`."""
    assert not patch, "a fault patch needs its own process"
    r = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


# Each rule once in-process in the quick tier; through the installed command in the slow tier.
HOW = [pytest.param(in_process, id="in-process"),
       pytest.param(minigpt, id="installed", marks=pytest.mark.slow)]


@pytest.mark.parametrize("run_cli", HOW)
def test_a_missing_latest_link_resumes_from_the_newest_committed_step(tmp_path, corpus, run_cli,
                                                                     no_pictures):
    """`checkpoints/latest` gone (a copy tool that drops links): the newest complete step is
    the committed one; --resume continues from it, bit for bit as an uninterrupted run, and
    never rewrites it."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    keep = [*sets(corpus, tmp_path), "--set", "train.keep_checkpoints=2"]
    assert invoke("--out", str(straight), *keep).exit_code == 0
    assert invoke("--out", str(run), *keep, "--stop-after", "4").exit_code == 0
    (run / CKPT_DIR / LATEST).unlink()
    step4 = tree_hash(run / CKPT_DIR / "step-000004")
    assert load_run(run, "cpu").step == 4  # loaders find it too
    r = run_cli("train", "--out", str(run), "--resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "from step 4" in r.stderr
    assert tree_hash(run / CKPT_DIR / "step-000004") == step4
    assert leftovers(run) == [LATEST, "step-000004", "step-000006"]
    assert (run / "model.safetensors").read_bytes() == (straight / "model.safetensors").read_bytes()


@pytest.mark.parametrize("run_cli", HOW)
def test_a_missing_latest_link_and_a_damaged_newest_step_is_refused(tmp_path, corpus, run_cli):
    run = tmp_path / "run"
    assert invoke("--out", str(run), *sets(corpus, tmp_path), "--stop-after", "4").exit_code == 0
    (run / CKPT_DIR / LATEST).unlink()
    weights = run / CKPT_DIR / "step-000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    before = tree_hash(run)
    line = error_line(run_cli("train", "--out", str(run), "--resume", cwd=tmp_path),
                      after_progress=True)
    assert "step-000004/model.safetensors" in line and "sha256" in line
    assert tree_hash(run) == before


@pytest.mark.parametrize("run_cli", HOW)
def test_a_latest_that_is_a_copy_is_refused_and_the_run_still_loads(tmp_path, corpus, run_cli):
    """A run zipped and unzipped: `latest` became a directory. --resume cannot commit past it,
    so it refuses before doing anything, saying how to restore the link; sampling works."""
    run = tmp_path / "run"
    assert invoke("--out", str(run), *sets(corpus, tmp_path), "--stop-after", "2").exit_code == 0
    (run / CKPT_DIR / LATEST).unlink()
    shutil.copytree(run / CKPT_DIR / "step-000002", run / CKPT_DIR / LATEST)
    before = tree_hash(run)
    line = error_line(run_cli("train", "--out", str(run), "--resume", cwd=tmp_path),
                      after_progress=True)
    assert "checkpoints/latest is a directory, not the symbolic link" in line
    assert "ln -s step-000002" in line
    assert tree_hash(run) == before
    r = run_cli("sample", "--run", str(run), "-n", "3", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


# The first save of the resumed session (step 4) fails: with eval_interval 1 the session has
# evaluated, scored heads and logged steps 3 and 4 by then, which must not reach the run.
OBSTACLES = {  # name: (Python run in the process first, or a file put in the way beforehand)
    "a file where step-000004 goes": ("", "step-000004"),
    "a file where its temp dir goes": ("""
import os, pathlib
pathlib.Path({ckpts!r}, f'.tmp-step-000004-{{os.getpid()}}').write_text('x')
""", None),
    "the disk full": ("""
import errno, pathlib
from minigpt.run import checkpoint
write = checkpoint.write_file_synced
def full(path, data):
    if 'step-000004' in str(path) and pathlib.Path(path).name == 'optimizer.safetensors':
        raise OSError(errno.ENOSPC, 'No space left on device', str(path))
    write(path, data)
checkpoint.write_file_synced = full
""", None),
}


@pytest.mark.parametrize("obstacle, run_cli", [  # quick: one obstacle, in-process
    pytest.param("a file where step-000004 goes", in_process, id="file-in-process"),
    *[pytest.param(o, minigpt, id=f"{o}-installed", marks=pytest.mark.slow) for o in OBSTACLES]])
def test_a_resume_whose_first_save_fails_changes_nothing(tmp_path, corpus, obstacle, run_cli):
    run = tmp_path / "run"
    assert invoke("--out", str(run), *sets(corpus, tmp_path), "--stop-after", "2").exit_code == 0
    ckpts = run / CKPT_DIR
    patch, in_the_way = OBSTACLES[obstacle]
    if in_the_way is not None:
        (ckpts / in_the_way).write_text("x")
    before = tree_hash(run)
    resume = ["train", "--out", str(run), "--resume", "--set", "train.eval_interval=1"]
    line = error_line(run_cli(*resume, cwd=tmp_path, patch=patch.format(ckpts=str(ckpts))),
                      after_progress=True)
    assert "saving checkpoint step 4 failed" in line and "(step-000002) is intact" in line
    after = {k: v for k, v in tree_hash(run).items()
             if not k.startswith("checkpoints/.tmp-step-000004-")}  # the obstacle itself
    assert after == before
    assert load_run(run, "cpu").step == 2
    for p in ckpts.glob("*step-000004*"):  # the obstacle gone, the same resume finishes
        p.unlink()
    r = run_cli(*resume, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert load_run(run, "cpu").step == 6
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and [s for s in steps if s <= 2] == [1, 2]


# --------------------------------------------------------------------------------------------
# Two trainers, one run directory; a killed trainer's lock.


def _hold_lock_then(run: Path, then: str) -> subprocess.Popen:
    """A process that takes the run lock, prints 'locked', then sleeps or SIGKILLs itself."""
    code = (f"import os, signal, sys, time\nfrom minigpt.run.lock import RunLock\n"
            f"lock = RunLock({str(run)!r}).acquire(); print('locked', flush=True)\n"
            + ("os.kill(os.getpid(), signal.SIGKILL)\n" if then == "die" else "time.sleep(600)\n"))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_trainer_refuses_and_a_killed_trainers_lock_does_not_stick(tmp_path, corpus,
                                                                         no_pictures):
    run = tmp_path / "run"
    r = invoke("--out", str(run), *sets(corpus, tmp_path), "--stop-after", "2")
    assert r.exit_code == 0, r.stderr
    holder = _hold_lock_then(run, "sleep")
    try:
        line = error_line(invoke("--out", str(run), "--resume"), after_progress=True)
        assert f"in use by process {holder.pid}" in line and "another `minigpt train`" in line
        line = error_line(invoke("--out", str(run), *sets(corpus, tmp_path)), after_progress=True)
        assert "already exists" in line  # a fresh start never touches an existing run
    finally:
        holder.kill()
        holder.wait()
    assert load_run(run, "cpu").step == 2  # the refusals changed nothing
    dead = _hold_lock_then(run, "die")
    dead.wait()
    assert dead.returncode == -signal.SIGKILL
    assert (run / LOCK_NAME).exists()  # the file stays, the kernel lock does not
    r = invoke("--out", str(run), "--resume")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == 6
    with RunLock(run):  # released at the end of training
        pass


def test_run_dir_with_only_a_stale_lock_can_be_started(tmp_path, corpus, no_pictures):
    run = tmp_path / "run"
    run.mkdir()
    dead = _hold_lock_then(run, "die")
    dead.wait()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    r = invoke("--out", str(run), *sets(corpus, tmp_path))
    assert r.exit_code == 0, r.stderr


@contextlib.contextmanager
def _trainer(run: Path, corpus, tmp_path: Path, every: int):
    """A real `minigpt train` that checkpoints every `every` steps and runs until stopped;
    its stderr is a pipe (kill_trials.read_until reads it). Killed, if still running, and
    reaped when the block ends."""
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "minigpt", "train", "--out", str(run),
                          *sets(corpus, tmp_path, max_steps=100000, every=every)], env=env,
                         cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         text=True)
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()


@pytest.mark.slow
def test_two_real_trainers_on_one_run_dir(tmp_path, corpus):
    run = tmp_path / "run"
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")}
    with _trainer(run, corpus, tmp_path, every=5) as a:
        found, seen = kt.read_until(a, r"^checkpoint step 5:", 300)
        assert found, "".join(seen)
        b = subprocess.run([sys.executable, "-m", "minigpt", "train", "--out", str(run),
                            "--resume"], check=False, env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
        assert b.returncode == 2, b.stderr
        assert b.stderr.strip() == b.stderr.strip().splitlines()[0]  # one line
        assert f"in use by process {a.pid}" in b.stderr
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    step = load_run(run, "cpu").step
    r = invoke("--out", str(run), "--resume", "--set", f"train.max_steps={step + 3}")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == step + 3


# --------------------------------------------------------------------------------------------
# Signals: a second Ctrl-C while the first one's checkpoint is being written.


@pytest.mark.slow
def test_double_sigint_exits_130_and_keeps_a_loadable_run(tmp_path, corpus):
    run = tmp_path / "run"
    with _trainer(run, corpus, tmp_path, every=3) as p:
        found, seen = kt.read_until(p, r"^checkpoint step 6:", 300)
        assert found, "".join(seen)
        p.send_signal(signal.SIGINT)
        time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        err = p.stderr.read()
        p.wait(timeout=120)
    assert p.returncode == 130, err
    assert "Traceback" not in err, err
    step = load_run(run, "cpu").step
    assert step >= 6
    r = invoke("--out", str(run), "--resume", "--set", f"train.max_steps={step + 2}")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == step + 2


def test_ctrl_c_outside_the_loop_exits_130_with_a_message(monkeypatch, capsys, tmp_path):
    import minigpt.train as train_mod
    from minigpt import cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "train", interrupted)
    monkeypatch.setattr(sys, "argv", ["minigpt", "train", "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 130
    assert capsys.readouterr().err.strip() != ""
