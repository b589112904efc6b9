"""Files from elsewhere and names that are not plain text (issue 26), through the installed
`minigpt` console script in a subprocess, each in bounded time and memory: a special file
(/dev/zero, /dev/urandom, a FIFO, a directory, a link to a device) named as a text is one
`error:` line and exit 2, a huge text costs what the model can use of it, attention that is
not finite is refused instead of written as a bare NaN, and escape sequences in a run's name
never reach the terminal raw.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_world import BLOCK, World, in_process, tree_hash, where_run
from conftest import error_line, make_run

pytestmark = pytest.mark.usefixtures("isolated")


MINIGPT = shutil.which("minigpt")
TIME_LIMIT = 90  # seconds: a process that blocks on a FIFO never ends by itself
MEMORY_LIMIT = 2 << 30  # bytes of address space: reading /dev/zero whole would exceed it
BIG_TEXT_BYTES = 100 << 20
EVIL_NAME = "\x1b[2J\x1b]0;pwned\x07\x1b[31mevil\u202e"  # clear screen, set title, red, RTL


@dataclass
class Elsewhere:
    """What is on disk besides the world: special files, a huge text, runs whose weights are
    not finite, a run whose name holds escape sequences."""

    files: dict[str, Path]
    runs: dict[str, Path]


@pytest.fixture(scope="module")
def elsewhere(world, tmp_path_factory) -> Iterator[Elsewhere]:
    root = tmp_path_factory.mktemp("elsewhere")
    files = {"fifo": root / "prompt.fifo", "dir": root / "a-directory.txt",
             "zero-link": root / "zero.txt", "big": root / "big.txt"}
    os.mkfifo(files["fifo"])
    files["dir"].mkdir()
    os.symlink("/dev/zero", files["zero-link"])
    line = b"all the world's a stage, and all the men and women merely players\n"
    with open(files["big"], "wb") as fh:
        chunk = line * 16384
        fh.writelines(chunk for _ in range(BIG_TEXT_BYTES // len(chunk) + 1))
    runs = {"nan-attention": make_run(root / "nan-attention", nan="blocks.1"),  # its attention
            "nan-logits": make_run(root / "nan-logits", nan="ln_f")}  # finite attention
    evil = root / "evil-runs" / EVIL_NAME
    shutil.copytree(world.runs["with-metrics"], evil, symlinks=True)
    runs["evil"] = evil
    yield Elsewhere(files, runs)
    files["big"].unlink()  # 100 MB: not left for pytest's kept temporary directories


def _limits() -> None:  # in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def installed(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`minigpt ARGS` as a user runs it, within TIME_LIMIT and MEMORY_LIMIT."""
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    env = {**os.environ, "MINIGPT_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run([MINIGPT, *args], cwd=cwd, env=env, capture_output=True,
                              text=True, errors="backslashreplace", timeout=TIME_LIMIT,
                              preexec_fn=_limits, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"minigpt {' '.join(args)}: still running after {TIME_LIMIT} s")


@dataclass
class Outside:
    id: str
    args: Callable[[World, Elsewhere, Path], list[str]]
    needles: tuple[str, ...] = ()  # the error line's; empty: the command succeeds
    check: Callable[[subprocess.CompletedProcess, Path], None] | None = None
    slow: bool = False  # the quick tier keeps one case of each kind (~4 s a process)


def _sample_file(name: str, *extra: str) -> Callable[[World, Elsewhere, Path], list[str]]:
    return lambda w, e, t: ["sample", "--run", str(w.good), "-n", "2", "--seed", "0",
                            "--prompt-file", str(e.files.get(name) or name), *extra]


def _inspect_file(name: str) -> Callable[[World, Elsewhere, Path], list[str]]:
    return lambda w, e, t: ["inspect-heads", "--run", str(w.good), "--json",
                            "--text-file", str(e.files.get(name) or name)]


def _big_prompt_used_its_end(r: subprocess.CompletedProcess, tmp: Path) -> None:
    doc = json.loads(r.stdout)
    assert doc["prompt_tokens"] == BLOCK and doc["prompt"].endswith("merely players\n")
    assert len(doc["prompt"]) < 1 << 20  # what was read, not 100 MB
    assert "bytes, longer than the model's context" in r.stderr


def _big_text_used_its_start(r: subprocess.CompletedProcess, tmp: Path) -> None:
    doc = json.loads(r.stdout)
    assert "".join(doc["token_strs"]) == "all the world's " and doc["n_tokens"] == BLOCK
    assert f"inspecting the first {BLOCK}" in r.stderr


def _no_scores_written(r: subprocess.CompletedProcess, tmp: Path) -> None:
    assert not list((tmp / "heads-out").iterdir())


def _name_escaped(r: subprocess.CompletedProcess, tmp: Path) -> None:
    shown = r.stdout + r.stderr
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\x1b[31mevil\\u202e" in shown


OUTSIDE = [
    # Slow where a quick in-process test checks the rule: the reader's refusals in
    # test_security.py::test_the_reader_refuses_what_is_not_a_regular_file_with_one_line,
    # a long prompt file in test_cli_sample.py::test_a_long_prompt_file_keeps_the_tokens_...
    Outside("sample-prompt-file-dev-zero", _sample_file("/dev/zero"),
            ("--prompt-file /dev/zero", "not a regular file (a character device)"), slow=True),
    Outside("sample-prompt-file-dev-urandom", _sample_file("/dev/urandom"),
            ("--prompt-file /dev/urandom", "not a regular file"), slow=True),
    Outside("sample-prompt-file-fifo", _sample_file("fifo"),
            ("--prompt-file", "prompt.fifo", "not a regular file (a FIFO)")),
    Outside("sample-prompt-file-directory", _sample_file("dir"),
            ("--prompt-file", "a-directory.txt", "not a regular file (a directory)"), slow=True),
    Outside("sample-prompt-file-link-to-dev-zero", _sample_file("zero-link"),
            ("--prompt-file", "zero.txt", "not a regular file"), slow=True),
    Outside("inspect-text-file-dev-zero", _inspect_file("/dev/zero"),
            ("--text-file /dev/zero", "not a regular file"), slow=True),
    Outside("inspect-text-file-dev-urandom", _inspect_file("/dev/urandom"),
            ("--text-file /dev/urandom", "not a regular file"), slow=True),
    Outside("inspect-text-file-fifo", _inspect_file("fifo"),
            ("--text-file", "prompt.fifo", "not a regular file (a FIFO)"), slow=True),
    Outside("inspect-text-file-directory", _inspect_file("dir"),
            ("--text-file", "a-directory.txt", "not a regular file (a directory)"), slow=True),
    Outside("inspect-text-file-link-to-dev-zero", _inspect_file("zero-link"),
            ("--text-file", "zero.txt", "not a regular file"), slow=True),
    Outside("sample-prompt-file-100mb", _sample_file("big", "--json"),
            check=_big_prompt_used_its_end, slow=True),
    Outside("inspect-text-file-100mb", _inspect_file("big"), check=_big_text_used_its_start,
            slow=True),
    Outside("inspect-nan-attention", lambda w, e, t: [
        "inspect-heads", "--run", str(e.runs["nan-attention"]), "--probe", "induction",
        "--format", "json", "--out", str(t / "heads-out")],
        ("attention of layer 1 head 0", "not finite", "NaN"), check=_no_scores_written),
    Outside("inspect-nan-logits", lambda w, e, t: [
        "inspect-heads", "--run", str(e.runs["nan-logits"]), "--probe", "induction", "--json"],
        ("the logits are not finite",), slow=True),
    Outside("runs-escape-codes-in-a-name",
            lambda w, e, t: ["runs", str(e.runs["evil"].parent)], check=_name_escaped),
    Outside("sample-escape-codes-in-a-name", lambda w, e, t: [
        "sample", "--run", str(e.runs["evil"]), "-n", "2"], check=_name_escaped, slow=True),
    Outside("curves-escape-codes-in-a-name", lambda w, e, t: [
        "curves", str(e.runs["evil"]), str(e.runs["evil"] / "nope"), "--out",
        str(t / "c.png")], ("unknown run",), check=_name_escaped, slow=True),
    Outside("error-naming-a-run-with-escape-codes", lambda w, e, t: [
        "sample", "--run", str(e.runs["evil"] / "nowhere")], ("does not exist",),
        check=_name_escaped),
]


@pytest.mark.parametrize("case, how", where_run(OUTSIDE))
def test_from_elsewhere_through_the_installed_command(case: Outside, how: str, world: World,
                                                      elsewhere: Elsewhere, tmp_path: Path):
    before = tree_hash(world.good)
    (tmp_path / "heads-out").mkdir()
    args = case.args(world, elsewhere, tmp_path)
    r = installed(args, tmp_path) if how == "process" else in_process(args)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    if case.needles:
        line = error_line(r)
        for needle in case.needles:
            assert needle in line, f"{needle!r} not in {line!r}"
    else:
        assert r.returncode == 0, r.stderr
    if case.check is not None:
        case.check(r, tmp_path)
    assert tree_hash(world.good) == before
