"""torchrun / DistributedDataParallel plumbing. A process started by torchrun sees WORLD_SIZE,
RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in its environment; anything else is a single
process (world 1, rank 0) and none of this touches torch.distributed.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from minigpt.errors import ArgumentError, MinigptError

T = TypeVar("T")


@dataclasses.dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: torch.device) -> tuple[DistInfo, torch.device]:
    """Join the process group when launched by torchrun (NCCL on CUDA, gloo on CPU); returns
    the rank info and this rank's device (cuda:LOCAL_RANK on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return DistInfo(), device
    if device.type == "mps":
        raise ArgumentError("device", "torchrun/DDP is not supported on Apple MPS; use {name} "
                            "cpu or a single process", subject="mps")
    info = DistInfo(rank=int(os.environ["RANK"]), world_size=world,
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info, device


def teardown(info: DistInfo) -> None:
    """Leave the process group once nothing holds it: a gloo group still referenced (by a DDP
    wrapper) is destroyed at interpreter exit instead, where it can abort the process."""
    if info.enabled and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def agree(ok: bool, info: DistInfo) -> bool:
    """True only if every rank says ok (so all ranks stop together instead of hanging)."""
    if not info.enabled:
        return ok
    t = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() == 0.0


def main_first(fn: Callable[[], T], info: DistInfo) -> T:
    """Run `fn` on rank 0, then (if it succeeded) on the other ranks: for steps that fill
    caches (tokenizer training, corpus tokenization) so only one rank does the work. If
    rank 0 fails, every rank raises instead of waiting forever."""
    if not info.enabled:
        return fn()
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below on this rank
            error = e
    if not agree(error is None, info):
        if error is not None:
            raise error
        raise MinigptError("rank 0 failed while setting up the run (see its error above)")
    return result if info.is_main else fn()
