"""`minigpt features train` and `minigpt features show --sae DIR`: sparse autoencoders on one
attention layer's head outputs (minigpt.features), trained with a progress bar and shown as rich
tables, JSON, a PNG of features x heads and an HTML page."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import _Group, app, err_console, out_console, say
from minigpt.display import duration, head_name, printable
from minigpt.errors import ArgumentError

features_app = typer.Typer(cls=_Group, no_args_is_help=True, rich_markup_mode=None,
                           help="Sparse autoencoders on the heads' outputs of one layer: "
                           "train one, show its features.")
app.add_typer(features_app, name="features")

LayerOpt = Annotated[int | None, typer.Option(
    "--layer", metavar="LAYER", help="The layer whose heads' outputs z (all heads, n_head x "
    "d_head wide) the SAE reads. Required with --run / --model.")]
ActivationsOpt = Annotated[Path | None, typer.Option(
    "--activations", help="Train on the one [n, d] tensor of this safetensors file instead "
    "of a model's layer (a tenth is held out).")]
WidthOpt = Annotated[int | None, typer.Option(
    "--width", help="Features (latents) of the SAE. Default: 8 x the input's width "
    "(n_head x d_head).")]
KOpt = Annotated[int, typer.Option("--k", help="Features active per token (TopK).")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Optimizer steps.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Tokens per step.")]
LrOpt = Annotated[float, typer.Option(
    "--lr", help="Adam's learning rate. 0 = 2e-4 x sqrt(16384 / width), at most 2e-3.")]
TokensOpt = Annotated[int, typer.Option(
    "--tokens", help="Tokens whose z the SAE trains on (drawn from the run's training split "
    "or the text's first 90%).")]
HeldOutOpt = Annotated[int, typer.Option(
    "--held-out", help="Held-out tokens (the validation split, or the text's last 10%) the "
    "quality and the loss recovered are measured on.")]
SeedOpt = Annotated[int, typer.Option(
    "--seed", help="Seed of the tokens drawn, the SAE's initial weights and its batches.")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", metavar=opt.OUT, help="The SAE's directory (SAELens's layout). Default: "
    "<run>/features/layer<L>.")]
ResumeOpt = Annotated[bool, typer.Option(
    "--resume", help="Continue the unfinished training in --out (same flags).")]
SaeOpt = Annotated[Path, typer.Option("--sae", help="An SAE directory features train wrote.")]
FeatureOpt = Annotated[int | None, typer.Option("--feature", help="Show this feature alone.")]
TopOpt = Annotated[int, typer.Option("--top", help="Show the N features active on the most "
                                     "held-out tokens.")]
FormatOpt = Annotated[list[str] | None, typer.Option(
    "--format", metavar="FORMAT", help="Files to write as well: png (features.png: features "
    "x heads), html (features.html); repeatable or comma-separated.")]
ShowOutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", metavar=opt.OUT, help="Directory for the files. Default: the SAE's "
    "directory.")]


@features_app.command("train")
def train_command(
    run: opt.Run = None, model: opt.Model = None, checkpoint: opt.Checkpoint = None,
    layer: LayerOpt = None, text_file: opt.TextFile = None, activations: ActivationsOpt = None,
    width: WidthOpt = None, k: KOpt = 16, steps: StepsOpt = 2000, batch_size: BatchOpt = 1024,
    lr: LrOpt = 0.0, tokens: TokensOpt = 262_144, held_out: HeldOutOpt = 32_768,
    seed: SeedOpt = 0, out: OutOpt = None, resume: ResumeOpt = False,
    json_out: opt.Json = False, device: opt.Device = "auto", threads: opt.Threads = 0,
    force: opt.Force = False,
) -> None:
    """Train a sparse autoencoder on one layer's head outputs (or on --activations)."""
    from minigpt.errors import ConflictError
    from minigpt.features.fit import SaeSettings
    from minigpt.threads import check_threads

    settings = SaeSettings(width, k, steps, batch_size, lr, seed)
    settings.check()  # before torch loads
    check_threads(threads)
    if activations is not None:
        for name, value in (("run", run), ("model", model), ("layer", layer),
                            ("text_file", text_file)):
            if value is not None:
                raise ConflictError(("activations", name))
        if out is None:
            raise ArgumentError("out", "is needed with --activations: give {name} DIR")
    from minigpt.device import cpu_threads
    from minigpt.features.train_features import Source, train_features

    if activations is not None:
        src = Source(activations=activations, tokens=tokens, held_out=held_out)
    elif layer is None:
        raise ArgumentError("layer", "is needed: the layer whose heads' outputs the SAE "
                            "reads (or give --activations FILE)")
    else:
        from minigpt.cli.main import load_inspected

        src = Source(load_inspected(run, model, device, checkpoint), layer, text_file,
                     tokens=tokens, held_out=held_out)
    if out is None:
        if src.loaded.run_dir is None:
            raise ArgumentError("out", "is needed with --model: give {name} DIR")
        out = Path(src.loaded.run_dir) / "features" / f"layer{layer}"
    bar = _Bar()
    with cpu_threads(threads), bar:
        result = train_features(src, settings, out, resume=resume, on_event=bar, force=force)
    if result.resumed_from:
        say(f"resumed from step {result.resumed_from}")
    say(summary_line(result.info))
    say(f"wrote {out}")
    if json_out:
        sys.stdout.write(json.dumps({"sae": str(out), **result.info}, allow_nan=False) + "\n")
        sys.stdout.flush()


def summary_line(info: dict) -> str:
    q = info["quality"]
    line = (f"held-out: L0 {q['l0']:.1f}, variance explained {q['variance_explained']:.3f}, "
            f"dead features {100 * q['dead_fraction']:.1f}%")
    ce = info.get("ce")
    if ce:
        rec = ce["recovered"]
        line += (f"; loss clean {ce['clean']:.4f}, layer zero-ablated {ce['zero_ablated']:.4f}, "
                 f"SAE spliced in {ce['sae']:.4f}: "
                 + (f"{100 * rec:.1f}% of the loss recovered" if rec is not None else
                    "ablating the layer costs nothing"))
    return line + f" ({duration(info['seconds'])})"


class _Bar:
    """Renders collecting and training progress: a rich bar with ETA on a terminal, a plain
    line every 10% otherwise."""

    def __init__(self) -> None:
        self.progress = self.task = None
        self.tty = err_console.is_terminal
        self.t0 = time.monotonic()
        self.last = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, e) -> None:
        from minigpt import events

        if isinstance(e, events.SaeStarting):
            say(f"features: a TopK SAE on {e.what}; into {e.out}")
            return
        if isinstance(e, events.Progress):
            what, done, total, stats = e.stage, e.done, e.total, ""
        else:
            what, done, total = "SAE step", e.step, e.steps
            stats = f"mse {e.mse:.4f} | dead {100 * e.dead_fraction:.1f}%"
        if not self.tty:
            tenth = 10 * done // max(total, 1)
            if tenth != self.last or done == total:
                self.last = tenth
                say(f"{what} {done}/{total} {stats}")
            return
        self._bar(what, done, total, stats)

    def _bar(self, what: str, done: int, total: int, stats: str) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        if self.progress is None:
            self.progress = Progress(TextColumn("{task.description}"), MofNCompleteColumn(),
                                     BarColumn(), TextColumn("{task.fields[stats]}"),
                                     TimeElapsedColumn(), TextColumn("ETA"),
                                     TimeRemainingColumn(), console=err_console)
            self.progress.start()
        if self.task is None or self.progress.tasks[-1].description != what:
            self.task = self.progress.add_task(what, total=total, stats="")
        self.progress.update(self.task, completed=done, stats=stats)


@features_app.command("show")
def show_command(
    sae: SaeOpt, run: opt.Run = None, model: opt.Model = None, checkpoint: opt.Checkpoint = None,
    feature: FeatureOpt = None, top: TopOpt = 10, text_file: opt.TextFile = None,
    tokens: TokensOpt = 16_384, seed: SeedOpt = 0, formats: FormatOpt = None,
    out: ShowOutOpt = None, json_out: opt.Json = False, device: opt.Device = "auto",
    threads: opt.Threads = 0, force: opt.Force = False,
) -> None:
    """An SAE's features: density, top contexts, the heads that write each, its tokens."""
    from minigpt.heads.flags import parse_formats

    fmts = parse_formats(formats or [], ("table", "png", "html"))
    from minigpt.device import cpu_threads
    from minigpt.features.show import describe
    from minigpt.features.store import load_sae
    from minigpt.infer.inputs import load_run_or_model

    model_sae, _, info = load_sae(sae)
    if run is None and model is None:
        if info.get("run") is None and info.get("model") is None:
            raise ArgumentError("sae", "was trained on --activations: it has no model, heads "
                                "or tokens to show", subject=sae)
        run = Path(info["run"]) if info.get("run") else None
        model = info.get("model")
        checkpoint = checkpoint if checkpoint is not None else (info.get("step") if run else None)
    loaded = load_run_or_model(run, model, device, checkpoint)
    with cpu_threads(threads, loaded.model):
        view = describe(loaded, model_sae, info, sae, feature=feature, top=top,
                        tokens=tokens, seed=seed, text_file=text_file, force=force)
    say(f"SAE {sae}: layer {view.layer} of {loaded.label}; " + summary_line(info))
    _write_files(view, fmts, out or sae)
    if json_out:
        sys.stdout.write(json.dumps(view.to_json(), ensure_ascii=False, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:
        out_console.print(features_table(view))


def _write_files(view, fmts: list[str], out: Path) -> None:
    from minigpt.features.features_html import write_html
    from minigpt.features.features_png import write_png

    for fmt, write in (("png", write_png), ("html", write_html)):
        if fmt in fmts:
            say(f"wrote {write(view, out)}")


def features_table(view):
    """One row per feature: density, the heads' fractions, the top context, the tokens."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from minigpt.cli.shading import shade

    table = Table(title=printable(f"features of the SAE on layer {view.layer}'s heads"),
                  caption=Text("density: the share of held-out tokens a feature is active on; "
                  "L{layer}.H{h}: the share of its decoder norm in head h's slice; context: "
                  "its largest activation, [the token it fired on]; +/-: the tokens its "
                  "direction through W_O and the unembedding raises / lowers most"),
                  box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("feature", justify="right")
    table.add_column("density", justify="right")
    for h in range(view.n_head):
        table.add_column(head_name(view.layer, h), justify="right")
    for name in ("top context", "+", "-"):
        table.add_column(name, overflow="fold")
    for f in view.features:
        ctx = f.contexts[0] if f.contexts else None
        text = "-" if ctx is None else (
            "".join(ctx["tokens"][:ctx["at"]]) + "[" + ctx["tokens"][ctx["at"]] + "]")
        table.add_row(str(f.index), f"{f.density:.4f}",
                      *[Text(f"{v:.2f}", style=shade(v)) for v in f.heads],
                      Text(printable(repr(text)[1:-1][-40:])),  # token text, never markup
                      Text(printable(" ".join(repr(t)[1:-1] for t, _ in f.promoted[:3]))),
                      Text(printable(" ".join(repr(t)[1:-1] for t, _ in f.suppressed[:3]))))
    return table

