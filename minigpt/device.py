"""Device selection shared by every command: `auto` picks cuda, then mps, then cpu."""

from __future__ import annotations

import torch

from minigpt.config import MinigptError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """Map a --device value to a torch.device; asking for hardware that is absent is a
    MinigptError (one line, exit 2), never a CUDA/MPS crash later on."""
    if name not in DEVICE_CHOICES:
        raise MinigptError(f"--device: '{name}' is not one of {', '.join(DEVICE_CHOICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MinigptError("--device cuda: CUDA is not available on this machine "
                           f"(torch {torch.__version__}); use --device cpu or --device auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise MinigptError("--device mps: Apple MPS is not available on this machine; "
                           "use --device cpu or --device auto")
    return torch.device(name)
