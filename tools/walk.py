"""How far a newcomer walks to follow the trainer, measured on the running code (the numbers
issue 40 bounds and tests/test_walk.py checks):

- **files per step**: the distinct minigpt source files a reader opens to follow one
  `minigpt train` step to `optimizer.step()`: the files of the frames on the stack when the
  optimizer steps, from the `train` command's function down (the walk from the CLI), and the
  files that get a call event (sys.setprofile) from the entry of that step's `Trainer.step` up
  to the optimizer's step (the step itself). The moment the optimizer steps is torch's global
  optimizer pre-step hook; the step measured is the third (neither the first, nor one after a
  log line, an evaluation or a checkpoint: the `--set` values below keep those away).
- **the loop module**: its lines and the distinct minigpt modules it imports.
- **set-up rooms**: the modules of the minigpt functions `set_up` calls itself (its direct
  callees), in call order, consecutive calls into one module counted once. A "climb back" is a
  module entered again after set-up had left it for another (`rooms` lists the sequence).
  `deep` is the same sequence over every minigpt call during set-up (callees of callees too),
  for comparison: the file door and the paths serve every floor, so that one never reaches 0.

    python tools/walk.py [--config bytes] [--set section.key=value ...]    # prints JSON

A developer tool: nothing in the package imports it.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's minigpt, wherever the script is run from

PACKAGE = ROOT / "minigpt"
LOOP = PACKAGE / "train" / "loop.py"  # the trainer's loop module
MEASURED_STEP = 3  # the optimizer step whose walk is measured
# A tiny run whose third step has no log line, evaluation or checkpoint around it.
QUIET = ["train.max_steps=3", "train.log_interval=100", "train.eval_interval=100",
         "train.checkpoint_interval=100", "train.sample_tokens=0",
         "train.head_scores_interval=off", "train.warmup_steps=1", "train.threads=1"]
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16",
        "train.batch_size=4", "train.eval_batches=1"]


def _ours(filename: str) -> str | None:
    """The package-relative path of a minigpt source file, else None."""
    try:
        return Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None


def _module(rel: str) -> str:
    parts = ["minigpt", *Path(rel).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _collapse(seq: list[str]) -> list[str]:
    return [m for i, m in enumerate(seq) if i == 0 or seq[i - 1] != m]


def climbs_back(rooms: list[str]) -> list[str]:
    """The entries of a (collapsed) room sequence that re-enter a room already left."""
    seen: set[str] = set()
    back = []
    for room in rooms:
        if room in seen:
            back.append(room)
        seen.add(room)
    return back


def loop_module(path: Path = LOOP) -> dict:
    """Lines of the loop module and the distinct minigpt modules it imports (anywhere)."""
    src = path.read_text(encoding="utf-8")
    mods: set[str] = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    mods.discard("__future__")
    ours = sorted(m for m in mods if m == "minigpt" or m.startswith("minigpt."))
    return {"path": path.as_posix(), "lines": len(src.splitlines()),
            "imports": len(ours), "imports_all": len(mods), "modules": ours}


class _Recorder:
    """The profile function: set-up's callees and the walk to the measured optimizer step."""

    def __init__(self, set_up_code, step_code, command_code) -> None:
        self.codes = set_up_code, step_code, command_code
        self.set_up_frame = None
        self.rooms: list[str] = []       # set_up's direct callees' modules
        self.deep: list[str] = []        # every minigpt call during set_up
        self.step_files: set[str] = set()
        self.stack_files: list[str] = []
        self.steps = 0
        self.done = False

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or self.done:
            return
        code = frame.f_code
        rel = _ours(code.co_filename)
        set_up_code, step_code, _ = self.codes
        if code is set_up_code:
            self.set_up_frame = frame
        elif self.set_up_frame is not None and rel and self._inside(frame, self.set_up_frame):
            self.deep.append(_module(rel))
            if frame.f_back is self.set_up_frame:
                self.rooms.append(_module(rel))
        if code is step_code:
            self.step_files = set()
        if rel:
            self.step_files.add(rel)

    @staticmethod
    def _inside(frame, outer) -> bool:
        f = frame.f_back
        while f is not None:
            if f is outer:
                return True
            f = f.f_back
        return False

    def optimizer_steps(self) -> None:
        """torch's optimizer pre-step hook: record the walk at the measured step."""
        self.steps += 1
        if self.steps != MEASURED_STEP or self.done:
            return
        self.done = True
        sys.setprofile(None)
        command_code = self.codes[2]
        stack, f = [], sys._getframe(1)
        while f is not None:
            rel = _ours(f.f_code.co_filename)
            if rel:
                stack.append(rel)
            if f.f_code is command_code:
                break
            f = f.f_back
        self.stack_files = list(dict.fromkeys(reversed(stack)))


def measure(config: str = "bytes", sets: list[str] | None = None) -> dict:
    """Run `minigpt train --config CONFIG --set ...` in this process (a tiny, quiet run in a
    temporary directory) and return the walk (module docstring). The profile function is on
    only while `set_up` and `Trainer.step` run, up to the measured optimizer step."""
    import torch._dynamo  # noqa: F401 - the first optimizer imports it: not under the profiler
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from typer.testing import CliRunner

    from minigpt.cli import app
    from minigpt.cli.train import train_command
    from minigpt.train import loop

    rec = _Recorder(loop.set_up.__code__, loop.Trainer.step.__code__, train_command.__code__)

    def profiled(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if rec.done:
                return fn(*args, **kwargs)
            sys.setprofile(rec)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
        return run

    real = loop.set_up, loop.Trainer.step
    loop.set_up, loop.Trainer.step = profiled(real[0]), profiled(real[1])
    hook = register_optimizer_step_pre_hook(lambda *_: rec.optimizer_steps())
    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", "--config", config, "--out", str(Path(tmp) / "run")]
        for s in [*TINY, *QUIET, *(sets or [])]:
            args += ["--set", s]
        try:
            result = CliRunner().invoke(app, args, catch_exceptions=False)
        finally:
            loop.set_up, loop.Trainer.step = real
            hook.remove()
    if result.exit_code != 0:
        raise RuntimeError(f"minigpt {' '.join(args)} failed:\n{result.output}")
    walk = sorted(set(rec.stack_files) | rec.step_files)
    rooms = _collapse(rec.rooms)
    deep = _collapse(rec.deep)
    return {"files_per_step": len(walk), "files": walk, "stack": rec.stack_files,
            "step_only": sorted(rec.step_files - set(rec.stack_files)),
            "loop": loop_module(),
            "set_up": {"rooms": rooms, "climbs_back": len(climbs_back(rooms)),
                       "deep_climbs_back": len(climbs_back(deep))}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="bytes")
    p.add_argument("--set", dest="sets", action="append", default=[])
    a = p.parse_args()
    print(json.dumps(measure(a.config, a.sets), indent=2))


if __name__ == "__main__":
    main()
