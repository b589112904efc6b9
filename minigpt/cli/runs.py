"""`minigpt runs [DIR]`, `minigpt runs --run RUN [--run RUN...]`: the runs in a directory, or
the runs named, as a rich table (or `--json`), from `minigpt.run.listing` (its docstring says
where each column comes from)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import app, out_console, say
from minigpt.display import duration, printable


@app.command("runs")
def runs_command(
    directory: Annotated[Path | None, typer.Argument(
        help="Directory holding run directories (or one run directory). Default: runs/, "
        "unless --run names the runs.", metavar="DIR", show_default=False)] = None,
    run: opt.Runs = None,
    json_out: opt.Json = False,
) -> None:
    """List runs: status, step, best and last val bits/byte, parameters, wall time, last
    change."""
    from minigpt.run.layout import DEFAULT_RUNS
    from minigpt.run.listing import find_run, list_runs

    places = [*([directory] if directory is not None else []), *map(find_run, run or [])]
    places = places or [DEFAULT_RUNS]
    rows = [r for place in places for r in list_runs(place)]
    for r in rows:
        if r.problem:
            say(f"note: {r.problem}")
        if r.skipped_lines:
            say(f"note: {r.path / 'metrics.jsonl'}: skipped {r.skipped_lines} damaged "
                f"line{'s' if r.skipped_lines != 1 else ''}")
    where = str(places[0]) if len(places) == 1 else ", ".join(map(str, places))
    if json_out:
        doc = {"directory": where, "runs": [r.to_json() for r in rows]}
        out_console.out(json.dumps(doc), highlight=False)
        return
    from rich.console import Console

    # Off a terminal rich assumes 80 columns and would fold every row in two.
    console = out_console if out_console.is_terminal else Console(highlight=False, width=160)
    console.print(_runs_table(rows, where))


def _runs_table(rows, where: str):
    """One row per run. Names come from the file system: shown with controls escaped, never
    read as markup."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(printable(f"runs in {where}"), style="table.title"))
    for name, justify in (("name", "left"), ("status", "left"), ("step", "right"),
                          ("val bits/byte: best (step), last", "right"),
                          ("parameters", "right"), ("wall time", "right"),
                          ("last change", "left")):
        table.add_column(name, justify=justify)
    for r in rows:
        table.add_row(Text(printable(r.name)), _status(r),
                      f"{r.step}/{r.max_steps if r.max_steps else '?'}", _val(r),
                      "-" if r.params is None else f"{r.params:,}",
                      "-" if r.wall_time is None else duration(r.wall_time),
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.last_change)))
    return table


def _status(r) -> str:
    """The run's status; for a run on induction ids that is done, what its heads came to
    ("finished, no induction head"; a run stopped by train.stop_when_formed with both heads
    formed stays "formed")."""
    if r.heads is None or r.status not in ("finished", "formed", "stopped", "interrupted",
                                           "killed"):
        return r.status
    return r.status if r.status == "formed" and r.heads.formed else \
        f"{r.status}, {r.heads.short()}"


def _val(r) -> str:
    """Best and last validation side by side (they differ once the model overfits); a run on
    synthetic induction ids has no bytes: the copies its last evaluation predicted."""
    if r.copy_accuracy is not None:
        return f"copies {100 * r.copy_accuracy:.1f}%"
    if r.best_val_bpb is None:
        return "-"
    best = f"{r.best_val_bpb:.4f} ({r.best_step})"
    if r.last_step is None or r.last_step == r.best_step:
        return best
    return f"{best}, {r.last_val_bpb:.4f}"
