"""Every numeric option of every command, and every numeric setting `--set` takes, given 0,
-1, a huge number, 2^63 and a non-integer (issue 50): each is refused in one line naming the
flag within seconds, or accepted where valid (the command then goes on to the failure its
context sets up: no run under runs/, a corpus that does not exist, a model that does not exist,
one line too). Options are found in typer's command tree and settings in the dataclasses, so a
new one is covered without editing this file. In-process (typer's CliRunner) with a per-case
alarm; a sample of the cases through the installed command in the slow tier."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
from contextlib import contextmanager

import pytest
import typer.main
from conftest import SHARP_INDUCTION, error_line, in_process, make_run

from minigpt.cli import app
from minigpt.config import Config

VALUES = ["0", "-1", "1" + "0" * 30, str(2**63), "1.5", "nan", "abc"]
PER_CASE_S = 60  # generous on a busy 2-core machine; a case that runs the work takes minutes

# What each command is given around the option so that a value it accepts leads to a quick,
# known failure instead of the work itself.
CONTEXT = {
    "bench": ["--suite", "sample", "--model", "no-such-model"],
    "train": ["--set", "data.corpus=no-such-corpus.txt"],
    "curves": ["no-such-run", "--out", "c.png"],
    "export": ["--out", "out"],
    "features train": ["--layer", "0"],  # a later --layer=VALUE replaces it
}


def commands(group=None, prefix: str = "") -> list[tuple[str, object]]:
    """(name, command) of every command, those of sub-groups too (`features train`)."""
    group = group or typer.main.get_command(app)
    out = []
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            out += commands(cmd, f"{prefix}{name} ")
        else:
            out.append((prefix + name, cmd))
    return out


def numeric_options() -> list[tuple[str, str, str]]:
    """(command, flag, 'int' | 'float') of every option whose values are numbers."""
    out = []
    for name, cmd in commands():
        for p in cmd.params:
            kind = p.bare_type() if hasattr(p, "bare_type") else ""
            kind = {"list[int]": "int", "list[float]": "float"}.get(kind, kind)
            if kind in ("int", "float") and p.opts[0].startswith("-"):
                out.append((name, max(p.opts, key=len), kind))
    return out


def numeric_settings() -> list[tuple[str, str]]:
    """(section.key, 'int' | 'float') of every numeric setting."""
    out = []
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else
                                    type(getattr(Config(), section.name))):
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if kind in ("int", "float"):
                out.append((f"{section.name}.{f.name}", kind))
    return out


@contextmanager
def deadline(seconds: int, what: str):
    def stop(signum, frame):
        raise TimeoutError(f"{what} ran past {seconds} s: a bound is missing")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_the_enumeration_finds_the_options_the_issue_names():
    flags = {(c, f) for c, f, _ in numeric_options()}
    assert {("circuit", "--ig-steps"), ("circuit", "--pairs"), ("sample", "--max-new-tokens"),
            ("inspect-heads", "--layer"), ("train", "--stop-after"),
            ("features train", "--steps")} <= flags
    assert {"model.n_layer", "train.max_steps", "train.learning_rate"} <= \
        {k for k, _ in numeric_settings()}


@pytest.mark.parametrize("command,flag,kind", numeric_options(),
                         ids=[f"{c} {f}" for c, f, _ in numeric_options()])
def test_every_numeric_option(tmp_path, command, flag, kind):
    context = CONTEXT.get(command, [])
    # the failure a value it accepts leads to
    base = error_line(in_process([*command.split(), *context], cwd=tmp_path,
                               MINIGPT_CACHE=str(tmp_path)))
    for value in VALUES:
        what = f"minigpt {command} {flag} {value}"
        with deadline(PER_CASE_S, what):
            r = in_process([*command.split(), *context, f"{flag}={value}"], cwd=tmp_path,
                           MINIGPT_CACHE=str(tmp_path))
        line = error_line(r)
        not_a_number = value == "abc" or kind == "int" and value in ("1.5", "nan")
        assert flag in line or line == base and not not_a_number, (what, line)


RUN_COMMANDS = ("circuit", "inspect-heads", "sample")
WITH_RUN = {"circuit": ["--probe", "induction", "--patch-from", "corrupted", "--no-curve"],
            "inspect-heads": ["--probe", "induction"], "sample": ["--prompt", "ab"]}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    
    return make_run(tmp_path_factory.mktemp("fuzz") / "tiny", **SHARP_INDUCTION)


@pytest.mark.parametrize("command,flag,kind",
                         [o for o in numeric_options() if o[0] in RUN_COMMANDS],
                         ids=[f"{c} {f}" for c, f, _ in numeric_options() if c in RUN_COMMANDS])
def test_every_numeric_option_on_a_real_run(tmp_path, tiny_run, command, flag, kind):
    """With a run to work on, a value that is accepted does the work: within the deadline,
    or it was refused in one line naming the flag."""
    for value in VALUES:
        what = f"minigpt {command} {flag} {value} (a run)"
        with deadline(PER_CASE_S, what):
            r = in_process([command, "--run", str(tiny_run), "--device", "cpu",
                            *WITH_RUN[command], f"{flag}={value}"], cwd=tmp_path,
                           MINIGPT_CACHE=str(tmp_path))
        if r.returncode != 0:
            assert flag in error_line(r), (what, r.stderr)


@pytest.mark.parametrize("key,kind", numeric_settings(), ids=[k for k, _ in numeric_settings()])
def test_every_numeric_setting(tmp_path, key, kind):
    base = error_line(in_process(["train", *CONTEXT["train"]], cwd=tmp_path,
                               MINIGPT_CACHE=str(tmp_path)))
    for value in VALUES:
        what = f"minigpt train --set {key}={value}"
        with deadline(PER_CASE_S, what):
            r = in_process(["train", *CONTEXT["train"], "--set", f"{key}={value}"],
                           cwd=tmp_path, MINIGPT_CACHE=str(tmp_path))
        line = error_line(r)
        not_a_number = value == "abc" or kind == "int" and value in ("1.5", "nan")
        assert key in line or line == base and not not_a_number, (what, line)


# The settings that set a training session's length or memory, each bounded by its cost
# (train.safety.check_training): hit with a config that needs no corpus.
TRAINING_BOUNDS = ("train.max_steps", "train.eval_batches", "train.sample_tokens",
                   "train.batch_size", "model.n_embd", "model.n_layer", "model.vocab_size",
                   "model.block_size")


# what else a value needs to reach the bound (a row of more positions than distinct ids)
BOUND_CONTEXT = {"model.block_size": ["--set", "data.induction_distinct=false"]}


@pytest.mark.parametrize("key", TRAINING_BOUNDS)
def test_every_training_bound_is_hit(tmp_path, key):
    assert key in {k for k, _ in numeric_settings()}
    for value in ("1" + "0" * 30, str(2**63)):
        what = f"minigpt train --config induction --set {key}={value}"
        with deadline(PER_CASE_S, what):
            r = in_process(["train", "--config", "induction", "--device", "cpu", "--out",
                            tmp_path / "run", *BOUND_CONTEXT.get(key, []), "--set",
                            f"{key}={value}"], cwd=tmp_path,
                           MINIGPT_CACHE=str(tmp_path))
        line = error_line(r)
        assert line.startswith(f"error: {key}={value}: ") and "--force" in line, (what, line)
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command,flag,kind", numeric_options(),
                         ids=[f"{c} {f}" for c, f, _ in numeric_options()])
def test_installed_command_bounds_2_to_the_63(tmp_path, command, flag, kind):
    program = shutil.which("minigpt")
    assert program is not None
    r = subprocess.run([program, *command.split(), *CONTEXT.get(command, []), flag, str(2**63)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=PER_CASE_S,
                       env={**os.environ, "MINIGPT_CACHE": str(tmp_path)}, check=False)
    error_line(r)
