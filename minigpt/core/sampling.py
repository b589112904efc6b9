"""What generation is asked to do, checked before anything heavy loads: `Sampling` (the
settings, validated once when made) and `check_seed`. The standard library only, no torch, so
`minigpt sample -t -1` is refused before torch loads (seconds on a busy laptop); generate.py
does the generating."""

from __future__ import annotations

import math
from dataclasses import dataclass

from minigpt.errors import ArgumentError

# Generation past this many tokens per sample is refused: a typo such as `-n 10000000000`
# should fail at once, not run for days. A million tokens is hours of CPU sampling.
MAX_NEW_TOKENS = 1_000_000
MAX_SAMPLES = 10_000  # samples per command; run it again for more


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn, validated once when made (ArgumentError naming the parameter).

    temperature 0 = greedy; top_k 0 and top_p 1.0 = off; `max_new_tokens` per sample."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 200
    num_samples: int = 1

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ArgumentError("temperature", "must be a finite number >= 0 (0 = greedy), got "
                                f"{self.temperature}")
        if self.top_k < 0:
            raise ArgumentError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ArgumentError("top_p", f"must be in (0, 1] (1 = off), got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ArgumentError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.max_new_tokens > MAX_NEW_TOKENS:
            raise ArgumentError("max_new_tokens", f"at most {MAX_NEW_TOKENS:,} per sample, got "
                                f"{self.max_new_tokens:,}")
        if not 1 <= self.num_samples <= MAX_SAMPLES:
            raise ArgumentError("num_samples", f"must be in 1..{MAX_SAMPLES:,}, got "
                                f"{self.num_samples}")


def check_seed(seed: int) -> None:
    """torch generators take seeds in [0, 2**64); say so instead of an overflow traceback."""
    if not 0 <= seed < 2**64:
        raise ArgumentError("seed", f"must be in [0, 2**64), got {seed}")
