"""Checkpoints: save and load a run's model, optimizer and trainer state without pickle, with a
commit protocol that survives kill -9 at any moment.

Run directory layout::

    <run>/config.yaml, tokenizer.tiktoken, tokenizer.json   resolved config + tokenizer
    <run>/metrics.jsonl, summary.md, train.lock               logs, end summary, the run lock
    <run>/checkpoints/step-000500/                            one complete, self-contained checkpoint:
        model.safetensors  optimizer.safetensors  trainer_state.json  config.yaml
        tokenizer.tiktoken  tokenizer.json  manifest.json   (sha256 of every other file)
    <run>/checkpoints/latest -> step-000500                   symlink: THE commit pointer
    <run>/model.safetensors, optimizer.safetensors, trainer_state.json, manifest.json
                                                              symlinks into checkpoints/latest/

Save protocol: write every file into `checkpoints/.tmp-step-N-<pid>/`, fsync each, write
manifest.json last, fsync, rename the directory to `step-N`, fsync, then atomically replace
the `latest` symlink (os.replace of a temp symlink) and fsync: that rename is the commit. Only
then are older step directories deleted. A kill at any point leaves `latest` pointing at a
complete, manifest-verified checkpoint (the previous one until the commit); leftovers
(`.tmp-*`, uncommitted `step-*`) are ignored by loaders and cleaned by the next save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minigpt import __version__
from minigpt.config import Config, MinigptError, from_dict, model_hash, parse_yaml, to_yaml
from minigpt.rundir import disk_error, fsync_dir, write_file_synced
from minigpt.safetensors_io import check_against, load_tensors, read_header, tensors_to_bytes

if TYPE_CHECKING:
    from minigpt.model import GPT
    from minigpt.tokenizer import Tokenizer

CKPT_DIR = "checkpoints"
LATEST = "latest"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
FORMAT = "minigpt-checkpoint-1"
# Convenience links at the top of the run dir, so plain `safetensors` finds <run>/model.safetensors.
TOP_LINKS = (MODEL_FILE, OPTIM_FILE, STATE_FILE, MANIFEST_FILE)


@dataclasses.dataclass
class LoadedRun:
    model: GPT          # on the requested device, eval mode
    cfg: Config         # the run's resolved config (model.vocab_size filled in)
    tokenizer: Tokenizer
    step: int           # optimizer steps completed when the checkpoint was written
    run_dir: Path


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint directory whose manifest and sha256 sums were verified."""
    path: Path
    step: int
    cfg: Config
    files: dict[str, Any]


# --------------------------------------------------------------------------------------------
# Naming: tied weights are stored once.


def raw_module(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DDP (`.module`) and torch.compile (`._orig_mod`) wrappers, so a
    compiled or distributed model saves exactly the names of an eager one."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: canonical} for state-dict entries that are the same Parameter (e.g. the LM head
    tied to the token embedding): the canonical (first) name is stored, the alias re-tied."""
    seen: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return aliases


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without tied aliases (what model.safetensors holds)."""
    model = raw_module(model)
    aliases = tied_aliases(model)
    return {k: v for k, v in model.state_dict().items() if k not in aliases}


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]
                      ) -> dict[str, torch.Tensor]:
    """Flatten the optimizer state as `<param name>.<key>` (exp_avg, exp_avg_sq, step);
    `names` lists the parameter names in optimizer order (param_groups concatenated)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert len(params) == len(names), "names must match the optimizer's parameters"
    out = {}
    for name, p in zip(names, params):
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"{name}.{key}"] = value
            else:  # older torch kept `step` as a Python number
                out[f"{name}.{key}"] = torch.tensor(float(value), dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------
# Saving.


def _die_hook(step: int, var: str) -> bool:
    """Fault injection for tests: MINIGPT_TEST_DIE_DURING_SAVE=<step> kills the process
    (SIGKILL) in the middle of that step's save; ..._ENOSPC_... simulates a full disk."""
    value = os.environ.get(var)
    return bool(value) and value.isdigit() and int(value) == step


def save_checkpoint(run_dir: Path, *, step: int, model: torch.nn.Module, cfg: Config,
                    tokenizer: Tokenizer, trainer_state: dict,
                    optimizer: torch.optim.Optimizer | None = None,
                    param_names: list[str] | None = None) -> Path:
    """Write a complete checkpoint for `step` and commit it (see the module docstring).
    Returns the committed directory. A write failure (disk full, permissions) removes the
    partial directory and raises MinigptError; the previous checkpoint stays committed."""
    run_dir = Path(run_dir)
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        raw = raw_module(model)
        aliases = tied_aliases(raw)
        meta = {"format": FORMAT, "step": str(step), "config_hash": model_hash(cfg.model),
                "minigpt_version": __version__, "tied": json.dumps(aliases),
                "tokenizer_hash": str(getattr(tokenizer, "hash", ""))}
        files: dict[str, bytes] = {MODEL_FILE: tensors_to_bytes(model_tensors(raw), meta)}
        write_file_synced(tmp / MODEL_FILE, files[MODEL_FILE])
        if _die_hook(step, "MINIGPT_TEST_DIE_DURING_SAVE"):
            os.kill(os.getpid(), signal.SIGKILL)
        if _die_hook(step, "MINIGPT_TEST_ENOSPC_DURING_SAVE"):
            import errno
            raise OSError(errno.ENOSPC, "No space left on device")
        if optimizer is not None:
            files[OPTIM_FILE] = tensors_to_bytes(
                optimizer_tensors(optimizer, param_names or []),
                {"format": FORMAT, "step": str(step)})
        files[STATE_FILE] = (json.dumps(trainer_state, indent=1) + "\n").encode()
        files[CONFIG_FILE] = to_yaml(cfg).encode()
        for name in (OPTIM_FILE, STATE_FILE, CONFIG_FILE):
            if name in files:
                write_file_synced(tmp / name, files[name])
        tokenizer.save(tmp)
        manifest = {"format": FORMAT, "step": step, "minigpt_version": __version__, "files": {}}
        for p in sorted(tmp.iterdir()):
            data = files.get(p.name)
            data = data if data is not None else p.read_bytes()
            manifest["files"][p.name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                         "bytes": len(data)}
        # The manifest is written last: a directory without it was never finished.
        write_file_synced(tmp / MANIFEST_FILE, (json.dumps(manifest, indent=1) + "\n").encode())
        fsync_dir(tmp)
        if final.exists():  # left by a crash after rename and before the commit: not referenced
            if _latest_target(root) == final.name:
                shutil.rmtree(tmp)
                return final  # the same step is already committed
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        _commit_latest(root, final.name)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = disk_error(e, tmp)
        prev = _latest_target(root)
        keep = f"the previous checkpoint ({prev}) is intact" if prev else "no checkpoint was saved"
        raise MinigptError(f"saving checkpoint step {step} failed: {err}; {keep}") from None
    _cleanup(root, keep=final.name)
    _ensure_top_links(run_dir)
    return final


def _commit_latest(root: Path, target: str) -> None:
    link = root / LATEST
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)  # atomic: readers see the old or the new target
    fsync_dir(root)


def _latest_target(root: Path) -> str | None:
    try:
        return os.readlink(root / LATEST)
    except OSError:
        return None


def _cleanup(root: Path, keep: str) -> None:
    """Remove everything but the committed checkpoint (older steps, temp dirs, stale links)."""
    for p in root.iterdir():
        if p.name in (keep, LATEST):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith("."):
            p.unlink(missing_ok=True)


def _ensure_top_links(run_dir: Path) -> None:
    for name in TOP_LINKS:
        link = run_dir / name
        if link.is_symlink() or not link.exists():
            target = f"{CKPT_DIR}/{LATEST}/{name}"
            if link.is_symlink() and os.readlink(link) == target:
                continue
            try:
                link.unlink(missing_ok=True)
                os.symlink(target, link)
            except OSError:
                pass  # convenience only; loaders always go through checkpoints/latest


# --------------------------------------------------------------------------------------------
# Finding and verifying.


def latest_checkpoint_dir(run_dir: Path) -> Path | None:
    """The committed checkpoint directory of a run, or None if none was ever committed."""
    root = Path(run_dir) / CKPT_DIR
    target = _latest_target(root)
    if target is None:
        return None
    if not re.fullmatch(r"step-\d{6,}", target):  # never follow a pointer out of the run
        raise MinigptError(f"{root / LATEST} points to '{target}', not a step-NNNNNN directory; "
                           "the run directory was tampered with")
    return root / target


def verify_checkpoint(ckpt_dir: Path, need: tuple[str, ...] = (MODEL_FILE,)) -> Checkpoint:
    """Check a checkpoint directory: manifest present and parseable, every listed file (and
    every file in `need`) present with the recorded sha256; weights sniffed for pickle/zip
    first. Parses config.yaml. One-line MinigptError naming the file on any problem."""
    ckpt_dir = Path(ckpt_dir)
    mpath = ckpt_dir / MANIFEST_FILE
    if not ckpt_dir.is_dir():
        raise MinigptError(f"checkpoint directory {ckpt_dir} is missing; the run is incomplete")
    if not mpath.is_file():
        raise MinigptError(f"{mpath} is missing: the checkpoint was never completed "
                           "(interrupted save?); it cannot be loaded")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        files = manifest["files"]
        step = int(manifest["step"])
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise MinigptError(f"{mpath} is corrupted (not a minigpt manifest)") from None
    for name in (*need, CONFIG_FILE):
        if name not in files or not (ckpt_dir / name).is_file():
            raise MinigptError(f"{ckpt_dir / name} is missing from the checkpoint")
    for name, info in files.items():
        path = ckpt_dir / Path(name).name
        if not path.is_file():
            raise MinigptError(f"{path} is missing from the checkpoint")
        if path.suffix == ".safetensors":
            read_header(path, "weights")  # pickle/zip/truncation get their own message
        # Size first (cheap, and a huge crafted file is never read), then hash in 1 MiB chunks.
        if not isinstance(info, dict) or ("bytes" in info and
                                          path.stat().st_size != info["bytes"]):
            raise MinigptError(f"{path} is corrupted: its size does not match {MANIFEST_FILE}; "
                               "restore it or retrain")
        digest = _sha256_file(path)
        if digest != info.get("sha256"):
            raise MinigptError(f"{path} is corrupted: its sha256 does not match {MANIFEST_FILE}; "
                               "restore it or retrain")
    cpath = ckpt_dir / CONFIG_FILE
    cfg = from_dict(parse_yaml(cpath.read_text(encoding="utf-8", errors="replace"), str(cpath)),
                    str(cpath))
    return Checkpoint(path=ckpt_dir, step=step, cfg=cfg, files=files)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_checkpoint(run_dir: Path, need: tuple[str, ...] = (MODEL_FILE,)) -> Checkpoint:
    """The verified latest checkpoint of `run_dir` (a run dir or a checkpoint dir itself)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise MinigptError(f"run directory {run_dir} does not exist; train one with "
                           "`minigpt train --out DIR`")
    if not run_dir.is_dir():
        raise MinigptError(f"{run_dir} is not a run directory")
    if (run_dir / MANIFEST_FILE).is_file() and not (run_dir / MANIFEST_FILE).is_symlink():
        return verify_checkpoint(run_dir, need)
    ckpt = latest_checkpoint_dir(run_dir)
    if ckpt is None:
        if (run_dir / CONFIG_FILE).is_file():
            raise MinigptError(f"{run_dir} has no saved checkpoint yet (training stopped before "
                               "the first save); continue it with `minigpt train --out "
                               f"{run_dir} --resume`")
        raise MinigptError(f"{run_dir} is not a minigpt run directory (no {CKPT_DIR}/{LATEST} "
                           f"and no {CONFIG_FILE}); train one with `minigpt train`")
    return verify_checkpoint(ckpt, need)


# --------------------------------------------------------------------------------------------
# Loading.


def load_model_weights(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    """Validate model.safetensors against `model` (names, dtypes, shapes, config hash) before
    reading any tensor data, then load it and re-tie aliased weights."""
    raw = raw_module(model)
    path = ckpt.path / MODEL_FILE
    header, meta = read_header(path, "weights")
    hint = "the weights do not belong to this config (different model shape?)"
    if meta.get("config_hash") and meta["config_hash"] != model_hash(ckpt.cfg.model):
        raise MinigptError(f"{path} was saved for a different model config "
                           f"(hash {meta['config_hash']} != {model_hash(ckpt.cfg.model)}); "
                           "the weights and config.yaml do not match")
    aliases = tied_aliases(raw)
    expected = {k: v for k, v in raw.state_dict().items() if k not in aliases}
    check_against(header, expected, path, hint)
    tensors = load_tensors(path)
    state = dict(tensors)
    for alias, canonical in aliases.items():
        state[alias] = tensors[canonical]
    raw.load_state_dict(state, strict=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str],
                         ckpt: Checkpoint) -> None:
    """Restore AdamW moments saved by optimizer_tensors (validated against the params)."""
    path = ckpt.path / OPTIM_FILE
    header, _ = read_header(path, "optimizer state")
    if not header:  # saved before the first step: nothing to restore
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    keys = sorted({k.rsplit(".", 1)[1] for k in header}) or ["exp_avg", "exp_avg_sq", "step"]
    expected = {}
    for name, p in zip(names, params):
        for key in keys:
            expected[f"{name}.{key}"] = (torch.empty((), dtype=torch.float32) if key == "step"
                                         else torch.empty(p.shape, dtype=p.dtype, device="meta"))
    check_against(header, expected, path, "the optimizer state does not match the model")
    tensors = load_tensors(path)
    sd = optimizer.state_dict()
    sd["state"] = {i: {key: tensors[f"{name}.{key}"] for key in keys}
                   for i, name in enumerate(names)}
    optimizer.load_state_dict(sd)


def read_trainer_state(ckpt: Checkpoint) -> dict:
    path = ckpt.path / STATE_FILE
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        raise MinigptError(f"{path} is missing or not valid JSON") from None
    if (not isinstance(state, dict) or not isinstance(state.get("step"), int)
            or isinstance(state["step"], bool) or state["step"] < 0):
        raise MinigptError(f"{path} is not a minigpt trainer state (no valid 'step')")
    return state


def load_run(run_dir: Path | None, device: str | torch.device = "cpu") -> LoadedRun:
    """Load a trained run for inference: the verified latest checkpoint's config, tokenizer and
    weights, model on `device` in eval mode. `run_dir=None` = the latest run under runs/.
    Every failure is a one-line MinigptError naming the file; nothing is unpickled."""
    from minigpt.device import resolve_device
    from minigpt.model import GPT
    from minigpt.tokenizer import Tokenizer

    run_dir = find_latest_run() if run_dir is None else Path(run_dir)
    dev = device if isinstance(device, torch.device) else resolve_device(str(device))
    ckpt = find_checkpoint(run_dir)
    cfg = ckpt.cfg
    if cfg.model.vocab_size <= 0:
        raise MinigptError(f"{ckpt.path / CONFIG_FILE}: model.vocab_size is {cfg.model.vocab_size}"
                           "; a trained run's config must record the real vocabulary size")
    tokenizer = Tokenizer.load(ckpt.path)
    if tokenizer.n_vocab > cfg.model.vocab_size:
        raise MinigptError(f"{ckpt.path}: the tokenizer has {tokenizer.n_vocab} tokens but "
                           f"model.vocab_size is {cfg.model.vocab_size}; files from different runs?")
    model = GPT(cfg.model)
    load_model_weights(model, ckpt)
    model.to(dev).eval()
    return LoadedRun(model=model, cfg=cfg, tokenizer=tokenizer, step=ckpt.step, run_dir=run_dir)


def find_latest_run(root: Path = Path("runs")) -> Path:
    """The run under `root` with the most recently committed checkpoint."""
    root = Path(root)
    best: tuple[float, Path] | None = None
    if root.is_dir():
        for d in root.iterdir():
            link = d / CKPT_DIR / LATEST
            try:
                mtime = link.lstat().st_mtime
            except OSError:
                continue
            if best is None or mtime > best[0]:
                best = (mtime, d)
    if best is None:
        raise MinigptError(f"no trained run found under {root}/ (looked for "
                           f"{root}/*/{CKPT_DIR}/{LATEST}); train one with `minigpt train`, or "
                           "pass --run DIR")
    return best[1]
