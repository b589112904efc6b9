"""The house rules of the package layout (docs/internals.md), read from the source with
`ast`: imports flow one way, ground floor up; no import cycles; only the CLI speaks typer and
rich; the ground floor and the config never import torch. Modules are cut by concept, not by
length; what catches real trouble is a function that does too much: no function over 60 lines,
and ruff's complexity rules (C901, too many branches / statements; pyproject.toml) hold."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt.paths import PACKAGE_DIR

# Floors, lowest first. A module may import modules of its own floor or below, never above.
FLOORS = [
    ("ground", {"minigpt", "minigpt.errors", "minigpt.paths", "minigpt.files", "minigpt.events",
                "minigpt.display", "minigpt.threads"}),
    ("config", {"minigpt.config"}),
    ("core", {"minigpt.core"}),
    ("device", {"minigpt.device", "minigpt.cost"}),
    ("interp", {"minigpt.interp"}),
    ("data", {"minigpt.data"}),
    ("run", {"minigpt.run"}),
    ("hf", {"minigpt.hf"}),
    ("infer", {"minigpt.infer"}),
    ("train, heads", {"minigpt.train", "minigpt.heads", "minigpt.features", "minigpt.truth"}),
    ("bench", {"minigpt.bench"}),
    ("cli", {"minigpt.cli", "minigpt.__main__"}),
]
MAX_LOOSE_ROOT_MODULES = 8
MAX_FUNCTION_LINES = 60  # the developers' guide: "a function over ~60 lines is a smell"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def floor_of(name: str) -> int:
    """The floor of a module: the floor listing it or the package that holds it."""
    for i, (_, members) in enumerate(FLOORS):
        if name in members or any(name.startswith(m + ".") for m in members if m != "minigpt"):
            return i
    raise AssertionError(f"{name} is on no floor: add it to FLOORS and to the README")


def imports_of(path: Path) -> set[str]:
    """Every module imported anywhere in the file (top level and inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from minigpt.heads import inspection` imports the submodule too
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if f"{node.module}.{a.name}" in MODULES}
    return found


GRAPH = {name: {m for m in imports_of(p) if m in MODULES and m != name}
         for name, p in MODULES.items()}


def test_the_package_root_holds_only_what_every_room_uses():
    """Loose modules at the root are the ground floor and the device: everything else lives in
    a room (a package) named for what it holds, so a newcomer opens a room, not a heap."""
    loose = {f"minigpt.{p.stem}" for p in PACKAGE_DIR.glob("*.py")
             if p.stem not in ("__init__", "__main__")}
    assert len(loose) <= MAX_LOOSE_ROOT_MODULES, sorted(loose)
    policy = {"minigpt.device", "minigpt.cost"}
    assert loose <= FLOORS[0][1] | policy, sorted(loose - FLOORS[0][1])
    rooms = {m for _, members in FLOORS[1:] for m in members if m != "minigpt.__main__"}
    assert all((PACKAGE_DIR.parent / m.replace(".", "/") / "__init__.py").is_file()
               for m in rooms - policy), rooms


def test_every_module_is_on_a_floor():
    for name in MODULES:
        floor_of(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_flow_one_way(name):
    up = [f"{m} ({FLOORS[floor_of(m)][0]})" for m in sorted(GRAPH[name])
          if floor_of(m) > floor_of(name)]
    assert not up, f"{name} ({FLOORS[floor_of(name)][0]}) imports upwards: {up}"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if nxt in ("minigpt",) or nxt == node:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])


def test_only_the_cli_imports_typer_and_rich_and_nothing_imports_the_cli():
    for name, p in MODULES.items():
        if floor_of(name) == len(FLOORS) - 1:
            continue
        tops = {m.split(".")[0] for m in imports_of(p)}
        assert not tops & {"typer", "rich", "click"}, f"{name} imports {tops & {'typer', 'rich'}}"
        assert not any(m.startswith("minigpt.cli") for m in imports_of(p)), name


def test_the_cli_never_imports_click():
    """typer >= 0.22 vendors click and does not install it."""
    for name, p in MODULES.items():
        assert "click" not in {m.split(".")[0] for m in imports_of(p)}, name


def test_ground_floor_and_config_do_not_import_torch():
    for name, p in MODULES.items():
        if floor_of(name) <= 1:
            tops = {m.split(".")[0] for m in imports_of(p)}
            assert not tops & {"torch", "numpy", "safetensors"}, f"{name} imports {tops}"


CORE_MAY_IMPORT = {"torch", "minigpt.config.settings", "minigpt.errors"}
# the analyses may also read the model and each other, state their cost as a `Cost` and name a
# head or an MLP node by its one spelling (display.head_name, display.mlp_name: standard
# library only)
INTERP_MAY_IMPORT = CORE_MAY_IMPORT | {"minigpt.cost", "minigpt.display"}


def outside_imports(path: Path, room: str = "core") -> set[str]:
    """What a file of `room` (core or interp) imports beyond torch, the standard library, the
    settings dataclasses, the errors and the rooms it may read: core reads core; interp reads
    core, interp, the Cost type and the names of heads."""
    rooms = ("minigpt.core",) if room == "core" else ("minigpt.core", "minigpt.interp")
    may = CORE_MAY_IMPORT if room == "core" else INTERP_MAY_IMPORT

    def allowed(m: str) -> bool:
        top = m.split(".")[0]
        return (top in sys.stdlib_module_names or top == "torch" or m in may
                or any(m == r or m.startswith(r + ".") for r in rooms))
    return {m for m in imports_of(path) if not allowed(m)}


def test_core_is_the_model_and_imports_only_torch_the_standard_library_the_settings_and_errors():
    """The model's room (docs/internals.md: read core/ first) reads no file, sends no event,
    knows no run directory, tokenizer or CLI, and holds no analysis: everything else consumes
    it."""
    core = {name: p for name, p in MODULES.items() if name.startswith("minigpt.core")}
    assert {"minigpt.core.gpt", "minigpt.core.generate", "minigpt.core.kernels",
            "minigpt.core.step"} <= set(core)
    for name, path in core.items():
        assert not outside_imports(path), f"{name} imports {outside_imports(path)}"


def test_the_maths_of_inspection_sits_on_the_model_and_the_model_never_imports_it():
    """interp/ (the analyses) reads the model; core/ never reads interp/; neither reads a
    file, a device policy or a run."""
    interp = {name: p for name, p in MODULES.items() if name.startswith("minigpt.interp")}
    assert {"minigpt.interp.heads", "minigpt.interp.qk", "minigpt.interp.sae",
            "minigpt.interp.edge_graph", "minigpt.interp.patching"} <= set(interp)
    for name, path in interp.items():
        extra = outside_imports(path, "interp")
        assert not extra, f"{name} imports {extra}"
    for name in MODULES:
        if name.startswith("minigpt.core"):
            assert not {m for m in GRAPH[name] if m.startswith("minigpt.interp")}, name


def test_the_rules_catch_what_they_look_for(tmp_path):
    """The checks above read real import statements, also inside functions."""
    src = tmp_path / "m.py"
    src.write_text("import os\ndef f():\n    from minigpt.cli.main import app\n"
                   "    import typer\n")
    assert {"minigpt.cli.main", "typer", "os"} <= imports_of(src)
    assert floor_of("minigpt.cli.main") > floor_of("minigpt.core.gpt")
    src.write_text("import json\nimport torch.nn\nfrom minigpt.config.settings import Config\n"
                   "from minigpt.core.gpt import GPT\nfrom minigpt.files import read_text\n"
                   "import numpy\nfrom minigpt.config import load_config\n")
    assert outside_imports(src) == {"minigpt.files", "numpy", "minigpt.config"}
    assert outside_imports(src, "interp") == outside_imports(src)


def test_importing_the_core_loads_no_file_code():
    """The maths takes a ModelConfig without the config loader: importing every core module
    loads neither the file door, the YAML parser nor the config loader."""
    code = ("import sys\n"
            "import minigpt.core.gpt, minigpt.interp.heads, minigpt.interp.head_circuits\n"
            "import minigpt.core.generate, minigpt.core.step\n"
            "bad = {'minigpt.files', 'minigpt.config.load', 'minigpt.config.fields', "
            "'minigpt.paths', 'yaml'}\n"
            "print(sorted(bad & set(sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_no_function_is_too_long_to_read():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, f"split by what each part does: {long}"


def test_ruffs_complexity_and_line_length_rules_hold():
    """C901 (McCabe complexity), PLR0912 (branches), PLR0915 (statements), with the limits in
    pyproject.toml's [tool.ruff.lint], and E501 (lines within the 100 columns of line-length)
    over the package, the tests, the benchmarks and the tools."""
    root = PACKAGE_DIR.parent
    where = [str(root / d) for d in ("minigpt", "tests", "benchmarks", "tools")
             if (root / d).is_dir()]
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--select",
                        "C901,PLR0912,PLR0915,E501", "--output-format", "concise", *where],
                       capture_output=True, text=True, check=False, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_test_reaches_a_benchmark_scripts_private_names():
    """Tests may use benchmarks/kill_trials.py's public helpers (conftest's `kill_trials`), never
    a private `_name`: a benchmark script is free to change what it keeps private."""
    import re

    tests = Path(__file__).resolve().parent
    bad = [f"{p.name}: {m[0]}" for p in sorted(tests.glob("*.py")) if p.name != "test_layout.py"
           for m in re.finditer(r"\b(?:kt|kill_trials\(\))\._\w+", p.read_text(encoding="utf-8"))]
    assert not bad, bad


# Files of other projects that docstrings name on purpose.
OUTSIDE_FILES = {"model.py": "nanoGPT's model file",
                 "convert_hf_to_gguf.py": "llama.cpp's converter"}


def test_every_file_a_docstring_or_comment_names_exists():
    """A module named in a docstring or comment (`outputs.py`, `run/checkpoint.py`) exists in
    the package, the tools or the benchmarks: a file that moved is renamed where it is named."""
    import re

    root = PACKAGE_DIR.parent
    ours = {p.relative_to(root).as_posix() for d in ("minigpt", "tools", "benchmarks", "tests")
            for p in (root / d).rglob("*.py")}
    names = {Path(p).name for p in ours}
    missing = []
    for path in sorted(p for d in ("minigpt", "tools", "benchmarks")
                       for p in (root / d).rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for ref in re.findall(r"(?<![\w/.-])((?:[\w-]+/)*[A-Za-z_]\w*\.py)\b", line):
                known = (any(p.endswith(ref) for p in ours) if "/" in ref
                         else ref in names or ref in OUTSIDE_FILES)
                if not known:
                    missing.append(f"{path.relative_to(root)}:{n}: {ref}")
    assert not missing, missing


FILE_SUFFIXES = {"json", "yaml", "png", "lock", "html", "md", "txt", "safetensors", "jsonl",
                 "gz", "py"}


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the docstrings and comments of a Python file, read line by line
    (a line inside triple quotes, or what follows a `#` outside them): fast, and near enough
    for names in prose."""
    out, inside = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        quotes = line.count('"""')
        if inside or quotes:
            out.append((n, line))
        elif "#" in line:
            out.append((n, line[line.index("#"):]))
        inside = inside != (quotes % 2 == 1)
    return out


@functools.cache
def top_level_names(path: Path) -> set[str]:
    """What a module defines, imports or lists in __all__ at its top level."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(getattr(t, "id", "") == "__all__" for t in targets):
                names |= set(ast.literal_eval(node.value))
    return names


def test_every_module_a_docstring_or_comment_names_by_dotted_name_exists():
    """A module named in prose by its dotted name (`interp.head_circuits`,
    `minigpt.run.load_run`, `cost.check_flops`) exists, and so does the name after it: a module
    that moved or a function renamed is renamed where it is named. Settings (`train.threads`)
    and file names (`config.yaml`) are not modules."""
    import dataclasses
    import re

    from minigpt.config.settings import SECTIONS

    settings = {f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)}
    rooms = sorted({name.split(".")[1] for name in MODULES if name.count(".")})
    ref = re.compile(r"(?<![\w./-])(?:minigpt\.)?((?:" + "|".join(rooms) + r")(?:\.[A-Za-z_]\w*)+)")
    root = PACKAGE_DIR.parent
    missing = []
    files = sorted(p for d in ("minigpt", "tools", "benchmarks") for p in (root / d).rglob("*.py"))
    for path in files:
        for n, line in prose_lines(path):
            for m in ref.finditer(line):
                parts = m.group(1).split(".")
                if m.group(1) in settings or parts[-1] in FILE_SUFFIXES:
                    continue
                k = next((k for k in range(len(parts), 0, -1)
                          if "minigpt." + ".".join(parts[:k]) in MODULES), 0)
                if k == 0 or (k < len(parts) and parts[k] not in top_level_names(
                        MODULES["minigpt." + ".".join(parts[:k])])):
                    missing.append(f"{path.relative_to(root)}:{n}: {m.group(1)}")
    assert not missing, missing


MAX_POSITIONAL = 6  # a helper's positional parameters: more are read by position, mixed up


def test_no_cli_helper_takes_more_than_six_positional_parameters():
    """Every function of minigpt/cli but the commands themselves (typer reads those by name)
    takes at most MAX_POSITIONAL positional parameters (self and cls not counted): more go by
    keyword, or together in one value."""
    many = []
    for name, path in MODULES.items():
        if not name.startswith("minigpt.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if any("command" in ast.unparse(d) for d in node.decorator_list):
                continue
            args = [a.arg for a in node.args.posonlyargs + node.args.args]
            n = len(args) - (args[:1] in (["self"], ["cls"]))
            if n > MAX_POSITIONAL:
                many.append(f"{name}.{node.name}: {n}")
    assert not many, many
