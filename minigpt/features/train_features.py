"""`minigpt features train`, as a library call: `train_features` collects layer L's z over the
run's data (or reads `--activations`), trains or resumes a TopK SAE on it, measures it on
held-out tokens and saves it (features.store). Every user input is checked before anything is
written: a bad value leaves no directory behind.
"""

from __future__ import annotations

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
from minigpt.features.fit import SaeSettings, TrainState, default_width, fit_sae, new_state
from minigpt.interp.sae import ce_recovered, quality
from minigpt.run.safetensors_io import load_tensors

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


def check_layer(layer: int | None, loaded) -> None:
    """`layer` names a layer of the loaded model (ArgumentError otherwise)."""
    if layer is None:
        raise ArgumentError("layer", "is needed: the layer whose heads' outputs the SAE reads")
    n = loaded.cfg.model.n_layer
    if not 0 <= layer < n:
        raise ArgumentError("layer", f"the model has {n} layer{'s' if n != 1 else ''} "
                            f"(0..{n - 1}); got {layer}")


def check_out(out: Path, resume: bool) -> None:
    """`out` is new, or (with `resume`) an unfinished training's directory."""
    if out.exists() and not out.is_dir():
        raise ArgumentError("out", "exists and is not a directory; give another", subject=out)
    if store.finished(out):
        raise ArgumentError("out", "already holds a finished SAE; give another directory "
                            "(or delete it)", subject=out)
    if out.is_dir() and any(out.iterdir()) and not resume:
        raise ArgumentError("out", "exists and is not empty; continue its training with "
                            "--resume or give another directory", subject=out)


def read_activations(path: Path) -> Tensor:
    """The one [n, d] float tensor of a safetensors file (n >= 20, d >= 1)."""
    tensors = load_tensors(path)
    if len(tensors) != 1:
        names = ", ".join(tensors)
        raise ArgumentError("activations", f"holds {len(tensors)} tensors ({names}); it must "
                            "hold one [n, d] tensor", subject=path)
    (x,) = tensors.values()
    if x.dim() != 2 or not x.is_floating_point():
        raise ArgumentError("activations", f"holds a {x.dim()}-D {x.dtype} tensor; it must "
                            "be one 2-D float tensor [n, d]", subject=path)
    if x.shape[0] < 20 or x.shape[1] < 1:
        raise ArgumentError("activations", f"holds {x.shape[0]} rows of {x.shape[1]}; at "
                            f"least 20 are needed (the last {HELD_OUT_FRACTION:.0%} is held out)",
                            subject=path)
    x = x.float()
    if not torch.isfinite(x).all():
        raise ArgumentError("activations", "holds NaN or infinite values", subject=path)
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
        r = collect.draw_rows(rows, split, n, seed + salt)

        def report(done: int, split=split, total=r.shape[0]) -> None:
            on_event(Progress(f"z of {split}", done, total))

        out.append((collect.collect(model, r, src.layer, report), r))
    return out[0][0], out[1][0], out[1][1]


def train_features(src: Source, settings: SaeSettings, out: Path, *, resume: bool = False,
                   on_event=None, force: bool = False) -> FeaturesResult:
    """Train (or, with `resume`, continue) an SAE on `src` into `out` (module docstring);
    refused before the work when its estimate does not fit (`check_features_cost`), unless
    `force`."""
    on_event = on_event or no_events
    settings.check()
    s = None  # the settings resolved for the input's width, once it is known
    if src.loaded is not None:
        check_layer(src.layer, src.loaded)
        s = settings.resolved(collect.z_width(src.loaded.cfg.model))
    check_out(out, resume)
    for name in ("tokens", "held_out"):
        if getattr(src, name) < 1:
            raise ArgumentError(name, f"must be a positive number, got {getattr(src, name)}")
    if s is not None:
        check_features_cost(src, s, collect.z_width(src.loaded.cfg.model), force=force)
        on_event(SaeStarting(src.describe(), out))
    t0 = time.monotonic()
    x, held, held_rows = gather(src, settings.seed, on_event)
    if s is None:
        s = settings.resolved(x.shape[1])
        check_features_cost(src, s, x.shape[1], x.shape[0] + held.shape[0], force=force)
        on_event(SaeStarting(src.describe(), out))
    state, meta = new_state(x, s), {"settings": s.to_json(), "d_in": x.shape[1],
                                    "source": src.describe()}
    resumed = _resume(out, state, meta) if resume else 0
    out.mkdir(parents=True, exist_ok=True)
    fit_sae(x, s, state, on_event=on_event,
              save=lambda st: store.save_state(out, st.tensors(), meta))
    info = _measure(src, state, held, held_rows)
    info.update(settings=s.to_json(), seconds=round(time.monotonic() - t0, 1),
                train_rows=int(x.shape[0]), held_out_rows=int(held.shape[0]))
    store.save_sae(out, state.sae, _cfg(src, state), info)
    return FeaturesResult(out, s, info, resumed)


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


def _resume(out: Path, state: TrainState, meta: dict) -> int:
    """Load the training state saved in `out` into `state` (the step it was at; 0 when none
    was saved); a MinigptError when it was started with other settings or inputs."""
    if not (out / store.STATE_FILE).is_file():
        return 0
    tensors, saved = store.load_state(out)
    if saved != meta:
        raise MinigptError(f"{out / store.STATE_FILE}: was started with other settings or "
                           f"inputs ({saved}; now {meta}); give the same flags, or another "
                           "--out")
    expect = state.tensors()
    for name, t in expect.items():
        if name not in tensors or tensors[name].shape != t.shape:
            raise MinigptError(f"{out / store.STATE_FILE}: tensor {name} missing or of "
                               "another shape; delete the directory or give another --out")
    state.load(tensors)
    return state.step


def _measure(src: Source, state: TrainState, held: Tensor, held_rows: Tensor | None) -> dict:
    """Held-out quality and, for a model's layer, the losses clean / zero-ablated / spliced."""
    sae = state.sae.eval()
    q = quality(sae, held)
    info = {"quality": q.to_json(), "density": [round(float(d), 6) for d in q.density]}
    if src.loaded is not None:
        with torch.no_grad():
            clean, zero, spliced = collect.spliced_losses(
                src.loaded.model, held_rows, src.layer, sae,
                own_output=src.loaded.cfg.data.source == "program")
        mcfg = src.loaded.cfg.model
        info.update(
            ce={"clean": clean, "zero_ablated": zero, "sae": spliced,
                "recovered": _finite(ce_recovered(clean, zero, spliced))},
            layer=src.layer, n_head=mcfg.n_head, d_head=mcfg.head_dim,
            run=str(src.loaded.run_dir) if src.loaded.run_dir is not None else None,
            model=None if src.loaded.run_dir is not None else src.loaded.source,
            step=src.loaded.step, text_file=str(src.text_file) if src.text_file else None)
    else:
        info.update(activations=str(src.activations))
    return info


def _finite(v: float) -> float | None:
    import math

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
