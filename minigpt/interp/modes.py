"""The ablation modes and their one check, without torch: inspect-heads refuses a typo in
`--ablate` before torch loads, and `interp.heads.ablate_heads` checks the same rule for
Python callers (both call `check_mode`)."""

from __future__ import annotations

from minigpt.errors import ArgumentError

MODES = ("zero", "mean", "resample")
MODE_HELP = {
    "zero": "the head's output replaced by zeros",
    "mean": "the head's output replaced by its mean over the input's positions",
    "resample": "the head's output replaced by its output on the same tokens in a random order",
}


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES, else ArgumentError naming `--ablate` and the valid ones."""
    if mode not in MODES:
        raise ArgumentError("ablate", f"'{mode}' is not an ablation mode; valid: "
                            f"{', '.join(MODES)}")
    return mode
