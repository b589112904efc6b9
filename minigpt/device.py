"""Devices and precision, shared by every command: `auto` picks cuda, then mps, then cpu;
mixed precision is bf16 autocast where the hardware has it; how much memory a run may use."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from minigpt.errors import ArgumentError

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
    """Whether `device` is a GPU with bf16 tensor cores (CUDA compute capability >= 8.0, or
    ROCm). Not `torch.cuda.is_bf16_supported()`, which also says yes where bf16 is only
    emulated (T4, V100: several times slower than fp16 or fp32)."""
    if device.type != "cuda":
        return False
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8


def amp_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `train.precision`: bf16 on CUDA under `auto` where the GPU has
    bf16 tensor cores (CPUs here have no native bf16: emulated is ~5x slower), bf16 wherever
    `bf16` is asked; None = plain fp32."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(device) else None
    return torch.bfloat16 if precision == "bf16" else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision in `dtype` (weights stay fp32); None or fp32 = no autocast."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def available_bytes(device: torch.device) -> int | None:
    """Memory a run can use: free CUDA memory, else the OS's MemAvailable (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
