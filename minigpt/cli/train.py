"""`minigpt train`: validate the config, train, and render the trainer's events (a rich progress
bar on a terminal, one plain line per log interval otherwise) and the end-of-run summary."""

from __future__ import annotations

import math
import os
import shlex
import sys
import time
from typing import Annotated, ClassVar

import typer

import minigpt.cli.options as opt
from minigpt import events
from minigpt.cli.main import app, err_console, out_console
from minigpt.display import duration, head_name, printable, size


@app.command("train")
def train_command(
    config: Annotated[str | None, typer.Option(
        "--config", "-c", help="YAML config file or bundled name (default: "
        "configs/default.yaml).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one setting: section.key=value (repeatable), e.g. "
        "--set train.max_steps=500.")] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", metavar=opt.OUT, help="Run directory (default: "
        "<run.out_dir>/<run.name>, i.e. runs/<config name>).")] = None,
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
    force: opt.Force = False,
) -> None:
    """Train a model; progress on stderr, everything saved in the run directory."""
    from minigpt.config import load_config, to_yaml

    if not resume:  # the config and --set checked before torch loads (the same check again
        load_config(config, set_ or [])  # below, in train_config, costs a millisecond)
    from minigpt.run.resume import train_config
    from minigpt.train import train

    cfg, run_dir = train_config(config, set_ or [], out=out, resume=resume, device=device)
    if print_config:
        out_console.print(to_yaml(cfg), end="", markup=False, highlight=False, soft_wrap=True)
        return
    view = _TrainView(quiet=os.environ.get("RANK", "0") != "0")
    try:
        done = train(cfg, run_dir, resume=resume, on_event=view.on_event, stop_after=stop_after,
                     force=force)
    finally:
        view.close()
    view.finish(done)
    code = {"SIGINT": 130, "SIGTERM": 143}.get(done.signal, 0)
    if code:
        raise typer.Exit(code)


RISING_EVALS = 3  # evaluations in a row above the best before the overfitting warning


class _TrainView:
    """Renders train events: a rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.tty = err_console.is_terminal and not quiet
        self.progress = None
        self.task = None
        self.corpus_pass: dict[str, float] = {}  # stage -> when its progress was last shown
        self.t0, self.start_step = time.monotonic(), 0  # for the ETA: this session's average
        self.synthetic = False       # data.source induction: no bytes, the copies matter
        self.not_best = 0            # evaluations in a row above the best one
        self.warned = False
        self.threads = 0             # CPU threads of this session (0: not on CPU)

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
        render = None if self.quiet else self._RENDER.get(type(e))
        if render is not None:
            render(self, e)

    def _start(self, e: events.StartEvent) -> None:
        self.t0, self.start_step = time.monotonic(), e.start_step
        self.threads = e.threads
        self.synthetic = e.data_source == "induction"
        what = "resuming" if e.start_step else "training"
        self.line(f"{what} {e.run_dir}: {e.params:,} parameters, vocab {e.n_vocab}, "
                  f"{e.tokens_per_step:,} tokens/step, device {e.device}"
                  + (f" ({e.threads} thread{'s' if e.threads != 1 else ''}: train.threads)"
                     if e.threads else "")
                  + (f" x {e.world_size} processes" if e.world_size > 1 else "")
                  + (", bf16 autocast (train.precision)" if e.precision == "bf16" else "")
                  + (f", from step {e.start_step}" if e.start_step else ""))
        if self.tty:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.progress = Progress(
                TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                TextColumn("ETA {task.fields[eta]}"),
                console=err_console, transient=False)
            self.progress.start()
            self.task = self.progress.add_task("train", total=e.max_steps,
                                               completed=e.start_step, stats="", eta="?")

    def eta(self, step: int, max_steps: int) -> str:
        """Time left at this session's average speed so far (evaluations included, as they
        recur): steady on a machine whose load comes and goes, unlike the last steps' speed."""
        done, spent = step - self.start_step, time.monotonic() - self.t0
        if done <= 0 or spent <= 0:
            return "?"
        return duration((max_steps - step) * spent / done)

    def _step(self, e: events.StepEvent) -> None:
        stats = f"loss {e.loss:.4f} | lr {e.lr:.2e} | {e.tokens_per_s:,.0f} tok/s"
        eta = self.eta(e.step, e.max_steps)
        if self.progress is not None:
            self.progress.update(self.task, completed=e.step, stats=stats, eta=eta)
            return
        self.line(f"step {e.step}/{e.max_steps} | {stats} | grad norm {e.grad_norm:.3f} | "
                  f"{duration(e.elapsed)} | ETA {eta}")

    def _eval(self, e: events.EvalEvent) -> None:
        if self.synthetic:  # random ids: half the positions cannot be predicted, no bytes
            copies = ("" if not math.isfinite(e.copy_loss) else
                      f"on the copies: loss {e.copy_loss:.4f}, {100 * e.copy_accuracy:.1f}% "
                      "predicted | ")
            self.line(f"eval step {e.step}: {copies}val loss over all positions "
                      f"{e.val_loss:.4f} (first occurrences cannot be predicted) | "
                      f"{duration(e.elapsed)}")
        else:
            self.line(f"eval step {e.step}: val loss {e.val_loss:.4f} | ppl {e.val_ppl:.2f} | "
                      f"{e.val_bpb:.4f} bits/byte (best {e.best_val_bpb:.4f}) | "
                      f"{duration(e.elapsed)}")
        self._rising(e)
        for prompt, text in e.samples:
            body = printable(prompt + text, keep="\n\t").replace("\n", "\n  | ")
            self.line(f"  | {body}")

    def _rising(self, e: events.EvalEvent) -> None:
        """One plain warning once validation has stayed above its best for RISING_EVALS
        evaluations in a row: the model is overfitting, and the weights saved are the
        latest, not the best. (Synthetic induction rows are drawn fresh for every batch:
        nothing to overfit.)"""
        if self.synthetic:
            return
        self.not_best = 0 if e.val_loss <= e.best_val_loss else self.not_best + 1
        if self.not_best >= RISING_EVALS and not self.warned:
            self.warned = True
            self.line(f"warning: the validation loss has been above its best "
                      f"({e.best_val_loss:.4f}, step {e.best_step}) for {self.not_best} "
                      f"evaluations in a row (now {e.val_loss:.4f}): the model is overfitting "
                      "its training data, and the weights saved are the latest step's, not "
                      f"the best; fewer train.max_steps (about {e.best_step}), more data or "
                      "more model.dropout would help")

    def _head_formed(self, e: events.HeadFormedEvent) -> None:
        self.line(f"{head_name(e.layer, e.head)} became {e.what} at step {e.step:,} "
                  f"({e.kind} score {e.score:.2f})")

    def _nothing_saved(self, e: events.NothingSavedEvent) -> None:
        self.line(f"note: {e.run_dir} holds no saved checkpoint yet (the run stopped before "
                  "its first save); starting it from step 0")

    def _unread_kept(self, e: events.UnreadLinesKept) -> None:
        self.line(f"note: {e.path}: kept {e.lines} line{'s' if e.lines != 1 else ''} that "
                  "are not metrics records where they stand, byte for byte (readers skip "
                  "them; remove them by hand if they are not wanted)")

    def _checkpoint(self, e: events.CheckpointEvent) -> None:
        if self.progress is None:
            self.line(f"checkpoint step {e.step}: {e.path}")

    def _training_bpe(self, e: events.TrainingBPE) -> None:
        self.line("training the BPE tokenizer on the corpus's training split (cached for next "
                  "time) ...")

    def _corpus_progress(self, e: events.CorpusProgress) -> None:
        """A long pass over the corpus: a line at most every 10 s."""
        now = time.monotonic()
        last = self.corpus_pass.setdefault(e.stage, now)
        if now - last >= 10 and e.total:
            self.corpus_pass[e.stage] = now
            what = {"scan": "reading records", "bpe": "training the BPE",
                    "tokenize": "tokenizing"}.get(e.stage, e.stage)
            self.line(f"data: {what} {100 * e.done / e.total:.0f}% ({size(e.done)} of "
                      f"{size(e.total)})")

    def _dataset_ready(self, e: events.DatasetReady) -> None:
        if e.synthetic:
            self.line(f"data: {e.synthetic}")
            return
        self.line(f"data: {e.n_train:,} train / {e.n_val:,} val tokens"
                  + (" (cached)" if e.cached else ""))
        if e.corpus_files:  # say what the config's paths resolved to
            more = f" (+{len(e.corpus_files) - 1} more files)" if len(e.corpus_files) > 1 else ""
            self.line(f"data: corpus {e.corpus_files[0]}{more}; token cache {e.cache_path}")

    _RENDER: ClassVar[dict] = {
        events.StartEvent: _start, events.StepEvent: _step, events.EvalEvent: _eval,
        events.HeadFormedEvent: _head_formed, events.NothingSavedEvent: _nothing_saved,
        events.UnreadLinesKept: _unread_kept,
        events.CheckpointEvent: _checkpoint, events.TrainingBPE: _training_bpe,
        events.DatasetReady: _dataset_ready, events.CorpusProgress: _corpus_progress}

    def _threads_hint(self, done: events.DoneEvent, resume: str) -> None:
        """After a session that ran on several CPU threads on a machine busier than its CPUs
        (the 1-minute load average above them): the speed it got, and the resume command on
        one thread, which leaves a CPU to the other work (docs/cli.md#threads)."""
        from minigpt.threads import usable_cpus

        try:
            busy, cpus = os.getloadavg()[0], usable_cpus()
        except OSError:
            return
        if self.threads > 1 and busy > cpus:
            self.line(f"note: this run trained at {done.tokens_per_s:,.0f} tokens/s on "
                      f"{self.threads} threads while the machine was busy (load {busy:.1f} on "
                      f"{cpus} CPUs); if it was slow and the other work goes on, resume on one "
                      f"thread: {resume} --set train.threads=1")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self, done: events.DoneEvent) -> None:
        """How the session ended: where to resume from, or the summary table."""
        if self.quiet:
            return
        resume = f"minigpt train --out {shlex.quote(str(done.run_dir))} --resume"
        if done.reason == "interrupted":
            self.line(f"interrupted by {done.signal} after step {done.step}; checkpoint saved "
                      f"in {done.checkpoint}\nresume with: {resume}")
            self._threads_hint(done, resume)
            return
        if done.reason == "stopped":
            self.line(f"stopped after step {done.step} as asked (--stop-after); resume with: "
                      f"{resume}")
            self._threads_hint(done, resume)
        if done.reason == "formed":
            self.line(f"stopped after step {done.step}: the heads named in "
                      "train.stop_when_formed have formed")
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
