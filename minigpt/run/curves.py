"""Pictures of training, from metrics records: `curves.png` in every run directory (train loss,
val loss and val bits/byte against step, with the learning rate), and several runs overlaid
against step and against training tokens (`minigpt curves`, from each run's metrics.jsonl).

The trainer keeps its run's `Series` in memory (`Series.add` per record) and rewrites
`curves.png` atomically at each evaluation and when a session ends early, so the picture is
never torn and always matches the metrics up to its step. matplotlib is
imported lazily inside the drawing functions, and only its object-oriented API with the Agg
canvas is used (Figure + FigureCanvasAgg: no pyplot, no display, no global backend switch).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from minigpt.display import figure_png
from minigpt.errors import ArgumentError, MinigptError, WriteError
from minigpt.files import atomic_file, atomic_write_bytes, not_replaceable
from minigpt.run.layout import METRICS_FILE
from minigpt.run.listing import Unreadable, data_kind, read_run_metrics
from minigpt.run.metrics import finite

CURVES_FILE = "curves.png"


@dataclass
class Series:
    """One run's curves. Train points come from the log records (kind "train"), eval points
    from the evaluations (kind "eval"); a value the log holds as null (not finite) is NaN,
    drawn as a gap. `elapsed` is training seconds over all sessions of the run."""

    name: str
    run_dir: Path
    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    elapsed: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_bpb: list[float] = field(default_factory=list)
    eval_elapsed: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)        # training tokens seen, per train
    eval_tokens: list[float] = field(default_factory=list)   # ... and per eval record
    copy_accuracy: list[float] = field(default_factory=list)  # induction runs, per eval
    skipped: int = 0  # damaged metrics.jsonl lines left out
    kind: dict = field(default_factory=dict)  # listing.data_kind: what it was trained on

    @property
    def synthetic(self) -> bool:
        return self.kind.get("source") == "induction"

    @property
    def empty(self) -> bool:
        return not self.step and not self.eval_step

    def add(self, r: dict) -> None:
        """Take one metrics record (kinds other than train and eval are not curves)."""
        if r.get("kind") == "train":
            self.step.append(r["step"])
            self.loss.append(_num(r.get("loss")))
            self.lr.append(_num(r.get("lr")))
            self.elapsed.append(_num(r.get("elapsed")))
            self.tokens.append(_num(r.get("tokens_seen")))
        elif r.get("kind") == "eval":
            self.eval_step.append(r["step"])
            self.val_loss.append(_num(r.get("val_loss")))
            self.val_bpb.append(_num(r.get("val_bpb")))
            self.eval_elapsed.append(_num(r.get("elapsed")))
            self.eval_tokens.append(_num(r.get("tokens_seen")))
            self.copy_accuracy.append(_num(r.get("copy_accuracy")))


def _num(x) -> float:
    v = finite(x)
    return math.nan if v is None else float(v)


def read_series(run_dir: Path, name: str | None = None) -> Series:
    """The curves of the run in `run_dir` (empty when it has no metrics yet)."""
    run_dir = Path(run_dir)
    try:
        records, bad = read_run_metrics(run_dir)  # a regular file only, size-capped
    except Unreadable as e:
        raise MinigptError(f"cannot read {e.path}: {e.why}") from None
    s = Series(name or run_dir.name, run_dir, skipped=bad, kind=data_kind(run_dir))
    for r in records:
        s.add(r)
    return s


def _figure(rows: int, cols: int, size: tuple[float, float], layout: str | None = None):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False, sharex="col")


def curves_figure(s: Series):
    """One run: train and val loss (left axis) with the learning rate (right axis) on top,
    val bits/byte below, both against step."""
    # Fixed margins instead of a layout engine: this is redrawn at every evaluation, and
    # constrained layout doubles the time of a draw (~0.2 s -> ~0.4 s on a busy 2-core CPU).
    fig, axes = _figure(2, 1, (8.0, 6.5))
    fig.subplots_adjust(left=0.1, right=0.88, top=0.87, bottom=0.08, hspace=0.25)
    top, bottom = axes[0][0], axes[1][0]
    top.plot(s.step, s.loss, color="tab:blue", linewidth=1.0, label="train loss")
    top.plot(s.eval_step, s.val_loss, "o-", color="tab:orange", markersize=3, label="val loss")
    top.set_ylabel("loss (nats/token)")
    top.grid(alpha=0.3)
    lr_ax = top.twinx()
    lr_ax.plot(s.step, s.lr, "--", color="tab:gray", linewidth=1.0, label="learning rate")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lines = top.get_lines() + lr_ax.get_lines()
    # above the panel, outside it: no curve (the learning rate included) runs through it
    top.legend(lines, [ln.get_label() for ln in lines], loc="lower center", ncol=3,
               bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    if s.synthetic or any(math.isfinite(a) for a in s.copy_accuracy):
        _copies_panel(bottom, s)  # synthetic ids: no bytes; how well it copies instead
    else:
        _bpb_panel(bottom, s)
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    last = max(s.step + s.eval_step, default=0)
    fig.suptitle(f"{s.name}: training curves up to step {last}", fontsize=11, y=0.985)
    return fig


def _bpb_panel(ax, s: Series) -> None:
    ax.plot(s.eval_step, s.val_bpb, "o-", color="tab:green", markersize=3)
    finite = [(b, st) for b, st in zip(s.val_bpb, s.eval_step, strict=True) if math.isfinite(b)]
    if finite:
        best, at = min(finite)
        last, last_at = s.val_bpb[-1], s.eval_step[-1]
        now = (f"; last {last:.4f} at step {last_at}" if last_at != at and math.isfinite(last)
               else "")
        ax.set_title(f"best {best:.4f} bits/byte at step {at}{now}", fontsize=9)
    ax.set_ylabel("val bits/byte")


def _copies_panel(ax, s: Series) -> None:
    """An induction run: the share of copy tokens predicted (train/copies.py)."""
    acc = [100 * a for a in s.copy_accuracy]
    ax.plot(s.eval_step, acc, "o-", color="tab:green", markersize=3)
    ax.set_ylim(-2, 102)
    if acc and math.isfinite(acc[-1]):
        ax.set_title(f"{acc[-1]:.1f}% of the copies predicted at step {s.eval_step[-1]}",
                     fontsize=9)
    ax.set_ylabel("val copies predicted (%)")


def write_curves(s: Series) -> Path:
    """Rewrite `curves.png` in the run directory of `s` with `curves_figure(s)` (atomically: a
    reader sees the old picture or the new one). Raises WriteError if it cannot be written."""
    return atomic_write_bytes(s.run_dir / CURVES_FILE, figure_png(curves_figure(s)))


def comparable(runs: list[Series]) -> str:
    """Whether `runs` can share one picture. Runs on synthetic induction ids beside runs on
    text: MinigptError (their losses measure different things). Text runs whose tokenizers
    differ: a note for the picture (train loss per token does not compare; bits per byte
    does). '' when nothing needs saying."""
    synthetic = [s.name for s in runs if s.synthetic]
    text = [s.name for s in runs if s.kind.get("source") == "text"]
    if synthetic and text:
        raise MinigptError(
            f"{', '.join(synthetic)} trained on synthetic induction ids and {', '.join(text)} "
            "on text: their losses measure different things, so one picture would mislead; "
            "overlay runs of one kind")
    tokenizers = {s.kind["tokenizer"] for s in runs if "tokenizer" in s.kind}  # known ones
    if len(tokenizers) > 1:
        return (f"tokenizers differ ({', '.join(sorted(tokenizers))}): train loss per token "
                "does not compare across them, val bits/byte does")
    return ""


def unknown_kinds(runs: list[Series]) -> list[str]:
    """One line per run whose config.yaml does not say what it was trained on (`data_kind`'s
    problem): the file, why, and that nothing was concluded about it."""
    return [f"{s.kind['problem']}; whether {s.name}'s losses compare with the other runs' is "
            "not checked" for s in runs if s.kind.get("problem")]


def overlay_figure(runs: list[Series], note: str = ""):
    """Several runs in one picture: train loss and val bits/byte (induction runs: copies
    predicted) in rows, against step and against training tokens seen in columns, one colour
    per run. Wall time is left out: on a shared laptop it shows the machine's load more than
    the run (`minigpt bench` measures speed)."""
    copies = all(s.synthetic for s in runs)
    fig, axes = _figure(2, 2, (12.0, 8.0), layout="constrained")
    for i, s in enumerate(runs):
        colour = f"C{i % 10}"
        low = [100 * a for a in s.copy_accuracy] if copies else s.val_bpb
        for col, (x, ex) in enumerate(((s.step, s.eval_step), (s.tokens, s.eval_tokens))):
            axes[0][col].plot(x, s.loss, color=colour, linewidth=1.0, label=s.name)
            axes[1][col].plot(ex, low, "o-", color=colour, markersize=3, label=s.name)
    for col, xlabel in enumerate(("step", "training tokens seen")):
        axes[0][col].set_ylabel("train loss (nats/token)")
        axes[1][col].set_ylabel("val copies predicted (%)" if copies else "val bits/byte")
        axes[1][col].set_xlabel(xlabel)
        for row in (0, 1):
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    what = "induction runs" if copies else "bits/byte compares across tokenizers"
    fig.suptitle(f"{len(runs)} run{'s' if len(runs) != 1 else ''} against step (left) and "
                 f"training tokens seen (right); {what}" + (f"\n{note}" if note else ""),
                 fontsize=11)
    return fig


def write_overlay(runs: list[Series], out: Path) -> Path:
    """Draw `overlay_figure(runs)` into `out` (a .png; written atomically). Every run must
    have metrics (MinigptError names the one that has none), and be `comparable`."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ArgumentError("out", "must name a .png file, e.g. curves.png", subject=out)
    for s in runs:
        if s.empty:
            raise MinigptError(f"run {s.run_dir} has no metrics yet ({METRICS_FILE} is missing "
                               "or holds no records); train it first, or leave it out")
    note = comparable(runs)
    if out.is_dir():
        raise ArgumentError("out", "is a directory; give a file name such as curves.png",
                            subject=out)
    if (why := not_replaceable(out)) is not None:  # a FIFO, /dev/null: never replaced
        raise ArgumentError("out", why, subject=out)
    try:
        with atomic_file(out) as fh:  # the temp file first: an unwritable place fails at once
            fh.write(figure_png(overlay_figure(runs, note)))
    except WriteError as e:
        reason = os.strerror(e.errno) if e.errno else "write failed"
        raise ArgumentError("out", f"cannot write it ({reason}); choose a writable place",
                            subject=out) from None
    return out
