"""The attention suite of `minigpt bench`: naive attention (the T x T score matrix written out)
against `F.scaled_dot_product_attention` (SDPA), and on CUDA against each SDPA backend forced on
its own (flash, memory-efficient, cuDNN, math). Forward and forward+backward; time, peak
memory, speed-up and memory ratios vs naive, and the max |difference| of the outputs (and of
the input gradients), which must be rounding-sized: it is the same math.

Inputs are random q, k, v of shape (batch, n_head, T, head_dim); the defaults (1, 4, T, 32)
are one attention layer of the default model (n_embd 128, n_head 4).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from minigpt.bench.timing import (
    Timing,
    cpu_malloc_for_measurement,
    memory_method,
    peak_memory_bytes,
    time_fn,
)
from minigpt.cost import memory_limit
from minigpt.display import size
from minigpt.events import BenchEvent, OnEvent

# Which SDPA backends are forced one at a time, per device. "sdpa" alone = PyTorch's own choice.
_BACKEND_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                  "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
DEVICE_BACKENDS = {"cuda": ("flash", "efficient", "cudnn", "math"), "cpu": ("math",)}
# Max |out - naive| that still counts as "same math" (rounding of a different summation order).
SAME_MATH_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def naive_attention(q: Tensor, k: Tensor, v: Tensor, blocked: Tensor) -> Tensor:
    """Textbook causal attention. q, k, v (B, H, T, D); blocked (T, T) bool, True above the
    diagonal (a key after the query), precomputed like nanoGPT's mask buffer."""
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, H, T, T) in memory
    att = att.masked_fill(blocked, float("-inf"))
    att = torch.softmax(att, dim=-1)  # (B, H, T, T)
    return att @ v  # (B, H, T, D)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, backend: str | None = None) -> Tensor:
    """Fused causal attention; `backend` forces one SDPA kernel (RuntimeError if it cannot run
    these inputs), None lets PyTorch choose."""
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = getattr(SDPBackend, _BACKEND_NAMES[backend], None)
    if member is None:
        raise RuntimeError(f"this torch has no SDPBackend.{_BACKEND_NAMES[backend]}")
    with sdpa_kernel(member):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@dataclass
class AttentionSettings:
    seq_lens: list[int]
    batch: int = 1
    n_head: int = 4
    head_dim: int = 32
    warmup: int = 2
    repeats: int = 7
    min_sample_ms: float = 5.0
    backends: bool = True  # also force each SDPA backend of the device (DEVICE_BACKENDS)
    backward: bool = True
    memory: bool = True


@dataclass
class AttentionRow:
    """One (seq_len, impl, pass) case. Times in ms, memory in MiB above the inputs."""

    seq_len: int
    impl: str  # naive | sdpa | sdpa[flash] | sdpa[efficient] | sdpa[cudnn] | sdpa[math]
    pass_: str  # fwd | fwd+bwd
    status: str = "ok"  # ok | skipped
    reason: str = ""
    timing: Timing | None = None
    peak_mem_mib: float | None = None
    speedup_vs_naive: float | None = None  # naive ms / this ms (same seq_len and pass)
    mem_ratio_vs_naive: float | None = None  # naive MiB / this MiB
    max_abs_diff: float | None = None  # vs naive: output (fwd) or q/k/v gradients (fwd+bwd)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        d["timing"] = self.timing.as_dict() if self.timing else None
        d["ms"] = self.timing.median_ms if self.timing else None
        return d


@dataclass
class AttentionResult:
    config: dict
    memory_method: str | None
    memory_note: str
    rows: list[AttentionRow] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"config": self.config, "memory_method": self.memory_method,
                "memory_note": self.memory_note, "rows": [r.as_dict() for r in self.rows],
                "verdicts": self.verdicts}


def _impls(device: torch.device, s: AttentionSettings) -> list[tuple[str, str | None]]:
    """(row label, backend) for the fused cases; backend None = PyTorch's choice."""
    out: list[tuple[str, str | None]] = [("sdpa", None)]
    if s.backends:
        out += [(f"sdpa[{b}]", b) for b in DEVICE_BACKENDS.get(device.type, ())]
    return out


def run_attention_suite(device: torch.device, dtype: torch.dtype, s: AttentionSettings,
                        on_event: OnEvent | None = None) -> AttentionResult:
    """Time and measure every (seq_len, impl, pass) case; see the module docstring."""
    say = on_event or (lambda e: None)
    method, note = memory_method(device) if s.memory else (None, "memory not measured")
    res = AttentionResult(
        config={"batch": s.batch, "n_head": s.n_head, "head_dim": s.head_dim,
                "seq_lens": list(s.seq_lens), "dtype": str(dtype).removeprefix("torch."),
                "warmup": s.warmup, "repeats": s.repeats, "causal": True},
        memory_method=method, memory_note=note)
    passes = ("fwd", "fwd+bwd") if s.backward else ("fwd",)
    for T in s.seq_lens:
        gen = torch.Generator().manual_seed(T)
        shape = (s.batch, s.n_head, T, s.head_dim)
        q, k, v, gout = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
        blocked = torch.ones(T, T, dtype=torch.bool, device=device).triu(1)
        # Naive needs a few (B, H, T, T) buffers; skip it rather than swap or run out of memory.
        need = 4.0 * s.batch * s.n_head * T * T * q.element_size()
        cases: list[tuple[str, object]] = []
        if need < memory_limit(device):
            cases.append(("naive", lambda a, b, c, m=blocked: naive_attention(a, b, c, m)))
        else:
            for p in passes:
                res.rows.append(AttentionRow(T, "naive", p, "skipped",
                                             f"would need ~{size(need)}"))
        for label, backend in _impls(device, s):
            cases.append((label, lambda a, b, c, be=backend: sdpa_attention(a, b, c, be)))
        ref: dict[str, object] = {}
        for label, fn in cases:
            for p in passes:
                say(BenchEvent("attention", f"T={T} {label} {p}"))
                res.rows.append(_run_case(T, label, p, fn, (q, k, v, gout), device, s, method,
                                          ref))
        del q, k, v, gout, cases, ref
    _fill_ratios(res.rows)
    res.verdicts = attention_verdicts(res.rows, dtype)
    return res


def _run_case(T: int, label: str, p: str, fn, tensors, device, s: AttentionSettings,
              method: str | None, ref: dict) -> AttentionRow:
    q, k, v, gout = tensors
    row = AttentionRow(T, label, p)
    if p == "fwd":
        def call():
            with torch.no_grad():
                return fn(q, k, v)
    else:
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def call():
            return torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), gout)
    try:
        with warnings.catch_warnings(record=True) as caught:  # SDPA explains refusals in warnings
            warnings.simplefilter("always")
            out = call()  # also the first warm-up
    except (RuntimeError, NotImplementedError, ValueError) as e:  # e.g. a backend that cannot
        why = [str(w.message).strip().splitlines()[0] for w in caught]  # run this dtype/shape
        row.status = "skipped"
        row.reason = "; ".join([str(e).strip().splitlines()[0], *why[:2]])[:240]
        return row
    outs = out if isinstance(out, tuple) else (out,)
    if label == "naive":
        ref[p] = outs
    elif p in ref:
        row.max_abs_diff = max((a.float() - b.float()).abs().max().item()
                               for a, b in zip(outs, ref[p]))
    del out, outs
    row.timing = time_fn(call, device, warmup=s.warmup, repeats=s.repeats,
                         min_sample_ms=s.min_sample_ms)
    if method is not None:
        # Median of 3: the first measured call after a change of malloc regime can still find
        # stale heap pages (seen: +1 buffer once in 4 runs); steady state is exact.
        with cpu_malloc_for_measurement() if device.type == "cpu" else contextlib.nullcontext():
            peaks = [peak_memory_bytes(call, device) for _ in range(3)]
        if all(p is not None for p in peaks):
            row.peak_mem_mib = sorted(peaks)[1] / 2**20
    return row


def _fill_ratios(rows: list[AttentionRow]) -> None:
    naive = {(r.seq_len, r.pass_): r for r in rows if r.impl == "naive" and r.status == "ok"}
    for r in rows:
        n = naive.get((r.seq_len, r.pass_))
        if r.impl == "naive" or r.status != "ok" or n is None:
            continue
        r.speedup_vs_naive = n.timing.median_ms / r.timing.median_ms
        if n.peak_mem_mib is not None and r.peak_mem_mib is not None:
            # RSS moves in 4 KiB pages: either kernel can show 0 (naive too, at a tiny T,
            # which made the verdict divide by zero), so floor both at one page.
            page = 4 / 1024
            r.mem_ratio_vs_naive = max(n.peak_mem_mib, page) / max(r.peak_mem_mib, page)


def _times(x: float) -> str:
    return f"{x:.1f}x" if x < 100 else f"{x:.0f}x"


def _speed(ratio: float, noisy: bool = False) -> str:
    """A speed ratio in words; `noisy`: the two timings' spreads overlap (Timing.overlaps)."""
    if 1 / 1.05 < ratio < 1.05:  # within 5%: below what a median on a noisy machine resolves
        return f"about as fast ({ratio:.2f}x)"
    if noisy:
        return (f"not measurably {'faster' if ratio >= 1 else 'slower'} ({ratio:.2f}x, the "
                "timings' spreads overlap)")
    return f"{_times(ratio)} faster" if ratio >= 1 else f"{_times(1 / ratio)} SLOWER"


def attention_verdicts(rows: list[AttentionRow], dtype: torch.dtype) -> list[str]:
    """One line per claim: same math, faster, less memory, O(T) vs O(T^2) memory growth."""
    out: list[str] = []
    diffs = [r.max_abs_diff for r in rows if r.max_abs_diff is not None]
    if diffs:
        tol = SAME_MATH_TOL.get(dtype, 1e-2)
        worst = max(diffs)
        word = "same math" if worst <= tol else "NOT the same math"
        out.append(f"{word}: max |fused - naive| = {worst:.2g} over all cases "
                   f"(tolerance {tol:g} for {str(dtype).removeprefix('torch.')})")
    ok = [r for r in rows if r.status == "ok" and r.impl != "naive" and r.speedup_vs_naive]
    naive = {(r.seq_len, r.pass_): r.timing for r in rows if r.impl == "naive" and r.timing}

    def speed(r: AttentionRow) -> str:
        return _speed(r.speedup_vs_naive, r.timing.overlaps(naive[(r.seq_len, r.pass_)]))
    if ok:
        t_max = max(r.seq_len for r in ok)
        for impl in dict.fromkeys(r.impl for r in ok):
            at = {r.pass_: r for r in ok if r.impl == impl and r.seq_len == t_max}
            if "fwd" not in at:
                continue
            f = at["fwd"]
            line = f"{impl} {speed(f)}"
            if "fwd+bwd" in at:
                line += f" ({speed(at['fwd+bwd'])} fwd+bwd)"
            if f.mem_ratio_vs_naive is not None:
                less = "less" if f.mem_ratio_vs_naive >= 1 else "MORE"
                ratio = f.mem_ratio_vs_naive if less == "less" else 1 / f.mem_ratio_vs_naive
                line += f" and {_times(ratio)} {less} memory"
            out.append(line + f" than naive at T={t_max} (forward)")
    out += _growth_verdicts(rows)
    return out


def _growth_verdicts(rows: list[AttentionRow]) -> list[str]:
    """Fit peak memory ~ T^p between the smallest and largest T (forward pass), over cases of
    at least 64 pages (smaller peaks are mostly page-granularity noise)."""
    out = []
    for impl in ("naive", "sdpa"):
        pts = sorted((r.seq_len, r.peak_mem_mib) for r in rows if r.impl == impl and
                     r.pass_ == "fwd" and r.peak_mem_mib is not None and r.peak_mem_mib >= 0.25)
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            (t0, m0), (t1, m1) = pts[0], pts[-1]
            p = math.log(m1 / m0) / math.log(t1 / t0)
            out.append(f"{impl} forward memory grows like T^{p:.1f} from T={t0} to T={t1} "
                       f"({m0:.2f} -> {m1:.2f} MiB)")
    return out
