"""`minigpt inspect-heads`: every head's scores as a rich table (and one head's attention map),
plus the files asked for: PNG heatmaps, the offline HTML viewer, the raw tensor, JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from minigpt.cli.main import (
    DeviceOpt,
    ModelOpt,
    RunOpt,
    app,
    out_console,
    say,
)
from minigpt.display import printable

TextOpt = Annotated[str | None, typer.Option(
    "--text", help="Text to run through the model. Default: a built-in passage.")]
TextFileOpt = Annotated[Path | None, typer.Option(
    "--text-file", help="Read the text from this UTF-8 file.")]
ProbeOpt = Annotated[str | None, typer.Option(
    "--probe", help="Built-in synthetic input instead of text: induction (random tokens "
    "repeated twice), previous (no repeats), duplicate (8 ids, many repeats).")]
LayerOpt = Annotated[list[int] | None, typer.Option(
    "--layer", help="Layer to show (repeatable). Default: all.")]
HeadOpt = Annotated[list[int] | None, typer.Option(
    "--head", help="Head to show (repeatable). Default: all.")]
FormatOpt = Annotated[list[str] | None, typer.Option(
    "--format", help="Files to write as well: png, html, safetensors, json (table: none); "
    "repeatable or comma-separated. The table is printed in every case, except with --json.")]
OutOpt = Annotated[Path | None, typer.Option(
    "--out", help="Directory for the files. Default: <run>/heads/.")]
MaxTokensOpt = Annotated[int | None, typer.Option(
    "--max-tokens", help="Inspect at most this many tokens (2..block_size; longer text is "
    "cut). Default: block_size.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the synthetic probes.")]
JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print the head scores as JSON on stdout (no tables).")]
AblateOpt = Annotated[str | None, typer.Option(
    "--ablate", metavar="MODE", help="Also measure what each head carries: the loss with that "
    "head alone ablated minus the loss without (nats/token). zero: its output replaced by "
    "zeros; mean: by its mean over the input's positions; resample: by its output on the same "
    "tokens in a random order.")]
CheckpointOpt = Annotated[int | None, typer.Option(
    "--checkpoint", metavar="STEP", help="Inspect the run's kept checkpoint of this step "
    "(train.keep_checkpoints sets how many are kept). Default: the latest.")]


@app.command("inspect-heads")
def inspect_heads_command(
    run: RunOpt = None, text: TextOpt = None, text_file: TextFileOpt = None,
    probe: ProbeOpt = None, layer: LayerOpt = None, head: HeadOpt = None,
    formats: FormatOpt = None, out: OutOpt = None, max_tokens: MaxTokensOpt = None,
    seed: SeedOpt = 0, json_out: JsonOpt = False, device: DeviceOpt = "auto",
    model: ModelOpt = None, checkpoint: CheckpointOpt = None, ablate: AblateOpt = None,
) -> None:
    """What every attention head attends to: head scores, dominant types, attention maps."""
    from minigpt.core.sampling import check_seed
    from minigpt.heads.flags import check_ablate, parse_formats

    fmts = parse_formats(formats or [])  # the flags before torch loads
    check_seed(seed)  # as sample's: torch generators take [0, 2**64)
    check_ablate(ablate)
    from minigpt.heads import output
    from minigpt.heads.inspection import inspect, select_heads
    from minigpt.heads.probes import prepare_input
    from minigpt.inputs import load_run_or_model

    loaded = load_run_or_model(run, model, device, checkpoint)
    if run is None and model is None:
        say(f"using the latest run: {loaded.run_dir}")
    mcfg = loaded.cfg.model
    layers, heads = select_heads(mcfg.n_layer, mcfg.n_head, layer or [], head or [])
    out_dir = output.out_dir(fmts, out, loaded.run_dir)  # made before the work, not after it
    inp = prepare_input(loaded.cfg, loaded.tokenizer, text=text, text_file=text_file,
                        probe=probe, max_tokens=max_tokens, seed=seed,
                        eot_first=loaded.eot_first)
    if inp.truncated:
        has = (f"{inp.n_text_tokens} tokens" if inp.file_bytes is None else
               f"more than {len(inp.tokens)} tokens ({inp.file_bytes:,} bytes)")
        say(f"note: the text has {has}; inspecting the first {len(inp.tokens)} (block_size "
            f"{mcfg.block_size}; see --max-tokens)")
    insp = inspect(loaded.model, inp, run=loaded.source, step=loaded.step, ablate=ablate,
                   seed=seed)
    verdict = "ok" if insp.parity_ok else "MISMATCH: the explicit path disagrees with SDPA"
    say(f"{'run' if loaded.run_dir is not None else 'model'} {loaded.label}, "
        f"{len(insp.tokens)} tokens ({insp.source}); explicit vs SDPA logits: max |diff| = "
        f"{insp.parity_max_diff:.2e} (tolerance {insp.parity_tol:.0e}: {verdict})")
    if insp.ablation is not None:
        ab = insp.ablation
        say(f"ablation ({ab.mode}): loss {ab.base_loss:.4f} nats/token over {ab.scored}; "
            "each head's effect = the loss with it alone ablated minus this one")
    if out_dir is not None:
        for path in output.write_files(insp, out_dir, fmts, layers, heads):
            say(f"wrote {path}")
    if json_out:
        sys.stdout.write(json.dumps(insp.to_json(layers, heads), ensure_ascii=False) + "\n")
        sys.stdout.flush()
    else:  # the table is printed whatever files were asked for (--json: the JSON instead)
        _print_tables(insp, layers, heads)


def _print_tables(insp, layers: list[int], heads: list[int]) -> None:
    """The score table of the selected heads, and each one's weights when there are few."""
    out_console.print(_heads_summary_table(insp, layers, heads))
    if len(layers) * len(heads) > 4:
        say("pick one head with --layer L --head H to see its attention weights")
        return
    for la in layers:
        for h in heads:
            out_console.print(_attention_table(insp, la, h, out_console.width))


def _shade(v: float):
    """Background for a weight in [0, 1]: white -> dark blue; white text on dark cells."""
    from rich.color import Color
    from rich.style import Style

    v = min(1.0, max(0.0, v))
    rgb = [round(255 * (1 - v) + c * v) for c in (20, 50, 130)]
    return Style(bgcolor=Color.from_rgb(*rgb), color="white" if v > 0.45 else "black")


def _heads_summary_table(insp, layers, heads):
    """Layer x head rows with every score (shaded) and the dominant type."""
    import math

    from rich import box
    from rich.table import Table
    from rich.text import Text

    from minigpt.core.heads import SCORE_NAMES

    short = {"induction": "ind", "previous": "prev", "duplicate": "dup", "delimiter": "delim",
             "entropy": "ent"}
    title = printable(f"head scores ({insp.source}, {len(insp.tokens)} tokens)")
    table = Table(title=Text(title, style="table.title"),
                  caption="L = layer, H = head; ind = induction, prev = previous-token, dup = "
                  "duplicate-token, first = attention to token 0, delim = delimiter, ent = "
                  "entropy (0 focused .. 1 uniform); - = not applicable to this input",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    ablation = insp.ablation
    names = [short.get(n, n) for n in SCORE_NAMES] + (["ablate"] if ablation is not None else [])
    for name in ("L", "H", "type", *names):
        table.add_column(name, justify="left" if name == "type" else "right", no_wrap=True)
    if ablation is not None:
        table.caption += (f"; ablate = the loss added (nats/token) with the head "
                          f"{ablation.mode}-ablated (red: the larger)")
        largest = max(float(ablation.effect.abs().max()), 1e-12)
    for la in layers:
        for h in heads:
            s = insp.head_scores(la, h)
            cells = [Text("-") if math.isnan(v) else Text(f"{v:.2f}", style=_shade(v))
                     for v in s.values()]
            if ablation is not None:
                effect = float(ablation.effect[la, h])
                cells.append(Text(f"{effect:+.3f}", style=_heat(effect / largest)))
            table.add_row(str(la), str(h), Text(insp.dominant(la, h), style="bold"), *cells)
    return table


def _heat(v: float):
    """Background for an ablation effect scaled to [-1, 1]: white -> red for a loss the head
    prevents, white -> blue for one it causes."""
    from rich.color import Color
    from rich.style import Style

    v = min(1.0, max(-1.0, v))
    end = (180, 30, 30) if v >= 0 else (40, 70, 170)
    rgb = [round(255 * (1 - abs(v)) + c * abs(v)) for c in end]
    return Style(bgcolor=Color.from_rgb(*rgb), color="white" if abs(v) > 0.45 else "black")


def _attention_table(insp, la: int, h: int, width: int):
    """One head's weights (x100) as a table: query rows, key columns, future keys blank. When
    the map does not fit the terminal, the last queries and the keys they attend to most
    (`Inspection.window`), and the caption says what is left out."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from minigpt.display import visible_token

    T = len(insp.tokens)
    rows, cols = insp.window(la, h, max(8, (width - 14) // 4))
    attn = insp.attention[la, h]
    note = "" if len(rows) == T else (
        f"; {T} tokens do not fit {width} columns: queries {rows[0]}..{rows[-1]} and the "
        f"{len(cols)} keys they attend to most (gaps in the key numbers are keys left out; "
        "widen the terminal or use --format png/html for all)")
    table = Table(title=f"layer {la} head {h}: {insp.dominant(la, h)}",
                  caption=f"attention x100, rows = queries, columns = keys, . = under 0.5, "
                  f"blank = a future key{note}",
                  box=box.SIMPLE, padding=(0, 0), pad_edge=False, collapse_padding=True)
    table.add_column("query", no_wrap=True)
    for j in cols:
        table.add_column(Text(f"{j}\n{visible_token(insp.token_strs[j], 3)}"), justify="right",
                         no_wrap=True, min_width=3)
    for t in rows:
        cells = []
        for j in cols:
            v = float(attn[t, j])
            cells.append(Text("") if j > t else
                         Text(f"{round(v * 100):3d}" if v >= 0.005 else "  .", style=_shade(v)))
        table.add_row(Text(f"{t:>3} {visible_token(insp.token_strs[t], 8)}"), *cells)
    return table
