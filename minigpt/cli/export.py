"""`minigpt export`: a run as a Hugging Face model directory (the directory on stdout, what was
written on stderr)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from minigpt.cli.main import RunOpt, app, err_console
from minigpt.errors import ArgumentError


@app.command("export")
def export_command(
    out: Annotated[Path, typer.Option(
        "--out", help="Directory to create (missing or empty; never overwritten).")],
    run: RunOpt = None,
    fmt: Annotated[str, typer.Option(
        "--format", help="hf: a directory AutoModelForCausalLM / AutoTokenizer.from_pretrained "
        "load (learned positions -> GPT-2, RoPE -> GPT-NeoX).")] = "hf",
) -> None:
    """Export a trained run for other tools: a Hugging Face transformers model directory."""
    from minigpt.hf.export import FORMATS, check_export_dir, export_hf
    from minigpt.run import load_run

    if fmt not in FORMATS:
        raise ArgumentError("format", f"'{fmt}' is not a format; valid: {', '.join(FORMATS)}")
    check_export_dir(out)  # fail before loading anything
    loaded = load_run(run, "cpu")
    done = export_hf(loaded, out)
    err_console.print(f"exported {loaded.label} as {done.architecture} ({done.n_params:,} "
                      f"parameters): {', '.join(done.files)}", markup=False, soft_wrap=True)
    err_console.print(f"load it with transformers: AutoModelForCausalLM.from_pretrained("
                      f"{str(done.out)!r}), AutoTokenizer.from_pretrained({str(done.out)!r})",
                      markup=False, soft_wrap=True)
    sys.stdout.write(f"{done.out}\n")
