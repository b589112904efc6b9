"""`minigpt features train` and `minigpt features show --sae DIR`: sparse autoencoders on one
attention layer's head outputs (minigpt.features), trained with a progress bar and shown as rich
tables, JSON, a PNG of features x heads and an HTML page."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import EtaLines, _Group, app, err_console, out_console, say
from minigpt.display import duration, head_name, printable
from minigpt.errors import ArgumentError

features_app = typer.Typer(cls=_Group, no_args_is_help=True, rich_markup_mode=None,
                           help="Sparse autoencoders on the heads' outputs of one layer: "
                           "train one, show its features.")
app.add_typer(features_app, name="features")

TrainRunOpt = Annotated[Path | None, typer.Option(
    "--run", metavar="RUN", help="The run whose layer the SAE reads: its directory, or its "
    "name under runs/. Default: the latest finished run under runs/ (named on stderr).")]
ShowRunOpt = Annotated[Path | None, typer.Option(
    "--run", metavar="RUN", help="Show the SAE on this run (its directory, or its name under "
    "runs/). Default: the run it was trained on, found from the SAE's directory.")]
TrainCheckpointOpt = Annotated[int | None, typer.Option(
    "--checkpoint", metavar="STEP", help="Read the run's kept checkpoint of this step "
    "(train.keep_checkpoints sets how many are kept). Default: the latest.")]
ShowCheckpointOpt = Annotated[int | None, typer.Option(
    "--checkpoint", metavar="STEP", help="Show the SAE on the run's kept checkpoint of this "
    "step. Default: the step it was trained on.")]
TrainTextOpt = Annotated[Path | None, typer.Option(
    "--text-file", help="Train on this UTF-8 text's tokens (its first 90%; "
    "the last 10% held out) instead of the run's own data; needed with --model.")]
ShowTextOpt = Annotated[Path | None, typer.Option(
    "--text-file", help="Measure the features on this UTF-8 text's last 10% "
    "instead of the run's validation split; needed with --model.")]
LayerOpt = Annotated[int | None, typer.Option(
    "--layer", metavar="LAYER", help="The layer whose heads' outputs z (all heads, n_head x "
    "d_head wide) the SAE reads. Required with --run / --model.")]
ActivationsOpt = Annotated[Path | None, typer.Option(
    "--activations", help="Train on the one [n, d] tensor of this safetensors file instead "
    "of a model's layer (a tenth is held out).")]
WidthOpt = Annotated[int | None, typer.Option(
    "--width", help="Features (latents) of the SAE. Default: 8 x the input's width "
    "(n_head x d_head).")]
KOpt = Annotated[int, typer.Option(
    "--k", help="Features active per token (TopK). 0 = automatic: width / 64, at most 32 (16 "
    "on the default run's layers, 8 on the induction config's).")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Optimizer steps.")]
BatchOpt = Annotated[int, typer.Option("--batch-size", help="Tokens per step.")]
LrOpt = Annotated[float, typer.Option(
    "--lr", help="Adam's learning rate, 0 to 1. 0 = 2e-4 x sqrt(16384 / width), at most "
    "2e-3.")]
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
SaeOpt = Annotated[Path, typer.Option("--sae", metavar="DIR",
                                      help="An SAE directory features train wrote.")]
FeatureOpt = Annotated[int | None, typer.Option(
    "--feature", metavar="N", help="Show this feature alone (flagged when dense or rare).")]
HeadNameOpt = Annotated[str | None, typer.Option(
    "--head", metavar="HEAD", help="Show the features this head writes most (L1.H2: those "
    "with the largest share of their decoder norm in its slice).")]
TopOpt = Annotated[int, typer.Option("--top", help="Show the first N features "
                                     "of the list (--sort), dense and dead ones left out.")]
SortOpt = Annotated[str, typer.Option(
    "--sort", metavar="selectivity|density|index",
    help="selectivity: the features whose activation falls most on one token (before, "
    "at or after where they fire) first; density: the most often active first; index.")]
ContextsOpt = Annotated[int, typer.Option(
    "--contexts", metavar="N", help="Largest activations shown per feature, each in its "
    "context with the token it fired on marked (1-100).")]
DenseOpt = Annotated[float, typer.Option(
    "--dense", metavar="FRACTION", help="A feature active on more than this fraction of the "
    "held-out tokens is dense: left out of the list and counted (1 keeps them all).")]
ShowTokensOpt = Annotated[int, typer.Option(
    "--tokens", help="Held-out tokens the features are measured on (the run's "
    "validation split, or the last 10% of --text-file).")]
ShowSeedOpt = Annotated[int, typer.Option(
    "--seed", help="Seed of the held-out rows drawn (the same seed, the same tokens).")]
FormatOpt = Annotated[list[str] | None, typer.Option(
    "--format", metavar="FORMAT", help="Files to write as well: png (features.png: features "
    "x heads), html (features.html), json (features_shown.json); repeatable or "
    "comma-separated.")]
ShowOutOpt = Annotated[Path | None, typer.Option(
    "--out", "-o", metavar=opt.OUT, help="Directory for the files. Default: the SAE's "
    "directory.")]


@features_app.command("train")
def train_command(
    ctx: typer.Context, run: TrainRunOpt = None, model: opt.Model = None,
    checkpoint: TrainCheckpointOpt = None,
    layer: LayerOpt = None, text_file: TrainTextOpt = None, activations: ActivationsOpt = None,
    width: WidthOpt = None, k: KOpt = 0, steps: StepsOpt = 2000, batch_size: BatchOpt = 1024,
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
    from minigpt.train.safety import StopFlag

    bar = _Bar()
    with cpu_threads(threads), bar, StopFlag() as flag:
        result = train_features(src, settings, out, resume=resume, on_event=bar, force=force,
                                stop=lambda: flag.signum is not None)
    if result.resumed_from:
        say(f"resumed from step {result.resumed_from}")
    if result.interrupted:
        _stopped(ctx, flag.signum, result, settings.steps, out)
    say(summary_line(result.info))
    say(f"wrote {out}")
    if json_out:
        sys.stdout.write(json.dumps({"sae": str(out), **result.info}, allow_nan=False) + "\n")
        sys.stdout.flush()


def _stopped(ctx, signum: int, result, steps: int, out: Path) -> None:
    """A training a signal stopped: the step its state was saved at, the command that resumes
    it, and the signal's exit code (130 for SIGINT, 143 for SIGTERM, as `train`)."""
    name = signal.Signals(signum).name
    say(f"interrupted by {name} after step {result.step} of {steps}; the training state is "
        f"saved in {out}")
    say(f"resume with: {resume_command(ctx, out)}")
    raise typer.Exit({"SIGINT": 130, "SIGTERM": 143}.get(name, 1))


def resume_command(ctx, out: Path) -> str:
    """The command that continues this training: the flags given, --out, --resume."""
    words = ["minigpt", "features", "train"]
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if p.name in ("resume", "out", "json_out") or source is None or \
                source.name != "COMMANDLINE":
            continue
        flag = max(p.opts, key=len)
        value = ctx.params[p.name]
        words += [flag] if p.is_flag else [flag, str(value)]
    return shlex.join([*words, "--out", str(out), "--resume"])


def summary_line(info: dict) -> str:
    """The SAE's held-out numbers in one line (what features.json holds of them)."""
    q = info.get("quality") or {}
    held = info.get("held_out_rows")
    on = f"the {held:,} held-out tokens" if isinstance(held, int) else "the held-out tokens"

    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    line = (f"held-out: L0 {num(q.get('l0'), '.1f')}, variance explained "
            f"{num(q.get('variance_explained'), '.3f')}, features never active on {on} "
            + ("-" if q.get("dead_fraction") is None else f"{100 * q['dead_fraction']:.1f}%")
            if q else "held-out quality: not recorded")
    ce = info.get("ce")
    if ce and None not in (ce.get("clean"), ce.get("zero_ablated"), ce.get("sae")):
        rec = ce.get("recovered")
        line += (f"; loss clean {ce['clean']:.4f}, layer zero-ablated {ce['zero_ablated']:.4f}, "
                 f"SAE spliced in {ce['sae']:.4f}: "
                 + (f"{100 * rec:.1f}% of the loss recovered" if rec is not None else
                    "ablating the layer costs nothing"))
    seconds = info.get("seconds")
    return line + (f" ({duration(seconds)})" if seconds is not None else "")


class _Bar:
    """Renders collecting and training progress: a rich bar with ETA on a terminal, a plain
    line every 10% otherwise."""

    def __init__(self) -> None:
        self.progress = self.task = None
        self.tty = err_console.is_terminal
        self.t0 = time.monotonic()
        self.last = -1
        self.idle = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, e) -> None:
        from minigpt import events

        if isinstance(e, events.SaeStarting):
            say(f"features: a TopK SAE on {e.what}; into {e.out}")
            self.idle = e.idle_after
            return
        if isinstance(e, events.Progress):
            what, done, total, stats = e.stage, e.done, e.total, ""
        else:
            what, done, total = "SAE step", e.step, e.steps
            stats = (f"mse {e.mse:.4f} | idle {100 * e.dead_fraction:.1f}% (no firing in "
                     f"{self.idle:,} training tokens)")
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
    sae: SaeOpt, run: ShowRunOpt = None, model: opt.Model = None,
    checkpoint: ShowCheckpointOpt = None, feature: FeatureOpt = None, head: HeadNameOpt = None,
    top: TopOpt = 10, sort: SortOpt = "selectivity", contexts: ContextsOpt = 3,
    dense: DenseOpt = 0.1, text_file: ShowTextOpt = None, tokens: ShowTokensOpt = 16_384,
    seed: ShowSeedOpt = 0,
    formats: FormatOpt = None, out: ShowOutOpt = None, json_out: opt.Json = False,
    device: opt.Device = "auto", threads: opt.Threads = 0, force: opt.Force = False,
) -> None:
    """An SAE's features: the most selective first, each with its heads, contexts and tokens."""
    from minigpt.features.show_options import ShowOptions
    from minigpt.heads.flags import parse_formats
    from minigpt.threads import check_threads

    fmts = parse_formats(formats or [], ("table", "png", "html", "json"))
    options = ShowOptions(feature, head, top, sort, contexts, dense, tokens, seed, text_file)
    options.check()  # before torch loads
    check_threads(threads)
    from minigpt.device import cpu_threads
    from minigpt.features.sae_run import open_sae
    from minigpt.features.show import describe

    opened = open_sae(sae, run, model, checkpoint, device)
    for note in opened.notes:
        say(f"note: {note}")
    files = _files_dir(fmts, out or sae)
    with cpu_threads(threads, opened.loaded.model):
        view = describe(opened.loaded, opened.sae, opened.info, sae, options, force=force,
                        on_event=EtaLines("features show"))
    say(f"SAE {sae}: layer {view.layer} of {opened.loaded.label}; " + summary_line(opened.info))
    _write_files(view, fmts, files)
    if json_out:
        sys.stdout.write(json.dumps(view.to_json(), ensure_ascii=False, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:
        for part in features_table(view, out_console.width):
            out_console.print(part)


SHOW_FILES = {"png": "features.png", "html": "features.html", "json": "features_shown.json"}


def _files_dir(fmts: list[str], out: Path) -> Path | None:
    """The directory of the files asked for, made and proven writable (every file's place
    checked) before any work; None when only the table was asked for."""
    from minigpt.heads.output import check_destinations, make_out_dir

    names = [SHOW_FILES[f] for f in fmts if f in SHOW_FILES]
    if not names:
        return None
    path = make_out_dir(Path(out))
    check_destinations(path, names)
    return path


def _write_files(view, fmts: list[str], out: Path | None) -> None:
    from minigpt.features.features_html import write_html
    from minigpt.features.features_png import write_png
    from minigpt.files import atomic_write_text

    def write_json(view, out: Path) -> Path:
        return atomic_write_text(out / SHOW_FILES["json"], json.dumps(
            view.to_json(), ensure_ascii=False, allow_nan=False, indent=1) + "\n")

    for fmt, write in (("png", write_png), ("html", write_html), ("json", write_json)):
        if fmt in fmts:
            say(f"wrote {write(view, out)}")


TOKEN_CHARS = 12  # a token's text at most, in the terminal
PLACES = {"prev": "where the token before is {}", "at": "on the token {}",
          "next": "where the next token is {}"}


def _context(c: dict, ids: bool, width: int):
    """One context in `width` columns: the tokens before (cut from the left), «the one it
    fired on», the next; synthetic ids as numbers, apart."""
    from rich.text import Text

    from minigpt.display import visible_token

    sep = " " if ids else ""
    at = "«" + visible_token(c["tokens"][c["at"]], TOKEN_CHARS) + "»"
    after = sep + visible_token(c["next"], TOKEN_CHARS)
    room = max(8, width - len(at) - len(after) - 4)
    before = sep.join(visible_token(t) for t in c["tokens"][:c["at"]]) + sep
    if len(before) > room:
        before = "…" + before[-(room - 1):]
    text = Text("    " + before, no_wrap=True, overflow="ellipsis")
    text.append(at, style="reverse")
    text.append(after, style="dim")
    return text


def _selective(f, ids: bool) -> str:
    """What a feature is selective on, in words."""
    from minigpt.display import visible_token

    if f.selectivity is None:
        return f"active on {f.firings} token{'s' if f.firings != 1 else ''}: too few to say more"
    token = "-" if f.token is None else visible_token(f.token, TOKEN_CHARS)
    return f"{100 * f.selectivity:.0f}% of its activation {PLACES[f.spot].format(token)}"


def _feature_lines(f, view, width: int) -> list:
    """One feature: a line of what it is, a line of what writes it and what it does, then its
    largest activations in context."""
    from rich.text import Text

    from minigpt.display import visible_token

    dense = f" (dense: above {view.options.dense:g})" if f.dense else ""
    head = Text(f"feature {f.index}", style="bold")
    head.append(f": active on {100 * f.density:.2f}% of the tokens{dense}; "
                + _selective(f, view.ids))
    top = sorted(enumerate(f.heads), key=lambda x: -x[1])
    writers = ", ".join(f"{head_name(view.layer, h)} {v:.2f}" for h, v in top[:3] if v >= 0.1)
    sep = " "
    does = Text(f"  written by {writers}; raises "
                + sep.join(visible_token(t, TOKEN_CHARS) for t, _ in f.promoted[:4])
                + "; lowers " + sep.join(visible_token(t, TOKEN_CHARS)
                                         for t, _ in f.suppressed[:4]))
    return [head, does, *(_context(c, view.ids, width) for c in f.contexts)]


def features_table(view, width: int = 100) -> list:
    """The features shown, a few lines each, and under them what the lines mean and what was
    left out (wrapped at words to the terminal's width)."""
    from rich.text import Text

    o = view.options
    what = f"feature {o.feature}" if o.feature is not None else "features"
    mine = f" that {o.head} writes most" if o.head else ""
    order = "" if o.feature is not None else f", the first {len(view.features)} by {o.sort}"
    out = [Text(printable(f"{what} of the SAE on layer {view.layer}'s heads{mine}{order}"),
                style="bold")]
    for f in view.features:
        out += [Text(""), *_feature_lines(f, view, width)]
    if not view.features:
        out.append(Text("(none)"))
    return [*out, Text(""), Text(_glossary(view), style="table.caption")]


def _glossary(view) -> str:
    """What the table's columns mean and what it leaves out, in words."""
    o, n = view.options, view.n_features
    parts = [
        "active on: the share of the held-out tokens where the feature is active",
        ("% of its activation: how much of it (summed over the tokens) falls on one token, "
        "before, at or after where it fires (the list's order: the most selective first)"),
        (f"written by: the heads with the largest shares of its decoder norm (L{view.layer}.H2 "
        "0.73: head 2 writes 73% of it)"),
        ("raises / lowers: the tokens its direction, through W_O and the unembedding, raises / "
        "lowers most directly"),
        ("then its largest activations, each in its context: «the token it fired on» and "
        "the next token")]
    if not view.ids:
        parts.append("tokens: · a space, ↵ a newline, → a tab, \\xNN a byte that is not text "
                     "alone")
    if o.feature is None:
        left = [(f"{view.n_dense} dense (active on more than {100 * o.dense:g}% of the "
                "tokens; --dense 1 keeps them)"), f"{view.n_dead} never active"]
        parts.append(f"of {n} features on {view.n_tokens:,} tokens, left out: "
                     + ", ".join(left))
        if o.head is not None:
            parts.append(f"{view.n_head_features} features are written most by {o.head}")
    if view.unseen:
        parts.append(f"raises / lowers among the tokens the data holds ({view.unseen} token "
                     "ids never occur in it and are left out)")
    return "; ".join(parts) + "."
