"""What a compiled program's circuit is searched on: random inputs of the program's vocabulary
(BOS first, as tracr adds it), the (clean, corrupted) pairs `minigpt circuit` scores (the
corrupted input drawn alike, or an ablation: zero or mean), and the metric that scores them.

The metric (interp.patching's `output` kind): at every position past BOS, the program's
output read off the logits towards the clean input's output: the logit of the clean output's
value (categorical), or the output value times (clean - reference) there (numerical; the
reference is the output of the source run: the corrupted input's, 0 under the zero ablation,
the mean output over the pairs and positions under the mean ablation, which is what the
linear output read makes of the mean residual stream).
"""

from __future__ import annotations

import random

import torch

from minigpt.errors import ArgumentError
from minigpt.heads.edge_circuit import Pairs
from minigpt.interp.edge_args import ABLATIONS
from minigpt.interp.patching import Metric
from minigpt.truth.store import Truth

RESAMPLE = "resample"  # --patch-from of a compiled run: a fresh random input of its vocabulary
SOURCES = (RESAMPLE, *ABLATIONS)
PATCH_ALIASES = {"corrupted": RESAMPLE}


def random_ids(tokenizer, truth: Truth, n_tokens: int, seed: str) -> list[int]:
    """One seeded random input of the program's vocabulary: BOS, then n_tokens - 1 tokens."""
    rng = random.Random(seed)
    vocab = truth.program["vocab"]
    return [tokenizer.eot_id] + [tokenizer.words[rng.choice(vocab)] for _ in range(n_tokens - 1)]


def check_source(patch_from: str | None) -> str:
    """A compiled run's --patch-from: resample (the default), zero or mean; ArgumentError
    otherwise (a text or a probe's corruption means nothing for a program)."""
    name = PATCH_ALIASES.get(patch_from or RESAMPLE, patch_from or RESAMPLE)
    if name not in SOURCES:
        raise ArgumentError("patch_from", f"'{patch_from}' is not a source for a compiled "
                            f"program; valid: {', '.join(SOURCES)} (resample: a fresh random "
                            "input of its vocabulary; zero, mean: ablations)")
    return name


def program_pairs(model, tokenizer, truth: Truth, *, patch_from: str | None, pairs: int,
                  seed: int, max_tokens: int | None = None) -> Pairs:
    """`pairs` clean inputs (seeds seed, seed + 1, ...) of `max_tokens` tokens (default: the
    model's block_size: BOS and max_seq_len tokens), each with a corrupted input drawn alike
    (`resample`) or an ablation, and the metric (module docstring)."""
    source = check_source(patch_from)
    block = model.cfg.block_size
    n = block if max_tokens is None else max_tokens
    if not 2 <= n <= block:
        raise ArgumentError("max_tokens", f"out of range; valid: 2..{block} (BOS and up to "
                            f"{block - 1} tokens of the program)", subject=max_tokens)
    if pairs < 1:
        raise ArgumentError("pairs", "must be at least 1", subject=pairs)
    device = next(model.parameters()).device
    clean = torch.tensor([random_ids(tokenizer, truth, n, f"clean:{seed + i}")
                          for i in range(pairs)], device=device)
    corrupted = torch.tensor([random_ids(tokenizer, truth, n, f"corrupted:{seed + i}")
                              for i in range(pairs)], device=device) \
        if source == RESAMPLE else source
    metric = Metric(tuple(range(1, n)), "output")
    targets = output_targets(model, truth, clean, corrupted, metric)
    what = (f"program {truth.program['name']}: {pairs} random input(s) of its vocabulary, "
            f"seeds {seed}..{seed + pairs - 1}")
    how = {RESAMPLE: "resample: fresh random inputs of the vocabulary, drawn alike",
           "zero": "zero: every edge's source value is zero",
           "mean": "mean: every edge's source value is its writer's mean over the inputs and "
                   "every position"}[source]
    return Pairs(clean, corrupted, targets, metric, what, how)


def output_targets(model, truth: Truth, clean: torch.Tensor, corrupted, metric: Metric
                   ) -> torch.Tensor:
    """The metric's targets (B, P): the clean output's index at each scored position
    (categorical), or clean - reference of the output value (numerical; module docstring)."""
    pos = list(metric.positions)
    with torch.no_grad():
        out = model(clean)[0]  # (B, T, n_out)
        if truth.categorical:
            return out[:, pos].argmax(-1)
        value = out[..., 0]
        if isinstance(corrupted, str):
            ref = torch.zeros_like(value) if corrupted == "zero" else \
                value.mean().expand_as(value)
        else:
            ref = model(corrupted)[0][..., 0]
    return (value - ref)[:, pos].double()


def program_outputs(model, truth: Truth, ids: list[int]) -> list:
    """The compiled program's output at every position of the input `ids` (BOS first; its
    own position included): the value each position reads (categorical), or the number."""
    with torch.no_grad():
        out = model(torch.tensor([ids], device=next(model.parameters()).device))[0][0]
    if truth.categorical:
        return [truth.output["values"][i] for i in out.argmax(-1).tolist()]
    return [round(float(v), 6) for v in out[:, 0]]
