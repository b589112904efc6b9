"""Measurement primitives for `minigpt bench`: a timing harness, peak-memory probes and the
environment description. No suite logic here (see attention.py, train.py, sample.py).

Timing contract: warm-up calls first (not recorded), then `repeats` samples; every sample is
bracketed by a device synchronisation (CUDA events on CUDA), so asynchronous kernels are
counted where they run, not where they were queued.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime as _dt
import gc
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from minigpt import __version__


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty list."""
    pos = (len(sorted_xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


@dataclass
class Timing:
    """Milliseconds per call over `repeats` samples (each sample averages `inner` calls)."""

    median_ms: float
    q1_ms: float  # 25th percentile: median and IQR are robust to a noisy shared machine
    q3_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    inner: int

    @classmethod
    def from_samples(cls, samples_ms: list[float], inner: int = 1) -> Timing:
        xs = sorted(samples_ms)
        return cls(median_ms=_quantile(xs, 0.5), q1_ms=_quantile(xs, 0.25),
                   q3_ms=_quantile(xs, 0.75), min_ms=xs[0], max_ms=xs[-1], repeats=len(xs),
                   inner=inner)

    def as_dict(self) -> dict:
        return asdict(self)

    def overlaps(self, other: Timing) -> bool:
        """Whether the two timings' spreads (first to third quartile) overlap: a ratio of the
        medians is then inside the noise of the machine, not a difference it measured."""
        return self.q1_ms <= other.q3_ms and other.q1_ms <= self.q3_ms


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 2,
            repeats: int = 5, min_sample_ms: float = 0.0) -> Timing:
    """Time `fn()` on `device`: `warmup` unrecorded calls, then `repeats` synchronised samples.

    Calls faster than `min_sample_ms` are looped `inner` times per sample (the per-call time is
    the sample / inner), so timer resolution and launch jitter do not dominate tiny kernels."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    last_ms = 0.0
    for _ in range(max(warmup, 1)):  # at least one call: it calibrates `inner`
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        last_ms = (time.perf_counter() - t0) * 1e3
    inner = 1
    if min_sample_ms > 0 and last_ms < min_sample_ms:
        inner = min(1000, math.ceil(min_sample_ms / max(last_ms, 1e-3)))
    samples: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            synchronize(device)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            synchronize(device)
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return Timing.from_samples(samples, inner)


# --------------------------------------------------------------------------------------------
# Peak memory. CUDA: the caching allocator's own peak counter. CPU (Linux): the kernel's
# resident-set high-water mark (VmHWM), reset before each case through /proc/self/clear_refs,
# with glibc told to mmap every allocation >= 64 KiB so a freed tensor's pages go back to the
# kernel instead of being silently reused (which would hide growth from the RSS counter).

CPU_RSS_METHOD = ("rss-hwm: resident-set growth (VmHWM after - VmRSS before, inputs excluded), "
                  "in-process, peak reset via /proc/self/clear_refs, glibc mmap threshold "
                  "64 KiB, median of 3 calls; page-counter granularity ~0.25 MiB")
CUDA_METHOD = ("cuda: torch.cuda.max_memory_allocated() - memory_allocated() before the call, "
               "median of 3 calls")

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter number (malloc.h)


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


def _reset_rss_peak() -> int:
    """Release free heap pages, reset VmHWM to the current RSS and return that RSS (KiB).
    (No gc.collect() here: it costs ~0.2 s per case; tensors are freed by refcount, and
    memory_method() collects once per suite.)"""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # "5" = reset the peak RSS to the current RSS (Linux >= 4.0)
    return _proc_status_kb("VmRSS:")


def memory_method(device: torch.device) -> tuple[str | None, str]:
    """(method, note): the method id used for peak memory on `device`, or None and why not."""
    if device.type == "cuda":
        return CUDA_METHOD, ""
    if device.type == "cpu":
        try:
            gc.collect()
            _reset_rss_peak()
            _proc_status_kb("VmHWM:")
        except OSError as e:
            return None, ("CPU peak memory n/a: no resettable RSS peak here "
                          f"({e.__class__.__name__})")
        return CPU_RSS_METHOD, ""
    return None, f"peak memory n/a on {device.type}: no peak-allocation counter"


@contextlib.contextmanager
def cpu_malloc_for_measurement() -> Iterator[None]:
    """glibc mmap threshold 64 KiB inside (exact RSS accounting), and 32 MiB (glibc's own
    dynamic maximum) after, so later timings keep normal heap reuse."""
    lib = _libc()
    can = lib is not None and hasattr(lib, "mallopt")
    if can:
        lib.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    try:
        yield
    finally:
        if can:
            lib.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory `fn()` needs above what is already allocated (inputs excluded), in bytes;
    None when `memory_method(device)` is None. `fn` should have been run once already (warm)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        del out
        return float(torch.cuda.max_memory_allocated(device) - base)
    if device.type == "cpu":
        try:
            base_kb = _reset_rss_peak()
            out = fn()
            peak_kb = _proc_status_kb("VmHWM:")
        except OSError:
            return None
        del out
        return float(max(peak_kb - base_kb, 0) * 1024)
    return None


# --------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device, dtype: torch.dtype, quick: bool) -> dict:
    """What a figure depends on: hardware, software, threads, dtype, and the load at the start
    (a busy machine makes every timing noisy)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = []
    env = {
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "minigpt": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpu_count": os.cpu_count() or 0,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "quick": quick,
        "load_avg": load,
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env
