"""Every module the package imports is a declared dependency, and every declared dependency
is imported (issue #15 finding 1: `minigpt/cli` imported `click`, which typer >= 0.22 no
longer installs, so every usage error on a fresh install was a ModuleNotFoundError).

Imports are read from the source with `ast` (top level and inside functions, as
tests/test_layout.py does); the standard library is `sys.stdlib_module_names`; an import name
maps to its distribution through the installed metadata
(`importlib.metadata.packages_distributions`: `yaml` -> PyYAML). Only the `[project]
dependencies` count: the dev extra is not installed for users."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from minigpt.paths import PACKAGE_DIR, PROJECT_ROOT

try:
    import tomllib
except ImportError:  # Python 3.10: the dev extra installs tomli
    import tomli as tomllib


def top_level_imports(path: Path) -> set[str]:
    """First components of every absolute import in the file, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def third_party(paths) -> dict[str, set[str]]:
    """{import name: files importing it} for names outside the stdlib and minigpt itself."""
    out: dict[str, set[str]] = {}
    for p in paths:
        for name in top_level_imports(p) - set(sys.stdlib_module_names) - {"minigpt",
                                                                             "__future__"}:
            out.setdefault(name, set()).add(p.name)
    return out


def canonical(dist: str) -> str:
    """PEP 503 name normalisation: PyYAML, pyyaml and py_yaml are one distribution."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def declared(extras: bool = True) -> set[str]:
    """The [project] dependencies, plus the user-facing optional extras (`hf`), never `dev`.
    An extra's import must sit inside a function that says what to install when it is missing:
    test_an_optional_extra_is_imported_only_inside_functions checks that."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    if extras:
        deps += [d for name, ds in project.get("optional-dependencies", {}).items()
                 if name != "dev" for d in ds]
    return {canonical(re.match(r"[A-Za-z0-9._-]+", d).group()) for d in deps}


def module_level_imports(path: Path) -> set[str]:
    """First components of the imports that run when the module is imported."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


# An extra the quick tier does not install (its users need jax; the slow tier's .ci/run installs
# it): import name -> its distribution, for the imports of it that nothing here can resolve.
SLOW_TIER_EXTRAS = {"tracr": "tracr-pypi"}


def undeclared(imports: dict[str, set[str]], deps: set[str]) -> dict[str, str]:
    """{import name: why} for imports no declared distribution provides."""
    dists = importlib.metadata.packages_distributions()
    bad = {}
    for name, files in sorted(imports.items()):
        provided_by = {canonical(d) for d in dists.get(name, [])} or \
            ({SLOW_TIER_EXTRAS[name]} if name in SLOW_TIER_EXTRAS else set())
        if not provided_by:
            bad[name] = f"not installed, not declared (imported in {sorted(files)})"
        elif not provided_by & deps:
            bad[name] = f"from {sorted(provided_by)}, not in [project] dependencies " \
                        f"(imported in {sorted(files)})"
    return bad


PACKAGE_FILES = sorted(PACKAGE_DIR.rglob("*.py"))


@pytest.mark.skipif(not (PROJECT_ROOT / "pyproject.toml").is_file(),
                    reason="a wheel install has no pyproject.toml to compare with")
def test_every_import_of_the_package_is_a_declared_dependency():
    assert undeclared(third_party(PACKAGE_FILES), declared()) == {}


@pytest.mark.skipif(not (PROJECT_ROOT / "pyproject.toml").is_file(),
                    reason="a wheel install has no pyproject.toml to compare with")
def test_every_declared_dependency_is_imported():
    dists = importlib.metadata.packages_distributions()
    used = {canonical(d) for name in third_party(PACKAGE_FILES)
            for d in dists.get(name, []) or [SLOW_TIER_EXTRAS.get(name, name)]}
    assert declared() - used == set()


@pytest.mark.skipif(not (PROJECT_ROOT / "pyproject.toml").is_file(),
                    reason="a wheel install has no pyproject.toml to compare with")
def test_an_optional_extra_is_imported_only_inside_functions():
    """`import minigpt...` works without the extras: no extra is imported at module level."""
    dists = importlib.metadata.packages_distributions()
    extra_only = declared() - declared(extras=False)
    assert extra_only  # the hf extra exists; the check below is not vacuous
    for p in PACKAGE_FILES:
        for name in module_level_imports(p):
            dist = {canonical(d) for d in dists.get(name, [])} or {SLOW_TIER_EXTRAS.get(name)}
            assert not dist & extra_only, (p, name)


def test_the_check_catches_what_it_looks_for(tmp_path):
    """`import click` inside a function (how the bug hid) and a module nobody installed are
    both caught; stdlib, minigpt and declared names are not."""
    src = tmp_path / "m.py"
    src.write_text("import os, json\nfrom minigpt.files import read_text\nimport yaml\n"
                   "def main():\n    import click\n    from not_installed_anywhere import x\n")
    found = undeclared(third_party([src]), {"pyyaml", "typer"})
    assert set(found) == {"click", "not_installed_anywhere"}
    assert "click" in found["click"] or "not declared" in found["click"]  # installed or not
    assert canonical("PyYAML") == "pyyaml" and canonical("Foo_Bar.baz") == "foo-bar-baz"
