"""What `features show` is asked for, checked without torch (a typo in `--sort` or a bad
`--head` is refused at once, before torch and the model load): `ShowOptions`, and the one
reading of a head's name, `parse_head`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import ArgumentError, ConflictError

SORTS = ("selectivity", "density", "index")
MAX_CONTEXTS = 100
DEFAULT_DENSE = 0.1


@dataclass(frozen=True)
class ShowOptions:
    """What `features show` is asked for; `check` words a bad value as its flag's error
    (standard library only: before torch loads)."""

    feature: int | None = None
    head: str | None = None        # "L1.H2": the features that head writes most
    top: int = 10
    sort: str = "selectivity"
    contexts: int = 3
    dense: float = DEFAULT_DENSE
    tokens: int = 16_384
    seed: int = 0
    text_file: Path | None = None

    def check(self) -> None:
        if self.feature is not None and self.head is not None:
            raise ConflictError(("feature", "head"))
        for name, lo, hi in (("top", 1, None), ("contexts", 1, MAX_CONTEXTS), ("tokens", 1, None),
                             ("seed", 0, 2**64 - 1)):
            v = getattr(self, name)
            if v < lo or (hi is not None and v > hi):
                bound = f"from {lo} to {hi:,}" if hi is not None else f"{lo} or more"
                raise ArgumentError(name, f"must be {bound}, got {v}")
        if self.feature is not None and self.feature < 0:
            raise ArgumentError("feature", f"must be 0 or more, got {self.feature}")
        if not 0 < self.dense <= 1:  # NaN included
            raise ArgumentError("dense", f"is a fraction of the tokens, in (0, 1]; got "
                                f"{self.dense} (1 keeps every feature)")
        if self.sort not in SORTS:
            raise ArgumentError("sort", f"must be one of {', '.join(SORTS)}; got {self.sort!r}")
        if self.head is not None:
            parse_head(self.head)


_HEAD = re.compile(r"L(\d{1,6})\.H(\d{1,6})")


def parse_head(name: str) -> tuple[int, int]:
    """(layer, head) of a head's name, `L1.H2` (display.head_name's spelling)."""
    m = _HEAD.fullmatch(name.strip())
    if m is None:
        raise ArgumentError("head", f"names a head as minigpt names heads, e.g. L1.H2 (layer 1, "
                            f"head 2); got {name!r}")
    return int(m.group(1)), int(m.group(2))
