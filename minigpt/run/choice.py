"""Which run a command uses when it is given no `--run`: the one rule of `sample`, `export` and
`inspect-heads`.

The candidates are the runs under runs/ with a committed checkpoint, the most recently
committed first (`load.trained_runs`), each with its status as `minigpt runs` decides it
(`listing.run_status`). A command says which runs fit it (`fits(run_dir)` returns None, or why
not: sample wants a run trained on text, export a model its format can hold). The pick is the
newest run that fits and is done (finished, or ended by train.stop_when_formed); failing that,
the newest that fits and is not training; failing that, the newest that fits. Every newer run
is passed over with the reason, and a pick that is not done says how it stands, so a run still
training is never used without a word. When nothing fits, `require_fit` decides: a
MinigptError naming each run and why (export), or the newest run with the reason it does not
fit (sample, which says what an induction run's output is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.errors import MinigptError
from minigpt.files import permission_denied_as_error
from minigpt.run.layout import DEFAULT_RUNS
from minigpt.run.listing import RunStatus, run_status
from minigpt.run.load import trained_runs

Fits = Callable[[Path], "str | None"]


@dataclass
class Pick:
    """The run a command uses, how it stands, and the newer runs passed over (with why)."""

    run_dir: Path
    status: RunStatus
    misfit: str | None = None  # why the pick does not fit (require_fit False, nothing fitted)
    # newer runs passed over: (run, why, whether --run would use it: not for a model the
    # command cannot take at all)
    passed: list[tuple[Path, str, bool]] = field(default_factory=list)


@permission_denied_as_error()
def pick_run(fits: Fits | None = None, root: Path = DEFAULT_RUNS, *,
             require_fit: bool = True, wanted: str = "a run") -> Pick:
    """The run under `root` a command without --run uses (the module docstring states the
    rule). `wanted` names what fits, for the error when nothing does ("a run trained on
    text")."""
    runs = trained_runs(root)
    why = {d: fits(d) if fits is not None else None for d in runs}
    states = {d: run_status(d) for d in runs}
    fitting = [d for d in runs if why[d] is None]
    if not fitting:
        if require_fit:
            raise MinigptError(f"no run under {root}/ is {wanted}: "
                               + "; ".join(f"{d} ({why[d]})" for d in runs[:5])
                               + ("; ..." if len(runs) > 5 else "")
                               + "; give --run DIR")
        return Pick(runs[0], states[runs[0]], why[runs[0]])
    chosen = next((d for d in fitting if states[d].done), None) \
        or next((d for d in fitting if states[d].status != "training"), fitting[0])
    newer = runs[:runs.index(chosen)]
    return Pick(chosen, states[chosen], None,
                [(d, why[d] or states[d].phrase(), why[d] is None or not require_fit)
                 for d in newer])
