"""`minigpt export`: a run as a Hugging Face model directory or a GGUF file for llama.cpp (the
path on stdout, what was written on stderr)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import app, latest_run, say
from minigpt.display import size
from minigpt.errors import ArgumentError

FORMATS = ("hf", "gguf")


@app.command("export")
def export_command(
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar=opt.OUT, help="hf: a directory to create (missing or empty); "
        "gguf: a new file (FILE.gguf). Never overwritten.")],
    run: opt.Run = None,
    fmt: Annotated[str, typer.Option(
        "--format", metavar="FORMAT", help="hf: a directory AutoModelForCausalLM / "
        "AutoTokenizer.from_pretrained load (learned positions -> GPT-2, RoPE -> GPT-NeoX). "
        "gguf: one file llama.cpp loads (gpt2 / gptneox; needs pip install "
        "'minigpt-lab[gguf]').")] = "hf",
    dtype: Annotated[str, typer.Option(
        "--dtype", help="gguf only: float32 (exact) or float16 (half the size) for the "
        "matrices (f32 and f16 still read).")] = "float32",
) -> None:
    """Export a trained run for other tools: transformers (--format hf) or llama.cpp (gguf)."""
    if fmt not in FORMATS:
        raise ArgumentError("format", f"'{fmt}' is not a format; valid: {', '.join(FORMATS)}")
    if fmt == "gguf":
        _gguf(out, run, dtype)
    else:
        from minigpt.hf.gguf import gguf_dtype

        if gguf_dtype(dtype) != "float32":
            raise ArgumentError("dtype", "applies to --format gguf only; --format hf writes "
                                "float32")
        _hf(out, run)


def _exportable(run_dir: Path) -> str | None:
    """Why a run cannot be exported (None: it can): its model has a setting GPT-2 and
    GPT-NeoX cannot express (`hf.arch.export_kind`, the rule of both formats)."""
    from minigpt.config import load_config
    from minigpt.errors import MinigptError
    from minigpt.hf.arch import export_kind
    from minigpt.run.layout import CONFIG_FILE

    try:
        export_kind(load_config(str(run_dir / CONFIG_FILE)).model)
    except MinigptError as e:
        return str(e)
    return None


def _load(run: Path | None):
    """The run to export, loaded on CPU: `run`, else the latest finished run whose model the
    formats can hold (saying which, and what newer run was passed over)."""
    from minigpt.run import load_run

    if run is None:
        run, which = latest_run(_exportable, wanted="a model GPT-2 or GPT-NeoX can hold")
        loaded = load_run(run, "cpu")
        say(f"exporting {which}{loaded.label}")
        return loaded
    return load_run(run, "cpu")


def _hf(out: Path, run: Path | None) -> None:
    from minigpt.hf.export import check_export_dir, export_hf

    check_export_dir(out)  # fail before loading anything
    loaded = _load(run)
    done = export_hf(loaded, out)
    say(f"exported {loaded.label} as {done.architecture} ({done.n_params:,} parameters): "
        f"{', '.join(done.files)}")
    say(f"load it with transformers: AutoModelForCausalLM.from_pretrained({str(done.out)!r}), "
        f"AutoTokenizer.from_pretrained({str(done.out)!r})")
    sys.stdout.write(f"{done.out}\n")


def _gguf(out: Path, run: Path | None, dtype: str) -> None:
    from minigpt.hf.gguf import check_gguf_out, export_gguf, gguf_dtype, require_gguf

    dtype = gguf_dtype(dtype)
    require_gguf()  # fail before loading anything
    check_gguf_out(out)
    loaded = _load(run)
    done = export_gguf(loaded, out, dtype)
    say(f"exported {loaded.label} as llama.cpp {done.architecture} ({done.n_params:,} "
        f"parameters, {done.dtype}, pre-tokenizer {done.pre_tokenizer}): "
        f"{size(done.n_bytes)}")
    say(f"load it with llama.cpp, e.g. llama-cpp-python: Llama(model_path={str(done.out)!r})")
    sys.stdout.write(f"{done.out}\n")
