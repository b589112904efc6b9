"""`minigpt inspect-heads`: every head's scores as a rich table (and one head's attention map),
plus the files asked for: PNG heatmaps, the offline HTML viewer, the raw tensor, JSON."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from minigpt.cli.main import (
    DeviceOpt,
    ModelOpt,
    RunOpt,
    app,
    err_console,
    load_weights,
    out_console,
)
from minigpt.errors import MinigptError


def _inspect_load_run(run: Path | None, device: str, model: str | None = None,
                      checkpoint: int | None = None):
    """Load the run or model to inspect: a run's latest checkpoint or its kept one of step
    `checkpoint`, or an imported model."""
    from minigpt.device import resolve_device
    from minigpt.run import find_latest_run

    dev = resolve_device(device)
    if run is None and model is None:
        run = find_latest_run()
        err_console.print(f"using the latest run: {run}", markup=False)
    return load_weights(run, model, dev, checkpoint)


@app.command("inspect-heads")
def inspect_heads_command(
    run: RunOpt = None,
    text: Annotated[str | None, typer.Option(
        "--text", help="Text to run through the model. Default: a built-in passage.")] = None,
    text_file: Annotated[Path | None, typer.Option(
        "--text-file", help="Read the text from this UTF-8 file.")] = None,
    probe: Annotated[str | None, typer.Option(
        "--probe", help="Built-in synthetic input instead of text: induction (random tokens "
        "repeated twice), previous (no repeats), duplicate (8 ids, many repeats).")] = None,
    layer: Annotated[list[int] | None, typer.Option(
        "--layer", help="Layer to show (repeatable). Default: all.")] = None,
    head: Annotated[list[int] | None, typer.Option(
        "--head", help="Head to show (repeatable). Default: all.")] = None,
    formats: Annotated[list[str] | None, typer.Option(
        "--format", help="table (terminal), png, html, safetensors, json; repeatable or "
        "comma-separated. Default: table.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Directory for the files. Default: <run>/heads/.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="Inspect at most this many tokens (2..block_size; longer text is "
        "cut). Default: block_size.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic probes.")] = 0,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the head scores as JSON on stdout (no tables).")] = False,
    device: DeviceOpt = "auto",
    model: ModelOpt = None,
    checkpoint: Annotated[int | None, typer.Option(
        "--checkpoint", metavar="STEP", help="Inspect the run's kept checkpoint of this step "
        "(train.keep_checkpoints sets how many are kept). Default: the latest.")] = None,
) -> None:
    """What every attention head attends to: head scores, dominant types, attention maps."""
    _inspect_heads(run, text, text_file, probe, layer or [], head or [], formats or [], out,
                   max_tokens, seed, json_out, device, model, checkpoint)


def _inspect_heads(run, text, text_file, probe, layers, heads, formats, out, max_tokens, seed,
                   json_out, device, model=None, checkpoint=None) -> None:
    import json

    from minigpt.heads import inspection as ins
    from minigpt.heads.probes import PROBES, prepare_input

    given = [flag for flag, v in (("--text", text), ("--text-file", text_file),
                                  ("--probe", probe)) if v is not None]
    if len(given) > 1:
        raise MinigptError(f"{' and '.join(given)} exclude each other: give one input")
    fmts = ins.parse_formats(formats)
    if probe is not None and probe not in PROBES:
        raise MinigptError(f"--probe: '{probe}' is not a probe; valid: {', '.join(PROBES)}")
    loaded = _inspect_load_run(run, device, model, checkpoint)
    mcfg = loaded.cfg.model
    layers, heads = ins.select_heads(mcfg.n_layer, mcfg.n_head, layers, heads)
    file_fmts = [f for f in fmts if f != "table"]
    out_dir = None
    if file_fmts:  # fail before the work, not after it
        if out is None and loaded.run_dir is None:
            raise MinigptError("--out: a --model has no run directory to write the "
                               f"{', '.join(file_fmts)} files into; give --out DIR")
        out_dir = ins.check_out_dir(Path(out) if out is not None else loaded.run_dir / "heads")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, text=text, text_file=text_file,
                        probe=probe, max_tokens=max_tokens, seed=seed,
                        eot_first=loaded.eot_first)
    if inp.truncated:
        err_console.print(f"note: the text has {inp.n_text_tokens} tokens; inspecting the first "
                          f"{len(inp.tokens)} (block_size {mcfg.block_size}; see --max-tokens)",
                          markup=False, soft_wrap=True)
    dev = next(loaded.model.parameters()).device
    insp = ins.inspect(loaded.model, inp.tokens, inp.token_strs, device=dev, source=inp.source,
                       run=loaded.source, step=loaded.step)
    verdict = "ok" if insp.parity_ok else "MISMATCH: the explicit path disagrees with SDPA"
    what = "run" if loaded.run_dir is not None else "model"
    err_console.print(f"{what} {loaded.label}, {len(insp.tokens)} tokens "
                      f"({insp.source}); explicit vs SDPA logits: max |diff| = "
                      f"{insp.parity_max_diff:.2e} (tolerance {insp.parity_tol:.0e}: {verdict})",
                      markup=False, soft_wrap=True)
    pairs = [(la, h) for la in layers for h in heads]
    written = []
    if "png" in file_fmts:
        from minigpt.heads.heatmap import write_pngs

        written += write_pngs(insp, out_dir, pairs)
    if "html" in file_fmts:
        from minigpt.heads.viewer import write_html

        written.append(write_html(insp, out_dir / "attention.html", pairs))
    if "safetensors" in file_fmts:
        written.append(ins.write_safetensors(insp, out_dir / "attention.safetensors"))
    if "json" in file_fmts:
        written.append(ins.write_json(insp, out_dir / "scores.json", layers, heads))
    for p in written:
        err_console.print(f"wrote {p}", markup=False, soft_wrap=True)
    if json_out:
        sys.stdout.write(json.dumps(insp.to_json(layers, heads), ensure_ascii=False) + "\n")
        sys.stdout.flush()
    elif "table" in fmts:
        out_console.print(_heads_summary_table(insp, layers, heads))
        if len(pairs) <= 4:
            for la, h in pairs:
                out_console.print(_attention_table(insp, la, h, out_console.width))
        else:
            err_console.print("pick one head with --layer L --head H to see its attention "
                              "weights", markup=False)


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

    from minigpt.heads.scores import SCORE_NAMES

    short = {"induction": "ind", "previous": "prev", "duplicate": "dup", "delimiter": "delim",
             "entropy": "ent"}
    table = Table(title=f"head scores ({insp.source}, {len(insp.tokens)} tokens)",
                  caption="L = layer, H = head; ind = induction, prev = previous-token, dup = "
                  "duplicate-token, first = attention to token 0, delim = delimiter, ent = "
                  "entropy (0 focused .. 1 uniform); - = not applicable to this input",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("L", "H", "type", *(short.get(n, n) for n in SCORE_NAMES)):
        table.add_column(name, justify="left" if name == "type" else "right", no_wrap=True)
    for la in layers:
        for h in heads:
            s = insp.head_scores(la, h)
            cells = [Text("-") if math.isnan(v) else Text(f"{v:.2f}", style=_shade(v))
                     for v in s.values()]
            table.add_row(str(la), str(h), Text(insp.dominant(la, h), style="bold"), *cells)
    return table


def _attention_table(insp, la: int, h: int, width: int):
    """One head's weights (x100) as a T x T table: query rows, key columns, upper triangle blank.
    Only the first tokens that fit the terminal are shown (the files show all of them)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    from minigpt.heads.inspection import visible_token

    T = len(insp.tokens)
    n = min(T, max(8, (width - 14) // 4))
    attn = insp.attention[la, h]
    note = "" if n == T else f"; first {n} of {T} tokens (widen the terminal or use png/html)"
    table = Table(title=f"layer {la} head {h}: {insp.dominant(la, h)}",
                  caption=f"attention x100, rows = queries, columns = keys{note}",
                  box=box.SIMPLE, padding=(0, 0), pad_edge=False, collapse_padding=True)
    table.add_column("query", no_wrap=True)
    for j in range(n):
        table.add_column(Text(f"{j}\n{visible_token(insp.token_strs[j], 3)}"), justify="right",
                         no_wrap=True, min_width=3)
    for t in range(n):
        cells = []
        for j in range(n):
            v = float(attn[t, j])
            cells.append(Text("") if j > t else
                         Text(f"{round(v * 100):3d}" if v >= 0.005 else "  .", style=_shade(v)))
        table.add_row(Text(f"{t:>3} {visible_token(insp.token_strs[t], 8)}"), *cells)
    return table

