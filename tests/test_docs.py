"""The documentation matches the code: the generated reference equals what the code declares,
every command the docs show parses with the program's own parser and every flag is documented,
every test, script, link and anchor they name exists, the README's Python runs, and what the
docs state about scores and resume is what the code does. (That the commands also RUN as
shown is tests/test_cli_real.py's job.)"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import re
import runpy
from pathlib import Path

import pytest
import typer
import typer.main
from conftest import in_process
from doc_commands import DOCS, code_lines, shown_commands

from minigpt.cli import app
from minigpt.config import SECTIONS, ConfigError, parse_override
from minigpt.paths import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()
CLI_MD = PROJECT_ROOT / "docs" / "cli.md"
GROUP = typer.main.get_command(app)  # the parser the installed `minigpt` runs
COMMANDS = {name: GROUP.commands[name] for name in GROUP.commands}

# Docs that other branches are writing (issue 21); links to them are checked once they exist.
PENDING: set[str] = set()


def docs_gen():
    spec = importlib.util.spec_from_file_location("docs_gen", PROJECT_ROOT / "tools" /
                                                  "docs_gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# The README's commands that CI and new users rely on.


def test_ci_runs_the_readme_test_command_verbatim():
    command = "pip install -e '.[dev]' && pytest"
    assert command in [line.strip() for line in code_lines(README)]
    ci = (PROJECT_ROOT / ".ci" / "run").read_text()
    assert any(line.strip() == command for line in ci.splitlines())


def test_the_readme_main_job_is_there():
    assert "    pip install -e . && minigpt train" in README.splitlines()


def test_the_readme_is_a_door():
    assert len(README.splitlines()) <= 250


# --------------------------------------------------------------------------------------------
# Generated reference: docs/config.md and the module list in docs/internals.md.


def test_generated_docs_match_the_code():
    """`python tools/docs_gen.py` rewrites them; run it after changing a setting or a module."""
    stale = [path.relative_to(PROJECT_ROOT).as_posix()
             for path, text in docs_gen().expected().items()
             if not path.exists() or path.read_text(encoding="utf-8") != text]
    assert stale == [], f"stale: {stale}; run `python tools/docs_gen.py`"


def test_the_module_list_names_every_module_and_only_those():
    text = (PROJECT_ROOT / "docs" / "internals.md").read_text()
    listed = set(re.findall(r"^- `(minigpt/\S+\.py)`", text, flags=re.MULTILINE))
    on_disk = {p.relative_to(PROJECT_ROOT).as_posix()
               for p in (PROJECT_ROOT / "minigpt").rglob("*.py") if "__pycache__" not in p.parts}
    assert listed == on_disk


def config_rows() -> list[tuple[str, str]]:
    """(section.key, allowed cell) of every row of docs/config.md."""
    text = (PROJECT_ROOT / "docs" / "config.md").read_text()
    return re.findall(r"^\| `(\w+\.\w+)` \| \w+ \| `.*?` \| (.*?) \| .* \|$", text,
                      flags=re.MULTILINE)


def test_config_reference_has_every_setting():
    rows = [path for path, _ in config_rows()]
    declared = [f"{s}.{fl.name}" for s, cls in SECTIONS.items() for fl in dataclasses.fields(cls)]
    assert rows == declared


def accepts(path: str, value: str) -> bool:
    try:
        parse_override(f"{path}={value}")
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("path, allowed", config_rows(), ids=[p for p, _ in config_rows()])
def test_the_allowed_column_is_what_the_loader_accepts(path, allowed):
    """Each bound the reference states is where `--set` starts and stops accepting values."""
    if allowed == "any":
        return
    choices = re.findall(r"`([^`]+)`", allowed)
    if choices:
        assert all(accepts(path, c) for c in choices)
        assert not accepts(path, "no-such-choice")
        return
    num = r"(-?[\d.e+-]+|2\^63 - 1)"

    def value(x: str) -> str:
        return str(2**63 - 1) if x == "2^63 - 1" else x

    bounds = []  # (value, inclusive, direction: -1 = lower bound, +1 = upper bound)
    if m := re.fullmatch(rf"([\[(]){num}, {num}([\])])", allowed):
        bounds = [(m[2], m[1] == "[", -1), (m[3], m[4] == "]", +1)]
    elif m := re.fullmatch(rf"(>=|>|<=|<) {num}", allowed):
        bounds = [(m[2], "=" in m[1], -1 if ">" in m[1] else +1)]
    assert bounds, f"{path}: cannot read the allowed cell {allowed!r}"
    for x, inclusive, _ in bounds:
        assert accepts(path, value(x)) == inclusive, (path, x)
    for x, _, direction in bounds:  # a step beyond the bound is refused
        v = value(x)
        beyond = int(v) + direction if re.fullmatch(r"-?\d+", v) else float(v) + direction * 0.5
        assert not accepts(path, str(beyond)), (path, beyond)


# --------------------------------------------------------------------------------------------
# Every command shown parses, every usage line names real flags, every flag is documented.

SHOWN = shown_commands(DOCS, inline=True)
RUNNABLE = [s for s in SHOWN if not s.synopsis]
SYNOPSES = [s for s in SHOWN if s.synopsis]


def options_of(name: str) -> set[str]:
    """A command's flags; a command group's (`features`): those of all its subcommands."""
    cmd = COMMANDS[name]
    parts = list(getattr(cmd, "commands", {}).values()) or [cmd]
    return {o for c in parts for p in c.params for o in (*p.opts, *p.secondary_opts)
            if o.startswith("-")} | {"--help"}


def parse(argv: list[str]) -> None:
    """Parse `minigpt ARGV` as the installed program does, without running the command:
    raises the parser's usage error (exit code 2) for anything it would refuse."""
    ctx = GROUP.make_context("minigpt", list(argv))
    if argv and not argv[0].startswith("-"):
        cmd, rest = COMMANDS[argv[0]], list(argv[1:])
        sub = cmd.make_context(argv[0], rest, parent=ctx)
        if hasattr(cmd, "commands") and rest and not rest[0].startswith("-"):  # a group
            assert rest[0] in cmd.commands, f"no command `{argv[0]} {rest[0]}`"
            cmd.commands[rest[0]].make_context(rest[0], rest[1:], parent=sub)


@pytest.mark.parametrize("shown", RUNNABLE,
                         ids=[f"{s.path.name}: {' '.join(s.argv)}" for s in RUNNABLE])
def test_every_documented_command_parses(shown):
    assert shown.argv[0] in COMMANDS or shown.argv[0].startswith("-"), shown.line
    try:
        parse(shown.argv)
    except typer.Exit as e:  # --help, --version
        assert e.exit_code == 0, shown.line
    except typer.TyperException as e:  # the parser's UsageError
        pytest.fail(f"{shown.path.name}: `minigpt {' '.join(shown.argv)}`: {e.format_message()}")


@pytest.mark.parametrize("shown", SYNOPSES,
                         ids=[f"{s.path.name}: {' '.join(s.argv)[:60]}" for s in SYNOPSES])
def test_every_synopsis_names_real_flags(shown):
    name = shown.argv[0]
    if name not in COMMANDS:
        assert not re.fullmatch(r"[a-z][a-z-]*", name), f"no command {name!r}: {shown.line}"
        return  # `minigpt COMMAND --help`, `minigpt ...`
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", " ".join(shown.argv[1:])))
    assert flags <= options_of(name), f"{shown.path.name}: {shown.line}: {flags - options_of(name)}"


def cli_sections() -> dict[str, str]:
    text = CLI_MD.read_text()
    parts = re.split(r"^## `minigpt ([a-z-]+)`$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_cli_md_has_a_section_per_command():
    assert set(cli_sections()) == set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_is_documented(name):
    section = cli_sections()[name]
    missing = {o for o in options_of(name) - {"--help"}
               if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", section)}
    assert not missing, f"docs/cli.md, `minigpt {name}`: flags not documented: {missing}"


# --------------------------------------------------------------------------------------------
# The figures and lists of commands the docs give, read from the command tree itself: a command
# added (issue 55's `compile`) or a flag given to one more command fails here until the docs say
# so.

NUMBERS = {w: i for i, w in enumerate([
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen"])}


def leaves() -> dict[str, object]:
    """Every command that runs, by the name a user types: `features train`, not `features`."""
    out = {}
    for name, cmd in GROUP.commands.items():
        for sub, c in (getattr(cmd, "commands", None) or {None: cmd}).items():
            out[f"{name} {sub}" if sub else name] = c
    return out


def taking(flag: str) -> set[str]:
    return {n for n, c in leaves().items() if any(flag in p.opts for p in c.params)}


def named(sentence: str) -> set[str]:
    """The command names written in backticks in `sentence`."""
    every = set(leaves()) | set(COMMANDS)
    return {m for m in re.findall(r"`([a-z][a-z -]*?)`", sentence) if m in every}


def test_cli_md_counts_and_links_every_command():
    first = CLI_MD.read_text().split("\n\n")[1]
    word = first.split()[0].lower()
    assert NUMBERS.get(word) == len(COMMANDS), f"docs/cli.md says {word!r} commands; the " \
        f"program has {len(COMMANDS)}: {sorted(COMMANDS)}"
    linked = set(re.findall(r"\[`([a-z-]+)`\]\(#minigpt-", first))
    assert linked == set(COMMANDS), first
    rows = set(re.findall(r"^\| \[`minigpt ([a-z-]+)`\]", README, flags=re.MULTILINE))
    assert rows == set(COMMANDS), "the README's command table"


def _sentence(path: Path, start: str) -> str:
    text = " ".join(path.read_text().split())
    i = text.index(start)
    return text[i:i + 300].split(")", 1)[0] if "(" in start else text[i:i + 300]


@pytest.mark.parametrize("doc, start, flag", [
    ("cli.md", "`--model` (on ", "--model"),
    ("cli.md", "`--force` (on ", "--force"),
    ("cli.md", "and the `--threads N` of ", "--threads"),
    ("cli.md", "Every command that writes a file or a directory (", "-o"),
    ("hf.md", "`--model PATH|hf:REPO_ID[@REVISION]` on ", "--model"),
])
def test_every_list_of_the_commands_taking_a_flag_is_the_trees(doc, start, flag):
    said = _sentence(PROJECT_ROOT / "docs" / doc, start)
    if doc == "hf.md" or "--threads" in start:
        said = said.split(" runs a Hugging Face model")[0].split(" set how many")[0]
    assert named(said) == taking(flag), f"docs/{doc}: {said!r}"


def test_every_command_that_writes_files_takes_o_and_its_format_takes_json():
    """`-o` wherever there is an `--out`; `json` among the files of every analysis whose
    --format picks several (export's --format picks one kind of export, not files)."""
    from minigpt.heads.flags import CIRCUIT_FORMATS, FORMATS

    assert taking("--out") == taking("-o")
    assert "json" in FORMATS and "json" in CIRCUIT_FORMATS
    said = _sentence(CLI_MD, "Where `--format` picks the files of an analysis (")
    assert named(said) == taking("--format") - {"export"}
    show = in_process(["features", "show", "--sae", "nowhere", "--format", "json,html"])
    assert "is not a format" not in show.stderr


# --------------------------------------------------------------------------------------------
# Names the docs cite: tests, scripts, files, links and their anchors.


@functools.cache
def cited_functions() -> dict[str, set[str]]:
    """{test file name: its function names}, parsed once for every doc."""
    return {p.name: {n.name for n in ast.walk(ast.parse(p.read_text()))
                     if isinstance(n, ast.FunctionDef)}
            for p in (PROJECT_ROOT / "tests").glob("test_*.py")}


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(PROJECT_ROOT).as_posix() for d in DOCS])
def test_every_test_the_docs_cite_exists(doc):
    """`tests/test_x.py::test_name` (a trailing * matches a prefix) and `tests/test_x.py`."""
    known = cited_functions()
    text = doc.read_text()
    for file, name in re.findall(r"tests/(test_\w+\.py)(?:::(\w+\*?))?", text):
        assert file in known, f"{doc.name}: tests/{file} does not exist"
        if name:
            hit = [f for f in known[file] if f == name or name.endswith("*")
                   and f.startswith(name[:-1])]
            assert hit, f"{doc.name}: tests/{file}::{name} does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(PROJECT_ROOT).as_posix() for d in DOCS])
def test_every_path_the_docs_cite_exists(doc):
    text = doc.read_text()
    paths = set(re.findall(r"(?<![\w/.-])((?:minigpt|benchmarks|tools|configs|tests)/[\w/.-]*"
                           r"\w\.(?:py|yaml|md))", text))
    placeholder = re.compile(r"/(?!README\b)[A-Z]+\.")  # configs/NAME.yaml
    missing = [p for p in paths if not (PROJECT_ROOT / p).exists() and p not in PENDING
               and not placeholder.search(p)]
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_every_benchmark_script_is_in_the_benchmarks_readme():
    text = (PROJECT_ROOT / "benchmarks" / "README.md").read_text()
    scripts = {p.name for p in (PROJECT_ROOT / "benchmarks").glob("*.py")}
    assert {s for s in scripts if f"benchmarks/{s}" not in text} == set()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)}


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(PROJECT_ROOT).as_posix() for d in DOCS])
def test_every_link_resolves(doc):
    """Relative links point at files that exist, and their #anchors at headings in them."""
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        rel = path.relative_to(PROJECT_ROOT).as_posix()
        if rel in PENDING and not path.exists():
            continue
        assert path.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(path), f"{doc.name}: link to {target}: no such heading"


# --------------------------------------------------------------------------------------------
# What the docs state about the code.


def test_the_readme_python_runs(tmp_path, monkeypatch):
    """The README's Python API block, as written, in a directory whose runs/ holds a run."""
    from conftest import make_run

    blocks = re.findall(r"^```python\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1
    make_run(tmp_path / "runs" / "tiny", top_files=True)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "readme_api.py"
    script.write_text(blocks[0])
    scope = runpy.run_path(str(script))
    assert scope["logits"].shape == (2, 64, 257) and len(scope["attn"]) == 4
    assert scope["ids"] and scope["run"].step == 7


def test_heads_md_defines_every_score_with_the_codes_thresholds():
    from minigpt.heads import timeline
    from minigpt.interp import heads as scores

    text = (PROJECT_ROOT / "docs" / "heads.md").read_text()
    table = text[text.index("| score | formula |"):].split("\n\n")[0].splitlines()[2:]
    names = [row.split("|")[1].strip() for row in table]
    assert names == list(scores.SCORE_NAMES)
    order = re.search(r"the highest of ([\w, ]+) if it\s+is >= ([\d.]+)", text)
    assert order[1].split(", ") == list(scores.PATTERN_SCORES)
    assert float(order[2]) == scores.DOMINANT_THRESHOLD
    assert f"`diffuse` if entropy >= {scores.DIFFUSE_ENTROPY}" in text
    assert f"`local` if local >= {scores.DOMINANT_THRESHOLD}" in text
    assert f"mean over t = {scores.LOCAL_WINDOW}..T-1 of the mass on keys t-{scores.LOCAL_WINDOW}" \
        in text
    assert f"first reaches {timeline.FORMED}" in text


def test_the_resume_rule_is_the_codes():
    """run-directory.md: "`train.*` (except `train.batch_size` and `train.optimizer`) and
    `run.device` may change"."""
    from minigpt.run.resume import RESUME_SAFE

    text = (PROJECT_ROOT / "docs" / "run-directory.md").read_text()
    assert ("`train.*` (except `train.batch_size` and `train.optimizer`) and\n  `run.device` "
            "may change") in text
    stated = {("run", "device")} | {("train", fl.name) for fl in dataclasses.fields(
        SECTIONS["train"]) if fl.name not in ("batch_size", "optimizer")}
    assert RESUME_SAFE == stated


def test_the_readme_says_where_runs_and_the_cache_go(tmp_path, monkeypatch):
    """Issue 50's newcomer: the README did not say where `minigpt train` writes. It says
    `runs/default/` under the current directory and `~/.cache/minigpt` (or $MINIGPT_CACHE):
    what the code resolves."""
    from minigpt.paths import cache_root
    from minigpt.run.resume import train_config

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`runs/default/` under the current directory" in readme
    assert "`~/.cache/minigpt` (or `$MINIGPT_CACHE`)" in readme
    monkeypatch.chdir(tmp_path)
    assert train_config(None, [])[1].resolve() == (tmp_path / "runs" / "default").resolve()
    for var in ("MINIGPT_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root("") == tmp_path / ".cache" / "minigpt"
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "c"))
    assert cache_root("") == tmp_path / "c"
