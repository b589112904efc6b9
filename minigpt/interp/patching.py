"""Interventions, measured: what every head or edge experiment scores (one `Metric`: `loss`,
`logit` or `logit_diff`), the one sweep driver that runs rows of interventions through the
forward pass's one intervention point (`core.gpt.Intervention`), and the interventions the
head experiments use. Ablation (`interp/heads.py`), head patching (`interp/head_circuits.py`) and
edge patching (`interp/edge_graph.py`) are each a `Plan` run by `sweep`.

The metric
----------
A metric reads the logits at its scored positions P (query positions, each predicting the
token after it) of one sequence and gives one number:

- `loss`: the mean over P of the cross-entropy of the target (the next token, or a fixed
  `target` token) in nats/token (per token in float32, within ~1e-6 of float64);
- `logit`: the mean over P of the target's logit;
- `logit_diff`: logit[answer] - logit[wrong] at the last position (P is that position);
- `output` (a compiled program's, minigpt.truth.inputs; P: its positions, each read as it is,
  not as a prediction of the next): the mean over P of the logit of the clean input's output
  there (a categorical output: targets are its index), or of the output value times its
  clean - reference difference there (a numerical one: targets are those float weights), so
  that every pair's change counts with one sign (a plain mean of values would cancel over
  pairs drawn alike).

A batch of sequences (several clean / corrupted pairs) is scored by the mean of their values.
Logits are the model's own (after `model.logit_softcap`, if set).

The sweep
---------
`sweep(model, idx, metric, targets, plan)` runs `plan.n` rows, each a change of the run on idx
(B, T) (B sequences, scored together): row r changes nothing before block `plan.layer(r)`, so
one clean pass keeps the residual stream entering every block (`GPT.residual_stream`) and the
rows of layer l start from it (`GPT.from_layer`), batched (every row holds the B sequences),
in chunks bounded by CHUNK_FLOATS, with the LM head at the scored positions only. When
`plan.base_row`, each chunk also runs the unchanged input as its row 0, and each row's value
is returned beside it: a change that is no change then gives exactly the base's value (the
same kernels on the same batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from minigpt.core.gpt import ForwardSpec, Intervention
from minigpt.errors import ArgumentError

METRIC_KINDS = ("loss", "logit", "logit_diff")
# Floats of activations per row a chunk may hold (the wider of T x 4C and P scored x V, and a
# plan's own buffers): ~256 MB.
CHUNK_FLOATS = 64 * 1024 * 1024
SMALL_GAP = 1e-2  # a clean -> corrupted change of the metric below this gets a note


# --------------------------------------------------------------------------------------------
# The metric.


@dataclass(frozen=True)
class Metric:
    """What an experiment scores (module docstring): `kind` loss | logit | logit_diff, at the
    query `positions`; the target token is the next one unless `target` is set; `answer` and
    `wrong` (logit_diff only) are the two tokens compared at the last position."""

    positions: tuple[int, ...]
    kind: str = "loss"
    target: int | None = None
    answer: int | None = None
    wrong: int | None = None

    @property
    def logit_diff(self) -> bool:
        return self.kind == "logit_diff"

    def targets(self, tokens: Sequence[int]) -> list[int]:
        """The token scored at each position of `tokens` (none for a logit difference)."""
        assert self.kind != "output", "a program's targets are its outputs (truth.inputs)"
        if self.logit_diff:
            return []
        if self.target is not None:
            return [self.target] * len(self.positions)
        return [tokens[p + 1] for p in self.positions]

    def as_logit(self) -> Metric:
        """The linear metric of the same tokens: a loss becomes the target's logit."""
        return replace(self, kind="logit") if self.kind == "loss" else self

    def describe(self) -> str:
        if self.logit_diff:
            return f"logit[{self.answer}] - logit[{self.wrong}] at the last position"
        if self.kind == "output":
            return (f"the program's output towards the clean input's, averaged over "
                    f"{len(self.positions)} positions")
        what = f"token {self.target}" if self.target is not None else "the next token"
        if self.kind == "loss":
            return (f"the loss of predicting {what} (nats/token), averaged over "
                    f"{len(self.positions)} positions")
        return f"the logit of {what}, averaged over {len(self.positions)} positions"

    def to_json(self) -> dict:
        return {"kind": self.kind, "what": self.describe(), "positions": list(self.positions),
                "target": self.target, "answer": self.answer, "wrong": self.wrong}

    def values(self, logits: Tensor, targets: Tensor | None) -> Tensor:
        """(N,) in the logits' dtype (differentiable) from logits (N, P, V) at the positions
        and targets (N, P) (ignored for a logit difference)."""
        if self.logit_diff:
            last = logits[:, -1]
            return last[:, self.answer] - last[:, self.wrong]
        if self.kind == "output" and targets.is_floating_point():  # numerical: one output
            return (logits[..., 0] * targets.to(logits.dtype)).mean(-1)
        if self.kind in ("logit", "output"):
            return logits.gather(-1, targets[..., None])[..., 0].mean(-1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="none")
        return loss.view(targets.shape).mean(-1)


def make_metric(n_tokens: int, positions: Sequence[int] | None = None, *,
                target: int | None = None, answer: int | None = None,
                wrong: int | None = None, kind: str = "loss", minimum: int = 2,
                param: str = "max_tokens") -> Metric:
    """A checked Metric for an input of `n_tokens` tokens (positions None: every one with a
    next token; `answer` and `wrong` make it a logit difference); ArgumentError naming the
    parameter otherwise (`param` and `minimum`: what an input too short to score is refused
    as, and the shortest input of its kind that has a prediction to score)."""
    if (answer is None) != (wrong is None):
        raise ArgumentError("answer" if answer is None else "wrong",
                            "the logit difference needs both {name} and the other token "
                            "(--answer and --wrong)")
    if kind not in METRIC_KINDS:
        raise ArgumentError("metric", f"'{kind}' is not a metric; valid: "
                            f"{', '.join(METRIC_KINDS)}")
    if answer is not None:
        if target is not None:
            raise ArgumentError("target", "a target token and a logit difference (--answer, "
                                "--wrong) exclude each other; give one")
        if answer == wrong:
            raise ArgumentError("wrong", "is the same token as the answer: the difference "
                                "would be 0")
        return Metric((n_tokens - 1,), "logit_diff", answer=answer, wrong=wrong)
    if kind == "logit_diff":
        raise ArgumentError("metric", "logit_diff needs --answer and --wrong")
    scored = list(range(n_tokens - 1)) if positions is None else list(positions)
    if not scored:
        raise ArgumentError(param, f"the input has {n_tokens} tokens, too short to score a "
                            f"prediction: it needs at least {minimum} (see --max-tokens)")
    assert all(0 <= p < n_tokens - 1 for p in scored), "positions must have a next token"
    return Metric(tuple(scored), kind, target=target)


def check_same_length(clean: Sequence[int], corrupted: Sequence[int]) -> None:
    if len(clean) != len(corrupted):
        raise ArgumentError("patch_from", f"has {len(corrupted)} tokens but the input has "
                            f"{len(clean)}: patching swaps activations position by position, "
                            "so both need the same number of tokens")


# --------------------------------------------------------------------------------------------
# The sweep.

# How every long loop of an analysis reports: progress(stage, done, total). The analyses send no
# events (they import no events module); `minigpt.events.progress_to(on_event)` makes one of
# these that sends `events.Progress`, the one progress mechanism of the library.
OnProgress = Callable[[str, int, int], None]


def stage(progress: OnProgress | None, name: str) -> Callable[[int, int], None] | None:
    """`progress` for one stage: (done, total) -> progress(name, done, total); None: none."""
    return None if progress is None else (lambda done, total: progress(name, done, total))


class Plan(Protocol):
    """What `sweep` runs: `n` rows; row r changes nothing before block `layer(r)`;
    `intervention(rows, batch)` is the one Intervention for a chunk of rows laid out
    row-major, `batch` sequences per row (row 0 the unchanged input when `base_row`);
    `row_floats(T)` the floats a row of one sequence holds beyond the pass itself."""

    n: int
    base_row: bool

    def layer(self, row: int) -> int: ...

    def intervention(self, rows: Sequence[int], batch: int) -> Intervention: ...

    def row_floats(self, n_tokens: int) -> int: ...


def sweep(model, idx: Tensor, metric: Metric, targets: Tensor | None, plan: Plan,
          progress: Callable[[int, int], None] | None = None) -> tuple[float | None, Tensor]:
    """(the unchanged run's value or None, every row's value (n,) float64) of `plan` on idx
    (B, T) whose scored targets are `targets` (B, P) (module docstring); `progress(done, n)`
    after each chunk of rows. No gradients; the caller sets eval mode."""
    cfg = model.cfg
    B, T = idx.shape
    pos = list(metric.positions)
    with torch.no_grad():
        stream = model.residual_stream(idx, attn=ForwardSpec(cfg.attn_impl))  # L + 1 x (B, T, C)
        width = max(T * max(4 * cfg.n_embd, cfg.mlp_dim), len(pos) * cfg.n_out,
                    plan.row_floats(T))
        per = max(1, CHUNK_FLOATS // (B * width) - plan.base_row)
        values = torch.zeros(plan.n, dtype=torch.float64)
        base, done = None, 0
        by_layer: dict[int, list[int]] = {}
        for r in range(plan.n):
            by_layer.setdefault(plan.layer(r), []).append(r)
        for layer in sorted(by_layer):
            rows = by_layer[layer]
            for first in range(0, len(rows), per):
                chunk = rows[first:first + per]
                n = len(chunk) + plan.base_row
                x = stream[layer].repeat(n, 1, 1)  # (n * B, T, C): row r is r*B .. r*B+B-1
                spec = ForwardSpec(cfg.attn_impl, intervention=plan.intervention(chunk, B))
                out = model.from_layer(layer, x, attn=spec)
                logits = model.unembed(out[:, pos])  # (n * B, P, V): the scored positions only
                tgt = None if targets is None else targets.repeat(n, 1)
                v = metric.values(logits, tgt).double().view(n, B).mean(1).cpu()
                if plan.base_row:
                    base = float(v[0]) if base is None else base
                    v = v[1:]
                values[chunk] = v
                done += len(chunk)
                if progress is not None:
                    progress(done, plan.n)
    return base, values


def run_value(model, idx: Tensor, metric: Metric, targets: Tensor | None,
              spec: ForwardSpec | None = None) -> float:
    """The metric of one plain run on idx (B, T) (mean over the B sequences), no gradients;
    the LM head at the scored positions only."""
    with torch.no_grad():
        final = model.residual_stream(idx, attn=spec)[-1]
        v = metric.values(model.unembed(final[:, list(metric.positions)]), targets)
    return float(v.double().mean())


# --------------------------------------------------------------------------------------------
# Heads, one per row: ablation and head patching.


class HeadRows:
    """A Plan: row r replaces the output z of head `heads[r]` = (layer, head) by
    `replace(layer, z)` (which gets every row's z (rows * batch, H, T, D) of that layer and
    returns a tensor of that shape), the other heads and rows unchanged. A base row."""

    base_row = True

    def __init__(self, heads: Sequence[tuple[int, int]], n_head: int,
                 replace: Callable[[int, Tensor], Tensor]) -> None:
        self.heads, self.n_head, self.replace = list(heads), n_head, replace
        self.n = len(self.heads)

    def layer(self, row: int) -> int:
        return self.heads[row][0]

    def row_floats(self, n_tokens: int) -> int:
        return 0

    def intervention(self, rows: Sequence[int], batch: int) -> Intervention:
        layer = self.heads[rows[0]][0]
        mask = torch.zeros(1 + len(rows), self.n_head, 1, 1, dtype=torch.bool)
        for i, r in enumerate(rows, start=1):
            assert self.heads[r][0] == layer, "a chunk's rows share their layer"
            mask[i, self.heads[r][1]] = True  # (rows, H, 1, 1)
        return _ReplaceHeads(layer, mask.repeat_interleave(batch, dim=0), self.replace)


class _ReplaceHeads(Intervention):
    def __init__(self, layer: int, mask: Tensor, replace: Callable[[int, Tensor], Tensor]):
        self.at, self.mask, self.replace = layer, mask, replace

    def heads(self, layer: int, z: Tensor) -> Tensor:
        if layer != self.at:
            return z
        return torch.where(self.mask.to(z.device), self.replace(layer, z), z)


class Record(Intervention):
    """Keeps what a run writes (no change): `embed` (B, T, C), every layer's head outputs `z`
    (B, H, T, D), every MLP's output `mlp` {layer: (B, T, C)} and `final`, the residual the
    final norm reads (B, T, C)."""

    def __init__(self) -> None:
        self.z: list[Tensor] = []
        self.mlp: dict[int, Tensor] = {}
        self.embedded: Tensor | None = None
        self.final: Tensor | None = None

    def embed(self, x: Tensor) -> Tensor:
        self.embedded = x
        return x

    def heads(self, layer: int, z: Tensor) -> Tensor:
        self.z.append(z)
        return z

    def mlp_out(self, layer: int, y: Tensor) -> Tensor:
        self.mlp[layer] = y
        return y

    def final_in(self, x: Tensor) -> Tensor:
        self.final = x
        return x


def record(model, idx: Tensor, logits: bool = True) -> tuple[Tensor | None, Record]:
    """One plain run of idx (B, T), no gradients: its logits (B, T, V) (None when `logits` is
    false: the LM head is not run) and its Record."""
    rec = Record()
    spec = ForwardSpec(model.cfg.attn_impl, intervention=rec)
    with torch.no_grad():
        if not logits:
            model.residual_stream(idx, attn=spec)
            return None, rec
        out, _ = model(idx, attn=spec)
    return out, rec
