"""`minigpt inspect-heads`: every head's scores as a rich table (and one head's attention map),
plus the files asked for: PNG heatmaps, the offline HTML viewer, the raw tensor, JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import EtaLines, app, load_inspected, out_console, say
from minigpt.cli.shading import shade as _shade
from minigpt.cli.shading import worded
from minigpt.config.fields import comma_list
from minigpt.display import head_name, printable, visible_token
from minigpt.errors import ArgumentError
from minigpt.files import shown

LayerOpt = Annotated[list[int] | None, typer.Option(
    "--layer", metavar="LAYER", help="Layer to show (repeatable). Default: all.")]


def head_index(value: str) -> int:
    """--head's value: a head's index in the layers chosen; a head's name (L1.H2) is answered
    with the flags that mean it here."""
    import re

    m = re.fullmatch(r"\s*[Ll](\d{1,6})\.[Hh](\d{1,6})\s*", value)
    if m:
        raise typer.BadParameter(f"'{value}' names a layer and a head; here they are given "
                                 f"apart: --layer {m.group(1)} --head {m.group(2)}")
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"'{shown(value, 40)}' is not a head's index (an integer); "
                                 "with --layer L, --head H shows head H of layer L") from None


HeadOpt = Annotated[list[int] | None, typer.Option(
    "--head", parser=head_index, metavar="HEAD",
    help="Head to show (repeatable; with --layer, head H of those layers). Default: all.")]
FormatOpt = Annotated[list[str] | None, typer.Option(
    "--format", metavar="FORMAT", help="Files to write as well: png, html, safetensors, json "
    "(table: none); repeatable or comma-separated. The table is printed in every case, "
    "except with --json.")]
AblateOpt = Annotated[str | None, typer.Option(
    "--ablate", metavar="MODE", help="Also measure what each head carries: the loss with that "
    "head alone ablated minus the loss without (nats/token). zero: its output replaced by "
    "zeros; mean: by its mean over the input's positions; resample: by its output on the same "
    "tokens in a random order.")]
DlaOpt = Annotated[bool, typer.Option(
    "--dla", help="Also attribute the logit of the next token (or --target, or --answer minus "
    "--wrong) to every head directly: its output through W_O and the unembedding, scaled by the "
    "final norm of this run, averaged over the scored positions.")]
CompositionOpt = Annotated[bool, typer.Option(
    "--composition", help="Also score how much every head's output is read by the queries, "
    "keys and values of each later head (Q/K/V composition, from the weights), beside the "
    "score of random weights of the same shapes.")]
QkOpt = Annotated[list[str] | None, typer.Option(
    "--qk", metavar="HEAD", help="Also split the head's attention scores into (query writer x "
    "key writer) terms, exactly: why it attends where it does. A head as `minigpt circuit` "
    "names it (L1.H2); repeatable or comma-separated; `all` for every head. Terms are ranked by "
    "margin (the score minus its mean over the keys the query may attend to).")]
QkPairsOpt = Annotated[list[str] | None, typer.Option(
    "--qk-pairs", metavar="QUERY:KEY", help="With --qk: split at these (query, key) positions, "
    "e.g. 7:3,9:5 (repeatable or comma-separated). Default: on --probe induction the induction "
    "targets (each query of the second copy and the key after the earlier occurrence of its "
    "token); otherwise each query's most attended key.")]
FeaturesOpt = Annotated[Path | None, typer.Option(
    "--features", metavar="DIR", help="Also the features of this SAE (`minigpt features "
    "train`, on one of the model's layers) active at each position: the three largest, "
    "beside the heads.")]


@app.command("inspect-heads")
def inspect_heads_command(
    run: opt.Run = None, text: opt.Text = None, text_file: opt.TextFile = None,
    probe: opt.Probe = None, layer: LayerOpt = None, head: HeadOpt = None,
    formats: FormatOpt = None, out: opt.FilesOut = None, max_tokens: opt.MaxTokens = None,
    seed: opt.ProbeSeed = 0, json_out: opt.Json = False, device: opt.Device = "auto",
    model: opt.Model = None, checkpoint: opt.Checkpoint = None, ablate: AblateOpt = None,
    dla: DlaOpt = False, composition: CompositionOpt = False, patch_from: opt.PatchFrom = None,
    patch_direction: opt.PatchDirection = None, target: opt.Target = None,
    answer: opt.Answer = None, wrong: opt.Wrong = None, threads: opt.Threads = 0,
    lens: opt.Lens = False, qk: QkOpt = None, qk_pairs: QkPairsOpt = None,
    features: FeaturesOpt = None, force: opt.Force = False,
) -> None:
    """What every attention head attends to: head scores, dominant types, attention maps."""
    from minigpt.heads.flags import check_early, check_heads_patch_from, check_patch_direction

    fmts = check_early(formats, seed, threads, ablate=ablate)  # before torch loads
    patch_direction = check_patch_direction(patch_from, patch_direction)
    check_heads_patch_from(patch_from)
    from minigpt.device import cpu_threads
    from minigpt.heads import inspection as hi
    from minigpt.heads import output
    from minigpt.heads.probes import prepare_input

    loaded = load_inspected(run, model, device, checkpoint, probe)
    _check_program(loaded, ablate=ablate, dla=dla, patch_from=patch_from, lens=lens,
                   target=target, answer=answer)
    sae = _load_features(features, loaded)  # an SAE of another model: refused before any work
    mcfg = loaded.cfg.model
    layers, heads = hi.select_heads(mcfg.n_layer, mcfg.n_head, layer or [], head or [])
    qk_heads = _qk_heads(mcfg, qk)  # (layer, head) of each --qk head, checked before any work
    names = output.file_names(fmts, layers, heads, ablate, composition, dla or patch_from, lens,
                              [head_name(la, h) for la, h in qk_heads or []])
    out_dir = output.out_dir(fmts, out, loaded.run_dir, names)  # made, every place checked
    inp = prepare_input(loaded.cfg, loaded.tokenizer, text=text, text_file=text_file,
                        probe=probe, max_tokens=max_tokens, seed=seed,
                        eot_first=loaded.eot_first)
    circuits = hi.circuit_request(loaded, inp, max_tokens, seed, dla=dla, lens=lens,
                                  composition=composition, patch_from=patch_from,
                                  direction=patch_direction, target=target, answer=answer,
                                  wrong=wrong, qk=qk_heads, qk_pairs=qk_pairs)
    _say_truncated(inp, mcfg.block_size)
    with cpu_threads(threads):
        cost = hi.check_inspect_cost(loaded.model, len(inp.tokens), ablate=ablate, req=circuits,
                                     features=sae is not None, force=force)
        if cost is not None:
            say(f"inspect-heads: {len(inp.tokens)} tokens, estimated {cost.describe()} (a "
                "lower bound)")
        insp = hi.inspect(loaded.model, inp, run=loaded.source, step=loaded.step, ablate=ablate,
                          seed=seed, circuits=circuits, token_str=loaded.tokenizer.token_str,
                          on_event=EtaLines("inspect-heads"))
        active = _active_features(sae, loaded, inp.tokens)
    _say_measured(insp, loaded)
    if out_dir is not None:
        with output.saying_what_was_written(out_dir, names):
            for path in output.write_files(insp, out_dir, fmts, layers, heads):
                say(f"wrote {path}")
    _emit(insp, layers, heads, json_out, active)


def _say_truncated(inp, block_size: int) -> None:
    """A note on stderr when the text was cut to what the model reads at once."""
    if inp.truncated:
        has = (f"{inp.n_text_tokens} tokens" if inp.file_bytes is None else
               f"more than {len(inp.tokens)} tokens ({inp.file_bytes:,} bytes)")
        say(f"note: the text has {has}; inspecting the first {len(inp.tokens)} (block_size "
            f"{block_size}; see --max-tokens)")


def _check_program(loaded, **asked) -> None:
    """A compiled program's outputs are its values, not next tokens: the analyses that score
    next-token predictions are refused on one (ArgumentError naming the first flag given);
    `minigpt circuit` scores its output."""

    given = [k for k, v in asked.items() if v not in (None, False)]
    if given and loaded.cfg.data.source == "program":
        raise ArgumentError(given[0], "scores next-token predictions, and a compiled program's "
                            "output is its own value at each position, not one: see which "
                            "heads and edges carry it with `minigpt circuit --run "
                            f"{loaded.run_dir}` (patterns and --qk work here)")


def _say_measured(insp, loaded) -> None:
    """The stderr lines of what was measured: the parity check, the ablation, the circuits."""
    verdict = "ok" if insp.parity_ok else "MISMATCH: the explicit path disagrees with SDPA"
    say(f"{'run' if loaded.run_dir is not None else 'model'} {loaded.label}, "
        f"{len(insp.tokens)} tokens ({insp.source}); explicit vs SDPA logits: max |diff| = "
        f"{insp.parity_max_diff:.2e} (tolerance {insp.parity_tol:.0e}: {verdict})")
    if insp.ablation is not None:
        ab = insp.ablation
        say(f"ablation ({ab.mode}): loss {ab.base_loss:.4f} nats/token over {ab.scored}; "
            "each head's effect = the loss with it alone ablated minus this one")
    _say_circuits(insp)


def _emit(insp, layers, heads, json_out: bool, active: dict | None) -> None:
    """The JSON on stdout, or the tables (printed whatever files were asked for)."""
    if json_out:
        doc = insp.to_json(layers, heads)
        if active is not None:
            doc["features"] = active
        sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        sys.stdout.flush()
        return
    _print_tables(insp, layers, heads)
    if active is not None:
        out_console.print(active_table(active, insp.token_strs))


def active_table(active: dict, token_strs: list[str]):
    """inspect-heads --features: the features active at each position."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("pos", "token", "features (activation)"):
        table.add_column(name, justify="right" if name == "pos" else "left")
    for i, (tok, row) in enumerate(zip(token_strs, active["positions"])):
        table.add_row(str(i), Text(visible_token(tok)),  # token text, never markup
                      "  ".join(f"{x['feature']} ({x['act']:.2f})" for x in row) or "-")
    return worded(table, f"SAE features active on layer {active['layer']}'s heads (largest "
                  "three per position; see minigpt features show --feature N)")


def _load_features(features: Path | None, loaded):
    """The SAE of --features and its layer, checked against the model (None without)."""
    if features is None:
        return None
    from minigpt.features.show import load_for

    return load_for(features, loaded)


def _active_features(sae, loaded, tokens: list[int]) -> dict | None:
    """The features active at each position, for the table and the JSON (None without)."""
    if sae is None:
        return None
    from minigpt.features.show import active_features

    model, layer = sae
    per = active_features(loaded.model, model, layer, list(tokens))
    return {"layer": layer, "positions": [[{"feature": f, "act": a} for f, a in row]
                                          for row in per]}


def _qk_heads(mcfg, qk: list[str] | None) -> list[tuple[int, int]] | None:
    """The `--qk` heads as (layer, head), resolved and checked once (interp.qk.resolve_heads);
    None when --qk is not given."""
    from minigpt.interp.qk import resolve_heads

    return resolve_heads(mcfg, comma_list(qk)) if qk else None


def _say_circuits(insp) -> None:
    """One stderr line per circuit measurement: what it measured, on what."""
    if insp.dla is not None:
        d = insp.dla
        say(f"dla: {d.what}; the model's value {d.logit:.4f}, the components add up to "
            f"{d.total:.4f} (heads {float(d.heads.sum()):+.4f}, "
            + ", ".join(f"{k} {v:+.4f}" for k, v in d.rows.items()) + ")")
    if insp.patch is not None:
        p = insp.patch
        say(f"patch ({p.direction}, from {shown(p.source)}): {p.what}; clean "
            f"{p.clean:.4f}, corrupted {p.corrupted:.4f}; each head's patch = the fraction of "
            "that change it "
            + ("produces alone" if p.direction == "noising" else "restores alone"))
        say("note: a fraction above 1 or below 0 is no error: effects do not add up (in the "
            "fully corrupted run other heads change too and partly cancel this one), so one "
            "head alone can move the metric further than the whole corruption does")
        for note in p.notes:
            say(f"note: {note}")
    if insp.qk is not None:
        worst = max(h.closure for h in insp.qk)
        say(f"qk: {len(insp.qk)} head(s) split at {shown(insp.qk_pairs, 300)}; the terms add up "
            f"to the model's scores and margins within {worst:.1e} (norm and QK-norm scales "
            "frozen at this input)")


def _print_tables(insp, layers: list[int], heads: list[int]) -> None:
    """The score tables of the selected heads (as many as the width needs), the composition
    summary, and each head's weights when there are few."""
    for table in _heads_tables(insp, layers, heads, out_console.width):
        out_console.print(table)
    if insp.composition is not None:
        out_console.print(_composition_table(insp.composition))
    if insp.qk is not None:
        roles = insp.writer_roles()
        for h in insp.qk:
            for part in _qk_table(h, roles, insp.qk_pairs_of(h)):
                out_console.print(part)
    if insp.lens is not None:
        from minigpt.cli.lens_tables import lens_tables

        for table in lens_tables(insp.lens, insp.token_strs, insp.token_str, out_console.width):
            out_console.print(table)
    if len(layers) * len(heads) > 4:
        say("pick one head with --layer L --head H to see its attention weights")
        return
    for la in layers:
        for h in heads:
            out_console.print(_attention_table(insp, la, h, out_console.width))


SHORT = {"induction": "ind", "previous": "prev", "duplicate": "dup", "delimiter": "delim",
         "entropy": "ent"}
KEY_COLUMNS = ("L", "H", "type")  # every table starts with these: each row says which head


def _head_columns(insp, layers, heads) -> list[tuple[str, list]]:
    """(header, one cell per row) of every number column, in order: the scores (shaded), then
    ablate, dla and patch when measured (heat-coloured, red = the larger)."""
    import math

    from rich.text import Text

    from minigpt.interp.heads import SCORE_NAMES

    pairs = [(la, h) for la in layers for h in heads]
    cols = []
    for name in SCORE_NAMES:
        cells = []
        for la, h in pairs:
            v = float(insp.scores[name][la, h])
            cells.append(Text("-") if math.isnan(v) else Text(f"{v:.2f}", style=_shade(v)))
        cols.append((SHORT.get(name, name), cells))
    cols += _lag_columns(insp, pairs)
    for header, values, fmt in (
            ("ablate", insp.ablation and insp.ablation.effect, "{:+.3f}"),
            ("dla", insp.dla and insp.dla.heads, "{:+.3f}"),
            ("patch", insp.patch and insp.patch.effect, "{:+.3f}")):
        if values is None:
            continue
        largest = max(float(values.abs().max()), 1e-12)
        cols.append((header, [Text(fmt.format(float(values[la, h])),
                                   style=_heat(float(values[la, h]) / largest))
                              for la, h in pairs]))
    return cols


LAG_HEADERS = {"previous": "prev@k", "induction": "ind@k"}


def _lag_columns(insp, pairs) -> list[tuple[str, list]]:
    """prev@k and ind@k: each head's best previous-token and induction score over the lags
    (interp.heads' lag scores), with its lag: `0.81@6` = 0.81 at lag 6; `-`: none applies."""
    import math

    from rich.text import Text

    cols = []
    for kind, header in LAG_HEADERS.items():
        cells = []
        for la, h in pairs:
            k, v = insp.best_lags(la, h)[kind]
            cells.append(Text("-") if not k or math.isnan(v)
                         else Text(f"{v:.2f}@{k}", style=_shade(v)))
        cols.append((header, cells))
    return cols


def _caption(insp, headers: set[str]) -> str:
    """What the abbreviations of the columns in `headers` mean."""
    from minigpt.interp.heads import LAG_WINDOW

    words = {"ind": "ind = induction", "prev": "prev = previous-token",
             "dup": "dup = duplicate-token", "first": "first = attention to token 0",
             "delim": "delim = delimiter", "ent": "ent = entropy (0 focused .. 1 uniform)"}
    words.update({"prev@k": f"prev@k = the best previous-token score over lags 1-{LAG_WINDOW} "
                  "(attention from t to t-k) @ its lag k",
                  "ind@k": f"ind@k = the best induction score over lags 1-{LAG_WINDOW} "
                  "(attention to the token k after an earlier occurrence) @ its lag k"})
    parts = ["L = layer, H = head"] + [w for k, w in words.items() if k in headers]
    if "ablate" in headers:
        parts.append(f"ablate = the loss added (nats/token) with the head "
                     f"{insp.ablation.mode}-ablated (red: the larger)")
    if "dla" in headers:
        parts.append("dla = the head's direct share of the logit")
    if "patch" in headers:
        parts.append(f"patch = fraction of the clean -> corrupted change "
                     f"({insp.patch.direction}, from {insp.patch.source.split(':')[0]}); "
                     "above 1 or below 0 is possible: effects do not add up, other heads "
                     "cancel part of the change in the corrupted run")
    return "; ".join(parts) + "; - = not applicable to this input"


def _heads_tables(insp, layers, heads, width: int) -> list:
    """The head table, cut into as many tables as `width` needs: each starts with L, H and
    the dominant type and takes the next number columns that fit whole, so every row says
    which head it is and every number is printed in full at any width."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    pairs = [(la, h) for la in layers for h in heads]
    types = [insp.dominant(la, h) for la, h in pairs]
    key = [[str(la) for la, _ in pairs], [str(h) for _, h in pairs], types]
    key_w = sum(max(len(n), *(len(c) for c in cells)) + 2 for n, cells in zip(KEY_COLUMNS, key))
    groups, used = [[]], key_w
    for header, cells in _head_columns(insp, layers, heads):
        w = max(len(header), *(len(c.plain) for c in cells)) + 2  # + padding and divider
        if groups[-1] and used + w > width:
            groups.append([])
            used = key_w
        groups[-1].append((header, cells))
        used += w
    tables = []
    for i, group in enumerate(groups):
        title = printable(f"head scores ({insp.source}, {len(insp.tokens)} tokens)"
                          + (f", part {i + 1} of {len(groups)}" if len(groups) > 1 else ""))
        table = Table(title=Text(title, style="table.title"), box=box.SIMPLE_HEAD,
                      pad_edge=False, padding=(0, 1, 0, 0), collapse_padding=True)
        for name in KEY_COLUMNS + tuple(h for h, _ in group):
            table.add_column(name, justify="left" if name == "type" else "right",
                             no_wrap=True)
        for r in range(len(pairs)):
            table.add_row(key[0][r], key[1][r], Text(types[r], style="bold"),
                          *(cells[r] for _, cells in group))
        # the caption below the table, not in it: a part of a few columns would squeeze it
        # into its own width (~24 columns piped)
        tables.append(Group(table, Text(_caption(insp, {h for h, _ in group}),
                                        style="table.caption")))
    return tables


def _composition_table(comp, top: int = 5):
    """The strongest pairs of each composition kind, beside the random-weights baseline."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    caption = ("from = the earlier head (layer.head) whose output the later head reads with its "
               "queries (q), keys (k) or values (v); random = the score of random weights of "
               "the same shapes")
    for name in ("kind", "from", "to", "score", "random"):
        table.add_column(name, justify="left" if name == "kind" else "right", no_wrap=True)
    for kind in ("q", "k", "v"):
        recs = sorted((r for r in comp.records() if r["kind"] == kind),
                      key=lambda r: -r["score"])[:top]
        for r in recs:
            table.add_row(kind, r["from"], r["to"], f"{r['score']:.3f}",
                          f"{r['baseline']:.3f}")
    return worded(table, "composition (weights only): the strongest pairs of each kind", caption)


QK_TOP = 8  # terms per head in the table (every one is in --json)


def _writer(name: str, roles: dict[str, dict]) -> str:
    """A writer's name with its role where one is known: `L0.H3 (previous-token 0.92)`."""
    r = roles.get(name)
    return name if r is None else f"{name} ({r['role']} {r['score']:.2f})"


def _qk_table(h, roles: dict[str, dict], pairs: str, top: int = QK_TOP) -> list:
    """One head's largest terms by margin (means over its pairs), its writers named with their
    roles, and under it (as wide as the terminal, wrapped at words) what it shows."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    terms = h.terms()
    largest = max(max(abs(m) for *_, m in terms), 1e-12)
    title = Text(f"{_writer(h.name, roles)}: why it attends where it does")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("query writer", "key writer", "margin", "score"):
        table.add_column(name, justify="left" if "writer" in name else "right", no_wrap=True)
    for q, k, score, margin in terms[:top]:
        table.add_row(_writer(q, roles), _writer(k, roles),
                      Text(f"{margin:+.3f}", style=_heat(margin / largest)), f"{score:+.3f}")
    caption = (f"split at {pairs}; score {float(h.scores.mean()):+.3f} and margin "
               f"{float(h.margins.mean()):+.3f} (means over the pairs; margin = the score minus "
               "its mean over the keys the query may attend to); the "
               f"{min(top, len(terms))} largest of {len(terms)} terms (query writer x key "
               f"writer) by margin; a head's role is its dominant score on this input; "
               f"closure {h.closure:.1e}")
    return [worded(table, title.plain, caption)]


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
    table = Table(box=box.SIMPLE, padding=(0, 0), pad_edge=False, collapse_padding=True)
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
    return worded(table, f"{head_name(la, h)} (layer {la} head {h}): {insp.dominant(la, h)}",
                  "attention x100, rows = queries, columns = keys, . = under 0.5, blank = a "
                  f"future key{note}")
