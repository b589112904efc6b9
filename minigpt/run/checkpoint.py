"""Checkpoints on disk: the commit protocol, then saving, finding and verifying.

The on-disk commit protocol (the file names are in `layout.py`). Save: write every file into
`checkpoints/.tmp-step-N-<pid>/`, fsync each, write manifest.json last, fsync, rename the
directory to `step-N`, fsync, make a temp symlink to it, run the caller's `before_commit`,
then atomically replace the `latest` symlink with it (os.replace) and fsync: that rename is
the commit. Only then are older step directories deleted. A kill at any point leaves `latest`
pointing at a complete, manifest-verified checkpoint (the previous one until the commit);
leftovers (`.tmp-*`, uncommitted `step-*`) are ignored by loaders and cleaned by the next
commit. A committed checkpoint is never overwritten. Where `latest` is missing or is not a link
(a run copied without its links), the newest step directory holding a manifest is the committed
one for loading; resuming such a run first needs the link back (resume.py says how).
Verify: manifest.json present and parseable, every file it lists with the recorded size and
sha256 (a flipped bit is caught), weights sniffed for pickle/zip before anything is parsed.
Nothing here unpickles; loading the tensors into a model is `load.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minigpt import __version__
from minigpt.config import Config, from_dict, model_hash, to_yaml
from minigpt.errors import ArgumentError, MinigptError, WriteError
from minigpt.files import (
    ReadError,
    disk_error,
    fsync_dir,
    load_json,
    load_yaml,
    open_file,
    write_file_synced,
)
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
    TRAIN_WEIGHTS_FILE,
    complete_steps,
    latest_checkpoint_dir,
    step_dir_name,
    step_of,
)
from minigpt.run.safetensors_io import read_header, tensors_to_bytes

if TYPE_CHECKING:
    from minigpt.data.tokenizer import Tokenizer

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
    parameters (train.weights.OptimizerChain: `param_groups` and `state` span every part), so
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


def save_checkpoint(run_dir: Path, *, step: int, model: torch.nn.Module, cfg: Config,
                    tokenizer: Tokenizer, trainer_state: dict,
                    optimizer: torch.optim.Optimizer | None = None,
                    param_names: list[str] | None = None, keep: int = 1,
                    before_commit: Callable[[], None] | None = None,
                    train_weights: torch.nn.Module | None = None) -> Path:
    """Write a complete checkpoint for `step` and commit it (see the module docstring), then
    delete all but the newest `keep` committed checkpoints. Returns the committed directory.
    `model` is what model.safetensors holds (the weights every reader uses); `train_weights`,
    if given (train.ema: the live weights beside their average), goes to
    train_weights.safetensors for --resume.

    `before_commit()` runs once the checkpoint is complete on disk, just before the commit
    (the trainer makes its metrics log durable up to `step` there). A failure before the commit
    (disk full, permissions, an obstacle in the way) removes what this save made and raises
    MinigptError: the previous checkpoint stays committed and nothing else was touched."""
    root = Path(run_dir) / CKPT_DIR
    prev = latest_checkpoint_dir(run_dir)  # the committed checkpoint this one follows
    final = root / step_dir_name(step)
    if final == prev:
        return final  # this step is committed already
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    made: list[Path] = []  # what this save created: removed again unless it commits
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # this pid's own leftover, if any
        tmp.mkdir()
        made.append(tmp)
        _write_checkpoint(tmp, step, model, cfg, tokenizer, trainer_state, optimizer,
                          param_names, train_weights)
        if final.exists():  # a leftover of a save that never committed: not referenced
            if prev is not None and step <= step_of(prev.name):
                raise RuntimeError(f"{final} is a committed checkpoint: never overwritten")
            shutil.rmtree(final)
        os.rename(tmp, final)
        made[0] = final
        fsync_dir(root)
        link = root / f".{LATEST}.tmp-{os.getpid()}"
        link.unlink(missing_ok=True)
        os.symlink(final.name, link)
        made.append(link)
        if before_commit is not None:
            before_commit()
        os.replace(link, root / LATEST)  # the commit: readers see the old or the new target
        made.clear()
        fsync_dir(root)
    except (OSError, WriteError) as e:
        err = e if isinstance(e, WriteError) else disk_error(e, Path(e.filename or tmp))
        kept = (f"the previous checkpoint ({prev.name}) is intact" if prev is not None
                else "no checkpoint was saved")
        raise MinigptError(f"saving checkpoint step {step} failed: {err}; {kept}") from None
    finally:
        for path in made:
            _remove(path)
    _cleanup(root, final, prev, keep)
    _ensure_top_links(run_dir)
    return final


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _write_checkpoint(directory: Path, step: int, model: torch.nn.Module, cfg: Config,
                      tokenizer: Tokenizer, trainer_state: dict,
                      optimizer: torch.optim.Optimizer | None, param_names: list[str] | None,
                      train_weights: torch.nn.Module | None = None) -> None:
    """Every file of a checkpoint into `directory`, each fsynced, manifest.json last."""
    raw = raw_module(model)
    meta = {"format": FORMAT, "step": str(step), "config_hash": model_hash(cfg.model),
            "minigpt_version": __version__, "tied": json.dumps(tied_aliases(raw)),
            "tokenizer_hash": str(getattr(tokenizer, "hash", ""))}
    files: dict[str, bytes] = {MODEL_FILE: tensors_to_bytes(model_tensors(raw), meta)}
    if train_weights is not None:
        files[TRAIN_WEIGHTS_FILE] = tensors_to_bytes(model_tensors(train_weights), meta)
    for name in (MODEL_FILE, TRAIN_WEIGHTS_FILE):
        if name in files:
            write_file_synced(directory / name, files[name])
    if optimizer is not None:
        files[OPTIM_FILE] = tensors_to_bytes(optimizer_tensors(optimizer, param_names or []),
                                             {"format": FORMAT, "step": str(step)})
    files[STATE_FILE] = (json.dumps(trainer_state, indent=1) + "\n").encode()
    files[CONFIG_FILE] = to_yaml(cfg).encode()
    for name in (OPTIM_FILE, STATE_FILE, CONFIG_FILE):
        if name in files:
            write_file_synced(directory / name, files[name])
    tokenizer.save(directory)
    manifest = {"format": FORMAT, "step": step, "minigpt_version": __version__, "files": {}}
    for p in sorted(directory.iterdir()):
        data = files.get(p.name)
        data = data if data is not None else p.read_bytes()
        manifest["files"][p.name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                     "bytes": len(data)}
    # The manifest is written last: a directory without it was never finished.
    write_file_synced(directory / MANIFEST_FILE,
                      (json.dumps(manifest, indent=1) + "\n").encode())
    fsync_dir(directory)


def _cleanup(root: Path, committed: Path, prev: Path | None, keep: int) -> None:
    """Keep the newest `keep` checkpoints of the run (those committed before this save, up to
    `prev`, and `committed`); remove older ones, temp dirs, leftovers of saves that never
    committed (step dirs after `prev` but `committed`) and stale temp links."""
    last = step_of(prev.name) if prev is not None else -1
    lineage = [p.name for s, p in complete_steps(root) if s <= last] + [committed.name]
    kept = set(lineage[-keep:]) | {committed.name, LATEST}
    for p in root.iterdir():
        if p.name in kept:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith("."):
            p.unlink(missing_ok=True)


def kept_steps(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints a run keeps (train.keep_checkpoints), oldest first."""
    latest = latest_checkpoint_dir(run_dir)
    if latest is None:
        return []
    last = step_of(latest.name)
    return [s for s, _ in complete_steps(Path(run_dir) / CKPT_DIR) if s <= last]


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
        manifest = load_json(mpath)
    except ReadError:  # unreadable, not UTF-8, not JSON within the limits (files.parse_json)
        manifest = None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not isinstance(step, int) or isinstance(step, bool):
        raise MinigptError(f"{mpath} is corrupted (not a minigpt manifest)")
    for name in (*need, CONFIG_FILE):
        if name not in files or not (ckpt_dir / name).is_file():
            raise MinigptError(f"{ckpt_dir / name} is missing from the checkpoint")
    for name, info in files.items():
        path = ckpt_dir / Path(name).name
        if not path.is_file():
            raise MinigptError(f"{path} is missing from the checkpoint")
        if path.suffix == ".safetensors":
            read_header(path, "weights")  # pickle/zip/truncation get their own message
        check_listed(path, info)
    cpath = ckpt_dir / CONFIG_FILE
    cfg = from_dict(load_yaml(cpath), str(cpath))
    return Checkpoint(path=ckpt_dir, step=step, cfg=cfg, files=files)


def check_listed(path: Path, info: object) -> None:
    """`path` is the file its checkpoint's manifest lists (`info`: {"bytes", "sha256"});
    MinigptError naming it as corrupted otherwise. Size first (cheap, and a huge crafted file
    is never read), then the hash in 1 MiB chunks."""
    if not isinstance(info, dict) or ("bytes" in info and path.stat().st_size != info["bytes"]):
        raise MinigptError(f"{path} is corrupted: its size does not match {MANIFEST_FILE}; "
                           "restore it or retrain")
    if _sha256_file(path) != info.get("sha256"):
        raise MinigptError(f"{path} is corrupted: its sha256 does not match {MANIFEST_FILE}; "
                           "restore it or retrain")


def listed_config(ckpt_dir: Path) -> None:
    """A checkpoint's config.yaml checked against its manifest before anything reads it (a
    file cut short would otherwise read as the defaults where it was cut); a manifest that
    cannot be read or does not list it is left to verify_checkpoint's messages."""
    try:
        files = load_json(Path(ckpt_dir) / MANIFEST_FILE).get("files")
    except (ReadError, AttributeError):
        return
    path = Path(ckpt_dir) / CONFIG_FILE
    if isinstance(files, dict) and CONFIG_FILE in files and path.is_file():
        check_listed(path, files[CONFIG_FILE])


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_file(path) as fh:
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
