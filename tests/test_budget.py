"""Every number a user types has a bound derived from what it costs (issue 50): `minigpt
circuit --ig-steps` and `--pairs` are estimated before the work starts (minigpt.core.budget,
core.edge_graph.circuit_cost) and refused in one line naming the cost and the largest value that
fits, unless --force; a long search reports its progress with an ETA (cli.main.EtaLines)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import in_process
from test_cli_circuits import make_run

from minigpt.core import budget
from minigpt.core.budget import Cost, check_cost, largest_fitting
from minigpt.core.edge_graph import circuit_cost, find_circuit
from minigpt.errors import ArgumentError

PROBE = ("--probe", "induction", "--patch-from", "corrupted")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny")


def error_line(r) -> str:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def circuit(run_dir: Path, *args: str):
    return in_process(["circuit", "--run", run_dir, "--device", "cpu", *PROBE, *args])


def test_largest_fitting_is_the_boundary_of_the_rule():
    def cost(v):
        return Cost(2.0 * v, 10.0 * v)

    for value, limit_s, limit_b in ((10**30, 100.0, 1e9), (7, 100.0, 1e9), (10**9, 1e9, 55.0)):
        n = largest_fitting(cost, value, limit_s, limit_b)
        assert n <= value
        assert cost(n).seconds <= limit_s and cost(n).bytes <= limit_b
        assert n == value or cost(n + 1).seconds > limit_s or cost(n + 1).bytes > limit_b


def test_check_cost_names_the_cost_and_what_fits_or_runs_when_forced(monkeypatch):
    monkeypatch.setattr(budget, "free_memory", lambda device: 1e12)

    def cost(v):
        return Cost(36.0 * v, 1e3 * v)

    with pytest.raises(ArgumentError) as e:
        check_cost("ig_steps", 2**63, cost, what="x")
    text = str(e.value)
    assert text.startswith(f"ig_steps {2**63}:") and "--force" in text
    fits = int(re.search(r"largest that fits is \{name\} (\d+)", e.value.problem).group(1))
    assert fits == 100  # 100 x 36 s = the hour
    assert check_cost("ig_steps", 2**63, cost, what="x", force=True).seconds == 36.0 * 2**63
    assert check_cost("ig_steps", 100, cost, what="x").seconds == 3600.0


def test_memory_bounds_as_time_does(monkeypatch):
    monkeypatch.setattr(budget, "free_memory", lambda device: 1e9)
    with pytest.raises(ArgumentError, match=r"memory free .*largest that fits is pairs 8\b"):
        check_cost("pairs", 10**6, lambda v: Cost(1.0, 1e8 * v), what="x")


def test_circuit_cost_grows_with_each_number(run_dir):
    from minigpt.run import load_run

    cfg = load_run(run_dir, "cpu").cfg.model
    base = circuit_cost(cfg, 24, 1, 5, True, 0.01)
    more_steps = circuit_cost(cfg, 24, 1, 50, True, 0.01)
    more_pairs = circuit_cost(cfg, 24, 10, 5, True, 0.01)
    assert more_steps.seconds > base.seconds and more_steps.bytes == base.bytes
    assert more_pairs.seconds == pytest.approx(10 * base.seconds)
    assert more_pairs.bytes == pytest.approx(10 * base.bytes)


@pytest.mark.parametrize("flag,value", [("--ig-steps", str(2**63)), ("--ig-steps", "10" + "0" * 30),
                                        ("--pairs", "1000000"), ("--pairs", str(2**63))])
def test_huge_values_are_refused_in_one_line_before_the_work(run_dir, flag, value):
    t0 = time.monotonic()
    r = circuit(run_dir, flag, value)
    line = error_line(r)
    assert time.monotonic() - t0 < 120  # a generous guard against running the search itself
    assert line.startswith(f"error: {flag} {value}: ") and "--force" in line
    assert re.search(rf"largest that fits is {flag} \d+", line), line
    assert "would take about" in line


def test_progress_has_an_eta(run_dir, monkeypatch):
    import sys

    main = sys.modules["minigpt.cli.main"]
    lines = []
    monkeypatch.setattr(main, "say", lines.append)
    clock = iter(range(0, 1000, 3))
    bar = main.EtaLines("circuit")
    bar.clock = lambda: float(next(clock))
    bar.start = bar.last = bar.prev = bar.clock()
    for k in range(1, 11):
        bar("scoring edges", k, 10)
    bar("circuit search", 1, 2)
    assert lines and all(x.startswith("circuit: ") for x in lines)
    assert any("ETA" in x for x in lines if "scoring edges" in x and "10/10" not in x)
    assert any("10/10" in x for x in lines)  # each stage's end is said once the bar speaks
    stages = []
    from minigpt.heads.edge_circuit import circuit_pairs
    from minigpt.run import load_run

    loaded = load_run(run_dir, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted", probe="induction")
    find_circuit(loaded.model, p.clean, p.corrupted, p.metric, p.targets, ig_steps=4,
                 progress=lambda *a: stages.append(a))
    assert stages[:4] == [("scoring edges", k, 4) for k in range(1, 5)]
    assert stages[-1][1] == stages[-1][2] and {s[0] for s in stages[4:]} == {
        "circuit search", "faithfulness curves"}


@pytest.mark.slow
def test_installed_command_refuses_a_billion_ig_steps(run_dir):
    """The installed program's one line (the quick tier refuses the same in this process:
    test_huge_values_are_refused_in_one_line_before_the_work)."""
    program = shutil.which("minigpt")
    assert program is not None
    r = subprocess.run([program, "circuit", "--run", str(run_dir), "--device", "cpu", *PROBE,
                        "--ig-steps", "1000000000"], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --ig-steps 1000000000: "), r.stderr
    assert "largest that fits is --ig-steps" in lines[0]
