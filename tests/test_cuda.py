"""The CUDA tier (`pytest -m cuda`; the default run leaves it out): what only a GPU can check.

Every test skips, saying why, where `torch.cuda.is_available()` is false. Stated tolerances
(max absolute difference unless said otherwise; float32 runs with TF32 off):
- attention, each SDPA backend (flash, efficient, cuDNN, math) and minigpt's explicit path,
  against the explicit path in float64 on the same inputs: output 1e-5 in float32, 4e-2 in
  bfloat16; q/k/v gradients 1e-4 (float32) and 3e-2 (bfloat16) of the largest float64
  gradient. (On CPU the bfloat16 explicit and SDPA paths measured 0.014 on the output and
  <= 0.8% on the gradients at these shapes: about 3x headroom.)
- a bf16-autocast step: the torch.compile'd model's loss within 2e-2 of the eager loss.
- KV-cache decoding vs a full recompute, float32: logits within 1e-4 at every step.
- resume on CUDA (float32, no compile): step, tokens seen and the data order are exact; the
  weights within 1e-3 and the losses within a relative 1e-3 of an uninterrupted run (CUDA
  kernels with atomics are not bitwise reproducible; see the README).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minigpt.config import ModelConfig, TrainConfig, load_config
from minigpt.core.gpt import GPT, attention
from minigpt.device import autocast, native_bf16
from minigpt.paths import PROJECT_ROOT

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here (torch.cuda.is_available() is False); "
                              "the CUDA tier runs where a GPU is"),
]

CUDA = torch.device("cuda")
BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
            "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative to the largest gradient


@pytest.fixture(autouse=True)
def _exact_float32():
    """float32 matmuls in full precision (no TF32), whatever the environment set."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


def _need_bf16(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not native_bf16(CUDA):
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no bf16 tensor cores "
                    "(compute capability < 8.0)")


def _qkv(seed: int = 0, B: int = 2, H: int = 4, T: int = 128, D: int = 64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4)]


def _attend(q, k, v, go, dtype, impl, backend=None):
    """Output and q/k/v gradients (float64 copies) of minigpt's causal attention() in `dtype`,
    with SDPA forced to `backend` (torch.nn.attention.sdpa_kernel) when given."""
    xs = [t.to(CUDA, dtype, copy=True).requires_grad_() for t in (q, k, v)]

    def run():
        out, _ = attention(*xs, impl=impl)  # causal, T x T: SDPA's is_causal path
        (out.double() * go.to(CUDA)).sum().backward()
        return out

    if backend is None:
        out = run()
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        member = getattr(SDPBackend, BACKENDS[backend], None)
        if member is None:
            pytest.skip(f"torch {torch.__version__} has no SDPBackend.{BACKENDS[backend]}")
        try:
            with sdpa_kernel(member):
                out = run()
        except RuntimeError as e:  # "No available kernel": the GPU or dtype lacks it
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            pytest.skip(f"the {backend} SDPA backend cannot run {dtype} causal attention "
                        f"(B, H, T, D) = {tuple(q.shape)} on {torch.cuda.get_device_name(0)}: "
                        f"{first}")
    return out.double(), [x.grad.double() for x in xs]


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_sdpa_backend_matches_the_explicit_path(backend, dtype_name):
    dtype = DTYPES[dtype_name]
    _need_bf16(dtype)
    q, k, v, go = _qkv()
    ref, ref_grads = _attend(q, k, v, go, torch.float64, "explicit")
    for impl, be in (("explicit", None), ("sdpa", backend)):
        out, grads = _attend(q, k, v, go, dtype, impl, be)
        err = (out - ref).abs().max().item()
        assert err <= OUT_TOL[dtype], (impl, be, dtype_name, err)
        for name, g, rg in zip("qkv", grads, ref_grads):
            rel = ((g - rg).abs().max() / rg.abs().max()).item()
            assert rel <= GRAD_TOL[dtype], (impl, be, dtype_name, f"d{name}", rel)
    assert ref.abs().max() > 0.5 and all(g.abs().max() > 0.5 for g in ref_grads)  # not trivial


def _tiny_gpt(**kw) -> GPT:
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64,
                         "vocab_size": 256, **kw})
    return GPT.from_config(cfg, seed=0).to(CUDA)


def test_bf16_autocast_training_step_under_torch_compile():
    """The GPU recipe: bf16 autocast, torch.compile, fused AdamW (train/weights.py). The compiled
    model's loss equals eager's within 2e-2; 30 compiled steps on one batch memorise it (loss
    below half its start); parameters stay float32 and finite."""
    _need_bf16(torch.bfloat16)
    from minigpt.train.weights import build_optimizer

    model = _tiny_gpt().train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (2, 8, 64), generator=g).to(CUDA)
    compiled = torch.compile(model)
    with autocast(CUDA, torch.bfloat16):
        eager_loss = model(x, y)[1].item()
        compiled_loss = compiled(x, y)[1].item()
    assert abs(eager_loss - compiled_loss) <= 2e-2, (eager_loss, compiled_loss)
    assert abs(eager_loss - math.log(256)) < 0.5  # GPT-2 init: about ln(vocab)

    opt, _ = build_optimizer(model, TrainConfig(learning_rate=3e-3, warmup_steps=0), CUDA)
    first = last = None
    for _ in range(30):
        with autocast(CUDA, torch.bfloat16):
            _, loss = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < 0.5 * first, (first, last)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model.parameters())


def _corpus(tmp: Path) -> Path:
    words = ["the", "king", "spoke", "to", "his", "son", "and", "queen", "sat", "by", "a",
             "fire", "while", "rain", "fell"]
    path = tmp / "corpus.txt"
    path.write_text("\n".join(" ".join(words[(i * 7 + j * 3) % len(words)]
                                       for j in range(4 + i % 9)) for i in range(600)) + "\n")
    return path


def _sets(tmp: Path, **over) -> list[str]:
    base = {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64, "model.block_size": 32,
            "tokenizer.vocab_size": 256, "train.batch_size": 8, "train.max_steps": 8,
            "train.warmup_steps": 2, "train.learning_rate": 1e-2, "train.min_lr": 1e-3,
            "train.eval_interval": 4, "train.eval_batches": 2, "train.log_interval": 1,
            "train.checkpoint_interval": 4, "train.sample_tokens": 0, "run.device": "cuda",
            "data.corpus": str(_corpus(tmp)), "data.cache_dir": str(tmp / "cache")}
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def test_the_training_loop_with_bf16_autocast_and_compile(tmp_path):
    """`minigpt train` on CUDA as configured for a GPU: bf16 autocast and torch.compile in the
    real loop, a finished run whose checkpoint holds the plain (uncompiled) parameter names."""
    _need_bf16(torch.bfloat16)
    from safetensors.torch import load_file

    from minigpt.train import train

    run = tmp_path / "run"
    done = train(load_config(None, _sets(tmp_path, **{"train.precision": "bf16",
                                                      "train.compile": "true"})), run)
    assert done.reason == "finished" and done.step == 8
    losses = [r["loss"] for r in _records(run, "train")]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0]
    weights = load_file(run / "model.safetensors")
    assert weights and not any("_orig_mod" in n for n in weights)
    assert all(w.dtype == torch.float32 for w in weights.values())


@pytest.mark.parametrize("pos", ["rope", "learned", "sinusoidal", "none"])
def test_kv_cache_decode_equals_full_recompute(pos):
    """100 one-token steps and, for a batch of 2, chunks of 5, all through the one forward
    pass with a KV cache: at every step the cached logits equal a full forward of
    the sequence within 1e-4 (float32)."""
    model = _tiny_gpt(pos_encoding=pos, block_size=128).eval()
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 256, (1, 101), generator=g).to(CUDA)
    with torch.no_grad():
        full, _ = model(seq)  # (1, 101, V)
        cache = model.new_kv_cache(1)
        steps = [model(seq[:, t:t + 1], kv_cache=cache)[0][0, -1] for t in range(101)]
        err = (torch.stack(steps) - full[0]).abs().max().item()
        assert err <= 1e-4, err
        assert full.abs().max() > 0.1  # logits that could differ

        pair = torch.randint(0, 256, (2, 100), generator=g).to(CUDA)
        full2, _ = model(pair)
        cache = model.new_kv_cache(2)
        chunks = [model(pair[:, t:t + 5], kv_cache=cache)[0] for t in range(0, 100, 5)]
        err2 = (torch.cat(chunks, dim=1) - full2).abs().max().item()
        assert err2 <= 1e-4, err2


def test_resume_on_cuda(tmp_path):
    """8 steps straight vs 4 steps, stop, --resume to 8, both on CUDA in float32 without
    compile. Exact: the step, tokens seen, the schedule and the data order (the data
    generator's state is identical at the end). Within tolerance only: weights (1e-3) and
    logged losses (relative 1e-3); see the README for why CUDA is not bitwise here."""
    from safetensors.torch import load_file

    from minigpt.run.resume import resume_config
    from minigpt.train import train

    sets = _sets(tmp_path, **{"train.precision": "fp32", "train.compile": "false"})
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(load_config(None, sets), straight)
    assert train(load_config(None, sets), split, stop_after=4).step == 4
    assert train(resume_config(split, []), split, resume=True).step == 8
    sa = json.loads((straight / "trainer_state.json").read_text())
    sb = json.loads((split / "trainer_state.json").read_text())
    assert (sa["step"], sa["tokens_seen"]) == (sb["step"], sb["tokens_seen"]) == (8, 8 * 8 * 32)
    assert sa["rng"]["data"] == sb["rng"]["data"]  # the schedule: every logged lr, below
    ra, rb = _records(straight, "train"), _records(split, "train")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, 9))
    for x, y in zip(ra, rb):
        assert x["lr"] == y["lr"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-3)
    wa, wb = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] - wb[name]).abs().max().item() <= 1e-3, name


def test_bench_on_cuda_reports_mfu_from_the_gpu_table(tmp_path):
    """`minigpt bench --device cuda --out FILE` in a real process: the attention suite forces each
    SDPA backend, the train suite's MFU divides by the GPU's datasheet peak (or --peak-tflops
    when the GPU is not in the table) and equals flops_per_token x tokens/s / peak."""
    from minigpt.bench.train import FP16_ONLY, gpu_peak_tflops

    name = torch.cuda.get_device_name(0)
    hit = gpu_peak_tflops(name)
    in_table = hit is not None and native_bf16(CUDA) and hit[0] not in FP16_ONLY
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "minigpt", "bench", "--device", "cuda", "--suite", "attention",
           "--suite", "train", "--seq-lens", "256,1024", "--out", str(out)]
    if not in_table:
        cmd += ["--peak-tflops", "100"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PROJECT_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cuda" and set(summary["suites"]) == {"attention", "train"}
    doc = json.loads(out.read_text())
    assert doc["environment"]["device"] == "cuda"
    assert doc["environment"]["device_name"] == name
    peak = doc["suites"]["train"]["peak"]
    if in_table:
        assert (peak["source"], peak["tflops"]) == ("datasheet table", hit[1])
    else:
        assert (peak["source"], peak["tflops"]) == ("--peak-tflops", 100.0)
    rows = doc["suites"]["train"]["rows"]
    assert {row["shape"]["name"] for row in rows} == {"4L-128", "6L-384"}
    for row in rows:
        expect = row["flops_per_token"] * row["tokens_per_s"] / (peak["tflops"] * 1e12)
        assert row["mfu"] == pytest.approx(expect, rel=1e-9)
        assert 0 < row["mfu"] < 1, row  # >= 1 would mean a wrong peak
    att = doc["suites"]["attention"]["rows"]
    impls = {row["impl"] for row in att}
    assert {"naive", "sdpa", "sdpa[flash]", "sdpa[efficient]", "sdpa[cudnn]", "sdpa[math]"} <= impls
    assert all(row["status"] == "ok" or row["reason"] for row in att)
    assert all(row["status"] == "ok" for row in att if row["impl"] in ("sdpa", "sdpa[math]"))
