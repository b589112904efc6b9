"""What a run writes besides checkpoints: RNG states as JSON, metrics.jsonl (written and read
back), summary.md.

RNG states are JSON (base64 bytes / plain lists), never pickled: torch (CPU and every CUDA
device), numpy's and Python's global generators, and the data-order generator.
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import torch

from minigpt.files import atomic_write_text, disk_error
from minigpt.run.layout import METRICS_FILE, SUMMARY_FILE  # noqa: F401 - re-exported


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(data_gen: torch.Generator) -> dict:
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


def set_rng_state(state: dict, data_gen: torch.Generator) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        cuda = [_unb64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), int(n[2]), int(n[3]),
                         float(n[4])))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    data_gen.set_state(_unb64(state["data"]))


def _finite(x):
    """JSON has no NaN/inf: non-finite floats are written as null."""
    return x if not isinstance(x, float) or math.isfinite(x) else None


class MetricsLog:
    """Append-only metrics.jsonl (one JSON object per line, flushed per record)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self._fh = None
        if enabled:
            try:
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            except OSError as e:
                raise disk_error(e, self.path) from None

    def write(self, record: dict) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")
            self._fh.flush()
        except OSError as e:
            raise disk_error(e, self.path) from None

    def sync(self) -> None:
        if self._fh is not None:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def truncate_metrics(path: Path, step: int) -> None:
    """On resume from `step`: keep only records up to that step (and drop a torn last line
    left by a kill), so the resumed log equals an uninterrupted run's."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            keep.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in keep))


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and the number of damaged lines skipped: a line that is
    not a JSON object with an integer `step` (a torn last line after kill -9, an edit, bit rot).
    Blank lines are neither. A missing file is ([], 0). Never raises on content."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return [], 0
    out, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
        else:
            bad += 1
    return out, bad


def write_summary(path: Path, rows: list[tuple[str, str]], samples: list[tuple[str, str]]
                  ) -> None:
    """summary.md: a two-column table of the run's figures and the last samples."""
    lines = ["# minigpt run summary", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in rows]
    for prompt, text in samples:
        lines += ["", f"Sample (prompt {prompt!r}):", "", "```", text.replace("```", "'''"),
                  "```"]
    atomic_write_text(path, "\n".join(lines) + "\n")
