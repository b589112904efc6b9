"""kill -9 trials: `minigpt train` is SIGKILLed at random moments (some in the middle of a
checkpoint write), then the run must load its last good checkpoint and `--resume` must finish it.

    python benchmarks/kill_trials.py                 # 24 trials (every 3rd one mid-save)
    python benchmarks/kill_trials.py --trials 40 --seed 3 --keep /tmp/kt

Each trial starts a real `python -m minigpt train` process on a tiny byte-level model that
checkpoints every 3 steps, waits for a random step to be reported on stderr (plus a random
0-40 ms), or for a random delay during start-up, and sends SIGKILL. "mid-save" trials instead
run `minigpt_command(..., die_during_save=<step>)`: a process that patches the checkpoint
writer to SIGKILL itself right after writing that step's weights, before the manifest and the
commit (the package has no fault hooks of its own), then runs the CLI.

Checks after every kill:
  - if a checkpoint was committed, `load_run` loads it, and its step is at least the last
    checkpoint the process reported (a reported checkpoint is never lost);
  - `minigpt train --out RUN --resume` (6 more steps) exits 0 and the run then loads at the
    expected step, with no leftover temporary checkpoint directories;
  - killed before the run directory existed: `--resume` refuses clearly and a fresh start works.
Prints one line per trial and a summary; exit code 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.run.layout import CKPT_DIR, LATEST, latest_checkpoint_dir
from minigpt.run.load import load_run

CKPT_EVERY = 3
MAX_STEPS = 300

# `python -c` body: SIGKILL itself in the middle of saving step argv[1] (right after that
# step's weights are written into the temporary directory), then run `minigpt argv[2:]`.
DIE_DURING_SAVE = """
import os, signal, sys
from pathlib import Path
from minigpt.run import checkpoint
step, sys.argv = int(sys.argv[1]), ["minigpt", *sys.argv[2:]]
write = checkpoint.write_file_synced
def write_then_die(path, data):
    write(path, data)
    if Path(path).name == "model.safetensors" and f".tmp-step-{step:06d}-" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.write_file_synced = write_then_die
from minigpt.cli import main
main()
"""


def minigpt_command(*args: str, die_during_save: int | None = None) -> list[str]:
    """`python -m minigpt ARGS`; with `die_during_save=N`, a `minigpt ARGS` process that kills
    itself (SIGKILL) in the middle of saving the checkpoint of step N."""
    if die_during_save is None:
        return [sys.executable, "-m", "minigpt", *args]
    return [sys.executable, "-c", DIE_DURING_SAVE, str(die_during_save), *args]


def tiny_sets(corpus: Path, cache: Path, max_steps: int = MAX_STEPS) -> list[str]:
    sets = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
            "tokenizer.vocab_size": 256, "train.batch_size": 4, "train.max_steps": max_steps,
            "train.warmup_steps": 2, "train.eval_interval": 100, "train.eval_batches": 1,
            "train.log_interval": 1, "train.checkpoint_interval": CKPT_EVERY,
            "train.sample_tokens": 0, "data.corpus": str(corpus), "data.cache_dir": str(cache)}
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def make_corpus(path: Path) -> Path:
    words = ["the", "king", "spoke", "to", "his", "son", "and", "queen", "sat", "by", "a",
             "fire", "while", "rain", "fell"]
    path.write_text("\n".join(" ".join(words[(i * 7 + j * 3) % len(words)]
                                       for j in range(4 + i % 9)) for i in range(400)) + "\n")
    return path


@dataclass
class Trial:
    index: int
    kind: str               # startup | random | mid-save
    ok: bool = False
    killed_at: str = ""     # what the process had reported when it was killed
    loaded_step: int | None = None
    resumed_to: int | None = None
    note: str = ""
    seconds: float = 0.0


def read_until(proc, pattern: str, timeout: float) -> tuple[bool, list[str]]:
    """Read `proc`'s stderr line by line until a line matches `pattern` (regex), the stream
    ends or `timeout` seconds pass: (matched, the lines read). tests/test_faults.py uses it."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            return False, seen
        seen.append(line)
        if re.search(pattern, line):
            return True, seen
    return False, seen


def run_trial(index: int, kind: str, rng: random.Random, work: Path, corpus: Path,
              cache: Path) -> Trial:
    t0 = time.time()
    tr = Trial(index, kind)
    run = work / "run"
    env = {**os.environ, "MINIGPT_CACHE": str(cache)}
    save_step = CKPT_EVERY * rng.randint(1, 12) if kind == "mid-save" else None
    proc = subprocess.Popen(minigpt_command("train", "--out", str(run), *tiny_sets(corpus, cache),
                                            die_during_save=save_step),
                            cwd=work, env=env, text=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    seen: list[str] = []
    try:
        if kind == "startup":
            time.sleep(rng.uniform(0.2, 8.0))
        elif kind == "random":
            target = rng.randint(1, 60)
            found, seen = read_until(proc, rf"^step {target}/", 300)
            if not found:
                raise RuntimeError(f"never saw step {target}: {''.join(seen)[-500:]}")
            time.sleep(rng.uniform(0, 0.04))
        if kind == "mid-save":
            proc.wait(timeout=300)  # it kills itself
        else:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        rest = proc.stderr.read()
        seen += rest.splitlines(keepends=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    if proc.returncode != -signal.SIGKILL:
        tr.note = f"exit {proc.returncode} instead of SIGKILL: {''.join(seen)[-300:]}"
        return _done(tr, t0)
    steps = [int(m.group(1)) for x in seen if (m := re.match(r"step (\d+)/", x))]
    ckpts = [int(m.group(1)) for x in seen if (m := re.match(r"checkpoint step (\d+):", x))]
    last_ckpt = ckpts[-1] if ckpts else "-"
    tr.killed_at = f"step {steps[-1] if steps else 0}, last checkpoint {last_ckpt}"

    only_lock = run.is_dir() and [p.name for p in run.iterdir()] == ["train.lock"]
    if not run.exists() or only_lock:  # killed before anything of the run was written
        if not only_lock:
            r = CliRunner().invoke(app, ["train", "--out", str(run), "--resume"])
            if r.exit_code != 2 or "does not exist" not in r.stderr:
                tr.note = f"resume of a never-created run: exit {r.exit_code}: {r.stderr[-300:]}"
                return _done(tr, t0)
        r = CliRunner().invoke(app, ["train", "--out", str(run), *tiny_sets(corpus, cache, 6)])
        tr.ok = r.exit_code == 0 and load_run(run, "cpu").step == 6
        tr.resumed_to, tr.note = 6, "killed before the run existed; fresh start worked"
        return _done(tr, t0, r.stderr if not tr.ok else "")

    committed = latest_checkpoint_dir(run)
    base = 0
    if committed is not None:
        try:
            base = tr.loaded_step = load_run(run, "cpu").step
        except Exception as e:  # noqa: BLE001 - a trial records any failure
            tr.note = f"committed checkpoint does not load: {e}"
            return _done(tr, t0)
        if ckpts and base < ckpts[-1]:
            tr.note = f"reported checkpoint {ckpts[-1]} lost (loads {base})"
            return _done(tr, t0)
        if save_step is not None and base != save_step - CKPT_EVERY:
            tr.note = f"mid-save at {save_step}: loads step {base}, expected {save_step - 3}"
            return _done(tr, t0)
    elif ckpts:
        tr.note = f"reported checkpoint {ckpts[-1]} but nothing is committed"
        return _done(tr, t0)
    goal = base + 6
    r = CliRunner().invoke(app, ["train", "--out", str(run), "--resume", "--set",
                                 f"train.max_steps={goal}"])
    if r.exit_code != 0:
        tr.note = f"--resume failed (exit {r.exit_code}): {r.stderr.strip()[-300:]}"
        return _done(tr, t0)
    tr.resumed_to = load_run(run, "cpu").step
    left = sorted(p.name for p in (run / CKPT_DIR).iterdir())
    if tr.resumed_to != goal:
        tr.note = f"resumed to step {tr.resumed_to}, expected {goal}"
    elif left != sorted([LATEST, f"step-{goal:06d}"]):
        tr.note = f"leftovers after resume: {left}"
    else:
        tr.ok = True
    return _done(tr, t0)


def _done(tr: Trial, t0: float, extra: str = "") -> Trial:
    tr.seconds = time.time() - t0
    if extra:
        tr.note += " " + extra[-300:]
    return tr


def kinds_for(n: int) -> list[str]:
    """Every 3rd trial mid-save, every 6th (offset) during start-up, the rest at random steps."""
    return ["mid-save" if i % 3 == 2 else "startup" if i % 6 == 0 else "random"
            for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, default=None, help="keep trial dirs here")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    root = args.keep or Path(tempfile.mkdtemp(prefix="minigpt-kill-"))
    root.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(root / "corpus.txt")
    cache = root / "cache"
    results = []
    for i, kind in enumerate(kinds_for(args.trials)):
        work = root / f"trial-{i:02d}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        tr = run_trial(i, kind, rng, work, corpus, cache)
        results.append(tr)
        verdict = "ok  " if tr.ok else "FAIL"
        print(f"trial {i:2d} {kind:8s} {verdict} killed at {tr.killed_at or '?'}"
              f" | loaded {tr.loaded_step} | resumed to {tr.resumed_to} | {tr.seconds:.1f}s"
              + (f" | {tr.note}" if tr.note else ""), flush=True)
    ok = sum(t.ok for t in results)
    by_kind = {k: (sum(t.ok for t in results if t.kind == k),
                   sum(t.kind == k for t in results)) for k in ("startup", "random", "mid-save")}
    print(f"kill -9 trials: {ok}/{len(results)} recovered ("
          + ", ".join(f"{k} {a}/{b}" for k, (a, b) in by_kind.items()) + ")")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
