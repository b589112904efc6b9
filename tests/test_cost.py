"""Every number a user types has a bound derived from what it costs (issue 50): `minigpt
circuit --ig-steps` and `--pairs` are estimated before the work starts (minigpt.cost,
interp.edge_graph.circuit_cost) and refused in one line naming the cost and the largest value that
fits, unless --force; a long search reports its progress with an ETA (cli.main.EtaLines)."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import SHARP_INDUCTION, error_line, in_process, make_run

from minigpt import cost, device
from minigpt.cost import Cost, check_cost, largest_fitting
from minigpt.errors import ArgumentError
from minigpt.events import Progress
from minigpt.interp.edge_graph import circuit_cost, find_circuit

PROBE = ("--probe", "induction", "--patch-from", "corrupted")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny", **SHARP_INDUCTION)


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
    monkeypatch.setattr(device, "available_bytes", lambda d: 1e12)

    def hourly(v):
        return Cost(36.0 * v, 1e3 * v)

    with pytest.raises(ArgumentError) as e:
        check_cost("ig_steps", 2**63, hourly, what="x")
    text = str(e.value)
    assert text.startswith(f"ig_steps {2**63}:") and "--force" in text
    fits = int(re.search(r"largest that fits is \{name\} (\d+)", e.value.problem).group(1))
    assert fits == 100  # 100 x 36 s = the hour
    assert check_cost("ig_steps", 2**63, hourly, what="x", force=True).seconds == 36.0 * 2**63
    assert check_cost("ig_steps", 100, hourly, what="x").seconds == 3600.0


def test_memory_bounds_as_time_does(monkeypatch):
    monkeypatch.setattr(device, "available_bytes", lambda d: 1e9)
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
        bar(Progress("scoring edges", k, 10))
    bar(Progress("circuit search", 1, 2))
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
@pytest.mark.parametrize("flag,value", [("--ig-steps", "1000000000"), ("--pairs", "1000000")])
def test_installed_command_refuses_a_billion_ig_steps(run_dir, flag, value):
    """Issue 50's causes 1 and 2, as typed: each refused in one line before the work (the
    quick tier refuses the same in this process:
    test_huge_values_are_refused_in_one_line_before_the_work)."""
    program = shutil.which("minigpt")
    assert program is not None
    r = subprocess.run([program, "circuit", "--run", str(run_dir), "--device", "cpu", *PROBE,
                        flag, value], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} {value}: "), r.stderr
    assert f"largest that fits is {flag}" in lines[0]


def test_circuit_shows_progress_and_whole_words(run_dir, monkeypatch):
    """Issue 50: circuit showed no progress, and its first line cut the corrupted input's
    description mid-word. Through the command: ETA lines on stderr, whole words."""
    import sys

    main = sys.modules["minigpt.cli.main"]
    monkeypatch.setattr(main.EtaLines, "FIRST", 0.0)
    monkeypatch.setattr(main.EtaLines, "EVERY", 0.0)
    r = in_process(["circuit", "--run", run_dir, "--device", "cpu", "--probe", "induction",
                    "--patch-from", "corrupted-second", "--ig-steps", "2", "--no-curve"])
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert any(x.startswith("circuit: scoring edges 1/2, ") and "ETA" in x for x in lines)
    first = next(x for x in lines if "corrupted: " in x)
    described = first.split("corrupted: ")[1].split("; metric")[0]
    from minigpt.heads.probes import CORRUPTIONS

    words = {w.strip("()") for w in f"corrupted-second: {CORRUPTIONS['corrupted-second']}".split()}
    assert all(w.strip("()") in words or w == "..." for w in described.split()), described


# -- training: the session's memory and length (train.safety.check_training) ------------------


def _cfg(**sets):
    from minigpt.config import load_config

    cfg = load_config("default", [f"{k}={v}" for k, v in sets.items()])
    cfg.model.vocab_size = cfg.model.vocab_size or cfg.tokenizer.vocab_size  # as fit_vocab
    return cfg


@pytest.fixture
def slow_machine(monkeypatch):
    """A machine of 1 GFLOP/s and 8 GB free: the estimates do not depend on this one."""
    monkeypatch.setattr(cost, "matmul_rate", lambda *a, **k: 1e9)
    monkeypatch.setattr(device, "available_bytes", lambda d: 8e9)


@pytest.mark.parametrize("key,value", [
    ("train.max_steps", 10**12), ("train.max_steps", 2**63), ("train.eval_batches", 10**8),
    ("train.sample_tokens", 10**12), ("train.batch_size", 10**9), ("model.n_embd", 10**6),
    ("model.n_layer", 10**6), ("model.vocab_size", 10**12), ("model.block_size", 10**9)])
def test_training_refuses_each_setting_naming_the_largest_that_fits(slow_machine, key, value):
    from minigpt.errors import ConfigError
    from minigpt.train.safety import Session, check_training

    cpu = torch.device("cpu")
    with pytest.raises(ConfigError) as e:
        check_training(_cfg(**{key: value}), Session(), cpu)
    text = str(e.value)
    assert text.startswith(f"{key}={value}: ") and "--force" in text, text
    fits = int(re.search(rf"largest that fits is {re.escape(key)}=(\d+)", text).group(1))
    assert 1 <= fits < value
    check_training(_cfg(**{key: fits}), Session(), cpu)  # the value it names does fit
    check_training(_cfg(**{key: value}), Session(force=True), cpu)  # forced: not checked


def test_a_huge_micro_batch_is_refused_with_a_batch_that_fits(slow_machine):
    """train.batch_size and train.micro_batch_size both huge: the refusal names a batch size
    that fits (its micro-batches no larger than it), not "even 1 does not fit", and blames no
    setting at its usual value (the default's vocabulary, 1024 BPE tokens + end-of-text)."""
    from minigpt.errors import ConfigError
    from minigpt.train.safety import Session, check_training

    cpu = torch.device("cpu")
    with pytest.raises(ConfigError) as e:
        check_training(_cfg(**{"train.batch_size": 2 * 10**8,
                               "train.micro_batch_size": 10**8}), Session(), cpu)
    text = str(e.value)
    fits = int(re.search(r"largest that fits is train.batch_size=(\d+)", text).group(1))
    assert 1 <= fits < 10**8 and "vocab_size" not in text, text
    check_training(_cfg(**{"train.batch_size": fits}), Session(), cpu)


def test_training_length_is_the_sessions(slow_machine):
    """--stop-after and a resume's first step bound the session: a huge max_steps with
    --stop-after 10 trains 10 steps; the largest max_steps named counts from the resumed step."""
    from minigpt.errors import ConfigError
    from minigpt.train.safety import Session, check_training

    cpu = torch.device("cpu")
    check_training(_cfg(**{"train.max_steps": 10**12}), Session(stop_after=10), cpu)
    with pytest.raises(ConfigError) as fresh:
        check_training(_cfg(**{"train.max_steps": 10**9}), Session(), cpu)
    with pytest.raises(ConfigError) as resumed:
        check_training(_cfg(**{"train.max_steps": 10**9}), Session(start=5000), cpu)
    largest = [int(re.search(r"largest that fits is train.max_steps=(\d+)", str(e.value))[1])
               for e in (fresh, resumed)]
    assert largest[1] == largest[0] + 5000


def test_bundled_configs_are_never_refused_and_never_measured(monkeypatch):
    """configs/*.yaml (the README's runs) fit a week at FLOOR_RATE, so no machine refuses
    them and none measures its rate for them."""
    from minigpt.train import safety

    def no_probe(*a, **k):
        raise AssertionError("measured the rate for a bundled config")

    monkeypatch.setattr(cost, "matmul_rate", no_probe)
    configs = sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))
    assert len(configs) >= 4
    for path in configs:
        from minigpt.config import load_config

        cfg = load_config(str(path), [])
        cfg.model.vocab_size = cfg.model.vocab_size or cfg.tokenizer.vocab_size
        safety.check_training(cfg, safety.Session(), torch.device("cpu"))


def test_train_refuses_a_trillion_steps_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    r = in_process(["train", "--config", "induction", "--out", out, "--device", "cpu",
                    "--set", "train.max_steps=1000000000000"], cwd=tmp_path,
                   MINIGPT_CACHE=str(tmp_path / "cache"))
    line = error_line(r)
    assert line.startswith("error: train.max_steps=1000000000000: ") and "--force" in line
    assert re.search(r"largest that fits is train.max_steps=\d+", line), line
    assert "a training session may take" in line and "years" in line
    assert not out.exists()  # refused before the run directory was made


# -- inspect-heads: progress and --max-tokens bounded by the cost of what is asked for -----------


def test_inspect_heads_reports_each_long_part(run_dir):
    from minigpt.heads.inspection import CircuitRequest, inspect
    from minigpt.heads.probes import corrupted_input, prepare_input
    from minigpt.run import load_run

    loaded = load_run(run_dir, "cpu")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    req = CircuitRequest(composition=True, qk=[(1, 0), (1, 2)])
    req.patch_tokens, req.patch_source = corrupted_input(loaded.cfg, loaded.tokenizer, inp,
                                                         "corrupted")
    seen = []
    inspect(loaded.model, inp, ablate="zero", circuits=req, on_event=seen.append)
    assert all(isinstance(e, Progress) for e in seen)
    seen = [(e.stage, e.done, e.total) for e in seen]
    stages = {s for s, _, _ in seen}
    assert stages == {"ablating heads", "patching heads", "splitting qk", "composition"}
    for name in stages:
        done = [(d, t) for s, d, t in seen if s == name]
        assert done[-1][0] == done[-1][1] and all(
            a[0] <= b[0] for a, b in itertools.pairwise(done))


def test_inspect_heads_eta_lines_on_stderr(run_dir, monkeypatch):
    import sys

    main = sys.modules["minigpt.cli.main"]
    monkeypatch.setattr(main.EtaLines, "FIRST", 0.0)
    monkeypatch.setattr(main.EtaLines, "EVERY", 0.0)
    r = in_process(["inspect-heads", "--run", run_dir, "--device", "cpu", "--probe",
                    "induction", "--ablate", "zero"])
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("inspect-heads: ablating heads")]
    assert lines and lines[-1].startswith("inspect-heads: ablating heads 6/6"), r.stderr


def test_inspect_heads_refuses_what_does_not_fit_and_runs_what_fits(run_dir, monkeypatch):
    """On a machine slow enough (patched) that --ablate on the tiny run's probe takes 1.7 h,
    it is refused naming the largest --max-tokens that fits; that value runs, and so does
    --force."""
    from minigpt.heads import inspection
    from minigpt.heads.probes import prepare_input
    from minigpt.run import load_run

    loaded = load_run(run_dir, "cpu")
    n = len(prepare_input(loaded.cfg, loaded.tokenizer, probe="induction").tokens)
    flops, _ = inspection.inspect_cost(loaded.cfg.model, n, ablate="zero")
    monkeypatch.setattr(cost, "matmul_rate", lambda *a, **k: flops / 6000)  # 1.67 h
    monkeypatch.setattr(cost, "FLOOR_RATE", 1e-9)  # always measured
    args = ["inspect-heads", "--run", run_dir, "--device", "cpu", "--probe", "induction",
            "--ablate", "zero", "--json"]
    line = error_line(in_process(args))
    assert line.startswith(f"error: --max-tokens {n}: inspecting {n} tokens with ablation "
                           "would take about 1h40m") and "--force" in line, line
    fits = int(re.search(r"largest that fits is --max-tokens (\d+)", line)[1])
    assert 2 <= fits < n
    assert in_process([*args, "--max-tokens", str(fits)]).returncode == 0
    forced = in_process([*args, "--force"])
    assert forced.returncode == 0 and "estimated" not in forced.stderr, forced.stderr


@pytest.mark.slow
def test_installed_train_refuses_then_force_trains(tmp_path):
    """`minigpt train --set train.max_steps=1000000000000`: one line, exit 2, nothing made;
    with --force it trains (its first step line appears) until stopped (SIGINT: checkpoint
    saved, exit 130)."""
    import os
    import signal

    program = shutil.which("minigpt")
    assert program is not None
    base = [program, "train", "--config", "induction", "--device", "cpu", "--set",
            "train.max_steps=1000000000000", "--set", "train.log_interval=1"]
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([*base, "--out", str(tmp_path / "a")], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path, check=False)
    assert error_line(r).startswith("error: train.max_steps=1000000000000: ")
    assert not (tmp_path / "a").exists()
    p = subprocess.Popen([*base, "--out", str(tmp_path / "b"), "--force"], text=True,
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=tmp_path)
    try:
        for line in p.stderr:
            if line.startswith("step "):  # its first step done
                break
        p.send_signal(signal.SIGINT)
        rest = p.stderr.read()
        assert p.wait(timeout=300) == 130, rest
    finally:
        if p.poll() is None:
            p.kill()
    assert "checkpoint saved" in rest or "interrupted" in rest, rest


@pytest.mark.slow
def test_installed_inspect_heads_refuses_a_qk_split_of_every_head_of_a_deep_model(tmp_path):
    """A 48-layer, 24-head model (random weights, 7 MB) with 1,024 tokens: `--qk all` would
    hold terabytes of (pairs x writers x writers) grids; refused in one line before the work."""
    from minigpt.config import from_dict
    from minigpt.core.gpt import GPT
    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.run.checkpoint import save_checkpoint

    tok = bytes_tokenizer()
    cfg = from_dict({"model": {"n_layer": 48, "n_head": 24, "n_embd": 96, "block_size": 1024,
                               "vocab_size": tok.n_vocab, "mlp": False},
                     "tokenizer": {"vocab_size": 256}})
    run = tmp_path / "deep"
    save_checkpoint(run, step=1, model=GPT.from_config(cfg, seed=0), cfg=cfg, tokenizer=tok,
                    trainer_state={"step": 1})
    program = shutil.which("minigpt")
    assert program is not None
    r = subprocess.run([program, "inspect-heads", "--run", str(run), "--device", "cpu",
                        "--probe", "induction", "--qk", "all"], capture_output=True, text=True,
                       timeout=300, check=False)
    line = error_line(r)
    assert line.startswith("error: --max-tokens ") and "qk split of 1152 heads" in line, line
    assert "of memory free" in line and "--force" in line


# -- features train: the SAE's size and length -----------------------------------------------


@pytest.mark.parametrize("flag", ["--steps", "--width", "--batch-size", "--tokens", "--held-out"])
def test_features_train_refuses_each_huge_number_before_the_work(run_dir, tmp_path, flag):
    out = tmp_path / "sae"
    for value in ("1" + "0" * 30, str(2**63)):
        r = in_process(["features", "train", "--run", run_dir, "--device", "cpu", "--layer",
                        "1", "--out", out, flag, value])
        line = error_line(r)
        assert line.startswith(f"error: {flag} {value}: ") and "--force" in line, line
        assert re.search(rf"largest that fits is {flag} \d+", line), line
        assert not out.exists()


def test_features_show_tokens_are_bounded(run_dir):
    """features.show.check_show_cost, the check `features show --tokens` makes: a huge count
    refused naming the largest that fits, which passes; --force passes anything."""
    from minigpt.features.show import check_show_cost
    from minigpt.interp.sae import TopKSAE
    from minigpt.run import load_run

    loaded, sae = load_run(run_dir, "cpu"), TopKSAE(24, 48, 4)
    with pytest.raises(ArgumentError) as e:
        check_show_cost(loaded, sae, 2**63)
    fits = int(re.search(r"largest that fits is \{name\} (\d+)", e.value.problem)[1])
    check_show_cost(loaded, sae, fits)
    check_show_cost(loaded, sae, 2**63, force=True)


@pytest.mark.slow
def test_features_show_refuses_a_huge_tokens_before_the_work(run_dir, tmp_path):
    """`features show --tokens`: one line naming it and the largest that fits (an SAE of a
    few steps on the tiny run: the bound does not depend on its weights)."""
    sae = tmp_path / "sae"
    made = in_process(["features", "train", "--run", run_dir, "--device", "cpu", "--layer", "1",
                       "--out", sae, "--steps", "2", "--tokens", "256", "--held-out", "64",
                       "--batch-size", "64", "--width", "48", "--k", "4"])
    assert made.returncode == 0, made.stderr
    for value in ("1" + "0" * 30, str(2**63)):
        line = error_line(in_process(["features", "show", "--sae", sae, "--run", run_dir,
                                      "--device", "cpu", "--tokens", value]))
        assert line.startswith(f"error: --tokens {value}: ") and "--force" in line, line
        assert re.search(r"largest that fits is --tokens \d+", line), line


# -- sample: the samples asked for -----------------------------------------------------------


def test_sample_refuses_what_cannot_end_in_an_hour_and_force_runs_it(tmp_path, monkeypatch):
    """On a machine slow enough (patched) that 3 samples of 20 tokens take 2 h, `sample` is
    refused in one line naming --num-samples and the largest that fits (1); --force samples."""
    from conftest import make_run

    from minigpt.infer import sample as smp
    from minigpt.run import load_run

    run = make_run(tmp_path / "run", top_files=True)
    loaded = load_run(run, "cpu")
    prompt = len(loaded.tokenizer.encode("ab"))
    flops = smp.sample_flops(loaded.model.cfg, prompt, 20, 3)
    monkeypatch.setattr(cost, "matmul_rate", lambda *a, **k: flops / 7200)
    monkeypatch.setattr(cost, "FLOOR_RATE", 1e-9)  # always measured
    args = ["sample", "--run", run, "--device", "cpu", "-p", "ab", "-n", "20",
            "--num-samples", "3", "--seed", "1"]
    line = error_line(in_process(args))
    assert line.startswith("error: --num-samples 3: 3 sample(s) of 20 tokens would take about "
                           "2h00m") and "the largest that fits is --num-samples 1" in line, line
    forced = in_process([*args, "--force", "--json"])
    assert forced.returncode == 0, forced.stderr
    assert len(forced.stdout.strip().splitlines()) == 3
