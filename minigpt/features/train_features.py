"""`minigpt features train`, as a library call: `train_features` collects layer L's z over the
run's data (or reads `--activations`), trains or resumes a TopK SAE on it, measures it on
held-out tokens and saves it (features.store). Every user input is checked before anything is
written: a bad value leaves no directory behind.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from minigpt.core.gpt import flops_per_token
from minigpt.cost import TRAIN_LIMIT_S, Work, check_flops
from minigpt.data.rows import HELD_OUT_FRACTION, held_out_count
from minigpt.errors import ArgumentError, MinigptError
from minigpt.events import Progress, SaeStarting, no_events
from minigpt.features import collect, store
from minigpt.features.fit import (
    Diverged,
    SaeSettings,
    TrainState,
    default_width,
    fit_sae,
    new_state,
)
from minigpt.files import check_new_path, read_only_dir, remove_stale_temps, shown
from minigpt.interp.sae import ce_recovered, quality
from minigpt.run.safetensors_io import DTYPE_SIZES, check_against, load_tensors, read_header

DEFAULT_TOKENS = 262_144     # activations to train on
DEFAULT_HELD_OUT = 32_768    # held-out tokens the quality is measured on


@dataclass
class Source:
    """What the SAE reads: a loaded run or model and its layer, or a file of activations."""

    loaded: object | None = None
    layer: int | None = None
    text_file: Path | None = None
    activations: Path | None = None
    tokens: int = DEFAULT_TOKENS
    held_out: int = DEFAULT_HELD_OUT

    def describe(self) -> str:
        if self.loaded is None:
            return f"activations {self.activations}"
        where = f"text {self.text_file}" if self.text_file else "its own data"
        return f"layer {self.layer}'s z of {self.loaded.label}, {where}"


@dataclass
class FeaturesResult:
    out: Path
    settings: SaeSettings
    info: dict = field(default_factory=dict)
    resumed_from: int = 0
    interrupted: str | None = None  # SIGINT / SIGTERM: stopped and saved at `step`
    step: int = 0


def check_layer(layer: int | None, loaded) -> None:
    """`layer` names a layer of the loaded model (ArgumentError otherwise)."""
    if layer is None:
        raise ArgumentError("layer", "is needed: the layer whose heads' outputs the SAE reads")
    n = loaded.cfg.model.n_layer
    if not 0 <= layer < n:
        raise ArgumentError("layer", f"the model has {n} layer{'s' if n != 1 else ''} "
                            f"(0..{n - 1}); got {layer}")


def check_out(out: Path, resume: bool) -> None:
    """`out` is new and can be made (its nearest existing parent a writable directory), or
    (with `resume`) an unfinished training's writable directory: said before any work."""
    path = check_new_path(out, "out")  # a parent that is a file, a loop, a name too long
    if path.exists() and not path.is_dir():
        raise ArgumentError("out", "exists and is not a directory; give another", subject=out)
    if path.is_dir():
        why = read_only_dir(path)
    else:
        parent = next(p for p in path.parents if p.exists())
        why = read_only_dir(parent)
        if why is not None:
            why = f"cannot be made: its parent {parent} {why.removeprefix('is ')}"
    if why is not None:
        raise ArgumentError("out", f"{why}; give a writable place", subject=out)
    if store.finished(out):
        raise ArgumentError("out", "already holds a finished SAE; give another directory "
                            "(or delete it)", subject=out)
    if out.is_dir() and any(out.iterdir()) and not resume:
        raise ArgumentError("out", "exists and is not empty; continue its training with "
                            "--resume or give another directory", subject=out)


MAX_ACTIVATION = 1e15  # larger values overflow float32 once squared and summed over a batch
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def activations_shape(path: Path) -> list[int]:
    """[n, d] of the one tensor of an activations file, from its header (read_activations'
    checks of the header: one tensor, 2-D, float, n >= 20, fitting in memory)."""
    header, _ = read_header(path, "activations")
    if len(header) != 1:
        names = shown(", ".join(header), 200)
        raise ArgumentError("activations", f"holds {len(header)} tensors ({names}); it must "
                            "hold one [n, d] tensor", subject=path)
    (info,) = header.values()
    shape = info["shape"]
    if len(shape) != 2 or info["dtype"] not in FLOAT_DTYPES:
        raise ArgumentError("activations", f"holds a {len(shape)}-D {info['dtype']} tensor; it "
                            "must be one 2-D float tensor [n, d]", subject=path)
    if shape[0] < 20 or shape[1] < 1:
        raise ArgumentError("activations", f"holds {shape[0]} rows of {shape[1]}; at "
                            f"least 20 are needed (the last {HELD_OUT_FRACTION:.0%} is held out)",
                            subject=path)
    nbytes = info["data_offsets"][1] - info["data_offsets"][0]
    store.check_fits_memory(path, nbytes, "activations", copies=2 + 4 / DTYPE_SIZES[info["dtype"]])
    return shape


def read_activations(path: Path) -> Tensor:
    """The one [n, d] float tensor of a safetensors file (n >= 20, d >= 1), its header checked
    (activations_shape) before it is read; values finite, below MAX_ACTIVATION, and not all
    rows the same."""
    activations_shape(path)
    (x,) = load_tensors(path).values()
    x = x.float()
    if not torch.isfinite(x).all():
        raise ArgumentError("activations", "holds NaN or infinite values", subject=path)
    big = float(x.abs().max())
    if big > MAX_ACTIVATION:
        raise ArgumentError("activations", f"holds values up to {big:.3g}: an SAE trains in "
                            "float32, where their squares overflow; scale them down (below "
                            f"{MAX_ACTIVATION:.0e})", subject=path)
    if bool((x == x[0]).all()):
        raise ArgumentError("activations", "holds the same row every time: nothing varies for "
                            "an SAE to learn", subject=path)
    return x


def gather(src: Source, seed: int, on_event) -> tuple[Tensor, Tensor, Tensor | None]:
    """(training activations, held-out activations, held-out rows of tokens or None)."""
    if src.loaded is None:
        x = read_activations(src.activations)
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
        cut = x.shape[0] - held_out_count(x.shape[0])
        return x[perm[:cut]], x[perm[cut:]], None
    rows = collect.run_rows(src.loaded, src.text_file)
    model = src.loaded.model
    out = []
    for split, n, salt in (("train", src.tokens, 0), ("val", src.held_out, 1)):
        r = collect.draw_rows(rows, split, n, (seed + salt) % 2**64)

        def report(done: int, split=split, total=r.shape[0]) -> None:
            on_event(Progress(f"z of {split}", done, total))

        out.append((collect.collect(model, r, src.layer, report), r))
    return out[0][0], out[1][0], out[1][1]


def train_features(src: Source, settings: SaeSettings, out: Path, *, resume: bool = False,
                   on_event=None, force: bool = False, stop=None) -> FeaturesResult:
    """Train (or, with `resume`, continue) an SAE on `src` into `out` (module docstring);
    refused before the work when its estimate does not fit (`check_features_cost`), unless
    `force`. `stop()` true after a step (a signal): the state is saved and the result says
    where it stopped. A failure in the work leaves `out` as it was (a new one removed)."""
    on_event = on_event or no_events
    settings.check()
    if src.loaded is not None:
        check_layer(src.layer, src.loaded)
    check_out(out, resume)
    for name in ("tokens", "held_out"):
        if getattr(src, name) < 1:
            raise ArgumentError(name, f"must be a positive number, got {getattr(src, name)}")
    d_in = (collect.z_width(src.loaded.cfg.model) if src.loaded is not None
            else activations_shape(src.activations)[1])
    s = settings.resolved(d_in)
    meta = {"settings": s.to_json(), "d_in": d_in, "source": src.describe()}
    saved = _saved_state(out, meta, s) if resume else None  # checked before any work
    if src.loaded is not None:
        check_features_cost(src, s, d_in, force=force)
        on_event(SaeStarting(src.describe(), out, s.dead_after))
    t0 = time.monotonic()
    x, held, held_rows = gather(src, settings.seed, on_event)
    if src.loaded is None:
        check_features_cost(src, s, d_in, x.shape[0] + held.shape[0], force=force)
        on_event(SaeStarting(src.describe(), out, s.dead_after))
    state = new_state(x, s)
    if saved is not None:
        state.load(saved)
    resumed, fresh = state.step, not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fit_sae(x, s, state, on_event=on_event, stop=stop,
                save=lambda st: store.save_state(out, st.tensors(), meta))
        if state.step < s.steps:  # stopped by a signal, the state saved
            return FeaturesResult(out, s, {}, resumed, interrupted="signal", step=state.step)
        check_finite_sae(state)
        info = _measure(src, state, held, held_rows, out)
        info.update(settings=s.to_json(), seconds=round(time.monotonic() - t0, 1),
                    train_rows=int(x.shape[0]), held_out_rows=int(held.shape[0]))
        store.save_sae(out, state.sae, _cfg(src, state), info)
    except MinigptError:
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return FeaturesResult(out, s, info, resumed, step=state.step)


def check_finite_sae(state: TrainState) -> None:
    """Every weight of the trained SAE is a finite number (Diverged otherwise)."""
    if not all(torch.isfinite(p).all() for p in state.sae.parameters()):
        raise Diverged(f"the SAE's weights are not finite numbers after step {state.step}: "
                       "the training diverged; lower --lr (0 = automatic) or scale the "
                       "activations")


def features_work(s: SaeSettings, d_in: int, rows: int, held_out: int, mcfg=None) -> Work:
    """What `train_features` does: collecting `rows` z of width `d_in` (a third of
    core.gpt.flops_per_token each, with the model `mcfg`; none for a file), `s.steps` steps
    of `s.batch_size` rows through the encoder and decoder (12 x width x d_in FLOPs a row,
    forward and backward), the held-out measures. Memory: the z, the SAE's two matrices with
    their gradients and Adam moments, a batch's latents."""
    width = s.width
    per_token = flops_per_token(mcfg, mcfg.block_size) / 3 if mcfg is not None else 0.0
    flops = (rows * per_token + s.steps * s.batch_size * 12.0 * width * d_in
             + held_out * (4.0 * width * d_in + 3 * per_token))
    held = 4.0 * rows * d_in + 32.0 * width * d_in + 12.0 * s.batch_size * width
    return Work(flops, held)


def check_features_cost(src: Source, s: SaeSettings, d_in: int, rows: int | None = None, *,
                        force: bool = False) -> None:
    """`features_work` of the resolved settings `s` on inputs `d_in` wide checked by cost's
    rule (`cost.check_flops`: a week, the training bound; a share of the free memory), naming
    the number furthest above its default (--width, --tokens, --held-out, --batch-size,
    --steps; a file's rows are what it holds) and the largest value of it that fits with the
    others as given, unless `force`."""
    mcfg = src.loaded.cfg.model if src.loaded is not None else None
    device = src.loaded.device if src.loaded is not None else "cpu"
    given = {"width": s.width, "steps": s.steps, "batch_size": s.batch_size}
    usual = {"width": default_width(d_in), "steps": 2000, "batch_size": 1024}
    if mcfg is not None:
        given.update(tokens=src.tokens, held_out=src.held_out)
        usual.update(tokens=DEFAULT_TOKENS, held_out=DEFAULT_HELD_OUT)
    rows = rows if rows is not None else src.tokens + src.held_out
    name = max(given, key=lambda k: given[k] / usual[k])

    def work_of(v: int) -> Work:
        n = {**given, name: v}
        at = replace(s, width=n["width"], steps=n["steps"], batch_size=n["batch_size"])
        if mcfg is None:
            return features_work(at, d_in, rows, held_out_count(rows))
        return features_work(at, d_in, n["tokens"] + n["held_out"], n["held_out"], mcfg)

    others = ", ".join(f"--{k.replace('_', '-')} {v:,}" for k, v in given.items() if k != name)
    check_flops(name, given[name], work_of, device=device, force=force, limit_s=TRAIN_LIMIT_S,
                limit_what="an SAE's training may take",
                what=f"an SAE of {given['width']:,} features on {rows:,} rows of width {d_in:,}, "
                f"{s.steps:,} steps of {s.batch_size:,}", none_fit=f"lower {others} too")


def _saved_state(out: Path, meta: dict, s: SaeSettings) -> dict[str, Tensor] | None:
    """The training state saved in `out`, checked (None when none was saved): a MinigptError
    when it was started with other settings or inputs, or when it does not hold a training
    state this one can continue (every tensor's dtype and shape, the weights finite, the
    generator's state one torch takes, the step within --steps). What a killed save left beside
    it (temps of processes gone) is deleted."""
    for name in (store.STATE_FILE, store.WEIGHTS_FILE, store.CFG_FILE, store.INFO_FILE):
        remove_stale_temps(out / name)
    if not (out / store.STATE_FILE).is_file():
        return None
    path = out / store.STATE_FILE
    header, saved = store.load_state_header(out)
    if saved != meta:
        raise MinigptError(f"{path}: was started with other settings or inputs ({saved}; now "
                           f"{meta}); give the same flags, or another --out")
    template = new_state(torch.zeros(1, meta["d_in"]), s)
    check_against(header, template.saved_form(), path, "not the training state of these "
                  "settings; delete the directory or give another --out")
    tensors = store.load_tensors(path)
    damaged = f"{path}: damaged ({{}}); delete the directory or give another --out"
    if not all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point()):
        raise MinigptError(damaged.format("it holds NaN or infinite values"))
    step = int(tensors["step"][0])
    if not 0 <= step <= s.steps:
        raise MinigptError(damaged.format(f"step {step} is not within 0..--steps {s.steps}"))
    if bool((tensors["since"] < 0).any()):
        raise MinigptError(damaged.format("a negative count of rows since a feature fired"))
    try:
        template.load(tensors)
    except RuntimeError as e:  # a generator state torch does not take
        raise MinigptError(damaged.format(f"its generator state is not one torch made: {e}")
                           ) from None
    return tensors


def _measure(src: Source, state: TrainState, held: Tensor, held_rows: Tensor | None,
             out: Path) -> dict:
    """Held-out quality and, for a model's layer, the losses clean / zero-ablated / spliced,
    and the run it read: its path from the SAE's directory and absolute, and its weights'
    sha256 (features show finds it by these, never from the working directory)."""
    sae = state.sae.eval()
    q = quality(sae, held)
    info = {"quality": {k: _finite(v) for k, v in q.to_json().items()},
            "density": [round(float(d), 6) for d in q.density]}
    if src.loaded is not None:
        with torch.no_grad():
            clean, zero, spliced = collect.spliced_losses(
                src.loaded.model, held_rows, src.layer, sae,
                own_output=src.loaded.cfg.data.source == "program")
        mcfg = src.loaded.cfg.model
        info.update(
            ce={"clean": clean, "zero_ablated": zero, "sae": spliced,
                "recovered": _finite(ce_recovered(clean, zero, spliced))},
            layer=src.layer, n_head=mcfg.n_head, d_head=mcfg.head_dim, **_run_of(src.loaded, out),
            model=None if src.loaded.run_dir is not None else src.loaded.source,
            step=src.loaded.step, text_file=str(src.text_file) if src.text_file else None)
    else:
        info.update(activations=str(src.activations))
    return info


def _run_of(loaded, out: Path) -> dict:
    """features.json's record of the run: `run` (absolute), `run_from_sae` (relative to the
    SAE's directory `out`), `weights_sha256`; all None for an imported model."""
    if loaded.run_dir is None:
        return {"run": None, "run_from_sae": None, "weights_sha256": None}
    run = Path(loaded.run_dir).resolve()
    return {"run": str(run), "run_from_sae": os.path.relpath(run, Path(out).resolve()),
            "weights_sha256": loaded.weights_sha256}


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _cfg(src: Source, state: TrainState) -> dict:
    if src.loaded is None:
        return store.sae_cfg(state.sae, None, "", 0, str(src.activations))
    return store.sae_cfg(state.sae, src.layer, src.loaded.source,
                         src.loaded.cfg.model.block_size,
                         str(src.text_file) if src.text_file else _dataset(src.loaded.cfg))


def _dataset(cfg) -> str:
    return {"induction": "synthetic induction rows",
            "program": "random inputs of the program"}.get(cfg.data.source, cfg.data.corpus)
