"""The trainer's clock: training seconds over all sessions of a run (a resumed session starts
from the seconds its checkpoint recorded) and tokens/s since the last report."""

from __future__ import annotations

import time


class Clock:
    """Training seconds over all sessions of the run, and tokens/s since the last report."""

    def __init__(self, base: float, step: int) -> None:
        self.start, self.base = time.perf_counter(), base
        self.mark, self.mark_step = self.start, step

    def elapsed(self) -> float:
        return self.base + time.perf_counter() - self.start

    def tokens_per_s(self, step: int, tokens_per_step: int) -> float:
        now = time.perf_counter()
        rate = (step - self.mark_step) * tokens_per_step / max(now - self.mark, 1e-9)
        self.mark, self.mark_step = now, step
        return rate
