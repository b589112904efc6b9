"""Devices and precision, shared by every command: `auto` picks cuda, then mps, then cpu;
mixed precision is bf16 autocast where the hardware has it; how much memory a run may use;
how many CPU threads a command computes on (`cpu_threads`: train.threads and the `--threads`
of sample, inspect-heads and bench, 0 = automatic; the rule and the OpenMP wait policy are in
`minigpt.threads`), with decoding's automatic count from the model's width (`decode_threads`;
`decoding_threads` is the block `minigpt sample` and `minigpt bench --suite sample` both decode
in, so the bench times what sample runs)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from minigpt.core.gpt import device_of
from minigpt.errors import ArgumentError, ConfigError, MinigptError
from minigpt.files import read_file
from minigpt.paths import cache_root
from minigpt.threads import check_threads, thread_problem

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """Map a device name to a torch.device; asking for hardware that is absent is an
    ArgumentError (`device`: one line, exit 2), never a CUDA/MPS crash later on."""
    if name not in DEVICE_CHOICES:
        raise ArgumentError("device", f"'{name}' is not one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ArgumentError("device", f"CUDA is not available on this machine (torch "
                            f"{torch.__version__}); use {{name}} cpu or {{name}} auto",
                            subject="cuda")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ArgumentError("device", "Apple MPS is not available on this machine; use {name} cpu "
                            "or {name} auto", subject="mps")
    return torch.device(name)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively: a GPU with bf16 tensor cores (CUDA compute
    capability >= 8.0, or ROCm), or a CPU with AVX512-BF16 or AMX instructions. Not
    `torch.cuda.is_bf16_supported()`, which also says yes where bf16 is only emulated (T4,
    V100: several times slower than fp16 or fp32); a CPU without those instructions emulates
    bf16 too."""
    if device.type == "cpu":
        return cpu_bf16()
    if device.type != "cuda":
        return False
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def cpu_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (x86 AVX512-BF16 or AMX tiles), as torch's
    own CPU capability checks report them. Measured on an AMD EPYC with AVX512-BF16 (2
    threads, torch 2.13): bf16 matmuls at the model's shapes 380-416 GFLOP/s against fp32's
    117-186."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `train.precision`: under `auto`, bf16 where the device computes
    it natively (`native_bf16`: recent GPUs, CPUs with AVX512-BF16 or AMX), fp32 elsewhere;
    bf16 wherever `bf16` is asked; None = plain fp32."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else None
    return torch.bfloat16 if precision == "bf16" else None


def forward_context(device: torch.device, dtype: torch.dtype | None
                    ) -> Callable[[], AbstractContextManager]:
    """What each forward pass runs in, as a factory of contexts: autocast in `dtype` on
    `device` (weights stay fp32); None or fp32 = no autocast (`contextlib.nullcontext`)."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """Mixed precision in `dtype` (weights stay fp32); None or fp32 = no autocast."""
    return forward_context(device, dtype)()


def available_bytes(device: torch.device) -> int | None:
    """Memory a run can use: free CUDA memory, else the OS's MemAvailable, and on the host no
    more than this process's address-space limit leaves (`ulimit -v`: RLIMIT_AS less what it
    already maps; a limit the work would meet as a MemoryError or a kill) (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    host, left = _host_available(), _address_space_left()
    if host is None:
        return left
    return host if left is None else min(host, left)


def _host_available() -> int | None:
    try:
        for line in read_file("/proc/meminfo", 1 << 20).decode().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (MinigptError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_left() -> int | None:
    """RLIMIT_AS less this process's mapped address space (VmSize); None without a limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        status = read_file("/proc/self/status", 1 << 20).decode()
        mapped = next(int(line.split()[1]) * 1024 for line in status.splitlines()
                      if line.startswith("VmSize:"))
        return max(0, soft - mapped)
    except (ImportError, MinigptError, ValueError, IndexError, StopIteration):
        return None


# --------------------------------------------------------------------------------------------
# Threads for decoding on CPU.

# Decoding one sequence is a chain of small ops: per token, one matrix-vector product per
# weight matrix and a few dozen elementwise ops on n_embd numbers. Each product reads its whole
# matrix for a few flops per weight, so it is bound by memory bandwidth, which a second core
# shares; a second intra-op thread adds a fork/join to each op, and on a busy machine every
# join also waits for a time slice. Measured on 2 cores (benchmarks/README.md, "Decoding
# threads"): two threads never beat one by more than 1% at any width from 128 to 768, and with
# a second process busy they ran 3-4x slower (4 x 128: 564 against 2417 tokens/s; 6 x 384: 82
# against 261). So a thread is given per this many weights of a block's largest matrix (the
# MLP's n_embd x 4 n_embd): every model up to GPT-2 small's width (768: 2.4 M) decodes on one
# thread, and width 1024 and beyond (GPT-2 medium and larger, not measured here) on more.
# `python benchmarks/sample_bench.py --crossover` re-measures it on another machine.
DECODE_WEIGHTS_PER_THREAD = 2 * 1024 * 1024


def decode_threads(model: torch.nn.Module, available: int | None = None) -> int:
    """Intra-op threads for decoding `model` (a GPT) one sequence at a time on CPU: one per
    DECODE_WEIGHTS_PER_THREAD weights of its MLP matrix (4 n_embd^2), at least 1 and at most
    `available` (default: torch's current setting, OMP_NUM_THREADS or the cores). The default
    4 x 128 model, 6 x 384 and GPT-2 small (768 wide) decode on 1 thread, 1024 wide on up
    to 2, 1600 wide (GPT-2 XL) on up to 4.

    It depends on the model and the thread setting only, never on the machine's load: the
    thread count changes how a decode step's sums are split (logits differ by ~1e-6), which
    can flip a sampled token, and the same seed must give the same text. On a machine busy
    with other work, OMP_NUM_THREADS=1 caps it at one."""
    available = torch.get_num_threads() if available is None else available
    n_embd = model.cfg.n_embd
    return max(1, min(available, 4 * n_embd * n_embd // DECODE_WEIGHTS_PER_THREAD))


@contextlib.contextmanager
def cpu_threads(threads: int = 0, model: torch.nn.Module | None = None) -> Iterator[int]:
    """Compute on `threads` intra-op threads (0 = automatic: torch's current setting, which is
    OMP_NUM_THREADS or the cores; for decoding `model`, `decode_threads(model)`); yields the
    count in use and restores the caller's setting afterwards, so in-process callers (tests,
    notebooks) keep theirs. A count outside 0..usable CPUs is an ArgumentError (`threads`;
    `minigpt.threads.check_threads`: the one rule). A model on another device than the CPU
    leaves the setting alone."""
    check_threads(threads)
    before = torch.get_num_threads()
    on_cpu = model is None or device_of(model).type == "cpu"
    if not on_cpu:
        chosen = before
    elif threads:
        chosen = threads
    else:
        chosen = decode_threads(model, before) if model is not None else before
    try:
        torch.set_num_threads(chosen)
        yield chosen
    finally:
        torch.set_num_threads(before)


def decoding_threads(model: torch.nn.Module, threads: int = 0) -> contextlib.AbstractContextManager:
    """Decode `model` on `threads` threads (0: `decode_threads(model)`) when it is on CPU;
    `minigpt sample` and `minigpt bench --suite sample` both decode inside this."""
    return cpu_threads(threads, model)


def training_threads(threads: int) -> contextlib.AbstractContextManager:
    """Train on train.threads intra-op threads (0: torch's current setting). On a machine busy
    with other work the threads no longer spin for each other (`minigpt.threads`), so two do
    not collapse the way they did (docs/cli.md, "Threads"). A count outside 0..usable CPUs is
    a ConfigError naming the setting, raised before the trainer creates anything."""
    problem = thread_problem(threads)
    if problem is not None:
        raise ConfigError(f"train.threads: {problem}")
    return cpu_threads(threads)


def compile_cache_dir(cache_dir: str) -> Path:
    """Where torch.compile keeps its on-disk caches (inductor's FX graph and AOTAutograd
    caches, compiled kernels; Triton's on CUDA): `<minigpt cache>/torch-compile`, the cache
    root of `data.cache_dir` / $MINIGPT_CACHE (paths.cache_root), so a second run of the same
    model loads its kernels instead of compiling them again."""
    return cache_root(cache_dir) / "torch-compile"


def use_compile_cache(cache_dir: str) -> None:
    """Point inductor at `compile_cache_dir` unless the user chose a TORCHINDUCTOR_CACHE_DIR.
    Inductor reads the variable whenever it opens its cache, and writes its default (a per-user
    directory in /tmp) there the first time anything asks, so that default counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir(cache_dir))
