"""Faults: kill -9 at random moments, signals, a full disk while saving, and two trainers on one
run directory. Whatever happens, the last committed checkpoint loads and `--resume` finishes
the run. (benchmarks/kill_trials.py runs many more kill -9 trials than the few here.)
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import kill_trials
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


def one_error_line(r) -> str:
    assert r.exit_code == 2, r.stderr
    assert "Traceback" not in r.stderr
    errs = [x for x in r.stderr.splitlines() if x.startswith("error")]
    assert len(errs) == 1 and r.stderr.strip().splitlines()[-1] == errs[0], r.stderr
    return errs[0]


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
# Disk full while saving.


def _assert_failed_save_left_a_good_run(run: Path, r, prev_step: int, corpus: Path,
                                        tmp: Path) -> None:
    line = one_error_line(r)
    assert "no space left on device" in line.lower()
    assert f"step-{prev_step:06d}" in line and "intact" in line
    assert load_run(run, "cpu").step == prev_step  # the previous checkpoint is intact
    assert leftovers(run) == [LATEST, f"step-{prev_step:06d}"]  # nothing half-written
    r = invoke("--out", str(run), "--resume")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == 6


def test_disk_full_just_before_the_commit(tmp_path, corpus, monkeypatch):
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


def test_disk_full_injected_in_the_write_helper(tmp_path, corpus, monkeypatch):
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
        line = one_error_line(r)
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
# Two trainers, one run directory; a killed trainer's lock.


def _hold_lock_then(run: Path, then: str) -> subprocess.Popen:
    """A process that takes the run lock, prints 'locked', then sleeps or SIGKILLs itself."""
    code = (f"import os, signal, sys, time\nfrom minigpt.run.lock import RunLock\n"
            f"lock = RunLock({str(run)!r}).acquire(); print('locked', flush=True)\n"
            + ("os.kill(os.getpid(), signal.SIGKILL)\n" if then == "die" else "time.sleep(600)\n"))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_second_trainer_refuses_and_a_killed_trainers_lock_does_not_stick(tmp_path, corpus):
    run = tmp_path / "run"
    r = invoke("--out", str(run), *sets(corpus, tmp_path), "--stop-after", "2")
    assert r.exit_code == 0, r.stderr
    holder = _hold_lock_then(run, "sleep")
    try:
        line = one_error_line(invoke("--out", str(run), "--resume"))
        assert f"in use by process {holder.pid}" in line and "another `minigpt train`" in line
        line = one_error_line(invoke("--out", str(run), *sets(corpus, tmp_path)))
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


def test_run_dir_with_only_a_stale_lock_can_be_started(tmp_path, corpus):
    run = tmp_path / "run"
    run.mkdir()
    dead = _hold_lock_then(run, "die")
    dead.wait()
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    r = invoke("--out", str(run), *sets(corpus, tmp_path))
    assert r.exit_code == 0, r.stderr


def _spawn_trainer(run: Path, corpus, tmp_path: Path, every: int) -> subprocess.Popen:
    """A real `minigpt train` that checkpoints every `every` steps and runs until stopped;
    its stderr is a pipe (kill_trials._read_until reads it)."""
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")}
    return subprocess.Popen([sys.executable, "-m", "minigpt", "train", "--out", str(run),
                             *sets(corpus, tmp_path, max_steps=100000, every=every)], env=env,
                            cwd=tmp_path, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)


@pytest.mark.slow
def test_two_real_trainers_on_one_run_dir(tmp_path, corpus):
    run = tmp_path / "run"
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")}
    a = _spawn_trainer(run, corpus, tmp_path, every=5)
    try:
        found, seen = kt._read_until(a, r"^checkpoint step 5:", 300)
        assert found, "".join(seen)
        b = subprocess.run([sys.executable, "-m", "minigpt", "train", "--out", str(run),
                            "--resume"], check=False, env=env, cwd=tmp_path, capture_output=True,
                           text=True,
                           timeout=300)
        assert b.returncode == 2, b.stderr
        assert b.stderr.strip() == b.stderr.strip().splitlines()[0]  # one line
        assert f"in use by process {a.pid}" in b.stderr
        a.send_signal(signal.SIGKILL)
        a.wait(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
        a.stderr.close()
    step = load_run(run, "cpu").step
    r = invoke("--out", str(run), "--resume", "--set", f"train.max_steps={step + 3}")
    assert r.exit_code == 0, r.stderr
    assert load_run(run, "cpu").step == step + 3


# --------------------------------------------------------------------------------------------
# Signals: a second Ctrl-C while the first one's checkpoint is being written.


@pytest.mark.slow
def test_double_sigint_exits_130_and_keeps_a_loadable_run(tmp_path, corpus):
    run = tmp_path / "run"
    p = _spawn_trainer(run, corpus, tmp_path, every=3)
    try:
        found, seen = kt._read_until(p, r"^checkpoint step 6:", 300)
        assert found, "".join(seen)
        p.send_signal(signal.SIGINT)
        time.sleep(0.005)
        p.send_signal(signal.SIGINT)
        err = p.stderr.read()
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
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
