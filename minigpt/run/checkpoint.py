"""Checkpoints on disk: the commit protocol, then saving, finding and verifying.

The on-disk commit protocol (the file names are in `layout.py`). Save: write every file into `checkpoints/.tmp-step-N-<pid>/`, fsync each, write
manifest.json last, fsync, rename the directory to `step-N`, fsync, then atomically replace
the `latest` symlink (os.replace of a temp symlink) and fsync: that rename is the commit. Only
then are older step directories deleted. A kill at any point leaves `latest` pointing at a
complete, manifest-verified checkpoint (the previous one until the commit); leftovers
(`.tmp-*`, uncommitted `step-*`) are ignored by loaders and cleaned by the next save.
Verify: manifest.json present and parseable, every file it lists with the recorded size and
sha256 (a flipped bit is caught), weights sniffed for pickle/zip before anything is parsed.
Nothing here unpickles; loading the tensors into a model is `load.py`.
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
from minigpt.config import Config, from_dict, model_hash, to_yaml
from minigpt.errors import ArgumentError, MinigptError
from minigpt.files import disk_error, fsync_dir, parse_yaml, write_file_synced
from minigpt.run.layout import (
    CKPT_DIR,
    CONFIG_FILE,
    FORMAT,
    LATEST,
    MANIFEST_FILE,
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILE,
    TOP_LINKS,
    step_dir_name,
)
from minigpt.run.safetensors_io import read_header, tensors_to_bytes

if TYPE_CHECKING:
    from minigpt.tokenizer import Tokenizer

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
    """Flatten the optimizer state as `<param name>.<key>` (AdamW: exp_avg, exp_avg_sq, step;
    Muon: momentum_buffer); `names` lists the parameter names in optimizer order
    (param_groups concatenated). `optimizer` may be a chain of optimizers over disjoint
    parameters (train.optim.OptimizerChain: `param_groups` and `state` span every part), so
    one file holds every part's state under unique parameter names."""
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
                    param_names: list[str] | None = None, keep: int = 1) -> Path:
    """Write a complete checkpoint for `step` and commit it (see the module docstring), then
    delete all but the newest `keep` committed checkpoints. Returns the committed directory.
    A write failure (disk full, permissions) removes the partial directory and raises
    MinigptError; the previous checkpoint stays committed."""
    run_dir = Path(run_dir)
    root = run_dir / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
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
    _cleanup(root, final.name, keep)
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


def _step_of(name: str) -> int | None:
    return int(name[5:]) if re.fullmatch(r"step-\d{6,}", name) else None


def _cleanup(root: Path, committed: str, keep: int) -> None:
    """Keep the newest `keep` committed checkpoints (complete step dirs up to the one just
    committed); remove older ones, temp dirs, uncommitted leftovers and stale links."""
    last = _step_of(committed)
    done = sorted((s, p.name) for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                  and (s := _step_of(p.name)) is not None and s <= last
                  and (p / MANIFEST_FILE).is_file())
    kept = {name for _, name in done[-keep:]} | {committed, LATEST}
    for p in root.iterdir():
        if p.name in kept:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith("."):
            p.unlink(missing_ok=True)


def discard_uncommitted(run_dir: Path) -> None:
    """Before a resume: remove step dirs newer than the committed one (renamed by a save that
    was killed before its commit), so they are never mistaken for kept checkpoints later."""
    root = Path(run_dir) / CKPT_DIR
    latest = latest_checkpoint_dir(run_dir)
    last = _step_of(latest.name) if latest is not None else -1
    for p in root.iterdir() if root.is_dir() else ():
        s = _step_of(p.name)
        if s is not None and s > last and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def kept_steps(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints a run keeps (train.keep_checkpoints), oldest first."""
    root = Path(run_dir) / CKPT_DIR
    latest = latest_checkpoint_dir(run_dir)
    if latest is None:
        return []
    last = _step_of(latest.name)
    return sorted(s for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                  and (s := _step_of(p.name)) is not None and s <= last
                  and (p / MANIFEST_FILE).is_file())


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


def find_checkpoint(run_dir: Path, need: tuple[str, ...] = (MODEL_FILE,),
                    step: int | None = None) -> Checkpoint:
    """The verified latest checkpoint of `run_dir` (a run dir or a checkpoint dir itself), or
    its kept checkpoint of `step` (ArgumentError `checkpoint` listing the kept steps)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise MinigptError(f"run directory {run_dir} does not exist; train one with "
                           "`minigpt train --out DIR`")
    if not run_dir.is_dir():
        raise MinigptError(f"{run_dir} is not a run directory")
    if (run_dir / MANIFEST_FILE).is_file() and not (run_dir / MANIFEST_FILE).is_symlink():
        return verify_checkpoint(run_dir, need)
    ckpt = latest_checkpoint_dir(run_dir)
    if ckpt is not None and step is not None:
        kept = kept_steps(run_dir)
        if step not in kept:
            raise ArgumentError("checkpoint", f"{run_dir} keeps no checkpoint of that step; "
                                f"kept: {', '.join(map(str, kept))} (train.keep_checkpoints "
                                "sets how many are kept)", subject=step)
        ckpt = ckpt.parent / step_dir_name(step)
    if ckpt is None:
        if (run_dir / CONFIG_FILE).is_file():
            raise MinigptError(f"{run_dir} has no saved checkpoint yet (training stopped before "
                               "the first save); continue it with `minigpt train --out "
                               f"{run_dir} --resume`")
        raise MinigptError(f"{run_dir} is not a minigpt run directory (no {CKPT_DIR}/{LATEST} "
                           f"and no {CONFIG_FILE}); train one with `minigpt train`")
    return verify_checkpoint(ckpt, need)
