"""A circuit of a model on its inputs (`minigpt circuit`): the (clean, corrupted) pairs from a
probe or a text (`circuit_pairs`, through the same input layer as inspect-heads: probes.py),
the search (`interp.edge_graph.find_circuit`) and the files (`write_circuit_files`: circuit.png and
faithfulness.png from edge_png.py, circuit.html from viewer.py, circuit.json)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from minigpt.cost import Cost, check_cost, timed
from minigpt.display import size
from minigpt.errors import ArgumentError
from minigpt.files import atomic_write_bytes, shown
from minigpt.heads.attribution_graph import graph_bytes
from minigpt.heads.probes import corrupted_input, prepare_input, token_id
from minigpt.interp.edge_args import ABLATIONS
from minigpt.interp.edge_graph import Circuit, attribute_edges, circuit_cost
from minigpt.interp.edge_positions import position_cost
from minigpt.interp.patching import Metric, check_same_length, make_metric

ABLATION_HELP = {"zero": "every edge's source value is zero",
                 "mean": "every edge's source value is its writer's mean over the inputs and "
                         "every position"}


@dataclass
class Pairs:
    """Batches of (clean, corrupted) token ids (B, T) (`corrupted` an ablation's name instead:
    zero or mean), the scored tokens `targets` (B, P) (None for a logit difference), the
    metric, and what the inputs are, for people."""

    clean: Tensor
    corrupted: Tensor | str
    targets: Tensor | None
    metric: Metric
    source: str
    corrupted_source: str


def check_circuit_cost(model, n_tokens: int, pairs: int, ig_steps: int, curves: bool = True,
                       force: bool = False, positions: bool = False, graph: bool = False) -> Cost:
    """The estimated cost of a circuit search (`interp.edge_graph.circuit_cost`, from one
    gradient step timed on a pair of `n_tokens` zeros); ArgumentError naming `pairs` or
    `ig_steps`, the cost and the largest value that fits (cost.check_cost), unless `force`."""
    cfg, device = model.cfg, next(model.parameters()).device
    ids = torch.zeros(1, max(2, n_tokens), dtype=torch.long, device=device)
    metric = make_metric(ids.shape[1])
    targets = torch.tensor([metric.targets(ids[0].tolist())], device=device)
    step_s = timed(lambda: attribute_edges(model, ids, ids, metric, targets, 1))

    held_graph = graph_bytes(cfg, n_tokens) if graph else 0.0  # --format graph's links

    def cost(n_pairs: int, steps: int) -> Cost:
        c = circuit_cost(cfg, n_tokens, n_pairs, steps, curves, step_s)
        if not positions:
            return Cost(c.seconds, c.bytes + held_graph)
        per_step, other, held = position_cost(cfg, n_tokens, n_pairs, curves)
        return Cost(c.seconds + (per_step * steps + other) * n_pairs * step_s,
                    c.bytes + held + held_graph)

    by = " by position" if positions else ""
    none_fit = (f"the attribution graph of {n_tokens} tokens alone holds {size(held_graph)}: "
                "give fewer tokens (--max-tokens, or a shorter text)") if graph else None
    check_cost("pairs", pairs, lambda v: cost(v, 1), none_fit=none_fit,
               what=f"{pairs} pairs of {n_tokens} tokens{by}", device=device, force=force)
    return check_cost("ig_steps", ig_steps, lambda v: cost(pairs, v), none_fit=none_fit,
                      what=f"{ig_steps} steps on {pairs} pair(s){by}", device=device,
                      force=force)


def circuit_pairs(cfg, tokenizer, *, patch_from: str | None, text: str | None = None,
                  text_file: Path | None = None, probe: str | None = None,
                  max_tokens: int | None = None, seed: int = 0, eot_first: bool = False,
                  pairs: int = 1, metric: str = "loss", target: str | None = None,
                  answer: str | None = None, wrong: str | None = None,
                  device: torch.device | str = "cpu",
                  check: Callable[[int], object] | None = None) -> Pairs:
    """The inputs of a circuit search: `pairs` (clean, corrupted) pairs of a probe (seeds
    seed, seed + 1, ...) or one of a text, corrupted as inspect-heads' --patch-from does (or
    ablated: `patch_from` zero or mean, interp.edge_graph's ablations), and
    the metric (`metric` loss or logit; `answer` and `wrong`: the logit difference; `target`:
    a fixed token), every token checked; ArgumentError naming the flag otherwise. `check`
    (e.g. check_circuit_cost) is called with the tokens of a pair once the first
    is made, before the others are."""
    if patch_from is None:
        raise ArgumentError("patch_from", "a circuit is what carries the difference between "
                            "a clean input and a corrupted one: give {name} corrupted (with "
                            "--probe induction) or {name} TEXT (a corrupted text)")
    if pairs < 1 or (pairs > 1 and probe is None):
        raise ArgumentError("pairs", "must be 1 for a text (one clean, one corrupted), and at "
                            "least 1 for a probe (each pair drawn with the next seed)",
                            subject=pairs)
    ids = {k: None if v is None else token_id(tokenizer, v, k)
           for k, v in (("target", target), ("answer", answer), ("wrong", wrong))}
    clean, bad, first = [], [], None
    for i in range(pairs):
        inp = prepare_input(cfg, tokenizer, text=text, text_file=text_file, probe=probe,
                            max_tokens=max_tokens, seed=seed + i, eot_first=eot_first)
        if patch_from in ABLATIONS:
            other, desc = [], f"{patch_from}: {ABLATION_HELP[patch_from]}"
        else:
            other, desc = corrupted_input(cfg, tokenizer, inp, patch_from,
                                          max_tokens=max_tokens, seed=seed + i,
                                          eot_first=eot_first)
            check_same_length(inp.tokens, other)
        clean.append(inp.tokens)
        bad.append(other)
        if first is None and check is not None:
            check(len(inp.tokens))
        first = first or inp
    m = make_metric(len(first.tokens), first.positions, kind=metric, minimum=first.min_tokens,
                    **ids)
    targets = None if m.logit_diff else torch.tensor([m.targets(c) for c in clean],
                                                     device=device)
    corrupted = patch_from if patch_from in ABLATIONS else torch.tensor(bad, device=device)
    return Pairs(torch.tensor(clean, device=device), corrupted, targets, m,
                 first.source + (f" x {pairs} seeds" if pairs > 1 else ""), desc)


def circuit_title(label: str, pairs: Pairs) -> str:
    """The pictures' title: the run or model, and which corruption ran (`corrupted-second`,
    `corrupted-first`, or the corrupted text, shortened)."""
    kind, _, what = pairs.corrupted_source.partition(": ")
    name = kind if kind != "text" else f"the text {shown(repr(what), 40)}"
    return f"{label}, corrupted: {name}"


def circuit_file_names(formats: Sequence[str], curves: bool, slug: str | None = None
                       ) -> list[str]:
    """The names of the files `write_circuit_files` writes for `formats` (faithfulness.png
    only with the curves), and the attribution graph's (`graph`: SLUG.json and
    graph-metadata.json): what is checked before any work."""
    names = [f"{slug}.json", "graph-metadata.json"] if "graph" in formats and slug else []
    if "png" in formats:
        names += ["circuit.png", *(["faithfulness.png"] if curves else [])]
    return names + [name for fmt, name in (("html", "circuit.html"), ("json", "circuit.json"))
                    if fmt in formats]


def write_circuit_files(result: Circuit, out: Path, formats: Sequence[str], title: str,
                        lens: list | None = None) -> list[Path]:
    """circuit.png and faithfulness.png (png), circuit.html (html), circuit.json (json) in
    `out`; the paths written. A full disk part way: one WriteError saying which were written
    and which not (output.saying_what_was_written)."""
    from minigpt.heads.output import saying_what_was_written

    with saying_what_was_written(out, circuit_file_names(formats, bool(result.curves))):
        return _write_circuit_files(result, out, formats, title, lens)


def _write_circuit_files(result: Circuit, out: Path, formats: Sequence[str], title: str,
                         lens: list | None) -> list[Path]:
    from minigpt.heads.edge_png import circuit_png, faithfulness_png
    from minigpt.heads.viewer import render_circuit_html

    written: list[Path] = []
    pictures = {}
    if "png" in formats or "html" in formats:
        pictures["circuit.png"] = circuit_png(result, title)
        if result.curves:
            pictures["faithfulness.png"] = faithfulness_png(result, title)
    if "png" in formats:
        written += [atomic_write_bytes(out / name, data) for name, data in pictures.items()]
    doc = result.to_json(lens=lens)
    if "html" in formats:
        page = render_circuit_html({"title": title, **doc}, pictures)
        written.append(atomic_write_bytes(out / "circuit.html", page.encode("utf-8")))
    if "json" in formats:
        text = json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False)
        written.append(atomic_write_bytes(out / "circuit.json", (text + "\n").encode("utf-8")))
    return written
