"""CPU threads, one policy for every command, without torch (OpenMP reads its settings from
the environment once, when torch loads it, so they are set before any import of torch):

- How many: a threads setting (`train.threads`, `--threads` of `sample`, `inspect-heads` and
  `bench`) is 0 = automatic (torch's default: OMP_NUM_THREADS, else the cores; decoding: as
  many as the model's width pays for, `minigpt.device.decode_threads`) or a count from 1 to
  the CPUs this process may run on (`check_threads`: more threads than CPUs only wait for each
  other, and a million of them crashed the process). `minigpt.device.cpu_threads` applies it.
  The count never depends on the machine's load: it decides how a sum is split over threads,
  so it can change a run's numbers (a model with biases sums their gradients over the batch),
  and the same command and seed must give the same run.
- How threads wait: torch's OpenMP runtime (GNU libgomp in the Linux wheels) lets a thread
  that has finished its share of an op spin for about 3 ms (300,000 checks) before it sleeps,
  waiting for the next op. Alone on the machine that saves a wake-up per op; on a machine busy
  with other work the spinning thread burns the time slice its partner needs, and a training
  step of the default model took 10-30x longer on 2 threads than on 1. `quiet_openmp()` (the
  `minigpt` command calls it first) sets `GOMP_SPINCOUNT` to OPENMP_SPIN checks (tens of
  microseconds) unless the user set `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`: measured in
  benchmarks/README.md ("Threads on a busy machine"; `python benchmarks/threads_bench.py`).
"""

from __future__ import annotations

import os
import sys

from minigpt.errors import ArgumentError

# Spin-wait checks before an idle OpenMP thread sleeps (libgomp's GOMP_SPINCOUNT; its default
# is 300,000, about 3 ms). See the module docstring and benchmarks/README.md.
OPENMP_SPIN = 1000
USER_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # a user's own choice is kept


def quiet_openmp(environ: dict | None = None) -> bool:
    """Put GOMP_SPINCOUNT=OPENMP_SPIN into `environ` (default os.environ) unless the user set
    GOMP_SPINCOUNT or OMP_WAIT_POLICY, or torch is already loaded (its OpenMP runtime has read
    the environment then, so a setting would change nothing). Returns whether it set it."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or any(k in environ for k in USER_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN)
    return True


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container or `taskset` may
    allow fewer than the machine has), else os.cpu_count()."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def thread_problem(value: object) -> str | None:
    """What is wrong with a threads setting (None: nothing): it must be 0 (automatic) or a
    count from 1 to usable_cpus(). The one rule; callers raise it as their kind of error
    (`train.threads`: a ConfigError; a command's `--threads`: an ArgumentError)."""
    cpus = usable_cpus()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"{value!r} is not a thread count; give 0 (automatic) or 1 to {cpus}"
    if value > cpus:
        digits = str(value)
        shown = digits if len(digits) <= 12 else f"{digits[:6]}... ({len(digits)} digits)"
        return (f"{shown} threads is more than the {cpus} CPU{'s' if cpus != 1 else ''} this "
                "process may run on (more threads than CPUs only wait for each other); give 0 "
                f"(automatic) or 1 to {cpus}")
    return None


def check_threads(value: int, param: str = "threads") -> int:
    """`value` if it is a valid threads setting (`thread_problem`), else an ArgumentError for
    the parameter `param` (a command's `--threads`)."""
    problem = thread_problem(value)
    if problem is not None:
        raise ArgumentError(param, problem)
    return value
