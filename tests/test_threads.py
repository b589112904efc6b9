"""The CPU thread policy (`minigpt.threads`, applied by `minigpt.device.cpu_threads`): one rule
for every threads setting (train.threads and the `--threads` of sample, inspect-heads and
bench: 0 = automatic, else 1 to the CPUs this process may run on; issue 39 finding 2: a
million threads crashed the process), and OpenMP's short spin-wait, set by the `minigpt`
command before torch loads unless the user chose their own. Speed is measured in
benchmarks/threads_bench.py, not here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import in_process

from minigpt.device import cpu_threads, decode_threads
from minigpt.errors import ArgumentError
from minigpt.threads import OPENMP_SPIN, quiet_openmp, thread_problem, usable_cpus

MINIGPT = shutil.which("minigpt")
CPUS = usable_cpus()


@pytest.fixture(autouse=True)
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_the_rule_takes_0_to_the_cpus_and_says_why_not():
    assert CPUS == len(os.sched_getaffinity(0))
    for ok in range(CPUS + 1):
        assert thread_problem(ok) is None
    for bad, why in ((-1, "is not a thread count"), (True, "is not a thread count"),
                     (CPUS + 1, f"more than the {CPUS} CPU"), (10**23, "(24 digits)")):
        assert why in thread_problem(bad)
    assert len(thread_problem(10**4000)) < 300  # a huge value is never echoed whole


def test_cpu_threads_sets_the_count_and_restores_the_callers():
    from minigpt.config import ModelConfig
    from minigpt.core.gpt import GPT

    torch.set_num_threads(CPUS)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64))
    with cpu_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    with cpu_threads(0) as n:  # automatic: torch's own count
        assert n == CPUS == torch.get_num_threads()
    with cpu_threads(0, model) as n:  # automatic for decoding: the model's width decides
        assert n == decode_threads(model, CPUS) == torch.get_num_threads()
    with cpu_threads(CPUS, model) as n:  # a count asked for is the count used
        assert n == CPUS
    with pytest.raises(ArgumentError, match="more than the"), cpu_threads(CPUS + 1):
        pass
    assert torch.get_num_threads() == CPUS


def test_quiet_openmp_keeps_a_users_choice_and_needs_torch_unloaded(monkeypatch):
    env: dict[str, str] = {}
    monkeypatch.delitem(sys.modules, "torch")  # as in a fresh `minigpt` process
    assert quiet_openmp(env) and env == {"GOMP_SPINCOUNT": str(OPENMP_SPIN)}
    for mine in ({"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        env = dict(mine)
        assert not quiet_openmp(env) and env == mine
    monkeypatch.setitem(sys.modules, "torch", torch)  # loaded: its OpenMP has read the env
    env = {}
    assert not quiet_openmp(env) and env == {}


def test_the_command_sets_it_before_torch_loads(tmp_path):
    """The entry point sets GOMP_SPINCOUNT first, and nothing imported torch before it."""
    code = ("import os, sys; sys.argv = ['minigpt', '--version']\n"
            "from minigpt.cli import main\n"
            "loaded = 'torch' in sys.modules\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(loaded, os.environ.get('GOMP_SPINCOUNT'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True).stdout.split()
    assert out[-2:] == ["False", str(OPENMP_SPIN)]


def installed(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINIGPT_CACHE": str(cwd / "cache")}
    return subprocess.run([MINIGPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def here(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The same command run by the app in this process (the quick tier's twin of a process
    that would only add its start-up)."""
    return in_process(list(args), cwd=cwd, MINIGPT_CACHE=str(cwd / "cache"))


@pytest.mark.parametrize("value, minigpt", [  # quick: in this process (were the rule broken,
    # 10^6 would crash the test process itself); slow: through the installed command
    *[pytest.param(v, installed, id=f"{v}-installed", marks=pytest.mark.slow)
      for v in (10**6, 2**31, 10**23, CPUS + 1)],
    *[pytest.param(v, here, id=f"{v}-in-process") for v in (10**6, 2**31, 10**23, CPUS + 1)]])
def test_train_threads_beyond_the_cpus_is_one_line_and_creates_nothing(tmp_path, value, minigpt):
    """Issue 39 finding 2: a segfault (10^6) and a torch ValueError traceback (2^31, 10^23)
    before; now one line, exit 2, no run directory."""
    r = minigpt(tmp_path, "train", "--config", "bytes", "--set", f"train.threads={value}",
                "--set", "train.max_steps=2", "--out", "runs/t")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and len(lines[0]) < 600, r.stderr
    assert lines[0].startswith("error: train.threads: ") and f"the {CPUS} CPU" in lines[0]
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command, minigpt", [  # refused before torch loads: the installed
    (["sample"], installed), (["inspect-heads"], installed),  # command; bench loads it first
    pytest.param(["bench", "--quick"], here, id="bench-in-process"),
    pytest.param(["bench", "--quick"], installed, id="bench-installed", marks=pytest.mark.slow)])
def test_every_threads_flag_follows_the_same_rule(tmp_path, command, minigpt):
    for value, why in ((CPUS + 1, f"more than the {CPUS} CPU"), (-1, "not a thread count")):
        r = minigpt(tmp_path, *command, "--threads", str(value))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert lines[0].startswith("error: --threads: ") and why in lines[0]
    assert not (tmp_path / "runs").exists()
