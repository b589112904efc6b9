"""inspect-heads' own flags, checked before anything heavy loads (standard library only, no
torch): a typo in `--format` or `--ablate` is refused at once, not after torch and the model
have loaded (seconds on a busy laptop)."""

from __future__ import annotations

from collections.abc import Sequence

from minigpt.core.modes import check_mode
from minigpt.errors import ArgumentError

FORMATS = ("table", "png", "html", "safetensors", "json")


def parse_formats(values: Sequence[str]) -> list[str]:
    """Format names (each may be comma-separated), validated against FORMATS; none given:
    the table."""
    out: list[str] = []
    for value in values:
        for name in (v.strip().lower() for v in value.split(",")):
            if name not in FORMATS:
                raise ArgumentError("format", f"'{name}' is not a format; valid: "
                                   f"{', '.join(FORMATS)}")
            if name not in out:
                out.append(name)
    return out or ["table"]


def check_ablate(mode: str | None) -> None:
    """`--ablate MODE`: one of core.modes.MODES (None: no ablation)."""
    if mode is not None:
        check_mode(mode)


def check_patch_direction(patch_from: str | None, direction: str | None) -> str:
    """`--patch-direction` (None: noising) applies to `--patch-from` only: given without it,
    it would change nothing, so it is refused (ArgumentError) instead of ignored."""
    if direction is not None and patch_from is None:
        raise ArgumentError("patch_direction", "applies to --patch-from only; give --patch-from "
                            "too, or leave it out")
    return "noising" if direction is None else direction
