"""One spelling per option (issue 47): every option two commands share is declared once
(minigpt/cli/options.py) and reads the same in each: the same flags, type, default and help text.
The walk reads typer's click command tree in-process (what `minigpt COMMAND --help` prints),
every command of every group (`features train`, `features show`), so a command that declares
its own copy of a shared option, or drifts from it, fails here; and a flag shows one metavar
in every command's help, even where its meaning is the command's own.

The few options whose meaning is the command's own are listed with why, and only the parts
named may differ."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import typer
from conftest import in_process

from minigpt.cli import app

# option -> (the commands where it means something of their own, why). Those commands still
# spell it the same (the same flags); the other commands sharing it agree in everything.
OWN_MEANING = {
    "--out": ({"train", "curves", "export", "bench", "compile", "features train",
               "features show"}, (
        "what is written is the command's own: a run directory (train, compile), a picture "
        "(curves), an export (export), a JSON report (bench), an SAE's directory (features "
        "train), an SAE's pictures beside it (features show); inspect-heads and circuit share "
        "one --out for their files")),
    "--layer": ({"inspect-heads", "features train"}, (
        "inspect-heads shows the layers given (repeatable, default all); features train reads "
        "one layer's head outputs (required)")),
    "--resume": ({"train", "features train"}, (
        "each continues its own unfinished work in --out: a run from its checkpoint, an SAE "
        "from its training state")),
    "--tokens": ({"features train", "features show"}, (
        "the tokens an SAE trains on, the held-out tokens its features are shown on")),
    "--top": ({"circuit", "features show"}, "the edges in circuit's table, the features shown"),
    "--format": ({"inspect-heads", "circuit", "export"}, (
        "each command writes its own files (export: one format; inspect-heads and circuit: "
        "several, not the same ones)")),
    "--dtype": ({"bench", "export"}, (
        "bench computes in it (auto picks), export stores the matrices in it; the values are "
        "spelled the same (float32, float16)")),
    "--json": ({"sample"}, (
        "sample prints one document per sample; everywhere else a flag printing the result as "
        "one document")),
    "--run": ({"runs", "curves", "features train", "features show"}, (
        "several runs make sense: repeatable, a run's directory or its name under runs/ (the "
        "runs given as arguments count the same); every other command reads one run, "
        "features show by default the one its SAE was trained on, features train the run "
        "whose layer it reads")),
    "--checkpoint": ({"features train", "features show"}, (
        "inspect-heads and circuit inspect the step given; features train reads its layer "
        "there, features show shows the SAE there (default: the step it was trained on)")),
    "--text-file": ({"features train", "features show"}, (
        "inspect-heads and circuit read the text whole; features train trains on its first "
        "90%, features show measures on its last 10%")),
    "--head": ({"inspect-heads", "features show"}, (
        "inspect-heads selects heads by their index in the layers chosen (repeatable); "
        "features show lists the features of one head named L1.H2")),
    "--seed": ({"sample", "features train", "features show"}, (
        "sample draws a fresh seed by default (and prints it); inspect-heads and circuit seed "
        "their synthetic inputs with 0; features seeds the tokens it draws (and the SAE's "
        "weights and batches); each help says its default")),
    "--device": ({"train"}, "train's default is the config's run.device"),
    "--compile": ({"bench", "sample"}, (
        "bench also times the train and decode steps compiled; sample decodes through the "
        "compiled one-token step")),
}


def commands(group=None, prefix: str = ""):
    """(name, command) of every command of the tree, a group's as `group command`."""
    group = group or typer.main.get_command(app)
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from commands(cmd, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", cmd


def metavar(cmd, p) -> str:
    """The value's placeholder in `--help` (`--out PATH`; '' for a flag)."""
    shown = p.get_help_record(cmd.make_context("minigpt", [], resilient_parsing=True))[0]
    last = shown.split(", ")[-1]
    return last.split(" ", 1)[1] if " " in last else ""


def options() -> dict[str, list[tuple[str, dict]]]:
    """Every option spelling -> [(command, what it is)] over the command tree."""
    found: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for name, cmd in commands():
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            what = {"flags": tuple(sorted(p.opts + p.secondary_opts)), "help": p.help,
                    "type": str(p.type_descriptor.annotation), "default": repr(p.default),
                    "multiple": p.multiple, "is_flag": p.is_flag, "required": p.required,
                    "metavar": metavar(cmd, p)}
            for flag in p.opts:
                if flag.startswith("--"):
                    found[flag].append((name, what))
    return found


SHARED = {flag: uses for flag, uses in options().items() if len(uses) > 1}


def test_the_walk_sees_the_shared_options_of_every_command_of_every_group():
    assert {"--run", "--model", "--device", "--threads", "--text", "--probe",
            "--patch-direction", "--patch-from", "--out"} <= set(SHARED)
    assert {c for c, _ in SHARED["--threads"]} >= {"sample", "inspect-heads", "circuit",
                                                   "bench", "features train", "features show"}
    top = typer.main.get_command(app).commands
    groups = {name for name, cmd in top.items() if hasattr(cmd, "commands")}
    assert groups == {"features"}
    walked = {name for name, _ in commands()}
    assert {f"features {c}" for c in top["features"].commands} <= walked
    assert set(top) - groups <= walked


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_a_shared_option_shows_one_metavar_everywhere(flag):
    """`--out PATH` in every command, `--run RUN` in every command: one spelling of the
    value in every help, whatever the option means there."""
    shown = {cmd: what["metavar"] for cmd, what in SHARED[flag]}
    assert len(set(shown.values())) == 1, (flag, shown)


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_a_shared_option_reads_the_same_in_every_command(flag):
    own = OWN_MEANING.get(flag, (set(), ""))[0]
    uses = SHARED[flag]
    assert len({what["flags"] for _, what in uses}) == 1, (flag, "one spelling", uses)
    alike = [(cmd, what) for cmd, what in uses if cmd not in own]
    for cmd, what in alike[1:]:
        first_cmd, first = alike[0]
        differ = sorted(k for k in what if what[k] != first[k])
        assert not differ, (f"{flag}: {cmd} and {first_cmd} differ in {differ}: "
                            f"{ {k: (what[k], first[k]) for k in differ} }")


def test_the_exceptions_are_real():
    """An option listed as some commands' own is shared by them, and each of them does read
    differently from the rest (a listing that no longer applies is removed)."""
    for flag, (own, why) in OWN_MEANING.items():
        uses = dict(SHARED[flag])
        assert own <= set(uses) and why, flag
        for cmd in own:
            assert any(uses[cmd] != what for other, what in uses.items() if other != cmd), (
                flag, cmd)


def test_a_short_flag_means_one_long_one():
    """-o is --out wherever it exists, and every command with --out has -o."""
    for flag, uses in options().items():
        for cmd, what in uses:
            if flag == "--out":
                assert "-o" in what["flags"], cmd
            shorts = [f for f in what["flags"] if not f.startswith("--")]
            assert all(f != "-o" or flag == "--out" for f in shorts), (cmd, flag)


# --------------------------------------------------------------------------------------------
# The old spellings kept for scripts (issue 47): `runs DIR` / `curves RUN...` beside `--run`,
# and bench's `--json PATH` beside `--out PATH` (`--json` alone is the flag every command has).
# runs: through the installed command; curves and bench in this process (the same code either
# way: drawing and timing are their CPU time), through the installed command in the slow tier.

MINIGPT = shutil.which("minigpt")


def installed(args: list, cwd: Path) -> subprocess.CompletedProcess:
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    r = subprocess.run([MINIGPT, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       timeout=300, check=False)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_runs_takes_run_as_it_takes_its_argument(trained_runs, tmp_path):
    finished, stopped = (trained_runs[k]["dir"] for k in ("finished", "stopped"))
    listed = {}
    for name, args in {"argument": [finished], "--run": ["--run", finished],
                       "relative argument": ["runs/finished"],
                       "--run by name": ["--run", "finished"], "directory": ["runs"],
                       "--run twice": ["--run", "stopped", "--run", "runs/finished"]}.items():
        argv, cwd = ["runs", *args, "--json"], finished.parent.parent  # cwd holds runs/
        r = installed(argv, cwd) if name in ("argument", "--run") else in_process(argv, cwd=cwd)
        assert r.returncode == 0, (name, r.stderr)
        listed[name] = json.loads(r.stdout)
    assert listed["argument"] == listed["--run"]
    assert listed["relative argument"] == listed["--run by name"]
    assert [x["name"] for x in listed["argument"]["runs"]] == ["finished"]
    both = sorted(listed["--run twice"]["runs"], key=lambda x: x["name"])
    assert both == listed["directory"]["runs"] and [x["path"] for x in both] == [
        "runs/finished", "runs/stopped"] and stopped.is_dir()


def test_curves_takes_run_as_it_takes_its_arguments(trained_runs, tmp_path):
    finished, stopped = (trained_runs[k]["dir"] for k in ("finished", "stopped"))
    drawn = {}
    for name, args in {"arguments": [finished, stopped], "--run": ["--run", finished, "--run",
                                                                     stopped],
                       "mixed": [finished, "--run", stopped]}.items():
        r = in_process(["curves", *args, "-o", tmp_path / f"{name}.png"])
        assert r.returncode == 0 and r.stderr == f"wrote {tmp_path / name}.png (2 runs)\n", \
            r.stderr
        drawn[name] = (tmp_path / f"{name}.png").read_bytes()
    assert drawn["arguments"] == drawn["--run"] == drawn["mixed"]
    none = in_process(["curves", "-o", tmp_path / "none.png"])
    assert none.returncode == 2 and "--run" in none.stderr and not (tmp_path / "none.png").exists()


@pytest.mark.slow
def test_installed_curves_takes_run_as_it_takes_its_arguments(trained_runs, tmp_path):
    """The two spellings through the installed program (the quick tier: the test above, in
    this process)."""
    finished, stopped = (trained_runs[k]["dir"] for k in ("finished", "stopped"))
    old = installed(["curves", finished, stopped, "-o", tmp_path / "old.png"], tmp_path)
    new = installed(["curves", "--run", finished, "--run", stopped, "-o", tmp_path / "new.png"],
                    tmp_path)
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert old.stderr.replace("old.png", "new.png") == new.stderr
    assert (tmp_path / "old.png").read_bytes() == (tmp_path / "new.png").read_bytes()


TINY_BENCH = ["bench", "--device", "cpu", "--quick", "--suite", "attention", "--seq-lens", "8"]


def _summary_shape(doc: dict) -> dict:
    """A bench summary without its measured numbers."""
    return {k: (sorted(v) if isinstance(v, dict) else v) for k, v in doc.items()}


def test_bench_json_path_is_the_old_spelling_of_out(tmp_path):
    old = in_process([*TINY_BENCH, "--json", tmp_path / "old.json"])
    new = in_process([*TINY_BENCH, "-o", tmp_path / "new.json"])
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    docs = [json.loads((tmp_path / f).read_text()) for f in ("old.json", "new.json")]
    assert [sorted(d) for d in docs] == [["environment", "schema", "suites", "summary"]] * 2
    for r, doc in ((old, docs[0]), (new, docs[1])):  # tables, then the summary line
        lines = r.stdout.strip().splitlines()
        assert lines[0].startswith("device cpu") and json.loads(lines[-1]) == doc["summary"]
    assert _summary_shape(docs[0]["summary"]) == _summary_shape(docs[1]["summary"])
    assert [len(d["suites"]["attention"]["rows"]) for d in docs] == [4, 4]


def test_bench_json_alone_prints_the_report(tmp_path):
    r = in_process([*TINY_BENCH, "--json"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    [line] = r.stdout.splitlines()  # one document, nothing else, no file
    doc = json.loads(line)
    assert doc["schema"] == "minigpt-bench/1" and doc["environment"]["quick"] is True
    assert len(doc["suites"]["attention"]["rows"]) == 4 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, needle", [
    (["--json", "/dev/null"], "--json /dev/null"),  # refused before any suite runs
    (["--out", "/dev/null"], "--out /dev/null"),
    (["--out", "a.json", "--json", "b.json"], "given twice"),
    (["stray.json"], "unexpected extra argument (stray.json)"),
])
def test_bench_out_spellings_refused_in_one_line(tmp_path, args, needle):
    r = in_process([*TINY_BENCH, *args], cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == [] and r.stdout == ""


@pytest.mark.slow
def test_installed_bench_json_path_and_out_write_the_same_report(tmp_path):
    """The two spellings through the installed program (test_bench_json_path_is_the_old_
    spelling_of_out runs them in this process)."""
    runs = [installed([*TINY_BENCH, flag, tmp_path / f"{flag.strip('-')}.json"], tmp_path)
            for flag in ("--json", "--out")]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    docs = [json.loads((tmp_path / f).read_text()) for f in ("json.json", "out.json")]
    assert _summary_shape(docs[0]["summary"]) == _summary_shape(docs[1]["summary"])
    for r, doc in zip(runs, docs, strict=True):
        assert json.loads(r.stdout.strip().splitlines()[-1]) == doc["summary"]
