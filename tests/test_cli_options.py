"""One spelling per option (issue 47): every option two commands share is declared once
(minigpt/cli/main.py) and reads the same in each: the same flags, type, default and help text.
The walk reads typer's click command tree in-process (what `minigpt COMMAND --help` prints),
so a command that declares its own copy of a shared option, or drifts from it, fails here.

The few options whose meaning is the command's own are listed with why, and only the parts
named may differ."""

from __future__ import annotations

from collections import defaultdict

import pytest
import typer

from minigpt.cli import app

# option -> (the commands where it means something of their own, why). Those commands still
# spell it the same (the same flags); the other commands sharing it agree in everything.
OWN_MEANING = {
    "--out": ({"train", "curves", "export"}, (
        "what is written is the command's own: a run directory (train), a picture (curves), "
        "an export (export); inspect-heads and circuit share one --out for their files")),
    "--format": ({"inspect-heads", "circuit", "export"}, (
        "each command writes its own files (export: one format; inspect-heads and circuit: "
        "several, not the same ones)")),
    "--dtype": ({"bench", "export"}, (
        "bench computes in it (auto picks), export stores the matrices in it; the values are "
        "spelled the same (float32, float16)")),
    "--json": ({"bench", "sample"}, (
        "bench's --json PATH writes its report to a file, as scripts use it; sample prints "
        "one document per sample; everywhere else a flag printing the result as one document")),
    "--seed": ({"sample"}, (
        "sample draws a fresh seed by default (and prints it); inspect-heads and circuit seed "
        "their synthetic inputs with 0; each help says its default")),
    "--device": ({"train"}, "train's default is the config's run.device"),
}


def options() -> dict[str, list[tuple[str, dict]]]:
    """Every option spelling -> [(command, what it is)] over the command tree."""
    tree = typer.main.get_command(app)
    found: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for name, cmd in tree.commands.items():
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            what = {"flags": tuple(sorted(p.opts + p.secondary_opts)), "help": p.help,
                    "type": str(p.type_descriptor.annotation), "default": repr(p.default),
                    "multiple": p.multiple, "is_flag": p.is_flag, "required": p.required}
            for flag in p.opts:
                if flag.startswith("--"):
                    found[flag].append((name, what))
    return found


SHARED = {flag: uses for flag, uses in options().items() if len(uses) > 1}


def test_the_walk_sees_the_shared_options():
    assert {"--run", "--model", "--device", "--threads", "--text", "--probe",
            "--patch-direction", "--patch-from", "--out"} <= set(SHARED)
    assert {c for c, _ in SHARED["--threads"]} >= {"sample", "inspect-heads", "circuit",
                                                   "bench"}


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
