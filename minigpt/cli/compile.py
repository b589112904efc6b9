"""`minigpt compile`: a RASP program (a built-in one by name, or `--program-file`) compiled by
tracr into a minigpt run directory with its known circuit (truth.json); `--list` names the
built-in programs. What was made goes to stderr, the run directory to stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import app, out_console, say
from minigpt.display import duration
from minigpt.errors import ArgumentError, ConflictError

ProgramArg = Annotated[str | None, typer.Argument(
    help="A built-in program (see --list).", show_default=False)]
ProgramFileOpt = Annotated[Path | None, typer.Option(
    "--program-file", metavar="FILE", help="Your own program: a Python file defining "
    "PROGRAM (a RASP expression), VOCAB (a set of token strings) and MAX_SEQ_LEN (the "
    "longest input). It runs as `python FILE` would.")]
CompileOutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", metavar=opt.OUT, help="The run directory to create (missing or empty; "
    "never overwritten). Default: runs/<program name>.")]
ListOpt = Annotated[bool, typer.Option(
    "--list", help="Name the built-in programs, one line each, and exit.")]


@app.command("compile")
def compile_command(program: ProgramArg = None, program_file: ProgramFileOpt = None,
                    out: CompileOutOpt = None, list_: ListOpt = False,
                    json_out: opt.Json = False) -> None:
    """Compile a RASP program with tracr into a minigpt run whose circuit is known."""
    from minigpt.truth.programs import BUILT_IN, built_in
    from minigpt.truth.programs import program_file as read_file

    if list_:
        _list(BUILT_IN, json_out)
        return
    if program is not None and program_file is not None:
        raise ConflictError(("program", "program_file"), "compile a built-in program or your "
                            "own file, one at a time")
    if program is None and program_file is None:
        raise ArgumentError("program", "give a built-in program (minigpt compile --list names "
                            "them) or --program-file FILE")
    from minigpt.truth.make import make_compiled_run, require_tracr
    from minigpt.truth.store import check_out

    prog = built_in(program) if program is not None else None  # a typo before tracr loads
    name = prog.name if prog is not None else Path(program_file).stem
    out = check_out(out if out is not None else Path("runs") / name)
    require_tracr()
    prog = prog or read_file(program_file)
    made = make_compiled_run(prog, out)
    t, m, c = made.truth, made.model, made.check
    say(f"compiled {prog.name} with tracr {made.tracr} in {duration(made.seconds)}: "
        f"{m['n_layer']} layers x {m['n_head']} head{'s' * (m['n_head'] > 1)} (d_head "
        f"{m['d_head']}, MLP "
        f"{m['d_mlp']} wide), residual stream {m['n_embd']} wide, {t.output['kind']} output; "
        f"truth: {len(t.nodes)} heads and MLPs, {len(t.edges)} edges")
    say(f"checked against tracr on {c['inputs']} random inputs: outputs "
        f"{'equal' if c['outputs_equal'] else 'DIFFER'}, residual streams within "
        f"{c['max_residual_diff']:.1g}")
    say(f"next: minigpt inspect-heads --run {made.out} --probe induction; minigpt circuit "
        f"--run {made.out}")
    if json_out:
        sys.stdout.write(json.dumps({"out": str(made.out), "program": t.program,
                                     "model": m, "tracr": made.tracr,
                                     "seconds": round(made.seconds, 3), "check": c,
                                     "truth": {"nodes": t.nodes, "edges": t.edges}}) + "\n")
    else:
        sys.stdout.write(f"{made.out}\n")


def _list(programs: dict, json_out: bool) -> None:
    if json_out:
        sys.stdout.write(json.dumps([{"name": p.name, "summary": p.summary,
                                      "vocab": list(p.vocab), "max_seq_len": p.max_seq_len}
                                     for p in programs.values()]) + "\n")
        return
    width = max(len(n) for n in programs)
    for p in programs.values():
        out_console.print(f"{p.name:<{width}}  {p.summary} [tokens {' '.join(p.vocab)}; up to "
                          f"{p.max_seq_len}]", markup=False, highlight=False, soft_wrap=True)
