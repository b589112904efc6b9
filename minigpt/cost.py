"""What a long analysis or a training session will cost, estimated before it starts, and the
one rule that bounds every number a user types into one: `check_cost` refuses a value whose
estimated time or memory does not fit (an ArgumentError naming the flag, or a ConfigError naming
the setting, with the cost and the largest value that fits), unless forced. The time comes from
the work's own pass count times one measured pass of the model (`timed`: `minigpt circuit
--ig-steps / --pairs`, interp.edge_graph.circuit_cost), or from its FLOPs: `check_flops` owns
that measurement and the sentence that words it (the FLOPs at this machine's measured matmul
rate, `matmul_rate`, a lower bound as no pass runs at the matmul peak; measured only when they
could take the limit at FLOOR_RATE) for `inspect-heads --max-tokens`, `sample`, `features
train` and `features show` and training's length, each caller keeping its own FLOPs formula
beside its maths. The memory is a count of what the work holds at once, bounded by a share of
what is free (`memory_limit`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minigpt.display import duration, size
from minigpt.errors import ArgumentError, ConfigError

TIME_LIMIT_S = 3600.0    # an analysis asked for interactively: at most an hour unless forced
TRAIN_LIMIT_S = 7 * 86400.0  # a training session (a model's, an SAE's): at most a week
MEMORY_SHARE = 0.8       # of the memory free when it starts
FLOOR_RATE = 1e9         # FLOP/s: slower than any machine this runs on; work whose FLOPs fit
                         # the time limit at this rate fits it anywhere, unmeasured


@dataclass(frozen=True)
class Cost:
    """An estimate: wall seconds and bytes held at once."""
    seconds: float
    bytes: float

    def describe(self) -> str:
        if self.seconds <= 0:
            return f"about {size(self.bytes)} of memory"
        return f"about {duration(self.seconds)} and {size(self.bytes)} of memory"


def memory_limit(device: torch.device | str) -> float:
    """Bytes a piece of work may hold at once on `device`: MEMORY_SHARE of what is free there
    (`device.available_bytes`, the one reader); infinite when that is unknown (memory then
    bounds nothing). The reader is imported here, not at the top: the analyses import this
    module for `Cost`, and the device module brings the file door with it."""
    from minigpt.device import available_bytes

    free = available_bytes(torch.device(device))
    return math.inf if free is None else MEMORY_SHARE * free


def timed(fn: Callable[[], object], repeats: int = 2) -> float:
    """Seconds of `fn()`, the fastest of `repeats` calls (the first warms up): one measured
    unit of an analysis, the base of its time estimate."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(device: torch.device | str, dtype: torch.dtype = torch.float32,
                n: int = 512) -> float:
    """FLOP/s of an (n, n) @ (n, n) matmul in `dtype` on `device`, the faster of two timed
    calls after a warm-up: about this machine's peak for the work, so an estimate made from it
    is a lower bound."""
    device = torch.device(device)
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def product() -> None:
        a @ a
        sync()

    product()
    return 2.0 * n ** 3 / max(timed(product), 1e-9)


def largest_fitting(cost_of: Callable[[int], Cost], value: int, limit_s: float,
                    limit_bytes: float) -> int:
    """The largest v in [0, value] whose cost fits (the cost grows with v); 0: none does."""
    lo, hi = 0, value
    while lo < hi:
        mid = (lo + hi + 1) // 2
        c = cost_of(mid)
        if c.seconds <= limit_s and c.bytes <= limit_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_cost(param: str, value: int, cost_of: Callable[[int], Cost], *, what: str,
               device: torch.device | str = "cpu", force: bool = False,
               limit_s: float = TIME_LIMIT_S, limit_what: str = "an analysis may take",
               basis: str = "estimated from one measured pass", minimum: int = 1,
               none_fit: str | None = None, setting: bool = False) -> Cost:
    """The estimated cost of `value` for `param`; refused if it takes more than `limit_s` or
    more than `memory_limit(device)`, naming the cost, how it was estimated (`basis`)
    and the largest value that fits (at least `minimum`; else `none_fit`, the fix), unless
    `force`: an ArgumentError naming the flag, or with `setting` a ConfigError naming the
    setting (`train.max_steps=N`)."""
    cost = cost_of(value)
    limit_bytes = memory_limit(device)
    if force or (cost.seconds <= limit_s and cost.bytes <= limit_bytes):
        return cost
    fits = largest_fitting(cost_of, value, limit_s, limit_bytes)
    over = (f"more than the {duration(limit_s)} {limit_what}" if cost.seconds > limit_s else
            f"more than the {size(limit_bytes)} of memory free for it")
    largest = f"{param}={fits}" if setting else f"{{name}} {fits}"
    fix = (f"the largest that fits is {largest}" if fits >= minimum else
           none_fit or f"even {minimum} does not fit; use a smaller input")
    problem = (f"{what} would take {cost.describe()} ({over}, {basis}); {fix}, or give --force "
               "to run it anyway")
    if setting:
        raise ConfigError(f"{param}={value}: {problem}")
    raise ArgumentError(param, problem, subject=value)


@dataclass(frozen=True)
class Work:
    """What a piece of work counted in FLOPs does: its FLOPs, and the bytes it holds at once."""
    flops: float
    bytes: float


def check_flops(param: str, value: int, work_of: Callable[[int], Work], *, what: str,
                device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                memory: str = "a count of what it holds", force: bool = False,
                limit_s: float = TIME_LIMIT_S, **rule) -> Cost | None:
    """`check_cost` for work counted in FLOPs (`work_of(v)`: the caller's own formula, kept
    beside its maths): the time is the FLOPs at this machine's matmul rate in `dtype`
    (`matmul_rate`, a lower bound: no pass runs at the matmul peak), measured only when the
    FLOPs could take `limit_s` at FLOOR_RATE; otherwise the time fits on any machine and only
    the memory is checked, unmeasured. `memory` says how the bytes were counted; the refusal's
    sentence names both. `rule` is passed on to check_cost (limit_what, minimum, none_fit,
    setting). The estimate when the rate was measured, else None (nothing worth saying)."""
    if force:
        return None
    rate = None
    basis = f"{memory}; its FLOPs fit the time at any speed"
    if work_of(value).flops > limit_s * FLOOR_RATE:
        rate = matmul_rate(device, dtype)
        basis = (f"its FLOPs at this machine's measured matmul rate, {rate / 1e9:.3g} GFLOP/s: "
                 f"a lower bound; memory: {memory}")

    def cost_of(v: int) -> Cost:
        w = work_of(v)
        return Cost(w.flops / rate if rate else 0.0, w.bytes)

    cost = check_cost(param, value, cost_of, what=what, device=device, limit_s=limit_s,
                      basis=basis, **rule)
    return cost if rate else None
