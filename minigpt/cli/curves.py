"""`minigpt curves --run RUN [--run RUN...] --out FILE.png` (or the runs as arguments):
several runs' training curves overlaid, against step and against training tokens seen (drawn
by `minigpt.run.curves`, which refuses to mix runs on text with runs on synthetic induction
ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import app, say
from minigpt.errors import ArgumentError


@app.command("curves")
def curves_command(
    out: Annotated[Path, typer.Option("--out", "-o", metavar=opt.OUT,
                                      help="The picture to write (.png).")],
    runs: Annotated[list[str] | None, typer.Argument(
        help="Run directories, or names of runs under runs/ (as --run).",
        metavar="RUN", show_default=False)] = None,
    run: opt.Runs = None,
) -> None:
    """Overlay several runs' train loss and val bits/byte, against step and tokens seen."""
    from minigpt.run.curves import comparable, read_series, unknown_kinds, write_overlay
    from minigpt.run.listing import find_run

    given = [*(runs or []), *(run or [])]
    if not given:
        raise ArgumentError("run", "give the runs to overlay: --run RUN (repeatable), or the "
                            "runs as arguments")
    dirs = [find_run(r) for r in given]
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
