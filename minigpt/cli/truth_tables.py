"""A circuit search scored against a compiled program's truth (`minigpt circuit` on a run with
truth.json; the numbers are minigpt.truth.scoring's) as terminal tables: each finder's edge
AUROC against both truths, the program's edges with every finder's score, and the heads'
types against the program's own."""

from __future__ import annotations

import re

from rich import box
from rich.table import Table

from minigpt.display import printable


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def truth_tables(scored: dict) -> list[Table]:
    """The tables of one scored search (truth.scoring.score's JSON)."""
    c = scored["circuit"]
    finders = Table(title=printable(f"against the truth of {scored['program']}: "
                                    f"{scored['edges']} edges, {scored['revealed']} of them "
                                    "revealed by this contrast"),
                    caption=f"AUROC: how well |score| ranks the true edges above the others "
                    f"(1 = all above, 0.5 = chance); largest false: the largest |score| of an "
                    f"edge the program does not have. The circuit ({c['edges']} edges): "
                    f"precision {_f(c['precision'])}, recall {_f(c['recall'])} (of the "
                    f"revealed: {_f(c['recall_revealed'])})", box=box.SIMPLE_HEAD,
                    pad_edge=False)
    for name in ("finder", "AUROC all", "AUROC revealed", "largest false"):
        finders.add_column(name, justify="left" if name == "finder" else "right")
    for name, f in scored["finders"].items():
        finders.add_row(name, _f(f["auroc"]["all"]), _f(f["auroc"]["revealed"]),
                        _f(f["largest_false"], ".2g"))
    return [finders, _edges(scored), *([_heads(scored)] if scored["heads"] else [])]


def _edges(scored: dict) -> Table:
    names = list(scored["finders"])
    table = Table(title="the program's edges", caption="vars: the variables it carries; tok: "
                  "their value changes with "
                  "the input tokens (else only with positions and constants); rev: it differs "
                  "between the clean and the source runs (revealed); * = in the circuit",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("edge", "vars", "tok", "rev", *names, ""):
        table.add_column(name, justify="right" if name in names else "left",
                         no_wrap=name != "vars", overflow="fold", min_width=4)
    for e in scored["true_edges"]:
        table.add_row(f"{e['from']} -> {e['to']} {e['input']}",
                      printable(", ".join(re.sub(r"_\d+$", "", v) for v in e["variables"])),
                      "yes" if e["tokens"] else "no",
                      "yes" if e["revealed"] else "no",
                      *(_f(e["scores"][n], "+.2g") for n in names),
                      "*" if e["in_circuit"] else "")
    return table


def _heads(scored: dict) -> Table:
    table = Table(title="the heads: the program's kind, inspect-heads' type",
                  caption="inspect-heads' type on the induction probe of the program's "
                  "vocabulary; score: the head's score of the program's kind",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("head", "program", "inspect-heads", "score"):
        table.add_column(name, justify="right" if name == "score" else "left")
    for h in scored["heads"]:
        table.add_row(h["head"], h["program"], h["typed"], _f(h["score"], ".2f"))
    return table
