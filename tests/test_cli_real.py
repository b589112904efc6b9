"""The installed program as people use it: the `minigpt` console script (the entry point pip
installed, never `python -m minigpt`) in a subprocess, from a directory outside the checkout,
with the token cache in a temporary directory.

- Usage errors, for every command: the parser's message (with a did-you-mean for commands and
  flags) on stderr, exit code 2, no traceback (issue #15 finding 1).
- Every `minigpt ...` command in the code blocks of the README, docs/cli.md, docs/heads.md
  and docs/hf.md (tests/doc_commands.py reads them; tests/test_docs.py parses the commands of
  every other doc): training commands get tiny `--set` overrides. Quick tier: the commands
  that read a run, in a directory whose runs/ holds a 3-step run trained by the real command;
  slow tier: all of them in document order from an empty directory (training included), and
  `bench --quick`.
- The run directory that run holds is the one docs/run-directory.md draws, and its
  metrics.jsonl records have the fields the page lists.
  Skipped, and why: usage synopses (they hold `[options]` brackets or `<placeholders>`: not
  runnable as written), `torchrun` lines (several processes; tests/test_train.py covers DDP),
  anything that is not `minigpt` (`pip install`, `pytest`), and `--device cuda` commands on
  a machine without CUDA (tests/test_cuda.py runs `bench --device cuda` where there is one).
- The fixes of issue #15 as the installed program shows them: tiny temperatures, non-finite
  logits, `runs` and `curves` bad input, resume of a run that saved nothing yet.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REAL_TINY, error_line, in_process
from doc_commands import RUN_DOCS, code_lines, minigpt_parts

from minigpt.paths import PROJECT_ROOT

MINIGPT = shutil.which("minigpt")
CUDA = torch.cuda.is_available()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = REAL_TINY  # conftest's: the documented commands' run (`place`) and the trainings here


def tiny(**over) -> list[str]:
    return [x for k, v in {**TINY, **over}.items() for x in ("--set", f"{k}={v}")]


# --------------------------------------------------------------------------------------------
# The documentation's commands.


def doc_commands() -> tuple[list[list[str]], list[tuple[str, str]]]:
    """(runnable minigpt commands as argv lists without "minigpt", in document order, each
    once; [(line, why skipped)])."""
    commands, skipped = [], []
    for line in (x for doc in RUN_DOCS for x in code_lines(doc.read_text(encoding="utf-8"))):
        for p in minigpt_parts(line):
            if p[0] != "minigpt":
                if p[0] in ("torchrun", "pip", "pytest"):
                    skipped.append((line.strip(), f"{p[0]}: not a minigpt command"))
                continue
            if any(("[" in w or "<" in w) for w in p[1:]):
                skipped.append((line.strip(), "usage synopsis"))
            elif "--device" in p and p[p.index("--device") + 1:][:1] == ["cuda"] and not CUDA:
                skipped.append((line.strip(), "needs CUDA, absent here"))
            elif p[1:] not in commands:
                commands.append(p[1:])
    return commands, skipped


COMMANDS, SKIPPED = doc_commands()


def for_test(argv: list[str], resume_steps: int = 5) -> list[str]:
    """A documented command as the tests run it: training gets the tiny overrides (on --resume
    the same ones, with more steps: the stored values are accepted, finding 4)."""
    if argv[0] != "train":
        return argv
    return [*argv, *(tiny(**{"train.max_steps": resume_steps}) if "--resume" in argv
                     else tiny())]


def test_the_documented_commands_were_found():
    """The extraction sees every kind of command and skips only what it says it skips."""
    kinds = {c[0] for c in COMMANDS}
    assert COMMANDS[:2] == [["train"], ["sample", "-p", "ROMEO:", "-n", "200"]]  # README first
    assert kinds == {"train", "sample", "inspect-heads", "circuit", "bench", "runs", "curves",
                     "export", "features", "compile"}
    assert ["sample", "--num-samples", "3", "--stop", "\\n\\n", "--json"] in COMMANDS
    assert ["train", "--out", "runs/default", "--resume"] in COMMANDS
    reasons = {why for _, why in SKIPPED}
    assert reasons == {"usage synopsis", "torchrun: not a minigpt command",
                       "pip: not a minigpt command", "pytest: not a minigpt command"} | (
        set() if CUDA else {"needs CUDA, absent here"})
    assert (["bench", "--device", "cuda", "--out", "bench-cuda.json"] in COMMANDS) == CUDA
    assert all("minigpt" in line for line, _ in SKIPPED if "synopsis" in _)


# --------------------------------------------------------------------------------------------
# Running the installed program.


@pytest.fixture(scope="session")
def program() -> str:
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    return MINIGPT


@pytest.fixture(scope="session")
def env(real_env) -> dict[str, str]:
    return real_env


def minigpt(program: str, args: list[str], cwd: Path, env: dict, timeout: float = 300,
            ok: bool = True) -> subprocess.CompletedProcess:
    assert not cwd.resolve().is_relative_to(PROJECT_ROOT), "run outside the checkout"
    r = subprocess.run([program, *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout, check=False)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    if ok:
        assert r.returncode == 0, f"minigpt {shlex.join(args)}: exit {r.returncode}\n{r.stderr}"
    return r


# `place` (conftest): a working directory whose runs/ holds `default` (3 steps, trained by the
# installed `minigpt train`), `bytes` and `induction` (copies), as the documented commands expect.


# --------------------------------------------------------------------------------------------
# Usage errors (finding 1).

USAGE_ERRORS = [
    (["trian"], "No such command 'trian'. Did you mean 'train'?"),
    (["sample", "--bogus"], "No such option: --bogus"),
    (["sample", "-n", "abc"], "Invalid value for '-n' / '--max-new-tokens'"),
    (["inspect-heads", "--layer"], "Option '--layer' requires an argument"),
    (["sample", "--tempreature", "0.5"], "(Possible options: --temperature)"),
    (["train", "--sett", "x=1"], "(Possible options: --set)"),
    (["runs", "--jsn"], "(Possible options: --json, --run)"),
    (["curves", "runs/default"], "Missing option '--out'"),
    (["curves", "--out", "x.png"], "give the runs to overlay"),
    (["bench", "--suite"], "Option '--suite' requires an argument"),
    (["inspect-heads", "--max-tokens", "many"], "Invalid value for '--max-tokens'"),
]


def here(args: list[str], cwd: Path, ok: bool = True) -> subprocess.CompletedProcess:
    """`minigpt ARGS` run by the app in this process, shaped like `minigpt` above."""
    r = in_process(args, cwd=cwd)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    if ok:
        assert r.returncode == 0, f"minigpt {shlex.join(args)}: exit {r.returncode}\n{r.stderr}"
    return r


# The parser's errors come before any command runs: the quick tier runs one unknown command and
# one unknown flag through the installed program, the rest in this process (the same parser,
# ~0.3 CPU-s a process saved each); the slow tier runs every one through the installed program.
QUICK_USAGE_PROCESSES = {("trian",), ("sample", "--bogus")}


@pytest.mark.parametrize("args, needle, installed", [
    pytest.param(a, n, i, id=f"{' '.join(a)}{'' if i else '-in-process'}",
                 marks=[pytest.mark.slow] if i and tuple(a) not in QUICK_USAGE_PROCESSES else [])
    for a, n in USAGE_ERRORS for i in (True, False) if i or tuple(a) not in QUICK_USAGE_PROCESSES])
def test_usage_errors_are_the_parsers_message_and_exit_2(program, env, tmp_path, args, needle,
                                                         installed):
    r = minigpt(program, args, tmp_path, env, ok=False) if installed else here(args, tmp_path,
                                                                                ok=False)
    assert needle in error_line(r)  # one line, like every other error (issue 50)


@pytest.mark.parametrize("installed", [pytest.param(False, id="in-process"),
                                       pytest.param(True, id="installed",
                                                    marks=pytest.mark.slow)])
def test_every_command_rejects_an_unknown_flag(program, env, tmp_path, installed):
    """Every command `minigpt --help` lists, with a flag it does not have."""
    def run(args: list[str], ok: bool = True) -> subprocess.CompletedProcess:
        return minigpt(program, args, tmp_path, env, ok=ok) if installed else here(args, tmp_path,
                                                                                   ok=ok)

    help_text = run(["--help"]).stdout
    names = re.findall(r"^  ([a-z-]+) ", help_text[help_text.index("Commands:"):], re.MULTILINE)
    assert set(names) == {"train", "sample", "inspect-heads", "circuit", "bench", "runs",
                          "curves", "export", "features", "compile"}
    for name in [*names, "features train", "features show"]:
        line = error_line(run([*name.split(), "--no-such-flag"], ok=False))
        assert "No such option: --no-such-flag" in line, line


# --------------------------------------------------------------------------------------------
# The documented commands that read runs (quick tier; training and bench are slow, below).

QUICK = [c for c in COMMANDS if c[0] not in ("train", "bench")]


def check_output(argv: list[str], r: subprocess.CompletedProcess, cwd: Path) -> None:
    """What each kind of documented command must have produced, beyond exit code 0."""
    if argv[0] == "sample":
        if "--json" in argv:
            docs = [json.loads(x) for x in r.stdout.splitlines()]
            assert len(docs) == int(argv[argv.index("--num-samples") + 1])
            for d in docs:
                assert d["finish_reason"] in ("stop", "length", "eot")
                assert "\n\n" not in d["text"]  # --stop "\n\n" (finding 3)
        else:
            assert r.stdout.strip()
        assert "sampling from" in r.stderr
    elif argv[0] == "inspect-heads":
        assert "explicit vs SDPA" in r.stderr + r.stdout
        if "--json" not in argv:  # the table, whatever files were asked for (issue 34)
            assert "head scores" in r.stdout, r.stdout
        _wrote(argv, r, cwd, {"html": "attention.html", "png": "attention_grid.png"})
    elif argv[0] == "circuit":
        assert "edges recover" in r.stderr, r.stderr
        if "--json" in argv:
            assert json.loads(r.stdout)["edges"]
        else:
            assert "strongest edges" in r.stdout, r.stdout
        _wrote(argv, r, cwd, {"html": "circuit.html", "png": "circuit.png"})
    elif argv[0] == "features":
        if argv[1] == "train":
            assert "of the loss recovered" in r.stderr or "costs nothing" in r.stderr, r.stderr
        else:
            assert "features of the SAE" in r.stdout, r.stdout
    elif argv[0] == "compile":
        if "--list" in argv:
            assert len(r.stdout.strip().splitlines()) >= 6, r.stdout
        else:
            assert (cwd / r.stdout.strip() / "truth.json").is_file(), r.stdout
    elif argv[0] == "runs":
        if "--json" in argv:
            names = {x["name"]: x["status"] for x in json.loads(r.stdout)["runs"]}
            assert {"default", "bytes"} <= set(names)
        else:
            assert re.search(r"default .* finished .* (\d+)/\1 ", r.stdout), r.stdout
    elif argv[0] == "curves":
        out = cwd / argv[argv.index("--out") + 1]
        assert out.read_bytes()[:8] == PNG_MAGIC
    elif argv[0] == "export":
        out = cwd / argv[argv.index("--out") + 1]
        if "gguf" in argv:  # one file, GGUF's magic first
            assert out.read_bytes()[:4] == b"GGUF" and r.stdout.strip() == str(out)
        else:
            assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
                p.name for p in out.iterdir()}


def _wrote(argv: list[str], r: subprocess.CompletedProcess, cwd: Path,
           files: dict[str, str]) -> None:
    """Each format asked for (a word of `argv`) said `wrote PATH` of its file, which exists."""
    for fmt, name in files.items():
        if fmt in argv:
            written = re.findall(rf"^wrote (\S+{name})$", r.stderr, re.MULTILINE)
            assert written and (cwd / written[0]).is_file(), r.stderr


def downloads(argv: list[str]) -> bool:
    """`--model hf:...` downloads from the Hugging Face hub, which tests never reach."""
    return any(a.startswith("hf:") for a in argv)


# The quick tier runs these documented commands with the work cut down (the same flags parsed,
# the same run read, the same kind of files written), in this process (the installed `features`
# command: tests/test_features.py); the slow tier runs them as documented, installed:
# `features train` trains 500 steps on 65,536 tokens and measures 32,768 held-out ones (~10 s);
# its SAE goes beside the documented one, which the documented `features show` reads.
CHEAPER = {("features", "train"): ["--steps", "20", "--tokens", "4096", "--held-out", "2048",
                                   "--out", "runs/induction/features/cheaper"]}


def first_of_each_kind(commands: list[list[str]]) -> list:
    """Each command as a pytest param (argv, how): the very first through the installed
    `minigpt` in the quick tier; the first of each other kind (command name) in the quick tier
    by the app in this process (a process adds only its start-up, ~2 CPU-s of importing torch);
    every command through the installed `minigpt` in the slow tier. The downloading ones are
    slow too: in this process in the quick tier (test_documented_hub_command_offline_in_process).
    A command in CHEAPER runs in the quick tier with those flags added."""
    seen, params = set(), []
    for argv in commands:
        kind = "hf:" if downloads(argv) else argv[0]
        quick = kind not in seen and kind != "hf:"
        cheaper = CHEAPER.get(tuple(argv[:2]))
        if quick and cheaper:
            params.append(pytest.param([*argv, *cheaper], "in-process",
                                       id=" ".join([*argv, "(cheaper)"])))
        elif quick and seen:
            params.append(pytest.param(argv, "in-process", id=" ".join([*argv, "(in process)"])))
        first = quick and not seen
        params.append(pytest.param(argv, "installed", id=" ".join(argv),
                                   marks=[] if first else [pytest.mark.slow]))
        seen.add(kind)
    return params


def _download_failed_offline(r: subprocess.CompletedProcess) -> None:
    """Offline, the real download path fails in one line, nothing else."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: --model hf:") and "download failed" in lines[0]


@pytest.mark.parametrize("argv, how", first_of_each_kind(QUICK))
def test_documented_command_works_on_a_trained_run(program, env, place, argv, how):
    if downloads(argv):  # offline: the real download path fails in one line, nothing else
        _download_failed_offline(minigpt(program, argv, place, {**env, "HF_HUB_OFFLINE": "1"},
                                         ok=False))
        return
    _sae_first(program, env, place, argv)
    if how == "in-process":  # the quick tier: the same app, without a process's start-up
        r = in_process(argv, cwd=place, MINIGPT_CACHE=env["MINIGPT_CACHE"])
        assert "Traceback" not in r.stderr and r.returncode == 0, r.stderr
        check_output(argv, r, place)
        return
    check_output(argv, minigpt(program, argv, place, env), place)


def _sae_first(program, env, place: Path, argv: list[str]) -> None:
    """A documented command that reads an SAE (`--sae`, `--features`) finds it made by the
    documented `features train` (run here when the tier ran it not: the slow tier alone)."""
    flag = next((f for f in ("--sae", "--features") if f in argv), None)
    if flag is None or (place / argv[argv.index(flag) + 1] / "features.json").exists():
        return
    train = next(c for c in COMMANDS if c[:2] == ["features", "train"])
    minigpt(program, train, place, env)


@pytest.mark.parametrize("argv", [pytest.param(a, id=" ".join(a)) for a in QUICK if downloads(a)])
def test_documented_hub_command_offline_in_process(place, argv, tmp_path, monkeypatch):
    """The documented `--model hf:` commands by the app in this process, huggingface_hub
    offline (as HF_HUB_OFFLINE=1 makes it when it is imported) with an empty cache."""
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _download_failed_offline(here(argv, place, ok=False))


def test_every_run_has_its_curves_png(place):
    assert (place / "runs" / "default" / "curves.png").read_bytes()[:8] == PNG_MAGIC


def documented_tree() -> set[str]:
    """The paths docs/run-directory.md draws under runs/default/ (directories end in /)."""
    text = (PROJECT_ROOT / "docs" / "run-directory.md").read_text()
    block = re.search(r"^```\nruns/default/\n(.*?)^```", text, re.DOTALL | re.MULTILINE)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        name = line.split()[0]
        stack[depth:] = [name]
        paths.add("".join(stack))
    return paths


def test_the_run_directory_is_the_documented_one(place):
    """Every file and link a trained run holds is drawn in docs/run-directory.md, and every
    one drawn is there (heads/ only once inspect-heads wrote it)."""
    run = place / "runs" / "default"
    actual = {p.relative_to(run).as_posix() + ("/" if p.is_dir() and not p.is_symlink() else "")
              for p in run.rglob("*")}

    def norm(paths: set[str]) -> set[str]:
        return {re.sub(r"step-\d{6}", "step-N", p) for p in paths
                if not p.startswith("heads/") or p == "heads/"}
    assert norm(actual) - {"heads/"} == norm(documented_tree()) - {"heads/"}


def test_metrics_records_have_the_documented_fields(place):
    text = (PROJECT_ROOT / "docs" / "run-directory.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$", text, re.MULTILINE)
    documented = {kind: set(re.findall(r"`(\w+)`", fields)) for kind, fields in rows
                  if kind != "kind"}  # the header row
    records = [json.loads(x) for x in
               (place / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    seen = {r["kind"]: set(r) - {"kind"} for r in records}
    assert seen == documented
    scores = next(r for r in records if r["kind"] == "heads")["scores"]
    assert "`{" + ", ".join(scores) + "}`" in text


# --------------------------------------------------------------------------------------------
# Issue #15's other findings, as the installed program shows them.


@pytest.mark.slow  # in-process: test_cli_sample.py::test_tiny_temperature_is_greedy_through_the_cli
def test_tiny_temperature_is_greedy_not_a_traceback(program, env, place):
    """Finding 2: `-t 1e-40` was an IndexError; with -n 1 it printed id 257. (That it equals
    greedy decoding is tests/test_cli_sample.py's check.)"""
    r = minigpt(program, ["sample", "--run", "runs/default", "-n", "1", "-t", "1e-40",
                          "--json"], place, env)
    assert json.loads(r.stdout)["tokens"] == 1


RUNS_CURVES_BAD = [
    pytest.param(["curves", "nope", "--out", "c.png"], "unknown run 'nope'",
                 marks=pytest.mark.slow),
    pytest.param(["runs", "empty"], "no runs under empty/", marks=pytest.mark.slow),
    pytest.param(["curves", "fresh", "--out", "c.png"], "has no metrics yet",
                 marks=pytest.mark.slow),
    pytest.param(["curves", "runs/default", "--out", "/proc/c.png"],
                 "--out /proc/c.png: cannot write", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("args, needle", RUNS_CURVES_BAD)
def test_runs_and_curves_bad_input(program, env, place, tmp_path, args, needle):
    """One error line, exit 2, nothing written (every case in-process: test_bad_input.py)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "train.lock").write_text("")
    (tmp_path / "runs").symlink_to(place / "runs")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    r = minigpt(program, args, tmp_path, env, ok=False)
    line = error_line(r)
    assert needle in line, line
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.slow
def test_non_finite_logits_are_one_error_line(program, env, tmp_path):
    from conftest import make_run

    make_run(tmp_path / "nan", nan="ln_f", top_files=True)
    r = minigpt(program, ["sample", "--run", "nan", "-n", "3"], tmp_path, env, ok=False)
    assert error_line(r, after_progress=True).startswith("error: generation step 1: ")


# --------------------------------------------------------------------------------------------
# Slow: the documentation from an empty directory, in order, training included.


@pytest.mark.slow
def test_the_docs_in_order_from_an_empty_directory(program, env, tmp_path):
    """Every documented command once, in document order (README, cli.md, heads.md, hf.md), in
    a fresh directory: trainings (tiny),
    the resume of runs/default with the same overrides (finding 4), a corpus under ~/texts/
    (HOME points into tmp; matplotlib keeps its own cache), stories.jsonl (records) in the
    working directory, bench --quick."""
    import matplotlib

    home = tmp_path / "home"
    (home / "texts").mkdir(parents=True)
    (home / "texts" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    env = {**env, "HOME": str(home), "MPLCONFIGDIR": matplotlib.get_cachedir()}
    cwd = tmp_path / "work"
    cwd.mkdir()
    # the README's own-text example trains on stories.jsonl: the bundled corpus as records
    text = (PROJECT_ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    (cwd / "stories.jsonl").write_text("".join(
        json.dumps({"text": text[i:i + 2000]}) + "\n" for i in range(0, len(text), 2000)),
        encoding="utf-8")
    for argv in (c for c in COMMANDS if not downloads(c)):  # hf: is the quick tier's (offline)
        args = for_test(argv)
        r = minigpt(program, args, cwd, env, timeout=600)
        check_output(args, r, cwd)
        if argv[:2] == ["train", "--out"] and "--resume" in argv:
            assert "from step 3" in r.stderr and "step 5/5" in r.stderr
        if argv[0] == "bench":
            json.loads(r.stdout.strip().splitlines()[-1])  # the compact summary line
        if argv[:3] == ["train", "--config", "induction"]:
            # the README's sample command again, now that the newest run is the induction
            # run: it samples the text run, and says it passed the other one over (issue 34)
            again = minigpt(program, ["sample", "-p", "ROMEO:", "-n", "20"], cwd, env)
            assert "passing over runs/induction" in again.stderr, again.stderr
            assert "from the latest finished run trained on text, runs/default" in again.stderr
    assert {p.name for p in (cwd / "runs").iterdir()} >= {"default", "speedrun", "bytes",
                                                         "induction", "mine"}


@pytest.mark.slow
def test_resume_where_a_kill_left_only_the_lock(program, env, tmp_path):
    """Finding 5: the run directory holds only train.lock; --resume starts it at step 0."""
    run = tmp_path / "runs" / "killed"
    run.mkdir(parents=True)
    (run / "train.lock").write_text("")
    r = minigpt(program, ["train", "--out", "runs/killed", "--resume", *tiny()], tmp_path, env)
    assert "holds no saved checkpoint yet" in r.stderr and "step 3/3" in r.stderr
