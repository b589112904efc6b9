"""`minigpt train`: validate the config, train, and render the trainer's events (a rich progress
bar on a terminal, one plain line per log interval otherwise) and the end-of-run summary."""

from __future__ import annotations

import math
import shlex
import sys
import time
from typing import Annotated

import typer

from minigpt import events
from minigpt.cli.main import app, err_console, out_console


@app.command("train")
def train_command(
    config: Annotated[str | None, typer.Option(
        "--config", "-c", help="YAML config file or bundled name (default: "
        "configs/default.yaml).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one setting: section.key=value (repeatable), e.g. "
        "--set train.max_steps=500.")] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Run directory (default: <run.out_dir>/<run.name>, i.e. "
        "runs/<config name>).")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the run in --out from its last checkpoint, with its own "
        "config.yaml: --config and --set values equal to the stored ones are accepted, and "
        "train.* (except batch_size) and run.device may change. A run that saved nothing yet "
        "starts from step 0.")] = False,
    device: Annotated[str | None, typer.Option(
        "--device", help="auto, cpu, cuda or mps (overrides run.device).")] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", help="Print the resolved config as YAML on stdout and exit.")] = False,
    stop_after: Annotated[int | None, typer.Option(
        "--stop-after", min=1, help="Stop cleanly after this step (checkpoint saved; continue "
        "later with --resume).")] = None,
) -> None:
    """Train a model; progress on stderr, everything saved in the run directory."""
    code = _train_cli(config, set_ or [], out, resume, device, print_config, stop_after)
    if code:
        raise typer.Exit(code)


def _train_cli(config, sets, out, resume, device, print_config, stop_after) -> int:
    import os

    from minigpt.config import ConfigError, load_config, to_yaml
    from minigpt.device import DEVICE_CHOICES

    if device is not None and device not in DEVICE_CHOICES:
        raise ConfigError(f"--device: '{device}' is not one of {', '.join(DEVICE_CHOICES)}")
    # On --resume only run.* settings locate the run; resume_config checks the rest against
    # the stored config (so the command that started the run, plus --resume, continues it).
    locate = [s for s in sets if s.split("=", 1)[0].strip().startswith("run.")]
    cfg = load_config(config, locate if resume else sets)  # validated before any work
    if device:
        cfg.run.device = device
    from minigpt.run.resume import resume_config, run_dir_for  # after validation: imports torch
    from minigpt.train import train

    run_dir = run_dir_for(cfg, out)
    if resume:
        cfg = resume_config(run_dir, sets, device, config)
    if print_config:
        out_console.print(to_yaml(cfg), end="", markup=False, highlight=False, soft_wrap=True)
        return 0
    view = _TrainView(quiet=os.environ.get("RANK", "0") != "0")
    try:
        done = train(cfg, run_dir, resume=resume, on_event=view.on_event, stop_after=stop_after)
    finally:
        view.close()
    if view.quiet:
        return {"SIGINT": 130, "SIGTERM": 143}.get(done.signal, 0)
    resume_cmd = f"minigpt train --out {shlex.quote(str(run_dir))} --resume"
    if done.reason == "interrupted":
        err_console.print(f"interrupted by {done.signal} after step {done.step}; checkpoint "
                          f"saved in {done.checkpoint}\nresume with: {resume_cmd}",
                          markup=False, highlight=False, soft_wrap=True)
        return 143 if done.signal == "SIGTERM" else 130
    if done.reason == "stopped":
        err_console.print(f"stopped after step {done.step} as asked (--stop-after); resume "
                          f"with: {resume_cmd}", markup=False, highlight=False, soft_wrap=True)
    view.summary(done)
    return 0


_CONTROL = str.maketrans({c: "\ufffd" for c in [*range(9), *range(11, 32), 127]})


def _clean(text: str) -> str:
    """Generated/corpus text with control characters (ESC, CR, ...) made harmless."""
    return text.translate(_CONTROL)


class _TrainView:
    """Renders train events: a rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.tty = err_console.is_terminal and not quiet
        self.progress = None
        self.task = None
        self.corpus_pass: dict[str, float] = {}  # stage -> when its progress was last shown

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        elif self.tty:
            err_console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def on_event(self, e) -> None:
        if self.quiet:
            return
        if isinstance(e, events.StartEvent):
            what = "resuming" if e.start_step else "training"
            self.line(f"{what} {e.run_dir}: {e.params:,} parameters, vocab {e.n_vocab}, "
                      f"{e.tokens_per_step:,} tokens/step, device {e.device}"
                      + (f" x {e.world_size} processes" if e.world_size > 1 else "")
                      + (f", from step {e.start_step}" if e.start_step else ""))
            if self.tty:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self.progress = Progress(
                    TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                    TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(),
                    console=err_console, transient=False)
                self.progress.start()
                self.task = self.progress.add_task("train", total=e.max_steps,
                                                   completed=e.start_step, stats="")
        elif isinstance(e, events.StepEvent):
            stats = (f"loss {e.loss:.4f} | lr {e.lr:.2e} | {e.tokens_per_s:,.0f} tok/s")
            if self.progress is not None:
                self.progress.update(self.task, completed=e.step, stats=stats)
            else:
                rate = e.step / e.elapsed if e.elapsed > 0 else 0.0
                eta = (e.max_steps - e.step) / rate if rate > 0 else math.nan
                eta_s = f"{eta // 60:.0f}m{eta % 60:02.0f}s" if math.isfinite(eta) else "?"
                self.line(f"step {e.step}/{e.max_steps} | {stats} | grad norm "
                          f"{e.grad_norm:.3f} | {e.elapsed:.1f}s | ETA {eta_s}")
        elif isinstance(e, events.EvalEvent):
            self.line(f"eval step {e.step}: val loss {e.val_loss:.4f} | ppl {e.val_ppl:.2f} | "
                      f"{e.val_bpb:.4f} bits/byte (best {e.best_val_bpb:.4f}) | "
                      f"{e.elapsed:.1f}s")
            for prompt, text in e.samples:
                body = _clean(prompt + text).replace("\n", "\n  | ")
                self.line(f"  | {body}")
        elif isinstance(e, events.HeadFormedEvent):
            self.line(f"L{e.layer}H{e.head} became {e.what} at step {e.step:,} "
                      f"({e.kind} score {e.score:.2f})")
        elif isinstance(e, events.NothingSavedEvent):
            self.line(f"note: {e.run_dir} holds no saved checkpoint yet (the run stopped before "
                      "its first save); starting it from step 0")
        elif isinstance(e, events.CheckpointEvent):
            if self.progress is None:
                self.line(f"checkpoint step {e.step}: {e.path}")
        elif isinstance(e, events.CorpusProgress):  # a long pass: a line every 10 s
            now, last = time.monotonic(), self.corpus_pass.setdefault(e.stage, time.monotonic())
            if now - last >= 10 and e.total:
                self.corpus_pass[e.stage] = now
                what = {"scan": "reading records", "bpe": "training the BPE",
                        "tokenize": "tokenizing"}.get(e.stage, e.stage)
                self.line(f"data: {what} {100 * e.done / e.total:.0f}% ({e.done / 1e6:,.0f} of "
                          f"{e.total / 1e6:,.0f} MB)")
        elif isinstance(e, events.TrainingBPE):
            self.line("training the BPE tokenizer on the corpus's training split (cached for next "
                      "time) ...")
        elif isinstance(e, events.DatasetReady):
            self.line(f"data: {e.n_train:,} train / {e.n_val:,} val tokens"
                      + (" (cached)" if e.cached else ""))
            if e.corpus_files:  # say what the config's paths resolved to
                more = f" (+{len(e.corpus_files) - 1} more files)" if len(e.corpus_files) > 1 else ""
                self.line(f"data: corpus {e.corpus_files[0]}{more}; token cache {e.cache_path}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, done) -> None:
        from rich.table import Table

        table = Table(title="training summary", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for k, v in done.summary_rows():
            table.add_row(k, v)
        if self.tty:
            err_console.print(table)
        else:
            for k, v in done.summary_rows():
                self.line(f"{k}: {v}")

