"""`minigpt compile`, as a library call: `make_compiled_run` compiles a program with tracr
(tracr_compile.py), converts its weights (convert.py), checks the minigpt model against
tracr's own on random inputs (the same outputs, every layer's residual stream within
CHECK_TOLERANCE) and writes the run (store.py). Needs tracr."""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path

from minigpt.truth.programs import BOS, Program
from minigpt.truth.store import (
    Truth,
    build_model,
    check_out,
    compiled_config,
    compiled_tokenizer,
    write_compiled_run,
)
from minigpt.truth.tracr_compile import compare, compile_program, random_inputs

CHECK_INPUTS = 200  # random inputs the model is checked on as it is written
CHECK_TOLERANCE = 1e-5  # the largest residual difference a compiled model may have


@dataclass
class CompiledRun:
    """What `make_compiled_run` made: the run directory, its truth, the model's settings,
    tracr's version, the seconds it took and the check against tracr."""

    out: Path
    truth: Truth
    model: dict
    tracr: str
    seconds: float
    check: dict


def make_compiled_run(program: Program, out: Path, seed: int = 0) -> CompiledRun:
    """Compile `program` into the run directory `out` (module docstring). MinigptError for
    what a user can fix (tracr missing, a program tracr cannot compile, `out` in use)."""
    out = check_out(out)  # before the compile: seconds of tracr for nothing otherwise
    t0 = time.perf_counter()
    c = compile_program(program)
    prog = {"name": program.name, "summary": program.summary, "source": program.source,
            "vocab": list(program.vocab), "max_seq_len": program.max_seq_len, "bos": BOS}
    cfg = compiled_config(prog, c.dims, len(c.output["directions"]))
    model = build_model(cfg, c.params, c.dims, c.residual, c.output["directions"])
    check = compare(c, model, random_inputs(program, CHECK_INPUTS, seed))
    if not check["outputs_equal"] or check["max_residual_diff"] > CHECK_TOLERANCE:
        raise AssertionError(f"the converted model differs from tracr's: {check}")
    version = importlib.metadata.version("tracr-pypi")
    seconds = time.perf_counter() - t0
    truth = Truth(prog, c.output, c.truth["directions"], c.truth["nodes"], c.truth["edges"],
                  {"tracr": version, "seconds": round(seconds, 2), "check_seed": seed,
                   **check})
    metrics = {"step": 0, "kind": "compiled", "program": program.name, "compile_s": seconds,
               **check}
    write_compiled_run(out, cfg, model, compiled_tokenizer(prog, c.input_ids), truth, metrics)
    return CompiledRun(out, truth, {k: getattr(cfg.model, k) for k in
                                    ("n_layer", "n_head", "d_head", "d_mlp", "n_embd",
                                     "vocab_size", "d_vocab_out")},
                       version, seconds, check)


def require_tracr() -> None:
    """MinigptError saying how to install tracr when it is missing (before any work)."""
    from minigpt.truth.programs import tracr_modules

    tracr_modules()

