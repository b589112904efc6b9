"""Where a run is, as plain JSON: trainer_state.json (the step, the best losses, and the RNG
states that let `--resume` continue it exactly). Its numbers follow `run/metrics.py`'s
`finite` (a number that is not finite is written as null and read back as missing).

RNG states are JSON (base64 bytes / plain lists), never pickled: torch (CPU and every CUDA
device), numpy's and Python's global generators, and the data-order generator.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minigpt.data.cache import DATA_SPLIT  # recorded in every trainer_state.json (docs/data.md)
from minigpt.errors import MinigptError
from minigpt.files import ReadError, load_json
from minigpt.run.metrics import finite, json_safe

# --------------------------------------------------------------------------------------------
# RNG states.


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def rng_state(data_gen: torch.Generator) -> dict:
    """Every RNG state a training step draws from, as JSON."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *[float(x) if isinstance(x, float) else
                                                      int(x) for x in np_state[2:]]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "data": _b64(data_gen.get_state()),
    }


@dataclasses.dataclass
class RngStates:
    """The RNG states of a trainer_state.json, checked and decoded (`parse_rng`)."""
    torch: torch.Tensor             # uint8, the CPU generator's state
    cuda: list[torch.Tensor]        # one per CUDA device of the saving process
    numpy: tuple                    # np.random.set_state's argument
    python: tuple                   # random.setstate's argument
    data: torch.Tensor              # the data-order generator's state

    def restore(self) -> None:
        """Set the global generators to these states (`data` is the data-order generator's, set
        by its owner). CUDA states are restored when the device count matches (a run may resume
        on another machine)."""
        torch.set_rng_state(self.torch)
        if self.cuda and torch.cuda.is_available() and len(self.cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


def _is_int(x: Any, lo: int, hi: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x < hi


def _bytes_of(value: Any, size: int | None) -> torch.Tensor | None:
    if not isinstance(value, str):
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error:
        return None
    if size is not None and len(raw) != size:
        return None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone() if raw else None


def parse_rng(obj: Any) -> RngStates | None:
    """The RNG states saved by `rng_state`, checked field by field before anything is restored;
    None when they are missing or damaged (the caller names the file)."""
    if not isinstance(obj, dict):
        return None
    size = torch.get_rng_state().numel()  # every CPU generator's state has this size
    cpu, data = _bytes_of(obj.get("torch"), size), _bytes_of(obj.get("data"), size)
    cuda = [_bytes_of(s, None) for s in obj.get("cuda") or []]
    n, p = obj.get("numpy"), obj.get("python")
    numpy_ok = (isinstance(n, list) and len(n) == 5 and n[0] == "MT19937"
                and isinstance(n[1], list) and len(n[1]) == 624
                and all(_is_int(v, 0, 2**32) for v in n[1]) and _is_int(n[2], 0, 625)
                and _is_int(n[3], 0, 2) and finite(n[4]) is not None)
    python_ok = (isinstance(p, list) and len(p) == 3 and _is_int(p[0], 0, 2**31)
                 and isinstance(p[1], list) and len(p[1]) == 625
                 and all(_is_int(v, 0, 2**32) for v in p[1]) and p[1][-1] <= 624
                 and (p[2] is None or finite(p[2]) is not None))
    if cpu is None or data is None or None in cuda or not numpy_ok or not python_ok:
        return None
    return RngStates(cpu, cuda, (n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], float(n[4])),
                     (p[0], tuple(p[1]), p[2]), data)


# --------------------------------------------------------------------------------------------
# trainer_state.json


@dataclasses.dataclass
class TrainerState:
    """Where a run is: the counters a resumed run continues from and its best evaluation.
    trainer_state.json holds these, `data_split` and the RNG states (`as_json`)."""
    step: int = 0                   # optimizer steps completed
    tokens_seen: int = 0
    elapsed: float = 0.0            # training seconds over all sessions
    best_val_loss: float = math.inf
    best_val_bpb: float = math.inf
    best_step: int = 0              # the step of the best evaluation

    def as_json(self, rng: dict) -> dict:
        """The trainer_state.json of this state and `rng` (from `rng_state`)."""
        return {**json_safe(dataclasses.asdict(self)), "data_split": DATA_SPLIT, "rng": rng}


def read_trainer_state(path: Path) -> tuple[TrainerState, RngStates]:
    """The state and RNG states of a checkpoint's trainer_state.json, to resume from. One-line
    MinigptError naming the file for anything missing or damaged."""
    try:
        raw = load_json(path)
    except ReadError as e:  # missing, not a regular file, not UTF-8, not JSON within limits
        raise MinigptError(f"{path} is missing or not valid JSON ({e.problem})") from None
    if not isinstance(raw, dict) or not _is_int(raw.get("step"), 0, 2**63):
        raise MinigptError(f"{path} is not a minigpt trainer state (no valid 'step')")
    rng = parse_rng(raw.get("rng"))
    if rng is None:
        raise MinigptError(f"{path}: the RNG and data-order state is missing or damaged, so the "
                           "run cannot be resumed; start a new run (the weights can still be "
                           "sampled)")
    if raw.get("data_split") != DATA_SPLIT:
        raise MinigptError(f"{path} records no byte split of the corpus (data_split): the run "
                           "was made by a development version before the byte split and cannot "
                           "be resumed; start a new run (the weights can still be sampled)")
    counts = {k: raw.get(k) for k in ("tokens_seen", "best_step")}
    numbers = {k: raw.get(k) for k in ("elapsed", "best_val_loss", "best_val_bpb")}
    if (not all(_is_int(v, 0, 2**63) for v in counts.values())
            or not all(v is None or finite(v) is not None for v in numbers.values())):
        raise MinigptError(f"{path} is damaged: a counter is missing or not a number")
    best = {k: math.inf if v is None else float(v) for k, v in numbers.items()}
    return TrainerState(step=raw["step"], **counts, **best), rng
