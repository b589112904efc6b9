"""A circuit search scored against a compiled program's truth (`minigpt circuit` on a run with
truth.json; the numbers are minigpt.truth.scoring's) as terminal tables: each finder's edge
AUROC against both truths, the program's edges with every finder's score, and the heads'
types against the program's own."""

from __future__ import annotations

import re

from rich import box
from rich.table import Table

from minigpt.cli.shading import worded
from minigpt.display import printable


def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def truth_tables(scored: dict) -> list:
    """The tables of one scored search (truth.scoring.score's JSON), each with its words
    (shading.worded)."""
    c = scored["circuit"]
    finders = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("finder", "AUROC all", "AUROC revealed", "largest false"):
        finders.add_column(name, justify="left" if name == "finder" else "right")
    for name, f in scored["finders"].items():
        finders.add_row(name, _f(f["auroc"]["all"]), _f(f["auroc"]["revealed"]),
                        _f(f["largest_false"], ".2g"))
    title = printable(f"against the truth of {scored['program']}: {scored['edges']} edges, "
                      f"{scored['revealed']} of them revealed by this contrast")
    caption = (f"AUROC: how well |score| ranks the true edges above the others (1 = all "
               f"above, 0.5 = chance); largest false: the largest |score| of an edge the "
               f"program does not have. The circuit ({c['edges']} edges): precision "
               f"{_f(c['precision'])}, recall {_f(c['recall'])} (of the revealed: "
               f"{_f(c['recall_revealed'])})")
    return [worded(finders, title, caption), _edges(scored),
            *([_heads(scored)] if scored["heads"] else [])]


def _edges(scored: dict):
    names = list(scored["finders"])
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    longest = max([4, *(len(v) for e in scored["true_edges"] for v in _vars(e))])
    for name in ("from", "to", "input", "vars", "tok", "rev", *names, ""):
        # the variables wrap at their commas where the terminal is narrow, never inside a
        # name; nothing else wraps
        table.add_column(name, justify="right" if name in names else "left",
                         no_wrap=name != "vars", min_width=longest if name == "vars" else None)
    for e in scored["true_edges"]:
        table.add_row(e["from"], e["to"], e["input"], printable(", ".join(_vars(e))),
                      "yes" if e["tokens"] else "no",
                      "yes" if e["revealed"] else "no",
                      *(_f(e["scores"][n], "+.2g") for n in names),
                      "*" if e["in_circuit"] else "")
    return worded(table, "the program's edges",
                  "vars: the variables it carries; tok: their value changes with the input "
                  "tokens (else only with positions and constants); rev: it differs between "
                  "the clean and the source runs (revealed); * = in the circuit")


def _vars(edge: dict) -> list[str]:
    """The RASP variables an edge carries, without tracr's numbering (`indices`, `tokens`)."""
    return [re.sub(r"_\d+$", "", v) for v in edge["variables"]]


def _heads(scored: dict):
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("head", "program", "inspect-heads", "score"):
        table.add_column(name, justify="right" if name == "score" else "left")
    for h in scored["heads"]:
        table.add_row(h["head"], h["program"], h["typed"], _f(h["score"], ".2f"))
    return worded(table, "the heads: the program's kind, inspect-heads' type",
                  "inspect-heads' type on the induction probe of the program's vocabulary; "
                  "score: the head's score of the program's kind")
