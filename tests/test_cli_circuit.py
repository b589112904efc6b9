"""`minigpt circuit`: its JSON is the library's (minigpt.interp.edge_graph.find_circuit) in the
issue's shape, its table fits 80 columns, its files are pictures, a page and JSON, and bad
input is one line, exit 2, before any work (in-process through typer's CliRunner, and through
the installed `minigpt` command)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SHARP_INDUCTION, error_line, in_process, make_run
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.heads.edge_circuit import circuit_pairs
from minigpt.interp import edge_graph as G
from minigpt.run import load_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny", **SHARP_INDUCTION)


def invoke(run_dir: Path, *args: str, width: int | None = None):
    env = {"COLUMNS": str(width)} if width else {}
    return CliRunner().invoke(app, ["circuit", "--run", str(run_dir), "--device", "cpu",
                                    *args], env=env, catch_exceptions=False)


PROBE = ("--probe", "induction", "--patch-from", "corrupted")


def test_json_is_the_librarys_in_the_issues_shape(run_dir):
    r = invoke(run_dir, *PROBE, "--pairs", "2", "--ig-steps", "3", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {"method", "ig_steps", "metric", "clean", "corrupted", "nodes", "edges", "circuit",
            "faithfulness"} <= set(doc) and "lens" not in doc
    assert doc["method"] == "eap-ig" and doc["ig_steps"] == 3 and doc["n_pairs"] == 2
    loaded = load_run(run_dir, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted", probe="induction",
                      pairs=2)
    want = G.find_circuit(loaded.model, p.clean, p.corrupted, p.metric, p.targets,
                          ig_steps=3, curves=False)
    edges = doc["edges"]
    assert len(edges) == want.n_edges == 9 + 9 * 4 + 7  # 2 layers of 3 heads, no MLP
    assert [abs(e["score"]) for e in edges] == sorted((abs(e["score"]) for e in edges),
                                                      reverse=True)
    assert {e["input"] for e in edges} == {"q", "k", "v", "logits"}
    by_name = {(e["from"], e["to"], e["input"]): e["score"] for e in want.edges()}
    for e in edges:
        assert e["score"] == pytest.approx(by_name[(e["from"], e["to"], e["input"])], abs=1e-6)
    assert doc["circuit"]["recovered"] == pytest.approx(want.recovered, abs=1e-6)
    assert doc["circuit"]["recovered"] >= 0.9 and doc["circuit"]["target"] == 0.9
    assert [f["fraction"] for f in doc["faithfulness"]] == list(G.FRACTIONS)
    assert doc["faithfulness"][-1]["recovered"] == pytest.approx(1.0, abs=1e-5)
    assert set(doc["curves"]) == {"eap", "eap-ig", "patching"}  # 52 edges: the baseline too
    names = [n["name"] for n in doc["nodes"]]
    assert names[0] == "embed" and names[-1] == "logits" and "L1.H2" in names
    assert "scoring every edge on 2 pair(s)" in r.stderr and "recover" in r.stderr


@pytest.mark.parametrize("width", [80, 200])
def test_the_table_fits_and_says_what_the_circuit_recovers(run_dir, width):
    r = invoke(run_dir, *PROBE, "--edges", "4", "--ig-steps", "1", "--no-curve", "--top", "52",
               width=width)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= width for line in lines) and "…" not in r.stdout
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert len(rows) == 52 and sum(line.rstrip().endswith("*") for line in rows) <= 4
    summary = [line for line in r.stderr.splitlines() if line.startswith("circuit (")]
    assert len(summary) == 1 and "the top 4 edges by |score|" in summary[0]


def test_the_files(run_dir, tmp_path):
    r = invoke(run_dir, *PROBE, "--format", "png,html,json", "--out", str(tmp_path))
    assert r.exit_code == 0, r.stderr
    for name in ("circuit.png", "faithfulness.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    page = (tmp_path / "circuit.html").read_text()
    assert "Content-Security-Policy" in page and "data:image/png;base64," in page
    assert '"edges":' in page and "</script>" in page
    doc = json.loads((tmp_path / "circuit.json").read_text())
    assert len(doc["edges"]) == 52 and r.stdout.strip()  # the table too


def test_a_text_pair_and_the_logit_difference(run_dir):
    r = invoke(run_dir, "--text", "abcabcab", "--patch-from", "abcxyzab", "--answer", "c",
               "--wrong", "z", "--patch-direction", "denoising", "--edges", "3", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["metric"]["kind"] == "logit_diff" and doc["direction"] == "denoising"
    assert doc["circuit"]["requested"] == 3


@pytest.mark.parametrize("args, expect", [
    (["--text", "abcdef", "--patch-from", "abc"], "--patch-from: has 3 tokens but the input"),
    (["--text", "abcdef", "--patch-from", "abcxyz", "--answer", "ab", "--wrong", "c"],
     "--answer: 'ab' is 2"),
    ([*PROBE, "--edges", "0"], "--edges 0: must be at least 1"),
    ([*PROBE, "--ig-steps", "0"], "--ig-steps 0: must be at least 1"),
    ([*PROBE, "--recover", "1.5"], "--recover 1.5: must be a fraction"),
    ([*PROBE, "--edges", "3", "--recover", "0.5"], "--edges and --recover exclude each other"),
    (["--probe", "induction"], "--patch-from: a circuit is what carries the difference"),
    (["--probe", "induction", "--patch-direction", "denoising"], "--patch-from: a circuit"),
    ([*PROBE, "--patch-direction", "up"], "--patch-direction: 'up' is not a direction"),
    ([*PROBE, "--format", "safetensors"], "--format: 'safetensors' is not a format"),
    (["--text", "abcdef", "--patch-from", "abcxyz", "--pairs", "2"], "--pairs 2: must be 1"),
    ([*PROBE, "--metric", "odds"], "--metric: 'odds' is not a metric"),
])
def test_bad_input_is_one_line_exit_2(run_dir, args, expect):
    assert expect in error_line(invoke(run_dir, *args))


def installed(run_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`minigpt circuit --run RUN_DIR ARGS` through the installed console script, 80 columns."""
    program = shutil.which("minigpt")
    assert program, "the `minigpt` console script is not on PATH: pip install -e ."
    return subprocess.run([program, "circuit", "--run", str(run_dir), "--device", "cpu", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "80"})


def here(run_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The same command run by the app in this process."""
    return in_process(["circuit", "--run", str(run_dir), "--device", "cpu", *args], cwd=cwd,
                      COLUMNS="80")


HOW_ID = {installed: "installed", here: "in-process"}
# The bad flags are refused before the model loads, so a process costs little there; a working
# call or a refusal after loading costs a process its torch import (~2 CPU-s): in-process in
# the quick tier, through the installed command in the slow tier (the quick tier runs the
# installed `minigpt circuit` in tests/test_cli_real.py).
INSTALLED_CASES = [
    pytest.param(args, needle, how, id=f"{name}-{HOW_ID[how]}",
                 marks=[pytest.mark.slow] if how is installed and loads else [])
    for name, args, needle, loads in (
        ("works", [*PROBE, "--edges", "5", "--ig-steps", "2"], None, True),
        ("text-pair-length", ["--text", "abcd", "--patch-from", "ab"], "has 2 tokens", True),
        ("answer-length", ["--text", "abcd", "--patch-from", "abce", "--answer", "xy",
                           "--wrong", "a"], "is 2 tokens", True),
        ("edges-0", [*PROBE, "--edges", "0"], "--edges 0: must be at least 1", False),
        ("ig-steps-0", [*PROBE, "--ig-steps", "0"], "--ig-steps 0: must be at least 1", False))
    for how in ((installed,) if not loads else (here, installed))]


@pytest.mark.parametrize("args, needle, how", INSTALLED_CASES)
def test_the_installed_command(run_dir, tmp_path, args, needle, how):
    """Through the `minigpt` console script: a working call and one-line errors, each before
    any work (the bad flags before the model loads)."""
    r = how(run_dir, tmp_path, *args)
    assert "Traceback" not in r.stderr, r.stderr
    if needle is None:
        assert r.returncode == 0, r.stderr
        assert "strongest edges" in r.stdout and "5 of" not in r.stdout
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_a_model_with_no_head_is_refused_before_any_work(run_dir, monkeypatch):
    """The config refuses n_layer 0 itself; a model that has no head anyway (built past the
    config) is refused by the command's first check after loading, before any input is made."""
    import minigpt.infer.inputs
    from minigpt.run import LoadedRun  # noqa: F401 - the type load_run_or_model returns

    loaded = load_run(run_dir, "cpu")
    headless = dataclasses.replace(loaded, cfg=dataclasses.replace(
        loaded.cfg, model=dataclasses.replace(loaded.cfg.model, n_layer=0)))
    monkeypatch.setattr(minigpt.infer.inputs, "load_run_or_model", lambda *a, **k: headless)
    made = []
    monkeypatch.setattr("minigpt.heads.edge_circuit.circuit_pairs", lambda *a, **k: made.append(1))
    assert "no head for a circuit" in error_line(invoke(run_dir, *PROBE))
    assert not made


def test_lens_is_inspect_heads_lens_of_the_first_pair(run_dir):
    """`--lens`: the JSON's `lens` is interp.lens.logit_lens of the first clean input at the
    metric's positions (inspect-heads' records), and the terminal prints its tables."""
    from minigpt.interp.lens import logit_lens

    r = invoke(run_dir, *PROBE, "--ig-steps", "1", "--no-curve", "--lens", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    loaded = load_run(run_dir, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted", probe="induction")
    tokens = p.clean[0].tolist()
    want = logit_lens(loaded.model, tokens, list(p.metric.positions),
                      p.metric.targets(tokens)).records(token_str=loaded.tokenizer.token_str)
    assert len(doc["lens"]) == len(want) == (loaded.cfg.model.n_layer + 1) * len(
        p.metric.positions)
    for got, exp in zip(doc["lens"], want):
        assert got.keys() == exp.keys() and got["point"] == exp["point"]
        assert got["rank"] == exp["rank"] and got["logit"] == pytest.approx(exp["logit"])
    table = invoke(run_dir, *PROBE, "--ig-steps", "1", "--no-curve", "--lens", width=80)
    assert table.exit_code == 0 and "logit lens" in table.stdout


def test_without_run_it_takes_the_run_inspect_heads_takes(run_dir, tmp_path, monkeypatch):
    """No --run: the same choice as inspect-heads (minigpt.run.choice; here the only run, not
    finished, named with how it stands)."""
    shutil.copytree(run_dir, tmp_path / "runs" / "tiny", symlinks=True)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["circuit", *PROBE, "--ig-steps", "1", "--no-curve",
                                 "--device", "cpu", "--threads", "1"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("using the latest run, killed at step 5: runs/tiny"), r.stderr


def test_circuit_picture_geometry(run_dir):
    """circuit.png's data: no kept edge's curve passes another node (the embed -> L1.H1 value
    edge ran through L0.H1); every label fits its circle; the title names the corruption."""
    from minigpt.heads import edge_png as C
    from minigpt.heads.edge_circuit import circuit_pairs, circuit_title
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.run import load_run

    loaded = load_run(run_dir, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted-first",
                      probe="induction")
    result = find_circuit(loaded.model, p.clean, p.corrupted, p.metric, p.targets, ig_steps=2,
                          curves=False)
    pos = C._positions(result)
    x, y0 = pos["embed"]
    assert (x, y0 + 1) in pos.values() and (x, y0 + 2) in pos.values()  # the issue's layout
    for e in result.edges():  # every edge of the graph, kept or not
        a, b = pos[e["from"]], pos[e["to"]]
        others = [q for n, q in pos.items() if n not in (e["from"], e["to"])]
        rad = C.route(a, b, C.BEND.get(e["input"], 0.08), others)
        curve = [C._bezier(a, b, rad, t / 40) for t in range(4, 37)]
        assert min((cx - ox) ** 2 + (cy - oy) ** 2 for ox, oy in others
                   for cx, cy in curve) >= C.CLEAR ** 2, e
    for name in pos:
        label = name.replace(".", "\n")
        wide = max(len(x) for x in label.split("\n")) * 0.62 * 6
        assert C.node_size(label, 6) ** 0.5 >= wide + 6, name  # the diameter holds the text
    title = circuit_title("runs/tiny", p)
    assert title.endswith("corrupted: corrupted-first")
    assert C._title(result, title).startswith("runs/tiny, corrupted: corrupted-first: ")
