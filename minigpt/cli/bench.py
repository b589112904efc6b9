"""`minigpt bench`: tables of the attention, train and sample suites on stdout; the last
stdout line is one compact JSON object (the contract for scripts)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from minigpt.cli.main import DeviceOpt, ModelOpt, app, err_console, out_console


@app.command("bench")
def bench_command(
    device: DeviceOpt = "auto",
    suite: Annotated[list[str] | None, typer.Option(
        "--suite", help="attention, train, sample or all; repeatable. Default: all.")] = None,
    seq_lens: Annotated[str | None, typer.Option(
        "--seq-lens", help="Attention sequence lengths, e.g. 128,256,512. "
        "Default: 256,512,1024,2048 (--quick: 128,256,512).")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="auto (bf16 on CUDA, fp32 elsewhere), float32, bfloat16, "
        "float16.")] = "auto",
    quick: Annotated[bool, typer.Option(
        "--quick", help="Small sizes and few repeats: under a minute on 2 CPU cores.")] = False,
    json_path: Annotated[str | None, typer.Option(
        "--json", help="Also write every figure and the environment to this JSON file.")] = None,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also time the train step under torch.compile (slow to warm up on "
        "CPU: about a minute per shape).")] = False,
    peak_tflops: Annotated[float | None, typer.Option(
        "--peak-tflops", help="Peak TFLOP/s for MFU (default: measured matmul rate on CPU, "
        "datasheet table on known GPUs).")] = None,
    model: ModelOpt = None,
) -> None:
    """Time attention kernels (naive vs SDPA), a training step (MFU) and decoding (KV cache)
    on this machine. Tables on stdout; the last stdout line is a JSON summary."""
    from minigpt.bench import runner as bench

    opts = bench.BenchOptions(device=device, suites=list(suite or []), seq_lens=seq_lens,
                              dtype=dtype, quick=quick, compile=compile_,
                              peak_tflops=peak_tflops, model=model)
    if json_path is not None:  # fail before the work, not after it
        bench.check_json_path(json_path)
    result = bench.run_bench(opts, on_event=lambda e: err_console.print(
        f"[bench] {e.suite}: {e.message}", markup=False, highlight=False))
    _bench_render(result)
    if json_path is not None:
        bench.write_json(json_path, result)
        err_console.print(f"wrote {json_path}", markup=False)
    import json

    # The contract for scripts: the LAST stdout line is one compact JSON object.
    sys.stdout.write(json.dumps(bench._finite(result.summary()), separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _bench_render(result) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text  # plain cells: "sdpa[math]" is not rich markup

    env = result.environment
    load = "/".join(str(x) for x in env.get("load_avg", [])) or "n/a"
    out_console.print(
        f"device {env['device']} ({env['device_name']}) | torch {env['torch']} | threads "
        f"{env['threads']} of {env['cpu_count']} cpus | dtype {env['dtype']} | load {load}"
        + (" | quick" if env["quick"] else ""), markup=False, soft_wrap=True)
    out_console.print("note: times are medians after warm-up; IQR = (q3 - q1) / median of the "
                      "repeats (quartiles in --json); on a shared or busy machine timings are "
                      "noisy", markup=False, soft_wrap=True)

    def g(x: float) -> str:  # 3 significant digits, no exponent for big numbers
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    def spread(t) -> str:  # interquartile range relative to the median
        return f"{100 * (t.q3_ms - t.q1_ms) / t.median_ms:.0f}%" if t.median_ms > 0 else "n/a"

    def num(x, fmt: str = "{:.3g}") -> str:
        return "n/a" if x is None else fmt.format(x)

    a = result.attention
    if a is not None:
        c = a.config
        t = Table(title=f"attention: batch {c['batch']}, {c['n_head']} heads, head_dim "
                  f"{c['head_dim']}, causal, {c['dtype']}", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="faster / less mem: ratios vs naive; MiB: peak memory above the "
                  "inputs; diff: max |out - naive| (fwd) or |grad - naive| (fwd+bwd)")
        for col in ("T", "impl", "pass", "ms", "IQR", "MiB", "faster", "less mem", "diff"):
            t.add_column(col, justify="left" if col in ("impl", "pass") else "right",
                         no_wrap=True)
        for r in a.rows:
            if r.status != "ok":
                t.add_row(str(r.seq_len), Text(r.impl), r.pass_, "skipped", Text(r.reason[:60]),
                          "", "", "", "")
                continue
            t.add_row(str(r.seq_len), Text(r.impl), r.pass_, g(r.timing.median_ms),
                      spread(r.timing), num(r.peak_mem_mib), num(r.speedup_vs_naive, "{:.2f}x"),
                      num(r.mem_ratio_vs_naive, "{:.1f}x"), num(r.max_abs_diff, "{:.0e}"))
        out_console.print(t)
        out_console.print(f"memory method: {a.memory_method or a.memory_note}", markup=False,
                          soft_wrap=True)
        for v in a.verdicts:
            out_console.print(f"verdict: {v}", markup=False, soft_wrap=True)
    tr = result.train
    if tr is not None:
        p = tr.peak
        peak = f"{p.tflops:.3g} TFLOP/s ({p.source})" if p.tflops else f"n/a ({p.note})"
        t = Table(title=f"train step (AdamW, random tokens): MFU vs peak {peak}",
                  box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="1st s = first step in seconds (includes compilation for compile); "
                  + ", ".join(f"{r.shape.name} = {r.shape.n_layer} layers x {r.shape.n_embd}, "
                              f"{r.params / 1e6:.2f}M params" for r in tr.rows
                              if r.mode == "eager"))
        for col in ("shape", "mode", "BxT", "ms/step", "IQR", "tok/s", "TFLOP/s", "MFU",
                    "1st s"):
            t.add_column(col, justify="left" if col in ("shape", "mode") else "right",
                         no_wrap=True)
        for r in tr.rows:
            s = r.shape
            t.add_row(Text(s.name), r.mode, f"{s.batch_size}x{s.block_size}", g(r.timing.median_ms),
                      spread(r.timing), f"{r.tokens_per_s:,.0f}", f"{r.achieved_tflops:.3g}",
                      num(r.mfu, "{:.1%}"), g(r.first_step_s))
        out_console.print(t)
        for dt, m in p.measured.items():
            out_console.print(f"measured {m['n']}x{m['n']} {dt} matmul: {m['tflops']:.3g} "
                              "TFLOP/s", markup=False)
        for v in tr.verdicts:
            out_console.print(f"verdict: {v}", markup=False, soft_wrap=True)
    sm = result.sample
    if sm is not None:
        s = sm.settings
        what = f"{s.model}, " if s.model else ""
        t = Table(title=f"greedy decoding, batch 1: {what}{s.n_layer}L {s.n_embd}d, prompt "
                  f"{s.prompt_len} + {s.new_tokens} new tokens", box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("KV cache", "TTFT ms", "prefill tok/s", "decode ms/tok", "IQR",
                    "decode tok/s"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in sm.rows:
            t.add_row("yes" if r.kv_cache else "no", g(r.ttft.median_ms),
                      f"{r.prefill_tokens_per_s:,.0f}", g(r.decode.median_ms),
                      spread(r.decode), f"{r.decode_tokens_per_s:,.0f}")
        out_console.print(t)
        for v in sm.verdicts:
            out_console.print(f"verdict: {v}", markup=False, soft_wrap=True)


