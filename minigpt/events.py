"""The events a long-running library call reports through its `on_event` callback: the one
progress mechanism of the library.

The library never prints: `train`, `build_tokenizer`, `prepare_dataset`, `run_bench`,
`inspect` (heads.inspection) and `train_features` call `on_event(event)` with these dataclasses,
and the CLI renders them (a progress bar, plain log lines with an ETA); tests collect them. The
analyses (minigpt.interp) import no events: their long loops take a plain
`progress(stage, done, total)` callback (interp.patching.OnProgress), and `progress_to(on_event)`
makes one that sends `Progress` events here. Standard library only.

A training session's events are also what its run directory is written from: metrics.jsonl
holds one record per StepEvent, EvalEvent and HeadScoresEvent, and the pictures and summary.md
are drawn from them (train/outputs.py), so every consumer sees the same stream.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minigpt.display import duration, head_name

OnEvent = Callable[[object], None]


def no_events(event: object) -> None:
    """The default callback: report nothing."""


# -- tokenizer --------------------------------------------------------------------------------


@dataclass
class TrainingBPE:
    """BPE training starts on `n_bytes` of corpus text (after train_max_bytes)."""
    corpus: str
    n_bytes: int
    vocab_size: int


@dataclass
class BPETrained:
    vocab_size: int      # ranks actually learned (fewer than asked if the corpus runs out of pairs)
    seconds: float
    path: Path           # cache directory it was saved to


@dataclass
class TokenizerCacheHit:
    path: Path


# -- data -------------------------------------------------------------------------------------


@dataclass
class TokenizingFile:
    """Tokenizing file `index` (0-based) of `n_files`; `n_bytes` is its size."""
    path: Path
    n_bytes: int
    index: int
    n_files: int


@dataclass
class CorpusProgress:
    """A long pass over the corpus, `done` of `total` bytes: stage "scan" (reading JSON Lines
    and Parquet files to measure their records; file bytes), "bpe" (training the BPE on the
    training documents) or "tokenize" (all documents); document bytes for the last two."""
    stage: str
    done: int
    total: int


@dataclass
class DatasetReady:
    cache_path: Path | None    # None for induction
    n_train: int               # 0 for induction: its rows are drawn from seeds, never stored
    n_val: int
    cached: bool               # True when an existing cache was reused
    corpus_files: tuple[Path, ...] = ()  # the resolved corpus files (empty for induction)
    synthetic: str = ""        # induction: what its rows are, in words


# -- training ---------------------------------------------------------------------------------


@dataclass
class StartEvent:
    run_dir: Path
    start_step: int          # steps already done (0 for a fresh run)
    max_steps: int
    params: int              # distinct parameters (tied weights once)
    device: str
    world_size: int
    tokens_per_step: int     # batch_size * block_size
    n_vocab: int
    bytes_per_token: float
    threads: int = 0         # CPU intra-op threads training runs on (0: not on CPU)
    data_source: str = "text"  # data.source: text, or induction (synthetic ids, no bytes)
    precision: str = "fp32"  # what train.precision resolved to here: fp32, or bf16 (autocast)


@dataclass
class NothingSavedEvent:
    """`--resume` found no committed checkpoint in `run_dir` (a run stopped during start-up,
    before its first save): the run starts from step 0."""
    run_dir: Path


@dataclass
class UnreadLinesKept:
    """A resumed run's metrics.jsonl holds `lines` lines that are not records (a damaged
    line, a note someone wrote, bytes that are not UTF-8): kept where they stand, byte for
    byte; readers skip them (and say so)."""
    path: Path
    lines: int


@dataclass
class StepEvent:
    step: int                # optimizer steps completed
    max_steps: int
    loss: float              # mean train loss of this step's global batch
    lr: float
    grad_norm: float         # before clipping
    tokens_per_s: float      # over the last log interval
    elapsed: float           # training seconds so far (all sessions)
    tokens_seen: int


@dataclass
class EvalEvent:
    step: int
    val_loss: float
    val_ppl: float
    val_bpb: float           # bits per byte = val_loss / ln 2 / bytes_per_token
    best_val_loss: float
    best_val_bpb: float
    elapsed: float
    samples: list[tuple[str, str]]  # (prompt, generated text)
    tokens_seen: int
    # data.source induction (train/copies.py): loss and top-1 accuracy on the copy positions
    copy_loss: float = math.nan
    copy_accuracy: float = math.nan
    best_step: int = 0       # the step of best_val_loss


@dataclass
class HeadScoresEvent:
    """Every head's score on the built-in probes (heads/timeline.py) at `step`."""
    step: int
    seconds: float           # how long the measurement took
    scores: dict[str, list]  # {score name: n_layer x n_head}
    circuit: dict | None = None  # the induction circuit's K-composition and best DLA head


FORMED = 0.9  # a head "is" a <kind> head once its score on the built-in probe reaches this


@dataclass
class CircuitCheck:
    """Whether a model's heads, as the built-in induction probe scored them at `step`, hold the
    induction circuit: an induction head in a layer after the first and a previous-token head
    in a layer before it, both >= FORMED. `induction` is the best-scoring induction head of the
    layers after the first, `previous` the best previous-token head below its layer: (layer,
    head, score), the score None where it does not apply."""
    step: int
    induction: tuple[int, int, float | None]
    previous: tuple[int, int, float | None]

    @property
    def formed(self) -> bool:
        return _ok(self.induction) and _ok(self.previous)

    def short(self) -> str:
        """A few words for `minigpt runs`."""
        return {(True, True): "heads formed", (True, False): "no previous-token head",
                (False, True): "no induction head"}.get(
            (_ok(self.induction), _ok(self.previous)), "no heads formed")

    def sentence(self) -> str:
        """What formed and what did not, in words (summary.md and the end of `minigpt train`)."""
        ind, prev = _head(self.induction), _head(self.previous)
        if self.formed:
            return (f"formed at step {self.step}: {ind} is an induction head "
                    f"({_score(self.induction)}) and {prev} a previous-token head "
                    f"({_score(self.previous)}), on the induction probe")
        said = [f"{what} formed ({_head(h)}, {_score(h)})" if _ok(h) else
                f"no {what} (the best, {_head(h)}, scores {_score(h)}; {FORMED} needed)"
                for what, h in (("induction head", self.induction),
                                ("previous-token head", self.previous))]
        return f"NOT formed by step {self.step}: " + "; ".join(said)

    def to_json(self) -> dict:
        return {"step": self.step, "formed": self.formed, "status": self.short(),
                **{k: {"head": f"L{h[0]}.H{h[1]}", "layer": h[0], "index": h[1], "score": h[2]}
                   for k, h in (("induction", self.induction), ("previous", self.previous))}}


def circuit_check(step: int, scores: dict) -> CircuitCheck | None:
    """The CircuitCheck of one head measurement (a HeadScoresEvent's `scores`, or a "heads"
    record's in metrics.jsonl); None for a one-layer model or scores without both kinds."""
    ind, prev = scores.get("induction"), scores.get("previous")
    if not isinstance(ind, list) or not isinstance(prev, list) or len(ind) < 2 \
            or len(prev) != len(ind) or not all(isinstance(r, list) and r for r in ind + prev):
        return None  # a one-layer model, or a record that is not one of ours

    def best(rows: list, layers: range) -> tuple[int, int, float | None]:
        value = {(la, h): _finite(v) for la in layers for h, v in enumerate(rows[la])}
        la, h = max(value, key=lambda k: -1.0 if value[k] is None else value[k])
        return la, h, value[la, h]

    induction = best(ind, range(1, len(ind)))
    return CircuitCheck(step, induction, best(prev, range(induction[0])))


def _finite(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _ok(h: tuple[int, int, float | None]) -> bool:
    return h[2] is not None and h[2] >= FORMED


def _head(h: tuple[int, int, float | None]) -> str:
    return head_name(h[0], h[1])


def _score(h: tuple[int, int, float | None]) -> str:
    """Three decimals, cut rather than rounded: 0.8996 shows as 0.899, never as the 0.900 it
    does not reach."""
    return "n/a" if h[2] is None else f"{math.floor(h[2] * 1000) / 1000:.3f}"


@dataclass
class CheckpointEvent:
    step: int
    path: Path


@dataclass
class HeadFormedEvent:
    """A head's probe score reached the "formed" threshold for the first time in this run."""
    step: int
    layer: int
    head: int
    kind: str                # induction | previous | duplicate | first
    what: str                # "an induction head", ...
    score: float


@dataclass
class DoneEvent:
    run_dir: Path
    step: int
    max_steps: int
    reason: str              # finished | interrupted | stopped | formed (stop_when_formed)
    signal: str              # SIGINT / SIGTERM when interrupted, else ""
    params: int
    tokens_seen: int
    wall_time: float         # training seconds (all sessions)
    tokens_per_s: float
    best_val_loss: float     # nan if never evaluated
    best_val_bpb: float
    checkpoint: Path | None
    best_step: int = 0       # the step of best_val_loss
    last_eval: EvalEvent | None = None  # this session's last evaluation (the saved model's)
    data_source: str = "text"  # data.source
    heads: HeadScoresEvent | None = None  # the last head measurement (None: heads not scored)

    def summary_rows(self) -> list[tuple[str, str]]:
        """The end-of-run figures (summary.md and the CLI's table share them): the best and the
        last validation value side by side (the saved weights are the last step's)."""
        last = self.last_eval
        rows = [
            ("status", f"{self.reason} at step {self.step}/{self.max_steps}"),
            ("parameters", f"{self.params:,}"),
            ("tokens seen", f"{self.tokens_seen:,}"),
            ("wall time", duration(self.wall_time)),
            ("tokens/s", f"{self.tokens_per_s:,.0f}"),
        ]
        run = shlex.quote(str(self.run_dir))
        if self.data_source == "induction":  # synthetic ids: no bytes, no text to sample
            if last is not None and math.isfinite(last.copy_loss):
                copies = (f"loss {last.copy_loss:.4f} nats/token, "
                          f"{100 * last.copy_accuracy:.1f}% predicted, at step {last.step}")
                rows.append(("copies (val)", copies))
            rows += [("val loss, all positions", _best_last(self.best_val_loss, self.best_step,
                                                             last and last.val_loss, last))]
            return [*rows, ("run directory", str(self.run_dir)), *self._heads_rows(run)]
        rows += [("val loss", _best_last(self.best_val_loss, self.best_step,
                                         last and last.val_loss, last)),
                 ("val bits/byte", _best_last(self.best_val_bpb, self.best_step,
                                              last and last.val_bpb, last)),
                 ("run directory", str(self.run_dir)),
                 ("sample", f"minigpt sample --run {run}")]
        return rows

    def _heads_rows(self, run: str) -> list[tuple[str, str]]:
        """An induction run's heads in words (what formed, what did not) and what to run next:
        on a run without the circuit, the commands that show what the model does instead."""
        check = circuit_check(self.heads.step, self.heads.scores) if self.heads else None
        inspect = f"minigpt inspect-heads --run {run} --probe induction"
        if check is None or check.formed:
            return [*([("heads", check.sentence())] if check else []), ("next", inspect)]
        last = self.last_eval
        how = "" if _ok(check.induction) else " some other way"  # no induction head to do it
        copies = (f" The model predicts {100 * last.copy_accuracy:.1f}% of the copies (val, "
                  f"step {last.step}){how}."
                  if last is not None and math.isfinite(last.copy_accuracy) else "")
        instead = (f"see what the model does instead: {inspect} (each head's pattern); "
                   f"{inspect} --ablate zero (what removing each head costs); minigpt circuit "
                   f"--run {run} --probe induction --patch-from corrupted (which heads carry "
                   "the copies)")
        return [("heads", check.sentence() + "." + copies), ("next", instead)]


def _best_last(best: float, best_step: int, last: float | None, ev: EvalEvent | None) -> str:
    """'best B at step S; last L at step N (saved)': the two differ once validation rises."""
    if not math.isfinite(best):
        return "n/a"
    text = f"best {best:.4f}" + (f" at step {best_step}" if best_step else "")
    if ev is not None and last is not None and math.isfinite(last) and ev.step != best_step:
        text += f"; last {last:.4f} at step {ev.step} (the saved model)"
    return text


# -- analyses and sparse autoencoders --------------------------------------------------------


@dataclass
class Progress:
    """`done` of `total` of a long loop's `stage`: an analysis's ("ablating heads", "patching
    heads", "splitting qk", "composition", "scoring edges", "circuit search", ...) or the z an
    SAE is trained on ("z of train", "z of val")."""
    stage: str
    done: int
    total: int


def progress_to(on_event: OnEvent) -> Callable[[str, int, int], None]:
    """The plain `progress(stage, done, total)` callback the analyses take
    (interp.patching.OnProgress), sending `Progress(stage, done, total)` to `on_event`."""
    return lambda stage, done, total: on_event(Progress(stage, done, total))


@dataclass
class SaeStarting:
    """Every check of `minigpt features train` passed (the cost included): the SAE on `what`
    starts, into `out`; a feature with no firing in `idle_after` training tokens counts as
    idle (dead, for AuxK)."""
    what: str
    out: Path
    idle_after: int = 0


@dataclass
class SaeStep:
    """An SAE's training: `step` of `steps` done, the step's losses, seconds so far."""
    step: int
    steps: int
    mse: float
    aux: float
    dead_fraction: float
    elapsed: float


# -- bench ------------------------------------------------------------------------------------


@dataclass
class BenchEvent:
    """A benchmark case starts (`suite`: attention | train | sample)."""
    suite: str
    message: str
