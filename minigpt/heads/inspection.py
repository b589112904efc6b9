"""Attention of a model on one input, with every head's scores: `inspect()` returns an
`Inspection` (data only); `cli` renders tables, `output.py` writes the files (`attention_png.py`
PNG, `viewer.py` HTML).

The maps come from the explicit attention path; the same input also runs through the SDPA path
and the largest logit difference is reported (`parity_max_diff`), so a map is never drawn from
a path that disagrees with the one the model runs on. Attention or logits that are not finite
(a model whose weights hold NaN) are refused with a MinigptError, never scored or written.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minigpt.config.fields import comma_list
from minigpt.core.gpt import device_of, flops_per_token
from minigpt.cost import Cost, Work, check_flops
from minigpt.display import head_name
from minigpt.errors import ArgumentError, MinigptError
from minigpt.events import OnEvent, progress_to
from minigpt.heads.probes import ProbeInput
from minigpt.interp.head_circuits import (
    KIND_HELP,
    Attribution,
    Composition,
    Patching,
    composition_cost,
    composition_scores,
    direct_logit_attribution,
    patch_heads,
)
from minigpt.interp.heads import (
    LAG_HELP,
    SCORE_HELP,
    SCORE_NAMES,
    Ablation,
    ablate_heads,
    attention_maps,
    best_lag,
    dominant_type,
    lag_scores,
    offset_profile,
    score_heads,
)
from minigpt.interp.lens import Lens, logit_lens
from minigpt.interp.patching import OnProgress, make_metric
from minigpt.interp.qk import QKHead, induction_pairs, qk_attribution, qk_cost

# --------------------------------------------------------------------------------------------
# Attention from a model.

# A head's dominant pattern as its role, in words (the qk split names its writers with them).
ROLE_WORDS = {"induction": "induction", "previous": "previous-token",
              "duplicate": "duplicate-token", "first": "first-token", "self": "self",
              "delimiter": "delimiter"}

# The order in which head kinds are worth showing first (`Inspection.most_distinctive`): the
# circuits the lecture builds up to before the attention sinks most text heads park on.
SHOW_FIRST = ("induction", "previous", "duplicate", "delimiter", "self", "first")


@dataclass
class Inspection:
    """Attention of every head on one input, with the head scores.

    attention: (n_layer, n_head, T, T) float32 on CPU, from the explicit attention path.
    scores: name -> (n_layer, n_head) float32 (NaN = not applicable to this input).
    parity_max_diff: max |logits_explicit - logits_sdpa| on the same input."""

    tokens: list[int]
    token_strs: list[str]
    attention: Tensor
    scores: dict[str, Tensor]
    parity_max_diff: float
    parity_tol: float
    source: str                      # "text", "probe:induction", ...
    run: str = ""
    step: int = 0
    notes: list[str] = field(default_factory=list)
    ablation: Ablation | None = None  # what each head carries (`ablate_heads`), if asked for
    dla: Attribution | None = None  # each head's direct share of the logit (interp.head_circuits)
    patch: Patching | None = None  # each head patched from a corrupted input
    composition: Composition | None = None  # Q/K/V composition from the weights
    copy_start: int | None = None    # induction probe: the position its second copy starts at
    patch_tokens: list[int] | None = None  # the corrupted input `patch` was patched from
    lens: Lens | None = None  # the logit lens (interp.lens), if asked for
    token_str: Callable[[int], str] | None = None  # any id's text (the lens's top tokens)
    # what each head does at every offset and lag (interp.heads; computed from `attention`):
    # offsets (n_layer, n_head, K + 1); lags {"previous"|"induction": (n_layer, n_head, K)}
    offsets: Tensor | None = None
    lags: dict[str, Tensor] | None = None
    qk: list[QKHead] | None = None  # scores split by writer (interp.qk), if asked for
    qk_pairs: str = ""  # which pairs they were split at, in words

    def __post_init__(self) -> None:
        if self.offsets is None:
            self.offsets = offset_profile(self.attention)
        if self.lags is None:
            self.lags = lag_scores(self.attention, self.tokens)

    @property
    def n_layer(self) -> int:
        return self.attention.shape[0]

    @property
    def n_head(self) -> int:
        return self.attention.shape[1]

    @property
    def parity_ok(self) -> bool:
        return self.parity_max_diff <= self.parity_tol

    def head_scores(self, layer: int, head: int) -> dict[str, float]:
        return {n: float(self.scores[n][layer, head]) for n in SCORE_NAMES}

    def dominant(self, layer: int, head: int) -> str:
        return dominant_type(self.head_scores(layer, head))

    def role(self, layer: int, head: int) -> tuple[str, float] | None:
        """The head's role on this input, in words, with its score: its dominant type when
        that is a pattern (`previous-token`, 0.92); None when it has none (diffuse, local,
        mixed)."""
        kind = self.dominant(layer, head)
        if kind not in ROLE_WORDS:
            return None
        return ROLE_WORDS[kind], float(self.scores[kind][layer, head])

    def writer_roles(self) -> dict[str, dict]:
        """{head name: {"role", "score"}} of every head with a role (`role`): how the qk
        split's writers are named."""
        out = {}
        for la in range(self.n_layer):
            for h in range(self.n_head):
                r = self.role(la, h)
                if r is not None:
                    out[head_name(la, h)] = {"role": r[0], "score": round(r[1], 4)}
        return out

    def qk_pairs_of(self, h: QKHead) -> str:
        """Which pairs head `h` was split at, in words, with how many of them are the induction
        targets on the induction probe."""
        more = ", ..." if len(h.pairs) > PAIRS_SHOWN else ""
        named = ", ".join(f"{t}:{s}" for _, t, s in h.pairs[:PAIRS_SHOWN])
        words = f"{len(h.pairs)} pair{'s' if len(h.pairs) != 1 else ''} ({named}{more})"
        if self.copy_start is not None:
            targets = set(induction_pairs(self.tokens, self.copy_start))
            hit = sum(p in targets for p in h.pairs)
            words += f"; {hit} of them the induction targets"
        return words

    def most_distinctive(self, pairs: Sequence[tuple[int, int]] | None = None
                         ) -> tuple[int, int]:
        """The head to show first, among `pairs` (None: all): of the kinds in SHOW_FIRST order
        (induction first: the reason a student opens the induction probe), the first that some
        head has as its dominant type, and of those heads the one scoring highest on it; no
        head with a dominant pattern: the one with the highest pattern score."""
        pairs = list(pairs) if pairs else [(la, h) for la in range(self.n_layer)
                                           for h in range(self.n_head)]

        def score(pair: tuple[int, int], kind: str) -> float:
            v = float(self.scores[kind][pair])
            return -1.0 if math.isnan(v) else v

        for kind in SHOW_FIRST:
            found = [p for p in pairs if self.dominant(*p) == kind]
            if found:
                return max(found, key=lambda p: score(p, kind))
        return max(pairs, key=lambda p: max(score(p, k) for k in SHOW_FIRST))

    def window(self, layer: int, head: int, n: int) -> tuple[list[int], list[int]]:
        """Which queries and keys of map (layer, head) to show when only `n` of each fit (a
        terminal): the last n queries (the ones with the most context; on the induction probe
        the second copy, where induction heads differ from the rest) and the n keys they give
        the most attention, in order. All of them when T <= n."""
        T = len(self.tokens)
        if T <= n:
            return list(range(T)), list(range(T))
        rows = list(range(T - n, T))
        mass = self.attention[layer, head, rows].sum(0)  # (T,) attention each key receives
        cols = sorted(torch.topk(mass, n, sorted=False).indices.tolist())
        return rows, cols

    def head_row(self, layer: int, head: int, digits: int = 6) -> dict:
        """One head's numbers as JSON: its name (`head`: L1.H2, with `layer` and `index`
        beside it, the one rule of every JSON), dominant type and every score rounded to
        `digits` (None = not applicable to this input). `--json`, scores.json and the viewer
        all take their per-head numbers from here."""
        s = self.head_scores(layer, head)
        row = {"head": head_name(layer, head), "layer": layer, "index": head,
               "dominant": dominant_type(s),
               **{n: (None if math.isnan(v) else round(v, digits)) for n, v in s.items()}}
        if self.ablation is not None:  # nats/token lost when this head alone is ablated
            row["ablation"] = round(float(self.ablation.effect[layer, head]), digits)
        if self.dla is not None:  # its direct share of the logit
            row["dla"] = round(float(self.dla.heads[layer, head]), digits)
        if self.patch is not None:  # fraction of the metric's change patching it moves
            row["patch"] = round(float(self.patch.effect[layer, head]), digits)
        return {**row, **self.lag_row(layer, head, digits)}

    def best_lags(self, layer: int, head: int) -> dict[str, tuple[int, float]]:
        """{"previous"|"induction": (best lag, its score)}; lag 0 (score NaN): none applies."""
        out = {}
        for kind, s in self.lags.items():
            k = int(best_lag(s[layer, head]))
            out[kind] = (k, float(s[layer, head, k - 1]) if k else math.nan)
        return out

    def lag_row(self, layer: int, head: int, digits: int = 6) -> dict:
        """One head's offset profile, its scores at every lag and the best lags (JSON)."""
        def nums(t: Tensor) -> list:
            return [None if math.isnan(v) else round(v, digits) for v in t.tolist()]

        best = self.best_lags(layer, head)
        return {"offsets": nums(self.offsets[layer, head]),
                "previous_lags": nums(self.lags["previous"][layer, head]),
                "induction_lags": nums(self.lags["induction"][layer, head]),
                "best_previous_lag": best["previous"][0] or None,
                "best_induction_lag": best["induction"][0] or None}

    def to_json(self, layers: Sequence[int] | None = None,
                heads: Sequence[int] | None = None) -> dict:
        """The scores as a JSON-ready dict (NaN -> null), for `--json` and `--format json`."""
        layers = list(range(self.n_layer)) if layers is None else list(layers)
        heads = list(range(self.n_head)) if heads is None else list(heads)
        return {"run": self.run, "step": self.step, "source": self.source,
                "n_layer": self.n_layer, "n_head": self.n_head, "n_tokens": len(self.tokens),
                "tokens": self.tokens, "token_strs": self.token_strs,
                "parity_max_abs_diff": self.parity_max_diff, "parity_ok": self.parity_ok,
                "score_definitions": SCORE_HELP,
                **({"ablation": self.ablation.to_json()} if self.ablation is not None else {}),
                **({"dla": self.dla.to_json()} if self.dla is not None else {}),
                **({"patch": self.patch_json()} if self.patch is not None else {}),
                **({"lens": self.lens.records(token_str=self.token_str)}
                   if self.lens is not None else {}),
                "lag_definitions": LAG_HELP,
                **({"composition_definitions": KIND_HELP,
                    "composition": self.composition.records()}
                   if self.composition is not None else {}),
                **({"qk_pairs": self.qk_pairs, "qk_writer_roles": self.writer_roles(),
                    "qk": [{**h.to_json(), "pairs_are": self.qk_pairs_of(h)}
                           for h in self.qk]}
                   if self.qk is not None else {}),
                "heads": [self.head_row(la, h) for la in layers for h in heads]}

    def patch_json(self) -> dict:
        """Patching's summary with what a reader needs to reproduce it elsewhere: the
        corrupted token ids, and how to read a fraction above 1 or below 0."""
        return {**self.patch.to_json(), "corrupted_tokens": self.patch_tokens,
                "reading": PATCH_READING}


# How to read a patching fraction, said wherever one is shown (table, circuits.png, viewer,
# JSON): one head can move the metric further than the whole corruption does.
PATCH_READING = (
    "0: the head carries nothing that differs between the inputs; 1: patching it alone moves "
    "the metric as far as corrupting the whole input does. Above 1 (or below 0) is possible: "
    "effects do not add up, because in the fully corrupted run other heads change too and "
    "partly cancel this one (e.g. heads that would act on its output), so one head patched "
    "alone can move the metric more than the whole clean -> corrupted change")


@dataclass
class CircuitRequest:
    """What of interp.head_circuits inspect() also measures: `dla`, `composition`, and patching
    from `patch_tokens` (described by `patch_source`) in `direction`; the metric's token
    (`target`) or logit difference (`answer` - `wrong`), as token ids. `lens`: the logit lens
    (interp.lens) of the same target (with `answer`: the answer's, at the last position)."""

    dla: bool = False
    composition: bool = False
    patch_tokens: list[int] | None = None
    patch_source: str = ""
    direction: str = "noising"
    lens: bool = False
    target: int | None = None
    answer: int | None = None
    wrong: int | None = None
    qk: list[tuple[int, int]] | None = None  # the heads whose scores to split (interp.qk)
    # at these pairs, or "induction" (the probe's targets); None: each head's own (qk_pairs_for)
    qk_pairs: list[tuple[int, int, int]] | str | None = None


PAIRS_SHOWN = 8  # pairs named in words; the rest counted


def circuit_request(loaded, inp, max_tokens, seed, *, dla, composition, patch_from,
                     direction, target, answer, wrong, lens=False, qk=None, qk_pairs=None):
    """What of interp/head_circuits.py and interp/qk.py to measure (None: nothing), every token
    checked first (the rules between inspect-heads' flags); `qk`: the --qk heads as (layer,
    head), resolved once by the caller; `qk_pairs`: the --qk-pairs items."""
    from minigpt.heads.probes import corrupted_input, token_id
    from minigpt.interp.head_circuits import check_composition
    from minigpt.interp.patching import check_same_length
    from minigpt.interp.qk import check_tokens

    uses_metric = dla or patch_from is not None or lens
    for param, value in (("target", target), ("answer", answer), ("wrong", wrong)):
        if value is not None and not uses_metric:
            raise ArgumentError(param, "sets the metric of --dla, --patch-from and --lens; "
                                "give one of them too")
    if qk_pairs and not qk:
        raise ArgumentError("qk_pairs", "chooses the pairs of --qk; give --qk HEAD too")
    if qk:
        check_tokens(len(inp.tokens))
    if not (uses_metric or composition or qk):
        return None
    if composition:
        check_composition(loaded.cfg.model)
    tok = loaded.tokenizer
    req = CircuitRequest(dla=dla, composition=composition, direction=direction, lens=lens,
                         target=None if target is None else token_id(tok, target, "target"),
                         answer=None if answer is None else token_id(tok, answer, "answer"),
                         wrong=None if wrong is None else token_id(tok, wrong, "wrong"),
                         qk=qk,
                         qk_pairs=qk_pairs_of_flag(qk_pairs, inp) if qk_pairs else None)
    if patch_from is not None:
        req.patch_tokens, req.patch_source = corrupted_input(
            loaded.cfg, tok, inp, patch_from, max_tokens=max_tokens, seed=seed,
            eot_first=loaded.eot_first)
        check_same_length(inp.tokens, req.patch_tokens)  # before any work
    return req


def qk_pairs_of_flag(values: list[str], inp):
    """--qk-pairs: `induction` (the induction probe's targets), or QUERY:KEY pairs."""
    from minigpt.interp.qk import INDUCTION, parse_pairs

    items = comma_list(values)
    if [v.lower() for v in items if v] == [INDUCTION]:
        if inp.source != "probe:induction":
            raise ArgumentError("qk_pairs", "induction names the induction probe's targets; "
                                "give --probe induction too, or QUERY:KEY pairs")
        return INDUCTION
    return parse_pairs(items, len(inp.tokens))


def pairs_words(pairs: Sequence[tuple[int, int, int]]) -> str:
    """`7:3, 9:5, ...` (the first PAIRS_SHOWN), and how many in all."""
    named = ", ".join(f"{t}:{s}" for _, t, s in pairs[:PAIRS_SHOWN])
    return named + (f", ... ({len(pairs):,} pairs)" if len(pairs) > PAIRS_SHOWN else "")


def qk_queries(tokens: Sequence[int], source: str, positions: Sequence[int] | None
               ) -> list[int]:
    """The queries a head is split at by default: the induction probe's second copy, else
    every query that has a choice of keys (1..T-1)."""
    if source == "probe:induction" and positions:
        return list(range(positions[0], len(tokens)))
    return list(range(1, len(tokens)))


def qk_pairs_for(req: CircuitRequest, tokens: Sequence[int], source: str,
                 positions: Sequence[int] | None) -> tuple[list | None, str]:
    """The pairs of `--qk` and what they are, in words: `req.qk_pairs` when given (the
    induction probe's targets for "induction"), else None: each head at its own most attended
    key of each query of `qk_queries`."""
    if req.qk_pairs == "induction":
        pairs = induction_pairs(tokens, positions[0])
        return pairs, (f"the {len(pairs)} induction targets: each query of the second copy "
                       f"(positions {positions[0]}..{len(tokens) - 1}) and the key one after "
                       "the earlier occurrence of its token")
    if req.qk_pairs is not None:
        return req.qk_pairs, f"the pairs asked for (query:key {pairs_words(req.qk_pairs)})"
    qs = qk_queries(tokens, source, positions)
    where = ("of the second copy" if source == "probe:induction" and positions else "")
    return None, (f"each head at its own most attended key of each query {where} (positions "
                  f"{qs[0]}..{qs[-1]}: one pair each)").replace("query  (", "query (")


def inspect(model, inp: ProbeInput, *, device: torch.device | str | None = None,
            run: str = "", step: int = 0, ablate: str | None = None, seed: int = 0,
            circuits: CircuitRequest | None = None,
            token_str: Callable[[int], str] | None = None,
            on_event: OnEvent | None = None) -> Inspection:
    """Attention maps and head scores of `model` on `inp.tokens` (already within block_size),
    on `device` (None: where the model's weights are). MinigptError if the attention or the
    logits are not finite. `ablate` (a mode of interp.heads' ablation) also measures what each
    head carries, scored where `inp` defines the loss (`positions`, `scored`, `min_tokens`).
    The delimiter score reads the token strings only when they are text (`inp.is_text`); `seed`
    orders the resample ablation's reference. `circuits` adds direct logit attribution,
    composition, patching and the logit lens (scored where the ablation is); `token_str`
    (the tokenizer's) names the lens's tokens. `on_event` gets an events.Progress as the long
    parts (ablation, patching, the qk split, composition) go on; `inspect_cost` estimates
    them all before."""
    tokens = inp.tokens
    if not tokens:
        raise ValueError("inspect: no tokens")
    progress = progress_to(on_event) if on_event is not None else None
    dev = torch.device(device) if device is not None else device_of(model)
    attn, diff = attention_maps(model, tokens, dev)
    check_finite(attn, diff, run)
    # fp32 on CPU agrees to ~1e-6; GPU kernels (TF32, other reduction orders) drift further
    tol = 1e-4 if dev.type == "cpu" else 1e-2
    ablation = None
    if ablate is not None:
        ablation = ablate_heads(model, tokens, ablate, positions=inp.positions,
                                scored=inp.scored, minimum=inp.min_tokens, seed=seed,
                                progress=progress)
    scores = score_heads(attn, tokens, inp.token_strs if inp.is_text else None)
    copy_start = (inp.positions[0] if inp.source == "probe:induction" and inp.positions
                  else None)
    insp = Inspection(tokens=list(tokens), token_strs=list(inp.token_strs), attention=attn,
                      scores=scores, parity_max_diff=diff, parity_tol=tol, source=inp.source,
                      run=run, step=step, ablation=ablation, copy_start=copy_start,
                      token_str=token_str)
    if circuits is not None:
        measure_circuits(insp, model, circuits, inp.positions, progress)
    return insp


def measure_circuits(insp: Inspection, model, req: CircuitRequest,
                     positions: Sequence[int] | None, progress: OnProgress | None = None
                     ) -> None:
    """Fill `insp.dla`, `.patch`, `.composition`, `.lens` and `.qk` as `req` asks
    (interp.head_circuits, interp.lens, interp.qk), reporting `progress`."""
    if req.composition:
        insp.composition = composition_scores(model, progress)
    if req.lens:
        insp.lens = lens_of(model, insp.tokens, req, positions)
    if req.qk:
        pairs, insp.qk_pairs = qk_pairs_for(req, insp.tokens, insp.source, positions)
        idx = torch.tensor([insp.tokens], dtype=torch.long, device=device_of(model))
        insp.qk = qk_attribution(model, idx, req.qk, pairs, progress,
                                 queries=qk_queries(insp.tokens, insp.source, positions))
    if not req.dla and req.patch_tokens is None:
        return
    metric = make_metric(len(insp.tokens), positions, target=req.target, answer=req.answer,
                         wrong=req.wrong)
    if req.dla:
        insp.dla = direct_logit_attribution(model, insp.tokens, metric)
    if req.patch_tokens is not None:
        insp.patch = patch_heads(model, insp.tokens, req.patch_tokens, metric,
                                 direction=req.direction, source=req.patch_source,
                                 progress=progress)
        insp.patch_tokens = list(req.patch_tokens)


def lens_of(model, tokens: Sequence[int], req: CircuitRequest,
            positions: Sequence[int] | None) -> Lens:
    """The logit lens at the metric's positions, of the metric's token: the next token (or
    `req.target`) at each scored position, or `req.answer` at the last position."""
    metric = make_metric(len(tokens), positions, target=req.target, answer=req.answer,
                         wrong=req.wrong)  # the checks DLA's metric gets
    targets = [req.answer] if metric.logit_diff else metric.targets(tokens)
    return logit_lens(model, tokens, list(metric.positions), targets)


def check_finite(attn: Tensor, logit_diff: float, run: str = "") -> None:
    """MinigptError naming the first head (or the logits) that is not finite: a model whose
    weights hold NaN or inf has no attention pattern to score, and JSON has no NaN."""
    bad = (~torch.isfinite(attn)).flatten(2).any(-1).nonzero()  # (k, 2): layer, head
    if not len(bad) and math.isfinite(logit_diff):
        return
    what = "the logits are"
    if len(bad):
        layer, head = bad[0].tolist()
        what = f"the attention of layer {layer} head {head} is"
    raise MinigptError(f"{run + ': ' if run else ''}{what} not finite (NaN or inf) on this "
                       "input: the model's weights hold NaN or inf (a run that diverged?); "
                       "nothing was written; inspect an earlier checkpoint")


def select_heads(n_layer: int, n_head: int, layers: Sequence[int] = (),
                 heads: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Validate layer / head indices (empty = all); ArgumentError names the valid range."""
    for param, values, n in (("layer", layers, n_layer), ("head", heads, n_head)):
        for v in values:
            if not 0 <= v < n:
                raise ArgumentError(param, f"out of range; valid: 0..{n - 1}", subject=v)
    return (sorted(set(layers)) or list(range(n_layer)), sorted(set(heads)) or list(range(n_head)))


# --------------------------------------------------------------------------------------------
# What an inspection costs, before it starts.


def inspect_cost(cfg, n_tokens: int, *, ablate: str | None = None,
                 req: CircuitRequest | None = None, features: bool = False
                 ) -> tuple[float, float]:
    """(FLOPs, bytes held at once) of `inspect` on `n_tokens` tokens of a model of `cfg` (a
    ModelConfig) with what is asked for: a forward pass is a third of core.gpt.flops_per_token
    per token; the maps take two (explicit and SDPA), an ablation or a patching sweep about
    half a pass per head (each row runs from its head's layer on), DLA, the lens and
    --features one each; the qk split and composition as their own formulas say
    (interp.qk.qk_cost, interp.head_circuits.composition_cost). Memory: the maps (three copies
    of layers x heads x T x T floats: the pass, the scores, the copy kept) and the qk split's
    or composition's, whichever is larger."""
    T, L, H = n_tokens, cfg.n_layer, cfg.n_head
    pass_flops = flops_per_token(cfg, T) * T / 3
    sweeps = (ablate is not None) + (req is not None and req.patch_tokens is not None)
    passes = 2 + sweeps * (L * H / 2 + 2) + features
    if req is not None:
        passes += req.dla + req.lens
    flops, held = passes * pass_flops, 12.0 * L * H * T * T
    extra = 0.0
    if req is not None and req.qk:
        pairs = max(1, len(req.qk_pairs) if isinstance(req.qk_pairs, list) else T - 1)
        qk = qk_cost(cfg, T, req.qk, pairs)
        flops, extra = flops + qk.flops, qk.bytes
    if req is not None and req.composition:
        comp = composition_cost(cfg)
        flops, extra = flops + comp.flops, max(extra, comp.bytes)
    return flops, held + extra


def check_inspect_cost(model, n_tokens: int, *, ablate: str | None = None,
                       req: CircuitRequest | None = None, features: bool = False,
                       force: bool = False) -> Cost | None:
    """`inspect_cost` on `n_tokens` tokens checked by cost's rule (`cost.check_flops`: refused,
    naming `max_tokens`, the estimate and the largest value that fits, unless `force`). The
    estimate when the rate was measured, else None (a quick inspection: nothing worth
    saying)."""
    cfg, device = model.cfg, device_of(model)

    def work_of(t: int) -> Work:
        return Work(*inspect_cost(cfg, min(t, n_tokens), ablate=ablate, req=req,
                                  features=features))

    asked = [w for w, on in (("ablation", ablate), ("DLA", req and req.dla),
                             ("patching", req and req.patch_tokens is not None),
                             ("the logit lens", req and req.lens),
                             (f"the qk split of {len(req.qk) if req and req.qk else 0} heads",
                              req and req.qk),
                             ("composition", req and req.composition), ("features", features))
             if on]
    return check_flops("max_tokens", n_tokens, work_of, device=device, minimum=2,
                       dtype=next(model.parameters()).dtype, force=force,
                       what=f"inspecting {n_tokens:,} tokens" + (f" with {', '.join(asked)}"
                                                                  if asked else ""),
                       none_fit="even 2 tokens do not fit: ask for less (fewer --qk heads, no "
                       "--composition)")
