"""minigpt bench: flag parsing, the timing/memory harness, same-math of naive vs SDPA, the FLOP
count behind MFU, and the result/JSON shape. No assertion here is about speed (benchmarks
measure speed; tests check that figures exist, are sane and are labelled)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import error_line
from typer.testing import CliRunner

from minigpt.bench import runner as bench
from minigpt.bench.attention import AttentionSettings, naive_attention, sdpa_attention
from minigpt.bench.sample import SampleSettings
from minigpt.bench.timing import Timing, memory_method, peak_memory_bytes, time_fn
from minigpt.bench.train import TrainShape, gpu_peak_tflops, mfu
from minigpt.cli import app
from minigpt.config import MinigptError, ModelConfig
from minigpt.core.gpt import GPT, flops_per_token

CPU = torch.device("cpu")

# The documented JSON keys (bench.py module docstring): the contract for scripts.
TOP_KEYS = {"schema", "environment", "suites", "summary"}
ENV_KEYS = {"device", "device_name", "torch", "minigpt", "python", "platform", "cpu_count",
            "threads", "interop_threads", "dtype", "quick", "load_avg", "timestamp"}
TIMING_KEYS = {"median_ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "repeats", "inner"}
ATTN_ROW_KEYS = {"seq_len", "impl", "pass", "status", "reason", "ms", "timing", "peak_mem_mib",
                 "speedup_vs_naive", "mem_ratio_vs_naive", "max_abs_diff"}
TRAIN_ROW_KEYS = {"shape", "mode", "params", "ms_per_step", "timing", "tokens_per_s",
                  "flops_per_token", "achieved_tflops", "mfu", "first_step_s"}
SAMPLE_ROW_KEYS = {"kv_cache", "prompt_len", "new_tokens", "ttft_ms", "ttft", "decode",
                   "prefill_tokens_per_s", "decode_tokens_per_s", "threads"}


def _tiny_plan() -> bench.Plan:
    """Smaller than --quick: the library path end to end in a couple of seconds."""
    return bench.Plan(
        AttentionSettings([32, 64], warmup=1, repeats=2, min_sample_ms=0.0),  # + sdpa[math]
        [TrainShape("tiny", 2, 32, 2, 16, 2, vocab_size=64)], 1, 2, 64,
        SampleSettings(n_layer=1, n_embd=32, n_head=2, block_size=32, vocab_size=64,
                       prompt_len=8, new_tokens=4, warmup=1, repeats=2))


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_document(doc: dict) -> None:
    """Documented keys present, every figure positive and finite."""
    assert set(doc) == TOP_KEYS and doc["schema"] == bench.SCHEMA
    assert ENV_KEYS <= set(doc["environment"])
    att, tr, sm = (doc["suites"][k] for k in ("attention", "train", "sample"))
    assert att["memory_method"] and att["verdicts"]
    ok = [r for r in att["rows"] if r["status"] == "ok"]
    assert {(r["impl"], r["pass"]) for r in ok} >= {("naive", "fwd"), ("sdpa", "fwd+bwd")}
    for r in att["rows"]:
        assert set(r) == ATTN_ROW_KEYS
    for r in ok:
        assert set(r["timing"]) == TIMING_KEYS
        assert _positive(r["ms"]) and _positive(r["peak_mem_mib"])
        if r["impl"] != "naive":
            assert _positive(r["speedup_vs_naive"]) and _positive(r["mem_ratio_vs_naive"])
            assert 0 <= r["max_abs_diff"] < 1e-4
    assert _positive(tr["peak"]["tflops"]) and tr["peak"]["source"] == "measured matmul"
    for r in tr["rows"]:
        assert TRAIN_ROW_KEYS <= set(r)
        for k in ("params", "ms_per_step", "tokens_per_s", "flops_per_token", "achieved_tflops",
                  "mfu", "first_step_s"):
            assert _positive(r[k]), k
    assert sm["same_tokens"] is True
    assert [r["kv_cache"] for r in sm["rows"]] == [False, True]
    for r in sm["rows"]:
        assert SAMPLE_ROW_KEYS <= set(r)
        for k in ("ttft_ms", "prefill_tokens_per_s", "decode_tokens_per_s"):
            assert _positive(r[k]), k
        assert isinstance(r["threads"], int) and r["threads"] >= 1
    s = doc["summary"]
    assert s["suites"] == ["attention", "train", "sample"]
    assert _positive(s["attention"]["sdpa_speedup_fwd"])
    assert _positive(s["sample"]["kv_speedup"])
    assert all(_positive(v["mfu"]) for v in s["train"].values())


# -------------------------------------------------------------------------------------------
# flags


@pytest.mark.parametrize("text,expected", [("128", [128]), ("512, 128,256", [128, 256, 512]),
                                           ("64,64", [64])])
def test_parse_seq_lens(text, expected):
    assert bench.parse_seq_lens(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "128,", "1", "-5", "1.5", "999999"])
def test_parse_seq_lens_rejects(text):
    with pytest.raises(MinigptError, match="^seq_lens"):
        bench.parse_seq_lens(text)


def test_dtype_and_suites():
    assert bench.resolve_dtype("auto", CPU) == torch.float32
    assert bench.resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with pytest.raises(MinigptError, match="^dtype"):
        bench.resolve_dtype("fp8", CPU)
    assert bench.parse_suites([]) == ["attention", "train", "sample"]
    assert bench.parse_suites(["sample", "attention,sample"]) == ["sample", "attention"]
    with pytest.raises(MinigptError, match="^suite"):
        bench.parse_suites(["attn"])


def test_the_train_suite_times_what_train_precision_auto_trains_in(monkeypatch):
    """--dtype auto on a CPU: the attention and sample suites in fp32 (as sample decodes), the
    train suite and its peak in train.precision auto's dtype: bf16 on a CPU with bf16
    instructions (the environment says so), fp32 on one without; an explicit dtype is
    every suite's."""
    for has_bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda a=has_bf16: a)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert bench.train_suite_dtype("auto", CPU, torch.float32) == want
        assert bench.train_suite_dtype("float32", CPU, torch.float32) == torch.float32
        plan = _tiny_plan()
        result = bench.run_bench(bench.BenchOptions(device="cpu", suites=["train"]), None,
                                 bench.Plan(plan.attention, plan.train_shapes, 1, 1, 32,
                                            plan.sample))
        env = result.environment
        assert env["dtype"] == "float32"
        assert env.get("train_dtype") == ("bfloat16" if has_bf16 else None)
        assert result.summary().get("train_dtype") == env.get("train_dtype")
        assert result.train.peak.dtype == str(want).removeprefix("torch.")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_cuda_fails_cleanly():
    line = error_line(CliRunner().invoke(app, ["bench", "--device", "cuda", "--quick"]))
    assert line.startswith("error: --device cuda"), line


@pytest.mark.parametrize("args,flag", [(["--seq-lens", "12x"], "--seq-lens"),
                                       (["--dtype", "half"], "--dtype"),
                                       (["--suite", "attn"], "--suite"),
                                       (["--json", "/nonexistent-dir/b.json"], "--json")])
def test_cli_bad_flags_fail_cleanly(args, flag):
    line = error_line(CliRunner().invoke(app, ["bench", "--device", "cpu", *args]))
    assert line.startswith(f"error: {flag}"), line


# -------------------------------------------------------------------------------------------
# harness


def test_timing_quantiles_are_exact():
    t = Timing.from_samples([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (t.min_ms, t.q1_ms, t.median_ms, t.q3_ms, t.max_ms) == (1.0, 2.0, 3.0, 4.0, 5.0)
    assert t.q3_ms - t.q1_ms == 2.0 and t.repeats == 5
    assert Timing.from_samples([1.0, 2.0]).median_ms == 1.5


def test_time_fn_warms_up_repeats_and_loops_tiny_calls():
    calls = []
    t = time_fn(lambda: calls.append(1), CPU, warmup=3, repeats=4, min_sample_ms=1.0)
    assert t.repeats == 4 and t.inner > 1  # a no-op is far below 1 ms, so it is looped
    assert len(calls) == 3 + 4 * t.inner
    assert 0 < t.min_ms <= t.q1_ms <= t.median_ms <= t.q3_ms <= t.max_ms


@pytest.mark.skipif(memory_method(CPU)[0] is None, reason="no resettable RSS peak here")
def test_cpu_peak_memory_sees_a_temporary_allocation():
    n = 8 * 2**20  # 8 Mi float32 = 32 MiB, touched, freed before fn returns

    def alloc():
        x = torch.ones(n)
        return float(x[-1])

    peak = peak_memory_bytes(alloc, CPU) / 2**20
    assert 30 <= peak <= 40, peak
    assert peak_memory_bytes(lambda: None, CPU) / 2**20 < 4


# -------------------------------------------------------------------------------------------
# same math


@pytest.mark.parametrize("T", [1, 17, 64])
def test_naive_and_sdpa_agree(T):
    g = torch.Generator().manual_seed(T)
    q, k, v, gout = (torch.randn(2, 3, T, 16, generator=g) for _ in range(4))
    blocked = torch.ones(T, T, dtype=torch.bool).triu(1)
    outs = {}
    for name, fn in [("naive", lambda a, b, c: naive_attention(a, b, c, blocked)),
                     ("sdpa", sdpa_attention),
                     ("math", lambda a, b, c: sdpa_attention(a, b, c, "math"))]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        outs[name] = (out, *torch.autograd.grad(out, leaves, gout))
    for name in ("sdpa", "math"):
        for a, b in zip(outs[name], outs["naive"]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # causal: the first query sees only the first key, so its output is v[..., 0, :]
    torch.testing.assert_close(outs["naive"][0][..., 0, :], v[..., 0, :])


def test_unsupported_backend_is_a_skipped_row_with_a_reason():
    """The CUDA path forces each SDPA backend; one that cannot run is reported, not fatal.
    On CPU the memory-efficient kernel does not exist, which exercises the same branch."""
    from minigpt.bench.attention import _run_case

    q = torch.randn(1, 2, 16, 8)
    row = _run_case(16, "sdpa[efficient]", "fwd",
                    lambda a, b, c: sdpa_attention(a, b, c, "efficient"), (q, q, q, q), CPU,
                    AttentionSettings([16]), None, {})
    assert row.status == "skipped" and row.timing is None and row.reason
    assert set(row.as_dict()) == ATTN_ROW_KEYS


# -------------------------------------------------------------------------------------------
# FLOPs and MFU


@pytest.mark.parametrize("shape,T,hand", [
    # 4 layers x 12 * 128^2 = 786,432 block matmul weights + LM head 1024 * 128 = 131,072:
    # N = 917,504; 6N = 5,505,024; attention 12 * 4 * 128 * 64 = 393,216.
    ({"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024}, 64, 5_898_240),
    # 6 x 12 * 384^2 = 10,616,832 + 1024 * 384 = 393,216: N = 11,010,048; 6N = 66,060,288;
    # attention 12 * 6 * 384 * 256 = 7,077,888.
    ({"n_layer": 6, "n_embd": 384, "n_head": 6, "vocab_size": 1024}, 256, 73_138_176),
])
def test_flops_per_token_matches_a_hand_count(shape, T, hand):
    cfg = ModelConfig(block_size=T, **shape)
    assert flops_per_token(cfg, T) == hand
    # ...and N is the model's own count of matmul weights (tied head counted once as a matmul)
    n = GPT(cfg).num_params()["matmul"]
    assert flops_per_token(cfg, T) == 6 * n + 12 * cfg.n_layer * cfg.n_embd * T


def test_mfu_formula_and_peak_table():
    # 5,898,240 FLOP/token x 10,000 tokens/s = 5.898e10 FLOP/s of a 0.1 TFLOP/s peak
    assert mfu(5_898_240, 10_000, 0.1) == pytest.approx(0.589824)
    assert mfu(5_898_240, 10_000, None) is None
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == ("A100", 312.0)
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.0)
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == ("H100 PCIe", 756.0)
    assert gpu_peak_tflops("NVIDIA GeForce RTX 4090") == ("RTX 4090", 165.0)
    assert gpu_peak_tflops("NVIDIA A10") == ("A10", 125.0)
    assert gpu_peak_tflops("NVIDIA H200") == ("H200 SXM", 989.0)
    assert gpu_peak_tflops("NVIDIA H200 NVL") == ("H200 NVL", 835.0)
    assert gpu_peak_tflops("NVIDIA H100 NVL") == ("H100 NVL", 835.0)
    assert gpu_peak_tflops("NVIDIA L40S") == ("L40S", 362.0)
    assert gpu_peak_tflops("NVIDIA L40") == ("L40", 181.0)
    assert gpu_peak_tflops("NVIDIA L4") == ("L4", 121.0)
    assert gpu_peak_tflops("Tesla T4") == ("T4 (fp16)", 65.0)
    for unknown in ("NVIDIA A10G", "NVIDIA GeForce GTX 1080", "NVIDIA GeForce RTX 4080"):
        assert gpu_peak_tflops(unknown) is None  # "n/a", never a wrong number


def test_fp16_only_gpus_have_no_bf16_peak(monkeypatch):
    """T4 and V100 have no bf16 tensor cores: their table figure is the fp16 rate, so a bf16
    (emulated) run gets MFU n/a rather than a ratio to the wrong peak."""
    from minigpt.bench.train import find_peak

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    cuda = torch.device("cuda")
    assert find_peak(cuda, torch.float16, None, 64).tflops == 65.0
    bf16 = find_peak(cuda, torch.bfloat16, None, 64)
    assert bf16.tflops is None and "float16" in bf16.note and "--peak-tflops" in bf16.note
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert find_peak(cuda, torch.bfloat16, None, 64).tflops == 756.0
    assert find_peak(cuda, torch.float32, None, 64).tflops is None  # fp32: not in the table


# -------------------------------------------------------------------------------------------
# end to end


def test_library_attention_and_sample_tiny_plan(monkeypatch):
    """Quick tier: the library path of two suites (the train suite's first AdamW step imports
    torch._dynamo, ~4 s once per process, so the all-suite runs below are marked slow), then
    the command's tables of that result."""
    events = []
    opts = bench.BenchOptions(device="cpu", suites=["attention", "sample"])
    result = bench.run_bench(opts, events.append, _tiny_plan())
    assert {e.suite for e in events} == {"attention", "sample"} and result.train is None
    doc = result.as_dict()
    assert set(doc["suites"]) == {"attention", "sample"}
    for r in doc["suites"]["attention"]["rows"]:
        assert set(r) == ATTN_ROW_KEYS and r["status"] == "ok"
        assert _positive(r["ms"]) and _positive(r["peak_mem_mib"])
        assert r["impl"] == "naive" or 0 <= r["max_abs_diff"] < 1e-4
    assert doc["suites"]["sample"]["same_tokens"] is True
    assert all(_positive(r["decode_tokens_per_s"]) for r in doc["suites"]["sample"]["rows"])
    assert json.loads(json.dumps(doc["summary"]))["sample"]["kv_speedup"] > 0
    monkeypatch.setattr(bench, "run_bench", lambda opts, on_event=None: result)
    r = CliRunner().invoke(app, ["bench", "--device", "cpu", "--suite", "attention,sample"])
    assert r.exit_code == 0, r.stderr
    shown = r.stdout
    assert shown.startswith("device cpu") and "sdpa[math]" in shown  # not eaten as markup
    assert json.loads(shown.splitlines()[-1]) == doc["summary"]
    assert "verdict: same math" in shown and "verdict: KV cache" in shown


@pytest.mark.slow
def test_library_run_tiny_plan_has_documented_keys(tmp_path):
    events = []
    result = bench.run_bench(bench.BenchOptions(device="cpu"), events.append, _tiny_plan())
    assert {e.suite for e in events} == {"attention", "train", "sample"}
    bench.write_json(tmp_path / "b.json", result)
    doc = json.loads((tmp_path / "b.json").read_text())
    _check_document(doc)
    assert doc["summary"] == json.loads(json.dumps(result.summary()))
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # no temp file left behind


@pytest.mark.slow
def test_cli_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(app, ["bench", "--device", "cpu", "--quick", "--json", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert lines[0].startswith("device cpu")  # environment first
    summary = json.loads(lines[-1])  # the last stdout line is the compact JSON summary
    doc = json.loads(out.read_text())
    _check_document(doc)
    assert summary == doc["summary"]
    assert doc["environment"]["quick"] is True
    assert any(line.startswith("verdict: sdpa") for line in lines)


def test_verdicts_say_when_a_ratio_is_inside_the_noise():
    """A ratio of two medians whose spreads (q1..q3) overlap is not stated as a speed-up
    (issue 41: a 1.3x "faster" with a 150% spread)."""
    from minigpt.bench.attention import AttentionRow, _fill_ratios, attention_verdicts
    from minigpt.bench.sample import SampleRow

    def t(q1, median, q3):
        return Timing(median, q1, q3, q1, q3, 5, 1)

    assert t(1, 2, 3).overlaps(t(2.5, 4, 9)) and not t(1, 2, 3).overlaps(t(3.5, 4, 5))

    def attention(naive, sdpa):
        rows = [AttentionRow(64, "naive", "fwd", timing=naive),
                AttentionRow(64, "sdpa", "fwd", timing=sdpa)]
        _fill_ratios(rows)
        return attention_verdicts(rows, torch.float32)

    noisy = ("sdpa not measurably faster (2.00x, the timings' spreads overlap) than naive at "
             "T=64 (forward)")
    assert attention(t(2, 4, 8), t(1, 2, 3)) == [noisy]
    clear = "sdpa 2.0x faster than naive at T=64 (forward)"
    assert attention(t(3.8, 4, 4.2), t(1.9, 2, 2.1)) == [clear]

    def sample(cached, recomputed):
        return bench.sample_verdicts([SampleRow(False, False, 8, 4, t(1, 1, 1), recomputed, 1,
                                                1 / (recomputed.median_ms / 1e3), 1),
                                      SampleRow(True, False, 8, 4, t(1, 1, 1), cached, 1,
                                                1 / (cached.median_ms / 1e3), 1)], True)[0]

    assert sample(t(1, 2, 6), t(2, 3, 9)).startswith(
        "KV cache against recomputing the context: 1.50x, within the noise")
    assert sample(t(1, 1, 1.1), t(3, 3, 3.3)).startswith(
        "KV cache decodes 3.0x faster than recomputing the context")


def test_bench_threads_sets_every_suites_threads():
    """`--threads N` (as train.threads): the environment records N, the sample suite decodes
    on N, and the caller's setting comes back afterwards; a count above the CPUs is refused
    before any work (tests/test_threads.py checks the rule through the installed command)."""
    from minigpt.threads import usable_cpus

    before = torch.get_num_threads()
    torch.set_num_threads(2 if before == 1 else 1)
    try:
        want = torch.get_num_threads() % 2 + 1  # the other count of 1 and 2
        opts = bench.BenchOptions(device="cpu", suites=["sample"], threads=want)
        if want > usable_cpus():
            pytest.skip("one CPU: no other thread count to ask for")
        result = bench.run_bench(opts, None, _tiny_plan())
        assert result.environment["threads"] == want
        assert {r.threads for r in result.sample.rows} == {want}
        assert torch.get_num_threads() != want
        with pytest.raises(MinigptError, match="more than the"):
            bench.run_bench(bench.BenchOptions(device="cpu", threads=10**6), None, _tiny_plan())
    finally:
        torch.set_num_threads(before)
