"""The logit lens as terminal tables (`inspect-heads --lens`; any command with a `interp.lens.Lens`
can print them): a summary per point, then the top token at every point and scored position,
cut into as many tables as the width needs, like the head table."""

from __future__ import annotations

from rich import box
from rich.style import Style
from rich.table import Table
from rich.text import Text

from minigpt.cli.shading import shade, worded
from minigpt.display import printable, visible_token

MAX_ROWS = 16  # scored positions shown in the terminal; the PNG, viewer and JSON have them all
CELL = 8  # a point's column: a token of up to 6 characters and its padding


def lens_tables(lens, token_strs, token_str, width: int) -> list[Table]:
    """The summary table and the per-position tables of `lens` (interp.lens.Lens) on an input
    whose tokens read `token_strs`; `token_str(id)` names any token; `width` the terminal's."""
    return [summary_table(lens), *position_tables(lens, token_strs, token_str, width)]


def summary_table(lens) -> Table:
    """Per point: the target's mean logit and probability, its median rank, and how often it
    is the top token."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("after", "logit", "prob", "median rank", "top = target"):
        table.add_column(name, justify="left" if name == "after" else "right", no_wrap=True)
    for row in lens.summary():
        table.add_row(row["point"], f"{row['logit']:.2f}", f"{row['prob']:.3f}",
                      f"{row['median_rank']:g}", f"{100 * row['top_is_target']:.0f}%")
    return worded(table, "logit lens: the residual stream read through the final norm and the "
                  f"unembedding, over {len(lens.positions)} scored positions",
                  "after = the point read (embed: the embeddings; Lk: the stream after layer k, "
                  "the last is the model's own output); rank = how many tokens score higher "
                  "than the target (0 = the top token)")


def position_tables(lens, token_strs, token_str, width: int) -> list[Table]:
    """Rows = the last MAX_ROWS scored positions (query position, its token, the target),
    columns = the points; a cell is the top token there over the target's rank, on a
    background as dark as the target's probability; green: the top token is the target."""
    P = len(lens.positions)
    cols = range(max(0, P - MAX_ROWS), P)
    key_w = 22
    per = max(1, (width - key_w) // CELL)
    groups = [list(range(i, min(i + per, len(lens.points))))
              for i in range(0, len(lens.points), per)]
    note = "" if P <= MAX_ROWS else (f"; the last {MAX_ROWS} of {P} scored positions "
                                     "(--json, --format png/html: all of them)")
    tables = []
    for n, group in enumerate(groups):
        part = f", part {n + 1} of {len(groups)}" if len(groups) > 1 else ""
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
                      collapse_padding=True)
        table.add_column("pos token -> target", no_wrap=True)
        for i in group:
            table.add_column(lens.points[i], justify="right", no_wrap=True)
        for j in cols:
            p = lens.positions[j]
            key = (f"{p:>3} {visible_token(token_strs[p], 7)} -> "
                   f"{visible_token(token_str(lens.targets[j]), 7)}")
            table.add_row(Text(printable(key)), *(_cell(lens, i, j, token_str) for i in group))
        tables.append(worded(table, f"logit lens: the top token at each point{part}",
                             "cell = the top token there, over the target's rank; background = "
                             "the target's probability (white 0 .. dark blue 1); green = the top "
                             "token is the target" + note))
    return tables


def _cell(lens, i: int, j: int, token_str) -> Text:
    rank, prob = int(lens.rank[i, j]), float(lens.prob[i, j])
    top = printable(visible_token(token_str(int(lens.top[i, j])), CELL - 2))
    style = shade(prob)
    if rank == 0:  # green on the light cells, bright green on the dark ones
        style = style + Style(bold=True, color="green" if prob <= 0.45 else "bright_green")
    return Text(f"{top}\n#{rank}", style=style)
