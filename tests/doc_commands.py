"""The `minigpt ...` commands the documentation shows, read from the Markdown files, for
tests/test_cli_real.py (which runs them through the installed program) and tests/test_docs.py
(which parses every one of them and checks every usage line's flags).

- RUN_DOCS: the files whose code-block commands are run, in this order (the README first: its
  tour trains the runs the later commands read). Every other Markdown file in DOCS has its
  commands parsed, not run (their examples may need files or extras the tests do not have).
- A usage synopsis (a line holding `[options]` brackets, `<placeholders>`, `...` or ALL-CAPS
  placeholders such as DIR) is not runnable as written; its continuation lines (indented,
  starting with `[`) belong to it.
- Inline code (`minigpt sample --json` in a sentence) counts with at least one argument after
  the command's name: a bare `minigpt runs` in prose names the command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from minigpt.paths import PROJECT_ROOT

RUN_DOCS = [PROJECT_ROOT / "README.md", *(PROJECT_ROOT / "docs" / f"{name}.md"
                                          for name in ("cli", "heads", "hf"))]
DOCS = [PROJECT_ROOT / "README.md", PROJECT_ROOT / "benchmarks" / "README.md",
        *sorted((PROJECT_ROOT / "docs").glob("*.md"))]


def code_lines(text: str) -> list[str]:
    """Lines of the fenced blocks and of the indented code blocks (4 spaces, after a blank
    line: a list item's continuation lines are not code)."""
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        lines += block.splitlines()
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    in_block, previous_blank = False, True
    for line in prose.splitlines():
        if line.startswith("    ") and (in_block or previous_blank):
            in_block = True
            lines.append(line)
        elif line.strip():
            in_block = False
        previous_blank = not line.strip()
    return lines


def inline_code(text: str) -> list[str]:
    """The `inline code` spans of the prose (outside code blocks) that start with `minigpt `."""
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    spans = re.findall(r"`([^`]+)`", " ".join(code_free(prose)))
    return [s for s in spans if s.startswith("minigpt ")]


def code_free(prose: str) -> list[str]:
    """The prose lines that are not an indented code block."""
    out, in_block, previous_blank = [], False, True
    for line in prose.splitlines():
        if line.startswith("    ") and (in_block or previous_blank):
            in_block = True
        else:
            if line.strip():
                in_block = False
            out.append(line)
        previous_blank = not line.strip()
    return out


def is_synopsis(argv: list[str]) -> bool:
    """Brackets, `<placeholders>`, `...` or an ALL-CAPS placeholder (DIR, STEP, COMMAND)."""
    return any(("[" in w or "<" in w or "..." in w or re.fullmatch(r"[A-Z][A-Z_]+", w))
               for w in argv[1:])


def minigpt_parts(line: str) -> list[list[str]]:
    """The commands of one shell line, split at `&&`, as argv lists (first word included);
    `torchrun ... -m minigpt ARGS` gives `minigpt ARGS`. [] for a line that is not shell."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return []  # not shell (a tree drawing)
    parts, part = [], []
    for w in [*words, "&&"]:
        if w == "&&":
            if part:
                parts.append(part)
            part = []
        else:
            part.append(w)
    return parts


@dataclass
class Shown:
    """One command as the documentation shows it."""
    argv: list[str]      # without the leading "minigpt"
    line: str
    path: Path
    synopsis: bool


def shown_commands(paths: list[Path], inline: bool = False) -> list[Shown]:
    """Every `minigpt ...` command in the code blocks of `paths` (and, with `inline`, in their
    inline code spans), in order; a synopsis's continuation lines are joined to it."""
    out: list[Shown] = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        lines = code_lines(text)
        for i, line in enumerate(lines):
            if line.strip().startswith("[") and out and out[-1].synopsis and out[-1].path == path:
                out[-1].argv += shlex.split(line)  # a synopsis continued
                out[-1].line += " " + line.strip()
                continue
            for p in minigpt_parts(line):
                if p[0] == "torchrun" and "minigpt" in p:
                    p = p[p.index("minigpt"):]
                if p[0] == "minigpt":
                    out.append(Shown(p[1:], line.strip(), path, is_synopsis(p)))
        if inline:
            for span in inline_code(text):
                for p in minigpt_parts(span):
                    if p[0] == "minigpt" and len(p) > 2:  # `minigpt runs` names, not runs
                        out.append(Shown(p[1:], span, path, is_synopsis(p)))
    return out
