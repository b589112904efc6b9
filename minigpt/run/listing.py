"""What a runs directory holds: one `RunRow` per run, for `minigpt runs`. Read-only: a run
being trained is read while it changes, never locked for longer than a probe, never written.

Where each column comes from:
- status: `training` while a trainer holds train.lock (probed with a shared, non-blocking
  flock on a read-only descriptor, released at once); else `no checkpoint` when none was
  committed (`--resume` starts such a run from step 0); else `finished` when the committed
  checkpoint reached the config's train.max_steps; else the status in summary.md when it was
  written at that checkpoint's step (`interrupted`: Ctrl-C/SIGTERM, `stopped`: --stop-after,
  `formed`: the heads train.stop_when_formed waits for formed); else `killed` (the trainer
  ended without writing its summary: kill -9, a crash, power loss).
  `damaged` when the commit pointer is not a step directory (a regular file, a link out of
  the run), the committed checkpoint's manifest.json is not a JSON object, a file it lists is
  missing or of another size, or a weights header is unsound (what every loading command
  refuses, found without reading a tensor), or config.yaml is cut short (no final newline, or
  a section or a setting missing that the committed checkpoint's own copy holds).
- step: the last step in metrics.jsonl, or the committed checkpoint's when the log is behind;
  max steps: config.yaml's train.max_steps.
  A run on synthetic induction ids (data.source induction) adds what its last head
  measurement in metrics.jsonl says of the induction circuit (`events.circuit_check`: heads
  formed, no induction head, no previous-token head, no heads formed).
- val bits/byte: the lowest val_bpb in metrics.jsonl with its step, and the last one (the
  saved weights are the last step's, so the two differ once validation rises); for a run on
  synthetic induction ids (which stand for no bytes: no bits per byte, null in the JSON), the
  share of copies the last evaluation predicted (`copy_accuracy`) instead.
- parameters: the tensors in the committed model.safetensors (tied weights stored once), from
  its header only.
- wall time: the last `elapsed` in metrics.jsonl (training seconds over all sessions).
- last change: the newest modification time of the run's own files.

Files that come from elsewhere: every file is read only if it is a regular file (a FIFO is
never waited on, /dev/zero never read, a directory never opened as a file) and within a size
cap. A run with a file minigpt cannot read (permission denied, not a regular file, too large;
or a run directory it cannot look into) is still listed, with status `unreadable` and
`problem` naming the file and why; the other runs are listed as usual.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from minigpt import display
from minigpt.errors import MinigptError
from minigpt.events import CircuitCheck, circuit_check
from minigpt.files import ReadError, load_json, open_regular, parse_yaml, read_problem, read_regular
from minigpt.run.layout import (
    CKPT_DIR,
    CONFIG_FILE,
    DEFAULT_RUNS,
    LATEST,
    LOCK_NAME,
    MANIFEST_FILE,
    METRICS_FILE,
    MODEL_FILE,
    SUMMARY_FILE,
    latest_checkpoint_dir,
)
from minigpt.run.metrics import finite, read_metrics
from minigpt.run.safetensors_io import read_header

RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, CKPT_DIR, LOCK_NAME)  # any one makes a run dir
_SUMMARY_STATUS = re.compile(r"^\| status \| (\w+) at step (\d+)/\d+ \|$", re.MULTILINE)
MAX_METRICS_BYTES = 1 << 30  # a million logged steps are ~150 MB
MAX_TEXT_BYTES = 16 << 20    # config.yaml, summary.md: a few KiB


@dataclass
class RunRow:
    name: str
    path: Path
    status: str               # see the module docstring
    step: int                 # 0 before the first logged step
    max_steps: int | None     # None when config.yaml is missing or unreadable
    best_val_bpb: float | None
    params: int | None        # None without a readable committed checkpoint
    wall_time: float | None   # training seconds, all sessions
    last_change: float        # seconds since the epoch
    skipped_lines: int        # damaged metrics.jsonl lines left out
    problem: str | None = None  # "<path>: <why>" of a file that could not be read
    best_step: int | None = None      # the evaluation of best_val_bpb
    last_val_bpb: float | None = None  # the last evaluation's (the saved model's, once done)
    last_step: int | None = None
    copy_accuracy: float | None = None  # induction runs: the last evaluation's copies predicted
    heads: CircuitCheck | None = None   # induction runs: the last head measurement's verdict

    def to_json(self) -> dict:
        return {"name": self.name, "path": str(self.path), "status": self.status,
                "step": self.step, "max_steps": self.max_steps,
                "best_val_bpb": self.best_val_bpb, "best_step": self.best_step,
                "last_val_bpb": self.last_val_bpb, "last_step": self.last_step,
                "copy_accuracy": self.copy_accuracy, "params": self.params,
                "wall_time_s": self.wall_time, "last_change": self.last_change,
                "skipped_lines": self.skipped_lines, "problem": self.problem,
                "heads": self.heads.to_json() if self.heads is not None else None}


class Unreadable(MinigptError):
    """A file of a run that minigpt cannot read: `str(err)` is "<path>: <why>"."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


def is_run_dir(path: Path) -> bool:
    """A directory holding any of RUN_MARKERS; also one minigpt may not look into (it is
    listed as unreadable: whether it is a run cannot be told)."""
    try:
        return path.is_dir() and any((path / m).exists() for m in RUN_MARKERS)
    except OSError:
        return True


def named_run(text: str | Path) -> Path:
    """The run directory `--run TEXT` names, the one rule of every command: TEXT itself when
    something is there (the command then says what is wrong with it, if anything), else the run
    of that name under runs/; a MinigptError with a did-you-mean when neither exists."""
    path = Path(text)
    if path.exists() or path.is_symlink():
        return path
    under = DEFAULT_RUNS / path
    inside = path.is_absolute() or path.parts[:1] == DEFAULT_RUNS.parts
    if not inside and under.exists():
        return under
    nor = "" if inside else f" (nor does {under})"
    raise MinigptError(f"run directory {path} does not exist{nor}{_did_you_mean(path)}; "
                       "`minigpt runs` lists the runs")


def _did_you_mean(path: Path) -> str:
    """'; did you mean runs/default?' for the run directory nearest in name to `path`, among
    its parent's and those under runs/ ('' when none is near)."""
    import difflib

    places = {path.parent, DEFAULT_RUNS} if not path.is_absolute() else {path.parent}
    near: dict[str, Path] = {}
    for place in places:
        try:
            for d in sorted(place.iterdir())[:10_000]:
                if is_run_dir(d):
                    near.setdefault(d.name, d)
        except OSError:
            continue
    hit = difflib.get_close_matches(path.name, list(near), n=1, cutoff=0.6)
    return f"; did you mean {near[hit[0]]}?" if hit else ""


def find_run(text: str) -> Path:
    """A run named as `--run` names one where several runs are taken (`minigpt runs`,
    `minigpt curves`): `named_run`'s, which must be a run directory."""
    try:
        path = named_run(text)
    except MinigptError as e:
        raise MinigptError(f"unknown run '{text}': {e}") from None
    if is_run_dir(path):
        return path
    under = DEFAULT_RUNS / text
    if not Path(text).is_absolute() and is_run_dir(under):
        return under
    raise MinigptError(f"unknown run '{text}': {path} is not a run directory (none of "
                       f"{', '.join(RUN_MARKERS)} in it){_did_you_mean(path)}; `minigpt runs` "
                       "lists the runs")


def list_runs(root: Path) -> list[RunRow]:
    """The runs in `root` (its subdirectories that hold any of RUN_MARKERS; `root` itself if
    it is a run), sorted by name. MinigptError saying where it looked when there are none, or
    when `root` itself cannot be read."""
    root = Path(root)
    try:
        if not root.is_dir():
            raise MinigptError(f"{root} is not a directory; give the directory that holds the "
                               "runs (default: runs/)")
        children = sorted(root.iterdir())
    except OSError as e:
        raise MinigptError(f"cannot read {root}: {read_problem(e)}") from None
    dirs = [root] if is_run_dir(root) else [p for p in children if is_run_dir(p)]
    if not dirs:
        raise MinigptError(f"no runs under {root}/ (looked for directories holding "
                           f"{', '.join(RUN_MARKERS)}); train one with `minigpt train`")
    return [read_row(d) for d in dirs]


def read_run_metrics(run_dir: Path) -> tuple[list[dict], int]:
    """`metrics.read_metrics` of a run's metrics.jsonl, read only when it is a regular file of at
    most MAX_METRICS_BYTES (missing: no records). Unreadable (a MinigptError) otherwise."""
    path = Path(run_dir) / METRICS_FILE
    try:
        with open_regular(path) as fh:
            size = fh.seek(0, 2)
    except FileNotFoundError:
        return [], 0
    except OSError as e:
        raise Unreadable(path, read_problem(e)) from None
    if size > MAX_METRICS_BYTES:
        raise Unreadable(path, f"larger than {display.size(MAX_METRICS_BYTES)}; not a metrics log")
    try:
        return read_metrics(path)
    except ReadError as e:  # replaced between the check and the read
        raise Unreadable(path, e.problem.removeprefix("cannot read it (").removesuffix(")")
                         ) from None


def read_row(run_dir: Path) -> RunRow:
    """One run's row (never raises for a damaged or unreadable run: the damage shows in its
    status, and `problem` names the first file that could not be read)."""
    problems: list[str] = []
    for d in (run_dir, run_dir / CKPT_DIR):  # directories it cannot look into
        try:
            os.listdir(d)
        except FileNotFoundError:
            pass
        except OSError as e:
            problems.append(f"{d}: {read_problem(e)}")
            break
    try:
        records, bad = read_run_metrics(run_dir)
    except Unreadable as e:
        records, bad = [], 0
        problems.append(str(e))
    evals = [r for r in records if r.get("kind") == "eval"]
    config = _config(run_dir, problems)
    synthetic = isinstance(config, dict) and isinstance(config.get("data"), dict) and \
        config["data"].get("source") == "induction"  # ids stand for no bytes: no bits/byte
    scored = [(r["val_bpb"], r["step"]) for r in evals
              if finite(r.get("val_bpb")) is not None and not synthetic]
    best = min(scored, key=lambda x: x[0]) if scored else (None, None)
    last = scored[-1] if scored else (None, None)
    copies = [r["copy_accuracy"] for r in evals if finite(r.get("copy_accuracy")) is not None]
    times = [r["elapsed"] for r in records if finite(r.get("elapsed")) is not None]
    max_steps = _max_steps(config)
    ckpt, ckpt_step, status = _checkpoint_status(run_dir, max_steps, problems)
    params = _params(ckpt, problems)
    return RunRow(name=run_dir.name, path=run_dir,
                  status=_problem_status(problems, status),
                  step=max([r["step"] for r in records] + [ckpt_step or 0]),
                  max_steps=max_steps, best_val_bpb=best[0],
                  params=params, wall_time=times[-1] if times else None,
                  last_change=_last_change(run_dir), skipped_lines=bad,
                  problem=problems[0] if problems else None, best_step=best[1],
                  last_val_bpb=last[0], last_step=last[1],
                  copy_accuracy=copies[-1] if copies else None, heads=_circuit(records, config))


@dataclass
class RunStatus:
    """A run's `status` column and the steps behind it, without reading metrics.jsonl."""

    status: str
    step: int | None       # the committed checkpoint's step (None: none committed)
    max_steps: int | None  # config.yaml's train.max_steps

    @property
    def done(self) -> bool:
        """Trained as far as it was meant to: finished, or stopped by train.stop_when_formed."""
        return self.status in DONE

    def phrase(self) -> str:
        """How it stands, for a message: "still training (step 1000 of 8000 committed)"."""
        of = f" of {self.max_steps}" if self.max_steps is not None else ""
        if self.status == "training":
            return f"still training (step {self.step or 0}{of} committed)"
        if self.status in ("interrupted", "stopped", "killed", "formed", "finished",
                           "compiled"):
            return f"{self.status} at step {self.step}{of}"
        return self.status


# formed: ended by train.stop_when_formed, as it was asked to; compiled: a program compiled by
# minigpt compile (its summary.md says so), complete as it was written
DONE = ("finished", "formed", "compiled")


def run_status(run_dir: Path) -> RunStatus:
    """The run's status as `minigpt runs` shows it (the module docstring says how it is
    decided), its committed step and its max steps; `unreadable` when a file it needs
    cannot be read."""
    problems: list[str] = []
    max_steps = _max_steps(_config(run_dir, problems))
    _, step, status = _checkpoint_status(run_dir, max_steps, problems)
    return RunStatus(_problem_status(problems, status), step, max_steps)


CUT_SHORT = "cut short"  # a problem of a file that was read but is not whole


def _problem_status(problems: list[str], status: str) -> str:
    """`damaged` when a file the run needs is there but not whole (config.yaml cut short),
    `unreadable` when one cannot be read, else `status`."""
    if any(CUT_SHORT in p for p in problems):
        return "damaged"
    return "unreadable" if problems else status


def _checkpoint_status(run_dir: Path, max_steps: int | None, problems: list[str]
                       ) -> tuple[Path | None, int | None, str]:
    """(committed checkpoint directory, its step, the run's status)."""
    try:
        ckpt = latest_checkpoint_dir(run_dir)
        ckpt_step = int(ckpt.name.split("-")[1]) if ckpt is not None else None
        status = _status(run_dir, ckpt_step, max_steps, problems)
        if ckpt is not None and status != "training" and not _manifest_ok(ckpt):
            status = "damaged"
    except MinigptError:
        return None, None, "damaged"
    except OSError as e:
        problems.append(f"{run_dir / CKPT_DIR}: {read_problem(e)}")
        return None, None, "damaged"
    return ckpt, ckpt_step, status


def _text(path: Path, problems: list[str]) -> str | None:
    """A small text file of the run (None when missing or unreadable, noted in `problems`)."""
    try:
        return read_regular(path, MAX_TEXT_BYTES).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as e:
        problems.append(f"{path}: {read_problem(e)}")
        return None


def _status(run_dir: Path, ckpt_step: int | None, max_steps: int | None,
            problems: list[str]) -> str:
    if _lock_held(run_dir / LOCK_NAME, problems):
        return "training"
    latest = run_dir / CKPT_DIR / LATEST
    if latest.exists() and not latest.is_symlink() and not latest.is_dir():
        return "damaged"  # a regular file where the commit pointer goes: not a step directory
    if ckpt_step is None:
        return "no checkpoint"
    if max_steps is not None and ckpt_step >= max_steps:
        return "finished"
    found = _SUMMARY_STATUS.search(_text(run_dir / SUMMARY_FILE, problems) or "")
    if found and int(found.group(2)) == ckpt_step:
        return found.group(1)
    return "killed"


def _manifest_ok(ckpt: Path) -> bool:
    """Whether the committed checkpoint looks loadable without reading its tensors: its
    manifest.json reads as a JSON object listing files (what `sample --run` checks first),
    every file it lists is there with the size it lists, and each weights file's header is
    sound (safetensors_io.read_header). A changed byte of the same size is found only by the
    hashes a loading command checks."""
    try:
        manifest = load_json(ckpt / MANIFEST_FILE)
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            return False
        for name, info in files.items():
            path = ckpt / Path(str(name)).name
            size = info.get("bytes") if isinstance(info, dict) else None
            if not path.is_file() or (isinstance(size, int) and path.stat().st_size != size):
                return False
            if path.suffix == ".safetensors":
                read_header(path, "weights")
    except (ReadError, MinigptError, OSError, RecursionError):
        return False
    return True


def _lock_held(path: Path, problems: list[str]) -> bool:
    """Whether a trainer holds the run lock (see lock.py): a shared, non-blocking flock fails
    exactly while someone holds the exclusive one."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no probe, report not held
        return False
    try:
        with open_regular(path) as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    except FileNotFoundError:  # no lock file: nobody ever trained here, or it was removed
        return False
    except OSError as e:
        problems.append(f"{path}: {read_problem(e)}")
    return False


def run_config(run_dir: Path) -> tuple[dict | None, str | None]:
    """A run's config.yaml as a mapping of sections, or None and why: "<path>: <why>" for a
    file that cannot be read or is not a config (not UTF-8, not YAML, empty, not a mapping);
    (None, None) for a run that has none yet (a run still starting). Never raises."""
    path = Path(run_dir) / CONFIG_FILE
    try:
        data = read_regular(path, MAX_TEXT_BYTES)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"{path}: {read_problem(e)}"
    if data and not data.endswith(b"\n"):  # minigpt ends it with one: cut, whatever it parses to
        return None, (f"{path}: {CUT_SHORT} (it does not end with a newline); the run's files "
                      "are damaged (its committed checkpoint keeps its own copy)")
    try:
        cfg = parse_yaml(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as e:
        return None, f"{path}: not UTF-8 text (invalid byte at offset {e.start})"
    except MinigptError as e:
        return None, str(e)
    if not isinstance(cfg, dict):
        what = "empty" if cfg is None else "not a mapping of sections"
        return None, f"{path}: {what}, not a config"
    cut = _cut_short(data, cfg, Path(run_dir))
    if cut:
        return None, (f"{path}: {cut}; the run's files are damaged (its committed checkpoint "
                      "keeps its own copy)")
    return cfg, None


CONFIG_SECTIONS = ("model", "tokenizer", "data", "train", "run")  # what config.yaml holds


def _cut_short(data: bytes, cfg: dict, run_dir: Path) -> str | None:
    """Why a run's config.yaml (minigpt writes every section) is cut short at a line, or None:
    a section or setting missing that the committed checkpoint's own copy holds."""
    try:
        ckpt = latest_checkpoint_dir(run_dir)
        if ckpt is None:
            return None
        saved = parse_yaml(read_regular(ckpt / CONFIG_FILE, MAX_TEXT_BYTES).decode("utf-8"))
    except (OSError, MinigptError, UnicodeDecodeError):
        return None  # the checkpoint's own problems are said where it is read
    if not isinstance(saved, dict):
        return None
    for s in CONFIG_SECTIONS:
        if isinstance(saved.get(s), dict) and not isinstance(cfg.get(s), dict):
            return f"{CUT_SHORT} (no {s} section; the checkpoint's copy has it)"
        lost = set(saved.get(s) or {}) - set(cfg[s]) if isinstance(saved.get(s), dict) else ()
        if lost:
            return f"{CUT_SHORT} ({s}.{min(lost)} is missing; the checkpoint's copy has it)"
    return None


def data_kind(run_dir: Path) -> dict:
    """What a run was trained on, from its config.yaml: {"source": "text" | "induction" |
    "program" (compiled, not trained),
    "tokenizer": a phrase naming its tokens ("bytes", "BPE 1024 (gpt4)", "gpt2 encoding",
    "synthetic ids 0..127")}; {} when it has no config.yaml; {"problem": "<path>: <why>"}
    when it cannot be read or does not say (never a kind guessed from the defaults). For
    `sample` (which picks the latest run trained on text) and `curves` (which refuses to
    overlay runs whose tokens differ)."""
    cfg, problem = run_config(run_dir)
    if cfg is None:
        return {"problem": problem} if problem else {}
    data, tok = cfg.get("data"), cfg.get("tokenizer")
    path = Path(run_dir) / CONFIG_FILE
    if not isinstance(data, dict) or not isinstance(tok, dict):
        missing = "data" if not isinstance(data, dict) else "tokenizer"
        return {"problem": f"{path}: no {missing} section, so what the run was trained on "
                "is unknown"}
    source = data.get("source")
    if source == "program":
        return {"source": "program", "tokenizer": "a compiled program's tokens"}
    if source == "induction":
        vocab = data.get("induction_vocab")
        tokens = f"synthetic ids 0..{vocab - 1}" if isinstance(vocab, int) else "synthetic ids"
    elif source != "text":
        return {"problem": f"{path}: data.source is {source!r}, not text or induction"}
    elif tok.get("encoding"):
        tokens = f"{tok['encoding']} encoding"
    elif not isinstance(tok.get("vocab_size"), int):
        return {"source": "text", "problem": f"{path}: no tokenizer.vocab_size, so the "
                "run's tokens are unknown"}
    elif tok["vocab_size"] == 256:
        tokens = "bytes"
    else:
        tokens = f"BPE {tok['vocab_size']} ({tok.get('pattern', 'gpt4')})"
    return {"source": str(source), "tokenizer": tokens}


def _config(run_dir: Path, problems: list[str]) -> dict | None:
    """The run's config.yaml as a dict (None when missing, unreadable or not a config, the
    last two noted in `problems`)."""
    cfg, problem = run_config(run_dir)
    if problem:
        problems.append(problem)
    return cfg


def _max_steps(config: dict | None) -> int | None:
    try:
        value = config["train"]["max_steps"] if config is not None else None
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _circuit(records: list[dict], config: dict | None) -> CircuitCheck | None:
    """A run on induction ids: the induction circuit as its last head measurement saw it."""
    data = config.get("data") if config is not None else None
    if not isinstance(data, dict) or data.get("source") != "induction":
        return None
    last = next((r for r in reversed(records) if r.get("kind") == "heads"
                 and isinstance(r.get("step"), int) and isinstance(r.get("scores"), dict)), None)
    return circuit_check(last["step"], last["scores"]) if last is not None else None


def _params(ckpt: Path | None, problems: list[str]) -> int | None:
    if ckpt is None:
        return None
    path = ckpt / MODEL_FILE
    try:
        with open_regular(path):  # read_header opens it: never a FIFO or a device
            pass
        header, _ = read_header(path, "weights")
    except FileNotFoundError:
        return None
    except OSError as e:
        problems.append(f"{path}: {read_problem(e)}")
        return None
    except (MinigptError, RecursionError):  # damaged: the weights' own commands say how
        return None
    return sum(math.prod(info["shape"]) for info in header.values())


def _last_change(run_dir: Path) -> float:
    paths = [run_dir, *(run_dir / n for n in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE)),
             run_dir / CKPT_DIR / LATEST]
    times = []
    for p in paths:
        try:
            times.append(p.lstat().st_mtime)
        except OSError:
            continue
    return max(times, default=0.0)
