"""`minigpt bench`: measure attention kernels, training and sampling on this machine.

`run_bench(options, on_event)` returns a `BenchResult`; the CLI renders it. Suites live in
attention.py (naive vs SDPA), train.py (train step, MFU peak) and sample.py (decoding);
timing and memory primitives in timing.py.

JSON (`--out PATH`, or `--json` on stdout: `BenchResult.as_dict()`), schema "minigpt-bench/1":
- `environment`: device, device_name, torch, minigpt, python, platform, cpu_count, threads,
  interop_threads, dtype, quick, load_avg, timestamp (+ cuda, cudnn on CUDA).
- `suites.attention`: config {batch, n_head, head_dim, seq_lens, dtype, warmup, repeats, causal},
  memory_method (how peak memory was measured; null = not measured), memory_note, verdicts,
  rows[] {seq_len, impl, pass, status, reason, ms, timing, peak_mem_mib, speedup_vs_naive,
  mem_ratio_vs_naive, max_abs_diff}.
- `suites.train`: peak {tflops, source, dtype, note, measured}, verdicts, rows[] {shape {name,
  n_layer, n_embd, n_head, block_size, batch_size, vocab_size}, mode, params, ms_per_step,
  timing, tokens_per_s, flops_per_token, achieved_tflops, mfu, first_step_s}.
- `suites.sample`: config {...SampleSettings}, same_tokens, verdicts, rows[] {kv_cache,
  prompt_len, new_tokens, ttft_ms, ttft, decode, prefill_tokens_per_s, decode_tokens_per_s,
  threads} (threads: the intra-op threads it decoded on, `minigpt.device.decode_threads`).
- every `timing`: {median_ms, q1_ms, q3_ms, min_ms, max_ms, repeats, inner}.
- `summary`: the compact line the CLI prints last (see `BenchResult.summary`).
Units: times in ms (`*_ms`, `ms`, `ms_per_step`), `first_step_s` in s, memory in MiB above the
inputs, rates in tokens/s and TFLOP/s, `mfu` a fraction (0.12 = 12%), ratios are naive / fused
(> 1 = the fused kernel wins), `max_abs_diff` in output units. null = not measured / n/a.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from minigpt.bench.attention import AttentionResult, AttentionSettings, run_attention_suite
from minigpt.bench.sample import SampleRow, SampleSettings, run_sample_suite, settings_for
from minigpt.bench.timing import environment
from minigpt.bench.train import (
    TRAIN_SHAPES,
    TRAIN_SHAPES_QUICK,
    Peak,
    TrainRow,
    TrainShape,
    find_peak,
    run_train_shape,
)
from minigpt.config.fields import comma_list
from minigpt.device import amp_dtype, cpu_threads, native_bf16, resolve_device
from minigpt.errors import ArgumentError
from minigpt.events import BenchEvent, OnEvent
from minigpt.files import atomic_write_text, not_replaceable

SCHEMA = "minigpt-bench/1"
SUITES = ("attention", "train", "sample")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEQ_LENS = [256, 512, 1024, 2048]
SEQ_LENS_QUICK = [128, 256, 512]


def parse_seq_lens(text: str) -> list[int]:
    """'128,256' -> [128, 256]; anything else is a one-line ArgumentError."""
    try:
        values = [int(p, 10) for p in comma_list(text)]
    except ValueError:
        values = []
    if not values or any(v < 2 or v > 1 << 17 for v in values):
        raise ArgumentError("seq_lens", f"'{text}' is not a comma-separated list of integers "
                            "in [2, 131072], e.g. {name} 128,256,512")
    return sorted(set(values))


def parse_suites(names: list[str] | None) -> list[str]:
    if not names:
        return list(SUITES)
    out: list[str] = []
    for part in comma_list(names):
        if part == "all":
            out += SUITES
        elif part in SUITES:
            out.append(part)
        else:
            raise ArgumentError("suite", f"'{part}' is not one of {', '.join(SUITES)}, all")
    return list(dict.fromkeys(out))


def train_suite_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The train suite's dtype: `dtype` (`resolve_dtype`'s), except that `auto` on a CPU is
    what `train.precision: auto` trains in there, bf16 autocast on a CPU with bf16
    instructions (`minigpt.device.amp_dtype`), so the suite times the step `minigpt train`
    runs; the attention and sample suites stay fp32 on a CPU, as sample decodes."""
    if name == "auto" and device.type == "cpu":
        return amp_dtype("auto", device) or torch.float32
    return dtype


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bf16 on CUDA (fp16 if the GPU has no bf16 tensor cores), fp32 on CPU and MPS."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if native_bf16(device) else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise ArgumentError("dtype", f"'{name}' is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class BenchOptions:
    """The command's flags, unparsed (the CLI passes them through)."""

    device: str = "auto"
    suites: list[str] = field(default_factory=list)  # empty = all
    seq_lens: str | None = None  # None = defaults for the mode
    dtype: str = "auto"
    quick: bool = False
    compile: bool = False
    peak_tflops: float | None = None
    model: str | None = None  # the sample suite decodes this Hugging Face model (hf.load_model)
    threads: int = 0  # CPU threads, as train.threads (0: each suite as its command runs)
    json_path: str | Path | None = None  # where the caller will write the report: checked first
    json_param: str = "out"  # the flag that named it (errors name it: `--out`, or the old `--json`)


@dataclass
class Plan:
    """Sizes and repeat counts of every suite (from the options; tests may shrink it)."""

    attention: AttentionSettings
    train_shapes: list[TrainShape]
    train_warmup: int
    train_repeats: int
    matmul_n: int
    sample: SampleSettings


def make_plan(opts: BenchOptions) -> Plan:
    seq = parse_seq_lens(opts.seq_lens) if opts.seq_lens is not None else None
    if opts.quick:
        return Plan(AttentionSettings(seq or SEQ_LENS_QUICK, warmup=1, repeats=5,
                                      min_sample_ms=2.0, backends=False),
                    TRAIN_SHAPES_QUICK, 1, 3, 512,
                    SampleSettings(block_size=128, prompt_len=32, new_tokens=32, warmup=1,
                                   repeats=2))
    return Plan(AttentionSettings(seq or SEQ_LENS), TRAIN_SHAPES, 2, 5, 1024, SampleSettings())


@dataclass
class TrainResult:
    peak: Peak
    rows: list[TrainRow]
    verdicts: list[str]

    def as_dict(self) -> dict:
        return {"peak": asdict(self.peak), "rows": [r.as_dict() for r in self.rows],
                "verdicts": self.verdicts}


@dataclass
class SampleSuiteResult:
    settings: SampleSettings
    rows: list[SampleRow]
    same_tokens: bool
    verdicts: list[str]

    def as_dict(self) -> dict:
        return {"config": asdict(self.settings), "same_tokens": self.same_tokens,
                "rows": [r.as_dict() for r in self.rows], "verdicts": self.verdicts}


@dataclass
class BenchResult:
    environment: dict
    attention: AttentionResult | None = None
    train: TrainResult | None = None
    sample: SampleSuiteResult | None = None

    def as_dict(self) -> dict:
        suites = {name: getattr(self, name).as_dict() for name in SUITES
                  if getattr(self, name) is not None}
        return _json_safe({"schema": SCHEMA, "environment": self.environment,
                           "suites": suites, "summary": self.summary()})

    def summary(self) -> dict:
        """Headline figures, one compact JSON object: device, dtype (and train_dtype where the
        train suite ran in another, `train_suite_dtype`), suites, and per suite
        attention {seq_len, sdpa_speedup_fwd, sdpa_mem_ratio_fwd, max_abs_diff}, train
        {<shape>[/compile]: {ms_per_step, tokens_per_s, mfu}}, sample {ttft_ms,
        decode_tokens_per_s, decode_tokens_per_s_no_cache, kv_speedup}. Non-finite -> None."""
        s: dict = {"device": self.environment["device"], "dtype": self.environment["dtype"],
                   "suites": [n for n in SUITES if getattr(self, n) is not None]}
        if "train_dtype" in self.environment:
            s["train_dtype"] = self.environment["train_dtype"]
        if self.attention is not None:
            fwd = [r for r in self.attention.rows if r.impl == "sdpa" and r.pass_ == "fwd"
                   and r.speedup_vs_naive is not None]
            diffs = [r.max_abs_diff for r in self.attention.rows if r.max_abs_diff is not None]
            if fwd:
                top = max(fwd, key=lambda r: r.seq_len)
                s["attention"] = {"seq_len": top.seq_len,
                                  "sdpa_speedup_fwd": _round(top.speedup_vs_naive),
                                  "sdpa_mem_ratio_fwd": _round(top.mem_ratio_vs_naive),
                                  "max_abs_diff": max(diffs) if diffs else None}
        if self.train is not None:
            s["train"] = {(r.shape.name + ("" if r.mode == "eager" else "/" + r.mode)):
                          {"ms_per_step": _round(r.timing.median_ms),
                           "tokens_per_s": _round(r.tokens_per_s), "mfu": _round(r.mfu, 4)}
                          for r in self.train.rows}
        if self.sample is not None:
            by = {(r.kv_cache, r.compiled): r for r in self.sample.rows}
            c, n = by[True, False], by[False, False]
            s["sample"] = {"ttft_ms": _round(c.ttft.median_ms),
                           "decode_tokens_per_s": _round(c.decode_tokens_per_s),
                           "decode_tokens_per_s_no_cache": _round(n.decode_tokens_per_s),
                           "kv_speedup": _round(c.decode_tokens_per_s / n.decode_tokens_per_s)}
            if (True, True) in by:
                k = by[True, True]
                s["sample"] |= {"decode_tokens_per_s_compiled": _round(k.decode_tokens_per_s),
                                "compiled_speedup": _round(k.decode_tokens_per_s
                                                           / n.decode_tokens_per_s)}
        return _json_safe(s)


def _round(x: float | None, digits: int = 3) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}") if abs(x) < 1000 else round(x, 1)


def run_bench(opts: BenchOptions, on_event: OnEvent | None = None,
              plan: Plan | None = None) -> BenchResult:
    """Resolve the options (ArgumentError for bad ones, the JSON path included) and run the
    chosen suites."""
    if opts.json_path is not None:
        check_json_path(opts.json_path, opts.json_param)
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    suites = parse_suites(opts.suites)
    if opts.peak_tflops is not None and not (opts.peak_tflops > 0 and
                                             math.isfinite(opts.peak_tflops)):
        raise ArgumentError("peak_tflops", f"must be a positive number, got {opts.peak_tflops}")
    if opts.model is not None and "sample" not in suites:
        raise ArgumentError("model", "only the sample suite decodes a model; include the "
                            "'sample' suite")
    plan = plan or make_plan(opts)
    with cpu_threads(opts.threads):  # checks it: 0..the CPUs available
        return _run_suites(opts, plan, device, dtype, suites, on_event or (lambda e: None))


def _run_suites(opts: BenchOptions, plan: Plan, device: torch.device, dtype: torch.dtype,
                suites: list[str], say: OnEvent) -> BenchResult:
    """The chosen suites, on the threads `run_bench` set (the sample suite: `opts.threads`,
    else as `minigpt sample` decodes)."""
    result = BenchResult(environment(device, dtype, opts.quick))
    train_dtype = train_suite_dtype(opts.dtype, device, dtype)
    if train_dtype != dtype and "train" in suites:
        result.environment["train_dtype"] = str(train_dtype).removeprefix("torch.")
    if "attention" in suites:
        result.attention = run_attention_suite(device, dtype, plan.attention, say)
    if "train" in suites:
        peak = find_peak(device, train_dtype, opts.peak_tflops, plan.matmul_n, say)
        rows = []
        for shape in plan.train_shapes:
            for mode in ("eager", "compile") if opts.compile else ("eager",):
                say(BenchEvent("train", f"{shape.name} {mode}"
                               + (" (compiling: slow on CPU)" if mode == "compile" else "")))
                rows.append(run_train_shape(shape, device, train_dtype, mode, peak,
                                            plan.train_warmup, plan.train_repeats))
        result.train = TrainResult(peak, rows, train_verdicts(rows, peak))
    if "sample" in suites:
        settings, model = plan.sample, None
        if opts.model is not None:
            from minigpt.hf import load_model

            loaded = load_model(opts.model, device)
            model, settings = loaded.model, settings_for(loaded.model, settings, loaded.label)
        rows, same = run_sample_suite(device, dtype, settings, say, model, opts.threads,
                                      opts.compile)
        result.sample = SampleSuiteResult(settings, rows, same, sample_verdicts(rows, same))
    return result


def train_verdicts(rows: list[TrainRow], peak: Peak) -> list[str]:
    out = []
    where = (f"{peak.tflops:.3g} TFLOP/s {peak.dtype} ({peak.source})" if peak.tflops
             else f"an unknown peak ({peak.note})")
    for name in dict.fromkeys(r.shape.name for r in rows):
        by = {r.mode: r for r in rows if r.shape.name == name}
        e = by["eager"]
        line = f"{name}: {e.tokens_per_s:,.0f} tokens/s eager"
        line += f", MFU {e.mfu:.1%} of {where}" if e.mfu is not None else ", MFU n/a"
        if "compile" in by:
            c = by["compile"]
            ratio = e.timing.median_ms / c.timing.median_ms
            how = ("within the noise of eager" if e.timing.overlaps(c.timing)
                   else "faster" if ratio >= 1 else "slower")
            line += (f"; torch.compile {ratio:.2f}x per step, {how} (compiling took "
                     f"{c.first_step_s:.0f} s)")
        out.append(line)
    return out


def sample_verdicts(rows: list[SampleRow], same: bool) -> list[str]:
    by = {(r.kv_cache, r.compiled): r for r in rows}
    c, n = by[True, False], by[False, False]
    ratio = c.decode_tokens_per_s / n.decode_tokens_per_s
    if c.decode.overlaps(n.decode):
        speed = (f"KV cache against recomputing the context: {ratio:.2f}x, within the noise "
                 "(the timings' spreads overlap)")
    else:
        speed = (f"KV cache decodes {ratio:.1f}x faster" if ratio >= 1 else
                 f"KV cache decodes {1 / ratio:.1f}x SLOWER") + " than recomputing the context"
    kv = (f"{speed} ({c.decode_tokens_per_s:,.0f} vs "
          f"{n.decode_tokens_per_s:,.0f} tokens/s, prompt {c.prompt_len} + {c.new_tokens} "
          f"new); greedy tokens {'identical' if same else 'DIFFER'} on every path")
    ttft = (f"time to first token {c.ttft.median_ms:.1f} ms (prefill "
            f"{c.prefill_tokens_per_s:,.0f} tokens/s for a {c.prompt_len}-token prompt)")
    out = [kv, ttft]
    if (True, True) in by:
        k = by[True, True]
        out.append(f"the compiled step decodes {k.decode_tokens_per_s:,.0f} tokens/s: "
                   f"{k.decode_tokens_per_s / n.decode_tokens_per_s:.1f}x recomputing the "
                   f"context, {k.decode_tokens_per_s / c.decode_tokens_per_s:.2f}x the eager "
                   f"step ({k.gflops:.2g} GFLOP/s, {k.gbytes:.3g} GB/s of weights and cache)")
    return out


def _json_safe(obj):
    """JSON has no NaN/Infinity: non-finite floats become null (None), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def check_json_path(path: str | Path, param: str = "out") -> Path:
    """The JSON target, checked before any benchmark runs (ArgumentError of `param`, the flag
    that named it, if unwritable)."""
    path = Path(path)
    if path.is_dir():
        raise ArgumentError(param, f"{path} is a directory; give a file name, e.g. "
                            f"{path / 'bench.json'}")
    if not path.parent.is_dir():
        raise ArgumentError(param, f"directory {path.parent} does not exist; create it first")
    if not os.access(path.parent, os.W_OK):
        raise ArgumentError(param, f"directory {path.parent} is not writable")
    if (why := not_replaceable(path)) is not None:  # a FIFO, /dev/null: never replaced
        raise ArgumentError(param, why, subject=path)
    return path


def write_json(path: str | Path, result: BenchResult) -> Path:
    """Write every figure as JSON, durably (temp file, fsync, rename; WriteError if that
    fails). `run_bench` checked the path before the work (`BenchOptions.json_path`)."""
    return atomic_write_text(Path(path), json.dumps(result.as_dict(), indent=2,
                                                    allow_nan=False) + "\n")
