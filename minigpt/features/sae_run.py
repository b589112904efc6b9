"""Which model an SAE is shown on (`features show --sae DIR`): the run or model given, else the
one its features.json records, found from the SAE's directory (never from the working
directory, where another run may have the same relative path), at the step it was trained on,
and checked to hold the weights it was trained on (features.json's `weights_sha256`). The SAE
itself is read last: its cfg.json's sizes are checked against the model and the free memory
before a tensor is read (features.store).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.errors import ArgumentError, MinigptError
from minigpt.features import store
from minigpt.interp.sae import TopKSAE


@dataclass
class Opened:
    """An SAE with the model it is shown on, and what to tell the user about the choice."""

    loaded: object
    sae: TopKSAE
    info: dict
    notes: list[str] = field(default_factory=list)


def recorded_run(sae_dir: Path, info: dict) -> Path:
    """The run directory features.json records, as seen from here: `run_from_sae` (the run's
    path relative to the SAE's directory) when that is a directory, else `run` when absolute.
    An older file's relative `run` (relative to where it was trained) is taken only when the SAE
    lies inside it (the default --out); elsewhere it is refused: it may name another run."""
    where = sae_dir / store.INFO_FILE
    rel, run = info.get("run_from_sae"), info.get("run")
    tried = []
    if rel is not None:
        cand = Path(os.path.normpath(sae_dir / rel))
        if cand.is_dir():
            return cand
        tried.append(str(cand))
    if run is not None and Path(run).is_absolute():
        if Path(run).is_dir():
            return Path(run)
        tried.append(run)
    if run is not None and not tried and Path(run).is_dir() and \
            Path(run).resolve() in Path(sae_dir).resolve().parents:
        return Path(run)  # an older file, in its run (the default --out): that run
    if run is not None and not tried:
        raise MinigptError(f"{where}: names its run by a path relative to where it was trained "
                           f"({run}), which may be another run from here; give --run DIR")
    raise MinigptError(f"{where}: its run is not there (looked at {' and '.join(tried)}); give "
                       "--run DIR (or --model) to show the SAE on it")


def _model_spec(sae_dir: Path, info: dict, run, model, checkpoint):
    """(run, model, checkpoint, whether they came from features.json)."""
    if run is not None or model is not None:
        return run, model, checkpoint, False
    if info.get("run") is None and info.get("model") is None:
        raise ArgumentError("sae", "was trained on --activations: it has no model, heads or "
                            "tokens to show", subject=sae_dir)
    if info.get("run") is None:
        return None, info["model"], None, True
    step = checkpoint if checkpoint is not None else info.get("step")
    return recorded_run(sae_dir, info), None, step, checkpoint is None


def _load(run, model, checkpoint, device, recorded: bool, sae_dir: Path, info: dict):
    from minigpt.infer.inputs import load_run_or_model
    from minigpt.run.checkpoint import kept_steps

    try:
        return load_run_or_model(run, model, device, checkpoint)
    except ArgumentError as e:
        if not recorded or e.param != "checkpoint":
            raise
        kept = ", ".join(map(str, kept_steps(run)))
        raise MinigptError(f"{sae_dir / store.INFO_FILE}: the SAE was trained on step "
                           f"{checkpoint} of {run}, which the run no longer keeps (kept: "
                           f"{kept}); give --checkpoint STEP to show it on another step"
                           ) from None


def open_sae(sae_dir: Path, run: Path | None, model: str | None, checkpoint: int | None,
             device: str) -> Opened:
    """The SAE in `sae_dir` and the model it is shown on (module docstring)."""
    sae_dir = Path(sae_dir)
    store.check_sae_dir(sae_dir)
    info = store.read_info(sae_dir)
    store.read_cfg(sae_dir)  # a broken cfg.json is said before the model loads
    run, model, checkpoint, recorded = _model_spec(sae_dir, info, run, model, checkpoint)
    loaded = _load(run, model, checkpoint, device, recorded, sae_dir, info)
    notes = []
    sha = info.get("weights_sha256")
    if sha is not None and loaded.weights_sha256 not in (None, sha):
        if recorded:
            raise MinigptError(f"{sae_dir / store.INFO_FILE}: {loaded.label} holds other "
                               "weights than the SAE was trained on (their sha256 differs: "
                               "another run at that path?); give --run DIR and --checkpoint "
                               "STEP of the run it was trained on")
        notes.append(f"the SAE was trained on other weights than {loaded.label}'s (sha256 "
                     f"{sha[:12]}...); its features are shown on these")
    return Opened(loaded, read_for(sae_dir, loaded)[0], info, notes)


def read_for(sae_dir: Path, loaded) -> tuple[TopKSAE, dict]:
    """The SAE in `sae_dir` and its features.json, for the loaded model: cfg.json's width
    checked against the model's before the weights are read."""
    store.check_sae_dir(sae_dir)
    info = store.read_info(sae_dir)
    _, d_in, d_sae, k = store.read_cfg(sae_dir)
    m = loaded.cfg.model
    if d_in != m.n_head * m.head_dim:
        raise MinigptError(f"{sae_dir / store.CFG_FILE}: an SAE of {d_in} inputs does not fit "
                           f"{loaded.label} ({m.n_head} heads x {m.head_dim} = "
                           f"{m.n_head * m.head_dim} wide); give the run or model it was "
                           "trained on")
    return store.load_weights(sae_dir, d_in, d_sae, k), info
