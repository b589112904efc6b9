"""The README stays true: every setting documented, the test command is the one CI runs, and
every command it shows exists."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import describe_fields
from minigpt.paths import PROJECT_ROOT

README = (PROJECT_ROOT / "README.md").read_text()


def test_every_setting_is_in_the_config_reference():
    missing = [path for path, *_ in describe_fields() if f"`{path}`" not in README]
    assert missing == []


def test_ci_runs_the_readme_test_command_verbatim():
    command = "pip install -e '.[dev]' && pytest"
    assert command in README
    ci = (PROJECT_ROOT / ".ci" / "run").read_text()
    assert any(line.strip() == command for line in ci.splitlines())


def test_quick_start_main_job_is_there():
    assert "pip install -e . && minigpt train" in README


def test_every_command_the_readme_shows_exists():
    shown = set(re.findall(r"^### `minigpt ([a-z-]+)`", README, flags=re.MULTILINE))
    assert shown == {"train", "sample", "inspect-heads", "bench", "export", "runs", "curves"}
    for name in shown:
        result = CliRunner().invoke(app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_file_tree_matches_the_checkout():
    """Every module, test file and benchmark is in the README's file tree, and the tree names
    no file that is gone."""
    tree = README[README.index("## Files"):]
    listed = set(re.findall(r"^((?:minigpt|tests|benchmarks)/\S+\.py)", tree, flags=re.MULTILINE))
    on_disk = {p.relative_to(PROJECT_ROOT).as_posix()
               for pattern in ("minigpt/**/*.py", "tests/*.py", "benchmarks/*.py")
               for p in PROJECT_ROOT.glob(pattern) if "__pycache__" not in p.parts}
    assert listed == on_disk
