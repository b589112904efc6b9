"""`minigpt curves RUN [RUN...] --out FILE.png`: several runs' training curves overlaid,
against step and against training tokens seen (drawn by `minigpt.run.curves`, which refuses
to mix runs on text with runs on synthetic induction ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from minigpt.cli.main import app, say
from minigpt.errors import MinigptError


@app.command("curves")
def curves_command(
    runs: Annotated[list[str], typer.Argument(
        help="Run directories, or names of runs under runs/.", metavar="RUN")],
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="The picture to write (.png).")],
) -> None:
    """Overlay several runs' train loss and val bits/byte, against step and tokens seen."""
    from minigpt.run.curves import comparable, read_series, unknown_kinds, write_overlay

    dirs = [_find_run(r) for r in runs]
    names = [d.name for d in dirs]
    series = [read_series(d, d.name if names.count(d.name) == 1 else str(d)) for d in dirs]
    for s in series:
        if s.skipped:
            say(f"note: {s.run_dir / 'metrics.jsonl'}: skipped {s.skipped} damaged "
                f"line{'s' if s.skipped != 1 else ''}")
    for line in unknown_kinds(series):
        say(f"note: {line}")
    path = write_overlay(series, out)  # runs that cannot share a picture are refused
    note = comparable(series)
    if note:
        say(f"note: {note}")
    say(f"wrote {path} ({len(series)} run{'s' if len(series) != 1 else ''})")


def _find_run(text: str) -> Path:
    """A run given as a directory, else as a name under runs/."""
    from minigpt.run.layout import DEFAULT_RUNS
    from minigpt.run.listing import is_run_dir

    for candidate in (Path(text), DEFAULT_RUNS / text):
        if is_run_dir(candidate):
            return candidate
    looked = f"{text}" + ("" if Path(text).is_absolute() else f" or {DEFAULT_RUNS / text}")
    raise MinigptError(f"unknown run '{text}': no run directory at {looked}; `minigpt runs` "
                       "lists the runs")
