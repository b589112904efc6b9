"""`minigpt bench`: tables of the attention, train and sample suites on stdout; the last
stdout line is one compact JSON object (the contract for scripts: the summary, or with
`--json` the whole report instead of the tables); `-o/--out` writes the report to a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import OldSpellingCommand, app, out_console, say
from minigpt.cli.shading import worded


@app.command("bench", cls=OldSpellingCommand)
def bench_command(
    ctx: typer.Context,
    device: opt.Device = "auto",
    suite: Annotated[list[str] | None, typer.Option(
        "--suite", help="attention, train, sample or all; repeatable. Default: all.")] = None,
    seq_lens: Annotated[str | None, typer.Option(
        "--seq-lens", help="Attention sequence lengths, e.g. 128,256,512. "
        "Default: 256,512,1024,2048 (--quick: 128,256,512).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="auto (bf16 on CUDA, fp32 elsewhere; the train suite on a CPU: "
        "what train.precision auto trains in there), float32, bfloat16, float16.")] = "auto",
    quick: Annotated[bool, typer.Option(
        "--quick", help="Small sizes and few repeats: under a minute on 2 CPU cores.")] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", metavar=opt.OUT,
        help="Also write every figure and the environment to this JSON file.")] = None,
    json_out: opt.Json = False,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also time the train step and the decode step under torch.compile "
        "(slow to warm up on CPU: about a minute per shape).")] = False,
    peak_tflops: Annotated[float | None, typer.Option(
        "--peak-tflops", help="Peak TFLOP/s for MFU (default: measured matmul rate on CPU, "
        "datasheet table on known GPUs).")] = None,
    model: opt.Model = None,
    threads: opt.Threads = 0,
    old_json_path: Annotated[str | None, typer.Argument(hidden=True)] = None,
) -> None:
    """Time attention kernels (naive vs SDPA), a training step (MFU) and decoding (KV cache)
    on this machine. Tables on stdout; the last stdout line is a JSON summary."""
    from minigpt.bench import runner as bench

    out, param, json_out = _json_spelling(ctx, out, json_out, old_json_path)
    opts = bench.BenchOptions(device=device, suites=list(suite or []), seq_lens=seq_lens,
                              dtype=dtype, quick=quick, compile=compile_,
                              peak_tflops=peak_tflops, model=model, json_path=out,
                              json_param=param, threads=threads)
    result = bench.run_bench(opts, on_event=lambda e: say(f"[bench] {e.suite}: {e.message}"))
    if out is not None:
        bench.write_json(out, result)
        say(f"wrote {out}")
    if json_out:  # the whole report as one document (its "summary" is the line printed last)
        sys.stdout.write(json.dumps(result.as_dict(), separators=(",", ":"), allow_nan=False)
                         + "\n")
        sys.stdout.flush()
        return
    _print_environment(result.environment)
    for table, lines in (_attention_table(result.attention), _train_table(result.train),
                         _sample_table(result.sample)):
        if table is not None:
            out_console.print(table)
            for line in lines:
                out_console.print(line, markup=False, soft_wrap=True)
    # The contract for scripts: the LAST stdout line is one compact JSON object.
    sys.stdout.write(json.dumps(result.summary(), separators=(",", ":"), allow_nan=False) + "\n")
    sys.stdout.flush()


def _json_spelling(ctx, out: Path | None, json_out: bool, old_path: str | None):
    """(the JSON file, the flag that named it, whether stdout carries the JSON document).
    `--json PATH`, the old spelling of `--out PATH` that scripts use, reads as it always did:
    the tables, the summary line and the file (the word after the flag `--json` is the hidden
    argument `old_path`)."""
    if old_path is None:
        return out, "out", json_out
    if not json_out:
        ctx.fail(f"Got unexpected extra argument ({old_path})")
    if out is not None:
        from minigpt.errors import ArgumentError

        raise ArgumentError("out", f"the file is given twice ({out} and --json {old_path}); "
                            "give it once, as --out PATH")
    return Path(old_path), "json", False


def _print_environment(env: dict) -> None:
    load = "/".join(str(x) for x in env.get("load_avg", [])) or "n/a"
    out_console.print(
        f"device {env['device']} ({env['device_name']}) | torch {env['torch']} | threads "
        f"{env['threads']} of {env['cpu_count']} cpus | dtype {env['dtype']}"
        + (f" (train suite {env['train_dtype']}: train.precision auto)"
           if "train_dtype" in env else "") + f" | load {load}"
        + (" | quick" if env["quick"] else ""), markup=False, soft_wrap=True)
    out_console.print("note: times are medians after warm-up; IQR = (q3 - q1) / median of the "
                      "repeats (quartiles in --json); on a shared or busy machine timings are "
                      "noisy", markup=False, soft_wrap=True)


def _g(x: float) -> str:
    """3 significant digits, no exponent for big numbers."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _iqr(t) -> str:
    """The interquartile range relative to the median."""
    return f"{100 * (t.q3_ms - t.q1_ms) / t.median_ms:.0f}%" if t.median_ms > 0 else "n/a"


def _num(x, fmt: str = "{:.3g}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _table(columns: list[str], left: tuple[str, ...] = ()):
    from rich import box
    from rich.table import Table

    t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", no_wrap=True)
    return t


def _attention_table(a) -> tuple[object, list[str]]:
    """The attention suite's table and the lines under it (memory method, verdicts)."""
    from rich.text import Text  # plain cells: "sdpa[math]" is not rich markup

    if a is None:
        return None, []
    c = a.config
    t = _table(["T", "impl", "pass", "ms", "IQR", "MiB", "faster", "less mem", "diff"],
               left=("impl", "pass"))
    for r in a.rows:
        if r.status != "ok":
            t.add_row(str(r.seq_len), Text(r.impl), r.pass_, "skipped", Text(r.reason[:60]),
                      "", "", "", "")
        else:
            t.add_row(str(r.seq_len), Text(r.impl), r.pass_, _g(r.timing.median_ms),
                      _iqr(r.timing), _num(r.peak_mem_mib), _num(r.speedup_vs_naive, "{:.2f}x"),
                      _num(r.mem_ratio_vs_naive, "{:.1f}x"), _num(r.max_abs_diff, "{:.0e}"))
    t = worded(t, f"attention: batch {c['batch']}, {c['n_head']} heads, head_dim "
               f"{c['head_dim']}, causal, {c['dtype']}",
               "faster / less mem: ratios vs naive; MiB: peak memory above the inputs; diff: "
               "max |out - naive| (fwd) or |grad - naive| (fwd+bwd)")
    return t, [f"memory method: {a.memory_method or a.memory_note}",
               *(f"verdict: {v}" for v in a.verdicts)]


def _train_table(tr) -> tuple[object, list[str]]:
    """The train suite's table and the lines under it (measured matmul rates, verdicts)."""
    from rich.text import Text

    if tr is None:
        return None, []
    p = tr.peak
    peak = f"{p.tflops:.3g} TFLOP/s ({p.source})" if p.tflops else f"n/a ({p.note})"
    t = _table(["shape", "mode", "BxT", "ms/step", "IQR", "tok/s", "TFLOP/s", "MFU", "1st s"],
               left=("shape", "mode"))
    for r in tr.rows:
        s = r.shape
        t.add_row(Text(s.name), r.mode, f"{s.batch_size}x{s.block_size}",
                  _g(r.timing.median_ms), _iqr(r.timing), f"{r.tokens_per_s:,.0f}",
                  f"{r.achieved_tflops:.3g}", _num(r.mfu, "{:.1%}"), _g(r.first_step_s))
    t = worded(t, f"train step (AdamW, random tokens): MFU vs peak {peak}",
               "1st s = first step in seconds (includes compilation for compile); "
               + ", ".join(f"{r.shape.name} = {r.shape.n_layer} layers x {r.shape.n_embd}, "
                           f"{r.params / 1e6:.2f}M params" for r in tr.rows
                           if r.mode == "eager"))
    return t, [*(f"measured {m['n']}x{m['n']} {dt} matmul: {m['tflops']:.3g} TFLOP/s"
                 for dt, m in p.measured.items()), *(f"verdict: {v}" for v in tr.verdicts)]


def _sample_table(sm) -> tuple[object, list[str]]:
    """The sample suite's table and its verdicts."""
    if sm is None:
        return None, []
    s = sm.settings
    what = f"{s.model}, " if s.model else ""
    threads = ", ".join(sorted({str(r.threads) for r in sm.rows}))
    t = _table(["KV cache", "TTFT ms", "prefill tok/s", "ms/tok", "IQR", "tok/s", "GFLOP/s",
                "GB/s"])
    for r in sm.rows:
        t.add_row(r.label, _g(r.ttft.median_ms),
                  f"{r.prefill_tokens_per_s:,.0f}", _g(r.decode.median_ms), _iqr(r.decode),
                  f"{r.decode_tokens_per_s:,.0f}", _g(r.gflops), _g(r.gbytes))
    t = worded(t, f"greedy decoding, batch 1: {what}{s.n_layer}L {s.n_embd}d, prompt "
               f"{s.prompt_len} + {s.new_tokens} new tokens, {threads} thread(s) (as "
               "`minigpt sample`)")
    work = "; ".join(f"{r.label}: {r.flops_per_token / 1e6:.3g} MFLOP, "
                     f"{r.bytes_per_token / 1e6:.3g} MB" for r in sm.rows
                     if not r.compiled)
    return t, [f"arithmetic of a decoded token (FLOPs; weights and cache read): {work}",
               *(f"verdict: {v}" for v in sm.verdicts)]
