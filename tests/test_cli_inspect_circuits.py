"""`minigpt inspect-heads --dla / --composition / --patch-from`: the numbers the command prints
are the library's (minigpt.interp.head_circuits), the head table shows every row's head and every
number in full at 80 and at 200 columns, and bad input is one line, exit 2 (in-process through
typer's CliRunner, and a few cases through the installed `minigpt` command)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SHARP_INDUCTION, attention_maps_unrendered, error_line, in_process, make_run
from rich.console import Console
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.interp import head_circuits as c
from minigpt.interp.patching import make_metric
from minigpt.run import load_run

BLOCK = SHARP_INDUCTION["block_size"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny", **SHARP_INDUCTION)


def invoke(run_dir: Path, *args: str, width: int | None = None):
    env = {"COLUMNS": str(width)} if width else {}
    return CliRunner().invoke(app, ["inspect-heads", "--run", str(run_dir), "--device", "cpu",
                                    *args], env=env, catch_exceptions=False)


def test_json_carries_the_librarys_numbers(run_dir):
    r = invoke(run_dir, "--probe", "induction", "--dla", "--composition", "--patch-from",
               "corrupted", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    loaded = load_run(run_dir, "cpu")
    from minigpt.heads.probes import corrupted_input, prepare_input

    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    bad, _ = corrupted_input(loaded.cfg, loaded.tokenizer, inp, "corrupted")
    metric = make_metric(len(inp.tokens), inp.positions)
    dla = c.direct_logit_attribution(loaded.model, inp.tokens, metric)
    patch = c.patch_heads(loaded.model, inp.tokens, bad, metric)
    for row in doc["heads"]:
        la, h = row["layer"], row["index"]
        assert row["dla"] == pytest.approx(float(dla.heads[la, h]), abs=1e-6)
        assert row["patch"] == pytest.approx(float(patch.effect[la, h]), abs=1e-6)
    assert doc["dla"]["logit"] == pytest.approx(doc["dla"]["sum_of_components"], abs=1e-5)
    assert doc["patch"]["direction"] == "noising" and "second copy" in doc["patch"][
        "corrupted_input"]
    recs = doc["composition"]
    assert len(recs) == 3 * 3 * 3  # kinds x earlier heads x later heads
    assert set(recs[0]) == {"kind", "from", "from_layer", "from_index", "to", "to_layer",
                            "to_index", "score",
                            "baseline"}
    assert all(r["from_layer"] < r["to_layer"] and 0 <= r["score"] <= 1 for r in recs)
    assert "dla:" in r.stderr and "patch (noising" in r.stderr


def test_text_patching_and_the_logit_difference(run_dir):
    r = invoke(run_dir, "--text", "abcabcab", "--patch-from", "abcxyzab", "--answer", "c",
               "--wrong", "z", "--dla", "--patch-direction", "denoising", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["patch"]["metric"] == "logit_diff" and doc["patch"]["direction"] == "denoising"
    assert doc["dla"]["what"] == "logit[99] - logit[122] at the last position"  # bytes ids
    assert all(isinstance(row["patch"], float) for row in doc["heads"])


@pytest.fixture(scope="module")
def with_files(run_dir, tmp_path_factory):
    """One call with every measurement that draws a picture and the PNG, HTML and JSON files
    (drawing is most of its CPU time), read by the tests of the pictures and of the lens:
    (result, the --out directory). The attention maps unrendered: the tests here read the
    other pictures."""
    out = tmp_path_factory.mktemp("files")
    with attention_maps_unrendered():
        r = invoke(run_dir, "--probe", "induction", "--dla", "--composition", "--patch-from",
                   "corrupted", "--lens", "--json", "--format", "png,html,json", "--out",
                   str(out))
    assert r.exit_code == 0, r.stderr
    return r, out


def test_files_have_the_pictures(with_files):
    _, out = with_files
    for name in ("composition.png", "circuits.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "composition" in json.loads((out / "scores.json").read_text())


@pytest.mark.parametrize("width", [80, 200])
def test_every_row_names_its_head_and_every_number_is_whole(run_dir, width):
    """Rendered in-process at `width` columns: each table fits, no cell is cut (no …), every
    data row starts with its layer and head, and every number the JSON holds is printed."""
    from minigpt.cli.heads import _heads_tables
    from minigpt.heads.inspection import CircuitRequest, inspect
    from minigpt.heads.probes import corrupted_input, prepare_input

    loaded = load_run(run_dir, "cpu")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    bad, src = corrupted_input(loaded.cfg, loaded.tokenizer, inp, "corrupted")
    insp = inspect(loaded.model, inp, ablate="zero",
                   circuits=CircuitRequest(dla=True, patch_tokens=bad, patch_source=src))
    console = Console(width=width, record=True, color_system=None)
    tables = _heads_tables(insp, [0, 1], [0, 1, 2], width)
    for t in tables:
        console.print(t)
    text = console.export_text()
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    assert len(tables) == (2 if width == 80 else 1)
    rows = [line.split() for line in text.splitlines()
            if re.match(r"^\s*[01]\s+[0-2]\s+[a-z]", line)]
    assert len(rows) == 6 * len(tables)  # every table: one row per head, L and H first
    printed = " ".join(text.split())
    for la in range(2):
        for h in range(3):
            for v in (insp.ablation.effect[la, h], insp.dla.heads[la, h],
                      insp.patch.effect[la, h]):
                assert f"{float(v):+.3f}" in printed


@pytest.mark.parametrize("args, expect", [
    (["--text", "abcdef", "--patch-from", "abc"], "--patch-from: has 3 tokens but the input"),
    (["--text", "abcdef", "--dla", "--answer", "ab", "--wrong", "c"], "--answer: 'ab' is 2"),
    (["--text", "abcdef", "--dla", "--answer", "a"], "--wrong: the logit difference needs both"),
    (["--text", "abcdef", "--target", "a"], "--target: sets the metric of --dla"),
    (["--probe", "previous", "--patch-from", "corrupted"], "--patch-from: with a probe"),
    (["--text", "abc", "--patch-from", "abd", "--patch-direction", "up"],
     "--patch-direction: 'up' is not a direction"),
    (["--text", "abc", "--patch-direction", "noising"],  # alone it would change nothing
     "--patch-direction: applies to --patch-from only"),
])
def test_bad_input_is_one_line_exit_2(run_dir, args, expect):
    assert expect in error_line(invoke(run_dir, *args))


def test_a_long_patch_from_text_is_echoed_cut(run_dir):
    """`--patch-from` with a 60 KB text: the stderr line that says what was patched from
    cuts it as every echoed value is cut (the JSON keeps it whole)."""
    r = invoke(run_dir, "--text", "ab" * 30000, "--patch-from", "cd" * 30000, "--json")
    assert r.exit_code == 0, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("patch (noising, from text: ")]
    assert len(line) < 400 and "cdc ... dcd" in line, line
    assert json.loads(r.stdout)["patch"]["corrupted_input"] == "text: " + "cd" * 30000

def test_a_one_layer_model_has_no_composition(tmp_path):
    run = make_run(tmp_path / "one", **SHARP_INDUCTION, n_layer=1)
    assert "composition needs heads in two layers" in error_line(invoke(run, "--composition"))


def installed(run_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`minigpt inspect-heads --run RUN_DIR ARGS` through the installed console script."""
    program = shutil.which("minigpt")
    assert program, "the `minigpt` console script is not on PATH: pip install -e ."
    return subprocess.run([program, "inspect-heads", "--run", str(run_dir), "--device", "cpu",
                           *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"},
                          check=False)


def here(run_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The same command run by the app in this process."""
    return in_process(["inspect-heads", "--run", str(run_dir), "--device", "cpu", *args],
                      cwd=cwd, COLUMNS="80")


# Each call loads the model (a process: ~2 CPU-s of importing torch): in this process in the
# quick tier, through the installed command in the slow tier (the quick tier runs the installed
# `minigpt inspect-heads` in tests/test_cli_real.py and tests/test_run_choice.py).
@pytest.mark.parametrize("how", [pytest.param(here, id="in-process"),
                                 pytest.param(installed, id="installed",
                                              marks=pytest.mark.slow)])
def test_the_installed_command(run_dir, tmp_path, how):
    """Through the `minigpt` console script: a working call and two one-line errors."""

    def run(*args):
        r = how(run_dir, tmp_path, *args)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    ok = run("--probe", "induction", "--dla", "--composition", "--patch-from", "corrupted")
    assert ok.returncode == 0, ok.stderr
    assert "dla" in ok.stdout and "patch" in ok.stdout and "composition" in ok.stdout
    for args, needle in ((["--text", "abcd", "--patch-from", "ab"], "has 2 tokens"),
                         (["--text", "abcd", "--dla", "--target", "xy"], "is 2 tokens")):
        r = run(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr


def test_corrupted_first_and_the_corrupted_ids_reproduce_the_numbers(run_dir):
    """`--patch-from corrupted-first` replaces the first copy; the JSON carries the corrupted
    ids, and patching from them outside inspect-heads gives the JSON's numbers. `corrupted` is
    `corrupted-second`."""
    docs = {}
    for name in ("corrupted", "corrupted-second", "corrupted-first"):
        r = invoke(run_dir, "--probe", "induction", "--patch-from", name, "--json")
        assert r.exit_code == 0, r.stderr
        docs[name] = json.loads(r.stdout)
    clean, half = docs["corrupted"]["tokens"], len(docs["corrupted"]["tokens"]) // 2
    second = docs["corrupted-second"]["patch"]
    assert docs["corrupted"]["patch"]["corrupted_tokens"] == second["corrupted_tokens"]
    assert second["corrupted_input"].startswith("corrupted-second: ")
    first = docs["corrupted-first"]["patch"]
    bad = first["corrupted_tokens"]
    assert first["corrupted_input"].startswith("corrupted-first: ")
    assert bad[half:] == clean[half:] and not set(bad[:half]) & set(clean)
    assert "do not add up" in first["reading"]
    loaded = load_run(run_dir, "cpu")
    metric = make_metric(len(clean), range(half, len(clean) - 1))
    patch = c.patch_heads(loaded.model, clean, bad, metric)
    for row in docs["corrupted-first"]["heads"]:
        assert row["patch"] == pytest.approx(float(patch.effect[row["layer"], row["index"]]),
                                             abs=1e-6)


def test_the_patch_column_says_how_to_read_a_fraction_above_1(run_dir):
    r = invoke(run_dir, "--probe", "induction", "--patch-from", "corrupted-first", width=80)
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "from corrupted-first" in text and "above 1 or below 0 is possible" in text
    assert "effects do not add up" in " ".join(r.stderr.split())


def test_the_lens_through_the_command(run_dir, with_files):
    r, out = with_files
    doc = json.loads(r.stdout)
    half = len(doc["tokens"]) // 2
    points = {rec["point"] for rec in doc["lens"]}
    assert points == {"embed", "L0", "L1"} and len(doc["lens"]) == 3 * (half - 1)
    assert {rec["position"] for rec in doc["lens"]} == set(range(half, 2 * half - 1))
    assert all(rec["target"] == doc["tokens"][rec["position"] + 1] for rec in doc["lens"])
    assert (out / "lens.png").read_bytes()[:4] == b"\x89PNG"
    assert '"lens":{"points"' in (out / "attention.html").read_text()
    r = invoke(run_dir, "--text", "abcabc", "--lens", "--target", "a", "--json")
    assert {rec["target"] for rec in json.loads(r.stdout)["lens"]} == {ord("a")}
