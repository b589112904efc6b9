"""What a training session writes into its run directory besides checkpoints, each file a
consumer of the trainer's events (events.py):

    metrics.jsonl     one record per StepEvent ("train"), EvalEvent ("eval") and
                      HeadScoresEvent ("heads"), appended as they come (`metrics_record`)
    curves.png        train/val loss, val bits/byte and the learning rate against step, and
    heads.png         the best head scores per layer: both redrawn at each EvalEvent, and at the
                      DoneEvent if records came after the last drawing, from the records kept in
                      memory (read once from metrics.jsonl on resume), never from the log
    summary.md        the DoneEvent's figures and the last EvalEvent's samples
    config.yaml, tokenizer.tiktoken, tokenizer.json   the session's config and tokenizer

Who may write when. A fresh session created its directory, so it writes from the start. A
resumed session writes nothing in the run directory before its first checkpoint is committed,
so a resume that fails or is killed early changes nothing already saved: its records wait in
memory. `before_commit` (save_checkpoint calls it once the new checkpoint is complete, just
before `latest` moves to it) then rewrites metrics.jsonl atomically as the records up to the
resumed step, every line that is not a record where it stood (byte for byte: what the tool
cannot read it never drops), plus this session's, so a committed checkpoint never runs ahead
of its log; the CheckpointEvent that follows the commit writes config.yaml, the tokenizer and
the pictures. Later saves only make the appended log durable first.

Another output is one more consumer in the session's list (reporting.py, `Reporting.build`): a
callable taking the same events in the same order, as the TensorBoard event files are
(tensorboard.py).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from minigpt.config import Config, to_yaml
from minigpt.data.tokenizer import RANKS_FILE, SIDECAR_FILE, Tokenizer
from minigpt.errors import WriteError
from minigpt.events import CheckpointEvent, DoneEvent, EvalEvent, HeadScoresEvent, StepEvent
from minigpt.files import atomic_write_bytes, atomic_write_text, check_replaceable, disk_error
from minigpt.heads.timeline import draw_timeline
from minigpt.run.curves import CURVES_FILE, Series, write_curves
from minigpt.run.layout import CONFIG_FILE, HEADS_PNG, METRICS_FILE, SUMMARY_FILE
from minigpt.run.metrics import json_safe, metrics_upto


def metrics_record(event: object) -> dict | None:
    """The metrics.jsonl record of an event; None for events the log does not keep."""
    if isinstance(event, StepEvent):
        return {"kind": "train", "step": event.step, "loss": event.loss, "lr": event.lr,
                "grad_norm": event.grad_norm, "tokens_per_s": event.tokens_per_s,
                "elapsed": event.elapsed, "tokens_seen": event.tokens_seen}
    if isinstance(event, EvalEvent):
        copies = ({"copy_loss": event.copy_loss, "copy_accuracy": event.copy_accuracy}
                  if math.isfinite(event.copy_loss) else {})  # induction runs only
        return {"kind": "eval", "step": event.step, "val_loss": event.val_loss,
                "val_ppl": event.val_ppl, "val_bpb": event.val_bpb, "elapsed": event.elapsed,
                "tokens_seen": event.tokens_seen, **copies}
    if isinstance(event, HeadScoresEvent):
        return {"kind": "heads", "step": event.step, "seconds": event.seconds,
                "scores": event.scores,
                **({"circuit": event.circuit} if event.circuit is not None else {})}
    return None


class RunOutputs:
    """The run directory's metrics, pictures, summary, config and tokenizer, written from the
    events of one session (rank 0 only). `resumed_at`: the step a resumed session continues
    from (None for a fresh run); `heads_png`: the session scores heads."""

    def __init__(self, run_dir: Path, cfg: Config, tokenizer: Tokenizer, *,
                 resumed_at: int | None, heads_png: bool) -> None:
        self.run_dir, self.cfg, self.tokenizer, self.heads_png = run_dir, cfg, tokenizer, heads_png
        self.path = run_dir / METRICS_FILE
        self.series = Series(run_dir.name, run_dir)
        self.heads: list[dict] = []  # the "heads" records, for heads.png and HeadWatch
        self.samples: list[tuple[str, str]] = []
        self._log = None             # metrics.jsonl, open for appending once the log is ours
        self._dirty = False          # records arrived since the pictures were drawn
        fresh = resumed_at is None
        self._kept: list[bytes] = []  # a resumed run's log lines up to the resumed step
        self.unread = 0              # ... of which lines that are not records (kept as they are)
        if not fresh:
            self._check_writable()
            self._kept, records, self.unread = metrics_upto(self.path, resumed_at)
            for r in records:
                self._remember(r)
        self._held: list[str] | None = None if fresh else []  # lines waiting for the commit
        self._owned = fresh          # may write config, tokenizer, pictures and summary
        if fresh:
            self._write_run_files()
            self._open_log()

    def _check_writable(self) -> None:
        """A resumed session writes its files after its first commit: what would make those
        writes fail (a directory or a FIFO where a file goes, a run directory that cannot be
        written) is refused now, before anything changes (WriteError, one line)."""
        for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CURVES_FILE, HEADS_PNG,
                     RANKS_FILE, SIDECAR_FILE):
            check_replaceable(self.run_dir / name)
        if not os.access(self.run_dir, os.W_OK | os.X_OK):
            raise WriteError(f"cannot write {self.run_dir} (permission denied); make the run "
                             "directory writable, then resume", self.run_dir)

    def __call__(self, event: object) -> None:
        record = metrics_record(event)
        if record is not None:
            self._append(json.dumps(json_safe(record)))
            self._remember(record)
        if isinstance(event, EvalEvent):
            self.samples = event.samples
            self._draw()
        elif isinstance(event, CheckpointEvent) and not self._owned:
            self._owned = True  # the session's first commit: its results are the run's now
            self._write_run_files()
            self._draw()
        elif isinstance(event, DoneEvent) and self._owned:
            self._write_summary(event)
            if self._dirty:
                self._draw()
            self.close()

    def before_commit(self) -> None:
        """Make the log durable up to the checkpoint being committed (see the docstring)."""
        if self._held is not None:
            atomic_write_bytes(self.path, b"".join(
                x + b"\n" for x in [*self._kept, *(h.encode("utf-8") for h in self._held)]))
            self._held = None
            self._open_log()
        elif self._log is not None:
            self._log.flush()
            os.fsync(self._log.fileno())

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- the files ----------------------------------------------------------------------------
    def _open_log(self) -> None:
        try:
            self._log = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        except OSError as e:
            raise disk_error(e, self.path) from None

    def _append(self, line: str) -> None:
        if self._held is not None:
            self._held.append(line)
            return
        try:
            self._log.write(line + "\n")
            self._log.flush()
        except OSError as e:
            raise disk_error(e, self.path) from None

    def _remember(self, record: dict) -> None:
        self.series.add(record)
        if record.get("kind") == "heads":
            self.heads.append(record)
        self._dirty = True

    def _write_run_files(self) -> None:
        atomic_write_text(self.run_dir / CONFIG_FILE, to_yaml(self.cfg))
        self.tokenizer.save(self.run_dir)

    def _draw(self) -> None:
        """curves.png and heads.png from the records in memory, each rewritten atomically."""
        if not self._owned:
            return
        write_curves(self.series)
        if self.heads_png:
            png = draw_timeline(self.heads, f"{self.run_dir.name}: head scores on the built-in "
                                "probes")
            if png is not None:
                atomic_write_bytes(self.run_dir / HEADS_PNG, png)
        self._dirty = False

    def _write_summary(self, done: DoneEvent) -> None:
        """summary.md: a two-column table of the run's figures and the last samples."""
        lines = ["# minigpt run summary", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in done.summary_rows()]
        for prompt, text in self.samples:
            lines += ["", f"Sample (prompt {prompt!r}):", "", "```", text.replace("```", "'''"),
                      "```"]
        atomic_write_text(self.run_dir / SUMMARY_FILE, "\n".join(lines) + "\n")
