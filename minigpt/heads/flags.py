"""inspect-heads' and circuit's own flags, checked before anything heavy loads (standard
library only, no torch): a typo in `--format` or `--ablate` is refused at once, not after
torch and the model have loaded (seconds on a busy laptop)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from minigpt.config.fields import comma_list
from minigpt.core.sampling import check_seed
from minigpt.errors import ArgumentError
from minigpt.interp.edge_args import ABLATIONS, check_direction
from minigpt.interp.modes import check_mode
from minigpt.threads import check_threads

FORMATS = ("table", "png", "html", "safetensors", "json")
CIRCUIT_FORMATS = ("table", "png", "html", "json", "graph")  # `minigpt circuit --format`
SLUG = re.compile(r"[A-Za-z0-9_-]{1,100}")  # a graph's name (heads/attribution_graph.py)


def parse_formats(values: Sequence[str], valid: Sequence[str] = FORMATS) -> list[str]:
    """Format names (each may be comma-separated), validated against `valid` (inspect-heads':
    FORMATS); none given: the table."""
    out: list[str] = []
    for name in (v.lower() for v in comma_list(values)):
        if name not in valid:
            raise ArgumentError("format", f"'{name}' is not a format; valid: "
                               f"{', '.join(valid)}")
        if name not in out:
            out.append(name)
    return out or ["table"]


def check_ablate(mode: str | None) -> None:
    """`--ablate MODE`: one of interp.modes.MODES (None: no ablation)."""
    if mode is not None:
        check_mode(mode)


def check_patch_direction(patch_from: str | None, direction: str | None) -> str:
    """`--patch-direction` (None: noising) applies to `--patch-from` only: given without it,
    it would change nothing, so it is refused (ArgumentError) instead of ignored; a direction
    must be one of interp.edge_args.DIRECTIONS (`check_direction`, the one rule)."""
    if direction is not None and patch_from is None:
        raise ArgumentError("patch_direction", "applies to --patch-from only; give --patch-from "
                            "too, or leave it out")
    return check_direction("noising" if direction is None else direction)


def check_heads_patch_from(patch_from: str | None) -> None:
    """inspect-heads' `--patch-from`: a corrupted input, never an ablation (`zero` and `mean`
    ablate the edges of `minigpt circuit`; a head's ablation is `--ablate`)."""
    if patch_from in ABLATIONS:
        raise ArgumentError("patch_from", f"{patch_from} is an ablation of edges, for minigpt "
                            f"circuit; a head's is --ablate {patch_from}")


def check_early(formats: Sequence[str] | None, seed: int, threads: int, *,
                valid: Sequence[str] = FORMATS, ablate: str | None = None) -> list[str]:
    """The flags inspect-heads and circuit share, checked before torch loads: the formats
    asked for (returned), the seed (as sample's: torch generators take [0, 2**64)), the
    threads and inspect-heads' ablation mode."""
    fmts = parse_formats(formats or [], valid)
    check_seed(seed)
    check_ablate(ablate)
    check_threads(threads)
    return fmts


def check_slug(slug: str) -> str:
    """`circuit --slug`: a graph's name, 1 to 100 letters, digits, `_` or `-` (what Neuronpedia
    accepts, and a file name and a URL part for circuit-tracer's viewer); ArgumentError
    otherwise."""
    if not SLUG.fullmatch(slug):
        raise ArgumentError("slug", "must be 1 to 100 letters, digits, '_' or '-' (the "
                            "characters the graph viewers accept in a graph's name), e.g. "
                            "induction-circuit", subject=slug)
    return slug
