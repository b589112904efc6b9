"""What a circuit search is asked for, checked without torch: `minigpt circuit` refuses a bad
`--edges`, `--recover`, `--ig-steps` or `--patch-direction` at once, before torch and the model
load, and `interp.edge_graph.find_circuit` checks the same rule for Python callers (both call
`check_search`). The patching direction's rule (`check_direction`) serves the heads' patching
and inspect-heads too; the IG steps' (`check_ig_steps`) the edge scores."""

from __future__ import annotations

from minigpt.errors import ArgumentError, ConflictError

DIRECTIONS = ("noising", "denoising")
ABLATIONS = ("zero", "mean")  # --patch-from without a corrupted input (interp.edge_graph)
DEFAULT_RECOVER = 0.9  # the circuit asked for when neither --edges nor --recover is given


def check_search(edges: int | None, recover: float | None, ig_steps: int,
                 direction: str) -> None:
    """ArgumentError (ConflictError for both edges and recover) naming the bad parameter:
    `edges` >= 1, 0 < `recover` <= 1, `ig_steps` >= 1, `direction` one of DIRECTIONS."""
    if edges is not None and recover is not None:
        raise ConflictError(("edges", "recover"), "a circuit is its size or the fraction it "
                            "must recover")
    if edges is not None and edges < 1:
        raise ArgumentError("edges", "must be at least 1: a circuit of no edge recovers "
                            "nothing by definition", subject=edges)
    if recover is not None and not 0.0 < recover <= 1.0:
        raise ArgumentError("recover", "must be a fraction in (0, 1], e.g. 0.9",
                            subject=recover)
    check_ig_steps(ig_steps)
    check_direction(direction)


def check_ig_steps(ig_steps: int) -> int:
    """`ig_steps` >= 1 (1 = EAP, more = EAP-IG), else an ArgumentError: the one rule, for
    `minigpt circuit` before torch loads and for every Python caller of the edge scores."""
    if ig_steps < 1:
        raise ArgumentError("ig_steps", "must be at least 1 (1 = EAP, more = EAP-IG)",
                            subject=ig_steps)
    return ig_steps


def check_direction(direction: str) -> str:
    """A patching direction, one of DIRECTIONS, else an ArgumentError naming
    `--patch-direction`: the one rule for heads (`interp.head_circuits.patch_heads`) and edges."""
    if direction not in DIRECTIONS:
        raise ArgumentError("patch_direction", f"'{direction}' is not a direction; valid: "
                            f"{', '.join(DIRECTIONS)}")
    return direction


def check_ablation(patch_from: str, direction: str) -> None:
    """An ablation (`zero`, `mean`) has no corrupted run to be the base of denoising: a
    ConflictError naming both flags; anything else passes."""
    if patch_from in ABLATIONS and direction == "denoising":
        raise ConflictError(("patch_from", "patch_direction"), f"an ablation ({patch_from}) "
                            "has no corrupted input to run: it patches the clean run, noising")
