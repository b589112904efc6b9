"""`minigpt circuit`: the edges of a model's graph that carry the difference between a clean
input and a corrupted one (EAP or EAP-IG scores, `minigpt.interp.edge_graph`), the circuit of the
strongest of them checked by running it (the fraction recovered), the faithfulness curve; a
table of the top edges and one line on stderr, the files asked for, or JSON."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import EtaLines, app, load_inspected, out_console, say
from minigpt.cli.shading import worded
from minigpt.display import printable
from minigpt.files import shown

MetricOpt = Annotated[str, typer.Option(
    "--metric", help="loss (of the next token, nats/token) or logit (of the next token) at "
    "the scored positions; --answer/--wrong make it logit_diff, logit[answer] - "
    "logit[wrong] at the last position (--metric logit_diff says so, and needs them).")]
IgStepsOpt = Annotated[int, typer.Option(
    "--ig-steps", help="EAP-IG: the gradient averaged over this many points between the two "
    "inputs' embeddings; 1 = EAP.")]
EdgesOpt = Annotated[int | None, typer.Option(
    "--edges", metavar="N", help="The circuit: the N edges of largest |score|, pruned. "
    "Default: the smallest such circuit that recovers --recover.")]
RecoverOpt = Annotated[float | None, typer.Option(
    "--recover", metavar="FRACTION", help="The circuit: the fewest top edges that recover "
    "this fraction of the clean -> corrupted change (default 0.9).")]
PairsOpt = Annotated[int, typer.Option(
    "--pairs", help="With a probe: this many (clean, corrupted) pairs, seeds --seed, "
    "--seed + 1, ...; scores and fractions are over all of them.")]
CurveOpt = Annotated[bool, typer.Option(
    "--curve/--no-curve", help="Also the faithfulness curve (10 circuit sizes, 0.1% to 100% "
    "of the edges) of EAP, EAP-IG and, on models of at most 2,000 edges, the real "
    "single-edge patching effects.")]
TopOpt = Annotated[int, typer.Option("--top", help="Edges in the table.")]
FormatOpt = Annotated[list[str] | None, typer.Option(
    "--format", metavar="FORMAT", help="Files to write as well: png (circuit.png, "
    "faithfulness.png), html (circuit.html), json (circuit.json), graph (an attribution graph "
    "for circuit-tracer's viewer and Neuronpedia: SLUG.json and graph-metadata.json; "
    "position-aware) (table: none); repeatable or comma-separated. The table is printed in "
    "every case, except with --json.")]
PositionsOpt = Annotated[bool, typer.Option(
    "--positions", help="Also score every edge per (writer position, reader position): the "
    "JSON's edges list their positions, the table's rows name them, and the faithfulness "
    "curve ranks position-aware edges too.")]
SlugOpt = Annotated[str | None, typer.Option(
    "--slug", metavar="NAME", help="The attribution graph's name (--format graph): letters, "
    "digits, _ and -; default: the run's or model's name, then -circuit.")]


@app.command("circuit")
def circuit_command(
    run: opt.Run = None, model: opt.Model = None, checkpoint: opt.Checkpoint = None,
    text: opt.Text = None, text_file: opt.TextFile = None, probe: opt.Probe = None,
    patch_from: opt.PatchFrom = None, patch_direction: opt.PatchDirection = None,
    metric: MetricOpt = "loss", target: opt.Target = None, answer: opt.Answer = None,
    wrong: opt.Wrong = None, ig_steps: IgStepsOpt = 5, edges: EdgesOpt = None,
    recover: RecoverOpt = None, pairs: PairsOpt = 1, curve: CurveOpt = True, top: TopOpt = 20,
    max_tokens: opt.MaxTokens = None, seed: opt.ProbeSeed = 0, formats: FormatOpt = None,
    out: opt.FilesOut = None, json_out: opt.Json = False, device: opt.Device = "auto",
    threads: opt.Threads = 0, lens: opt.Lens = False, force: opt.Force = False,
    positions: PositionsOpt = False, slug: SlugOpt = None,
) -> None:
    """The circuit: which edges between heads, MLPs, embedding and logits carry a behaviour."""
    from minigpt.heads.flags import CIRCUIT_FORMATS, check_early, check_slug
    from minigpt.interp.edge_args import check_ablation, check_search

    fmts = check_early(formats, seed, threads, valid=CIRCUIT_FORMATS)  # before torch loads
    patch_direction = patch_direction or "noising"
    check_search(edges, recover, ig_steps, patch_direction)
    check_ablation(patch_from or "", patch_direction)
    if slug is not None:
        check_slug(slug)
    positions = positions or "graph" in fmts  # a graph's nodes sit at positions
    from minigpt.device import cpu_threads
    from minigpt.heads.edge_circuit import circuit_pairs
    from minigpt.interp.edge_graph import graph_of
    from minigpt.truth.store import read_truth

    loaded = load_inspected(run, model, device, checkpoint, probe)
    graph_of(loaded.cfg.model)  # a model with no head: refused before any work
    truth = read_truth(loaded.run_dir)  # a compiled program's known circuit, or None
    out_dir, graph = _destination(loaded, fmts, out, curve, slug, truth)
    cost = []  # the estimate, made once the first pair's length is known
    check = _cost_check(loaded, threads, pairs=pairs, ig_steps=ig_steps, curve=curve,
                        force=force, cost=cost, positions=positions, graph="graph" in fmts)
    if truth is not None:
        p = _program_pairs(loaded, truth, patch_from, pairs=pairs, seed=seed,
                           max_tokens=max_tokens, check=check, text=text, text_file=text_file,
                           probe=probe, metric=metric, target=target, answer=answer,
                           wrong=wrong)
    else:
        p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from=patch_from, text=text,
                          text_file=text_file, probe=probe, max_tokens=max_tokens, seed=seed,
                          eot_first=loaded.eot_first, pairs=pairs, metric=metric,
                          target=target, answer=answer, wrong=wrong, device=loaded.device,
                          check=check)
    say(_start_line(loaded, p, positions, cost[0]))
    with cpu_threads(threads, loaded.model):
        search = {"direction": patch_direction, "ig_steps": ig_steps, "edges": edges,
                  "recover": recover, "curves": curve}
        result, seen = _measure(loaded.model, p, search, lens, EtaLines("circuit"), positions)
        scored = _truth(loaded, result, truth, p, seed) if truth is not None else None
    out_str = truth.output_str if truth is not None else loaded.tokenizer.token_str
    _report(loaded, p, result, seen, scored, out_dir=out_dir, fmts=fmts, json_out=json_out,
            top=top, out_str=out_str, graph=graph, threads=threads)


def _report(loaded, p, result, seen, scored, *, out_dir, fmts, json_out: bool, top: int,
            out_str, graph: tuple[str, str], threads: int) -> None:
    """What the search found: the summary on stderr, the files asked for (the attribution
    graph named `graph`, (scan, slug), with --format graph), and the JSON or the tables (with
    a compiled program's truth, `scored`, when there is one); `out_str(i)` names the model's
    output i (a token, or a compiled program's output value)."""
    from minigpt.device import cpu_threads
    from minigpt.heads.edge_circuit import circuit_title

    tok = loaded.tokenizer
    lens_records = seen.records(token_str=out_str) if seen is not None else None
    say(summary_line(result))
    for note in result.notes:
        say(f"note: {note}")
    if out_dir is not None:
        _write(result, out_dir, fmts, circuit_title(loaded.label, p), lens_records)
        if "graph" in fmts:
            with cpu_threads(threads, loaded.model):
                _write_graph(loaded, result, p, out_dir, slug=graph[1], scan=graph[0])
    if json_out:
        doc = result.to_json(lens=lens_records)
        if scored is not None:
            doc["truth"] = scored
        sys.stdout.write(json.dumps(doc, ensure_ascii=False, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:
        _print_tables(result, top, seen, tok, p.clean[0].tolist(), out_str)
        if scored is not None:
            from minigpt.cli.truth_tables import truth_tables

            for table in truth_tables(scored):
                out_console.print(table)


def _program_pairs(loaded, truth, patch_from, *, pairs, seed, max_tokens, check, **unused):
    """A compiled run's pairs (truth.inputs.program_pairs), the search's cost checked first;
    the flags that choose a text, a probe or a metric are refused: a program is scored on its
    own inputs and output."""
    from minigpt.errors import ArgumentError
    from minigpt.truth.inputs import program_pairs

    given = [k for k, v in unused.items() if v is not None and (k, v) != ("metric", "loss")]
    if given:
        raise ArgumentError(given[0], "does not apply to a compiled program: its inputs are "
                            "random inputs of its vocabulary (--pairs, --seed) and its metric "
                            "is its output; leave {name} out")
    check(loaded.cfg.model.block_size if max_tokens is None else max_tokens)
    return program_pairs(loaded.model, loaded.tokenizer, truth, patch_from=patch_from,
                         pairs=pairs, seed=seed, max_tokens=max_tokens)


def _truth(loaded, result, truth, p, seed: int) -> dict:
    """The circuit scored against the program's truth (truth.scoring), the one line of it on
    stderr."""
    from minigpt.truth.scoring import score

    scored = score(loaded.model, loaded.cfg, loaded.tokenizer, result, truth, p, seed)
    aurocs = ", ".join(f"{name} {_f(f['auroc']['all'])} / {_f(f['auroc']['revealed'])}"
                       for name, f in scored["finders"].items())
    c = scored["circuit"]
    say(f"truth: {scored['edges']} edges ({scored['revealed']} this contrast can reveal); edge "
        f"AUROC all / revealed: {aurocs}; the circuit's precision {_f(c['precision'])}, "
        f"recall {_f(c['recall'])}")
    return scored


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cost_check(loaded, threads: int, *, pairs: int, ig_steps: int, curve: bool, force: bool,
                cost: list, positions: bool = False, graph: bool = False):
    """circuit_pairs' `check`: the search's cost estimated from the first pair's length and
    refused when too large (heads.edge_circuit.check_circuit_cost); the estimate appended to
    `cost`."""
    from minigpt.device import cpu_threads
    from minigpt.heads.edge_circuit import check_circuit_cost

    def check(n_tokens: int) -> None:
        with cpu_threads(threads, loaded.model):
            cost.append(check_circuit_cost(loaded.model, n_tokens, pairs, ig_steps, curve, force,
                                           positions, graph))
    return check


def _write(result, out_dir, fmts, title: str, lens_records) -> None:
    from minigpt.heads.edge_circuit import write_circuit_files

    for path in write_circuit_files(result, out_dir, fmts, title, lens=lens_records):
        say(f"wrote {path}")


def _print_tables(result, top: int, seen, tok, tokens: list[int], out_str) -> None:
    """The top edges (by position, when they were scored so), and the logit lens's tables
    when it was asked for."""
    if result.positions is not None:
        out_console.print(position_table(result, top, [tok.token_str(t) for t in tokens]))
    else:
        out_console.print(edges_table(result, top))
    if seen is not None:
        from minigpt.cli.lens_tables import lens_tables

        strs = [tok.token_str(t) for t in tokens]
        for table in lens_tables(seen, strs, out_str, out_console.width):
            out_console.print(table)


def _measure(model, p, search: dict, lens: bool, on_event, positions: bool = False):
    """The circuit of the pairs `p` (`search`: find_circuit's settings; with `positions`, its
    scores by position too, and the faithfulness curve of position-aware edges) and, with
    `lens`, the logit lens (interp.lens.Lens) of the first clean input at the metric's
    positions, of the metric's token (with --answer: the answer's, at the last position); None
    without. The search's progress goes to `on_event` (events.Progress)."""
    from minigpt.events import progress_to
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.interp.edge_positions import position_split
    from minigpt.interp.lens import logit_lens

    split = position_split(model, p.clean.shape[0], p.clean.shape[1]) if positions else None
    result = find_circuit(model, p.clean, p.corrupted, p.metric, p.targets, **search,
                          progress=progress_to(on_event), collect=split)
    if split is not None:
        _positions(model, p, result, split, search["curves"])
    if not lens:
        return result, None
    tokens, m = p.clean[0].tolist(), p.metric
    if m.kind == "output":  # a program: its clean output (categorical), its one value
        targets = p.targets[0].tolist() if not p.targets.is_floating_point() else \
            [0] * len(m.positions)
    else:
        targets = [m.answer] * len(m.positions) if m.logit_diff else m.targets(tokens)
    return result, logit_lens(model, tokens, list(m.positions), targets)


def summary_line(result) -> str:
    """What the circuit recovers, in one line."""
    n, asked = int(result.circuit.sum()), result.requested
    how = (f"the top {asked} edges by |score|" + (f", {n} left after pruning" if n != asked
                                                  else "")
           if result.target is None else
           f"the fewest top edges found to recover {result.target:g}: {asked}"
           + (f", {n} left after pruning" if n != asked else ""))
    areas = result.areas()
    curve = (f"; faithfulness curve area {areas[result.method][0]:.3f} (best 0.999)"
             if result.method in areas else "")
    return (f"circuit ({how}): {n} of {result.n_edges} edges recover "
            f"{100 * result.recovered:.1f}% of the clean -> corrupted change (clean "
            f"{result.clean:.4f}, corrupted {result.corrupted:.4f}){curve}")


def edges_table(result, top: int):
    """The `top` strongest edges, narrow enough for 80 columns."""
    from rich import box
    from rich.table import Table

    steps = f", {result.ig_steps} steps" if result.ig_steps > 1 else ""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("#", "from", "to", "input", "score", "of gap", ""):
        table.add_column(name, justify="left" if name in ("from", "to", "input") else "right",
                         no_wrap=True)
    gap = result.gap
    for i, e in enumerate(result.edges()[:max(0, top)], start=1):
        table.add_row(str(i), e["from"], e["to"], e["input"], f"{e['score']:+.4f}",
                      f"{e['score'] / gap:+.3f}" if gap else "-",
                      "*" if e["in_circuit"] else "")
    return worded(table, printable(f"strongest edges ({result.method.upper()}{steps}, "
                                   f"{result.direction}) of {result.n_edges}"),
                  "score: the estimated change of the metric when the edge alone is patched; "
                  "of gap: score / the change when every edge is; * = in the circuit")


def _destination(loaded, fmts, out, curve: bool, slug: str | None, truth):
    """(the files' directory (None: none asked for), the graph's (scan, slug)), every
    destination checked before any work: a graph list the graph cannot join is refused too,
    and so is a graph of a compiled program (its outputs are no tokens)."""
    from minigpt.errors import ArgumentError
    from minigpt.heads import output
    from minigpt.heads.attribution_graph import listed_graphs, scan_of
    from minigpt.heads.edge_circuit import circuit_file_names

    if "graph" in fmts and truth is not None:
        raise ArgumentError("format", "graph: a compiled program's outputs are no tokens for "
                            "a graph's logits; leave graph out (--positions scores it)")
    scan = scan_of(loaded.cfg, loaded.run_dir)
    slug = slug or f"{scan}-circuit"
    out_dir = output.out_dir(fmts, out, loaded.run_dir, circuit_file_names(fmts, curve, slug))
    if "graph" in fmts:
        listed_graphs(out_dir)
    return out_dir, (scan, slug)


def _start_line(loaded, p, positions: bool, cost) -> str:
    """What the search is about to score, on what, with its estimated cost."""
    return (f"{'run' if loaded.run_dir is not None else 'model'} {loaded.label}: scoring every "
            f"edge{' by position' if positions else ''} on {p.clean.shape[0]} pair(s) of "
            f"{p.clean.shape[1]} tokens ({p.source}; corrupted: "
            f"{shown(p.corrupted_source, 240)}); metric: {p.metric.describe()}; estimated "
            f"{cost.describe()}")


def _positions(model, p, result, split, curves: bool) -> None:
    """The scores by position on `result`, and with `curves` the position-aware ranking's
    faithfulness curve at the summed curve's sizes, in positions (interp.position_circuits)."""
    result.positions = split.result
    if curves:
        from minigpt.interp.position_circuits import positional_curve

        _, summed, ranked = positional_curve(model, result, p.clean, p.corrupted, p.targets)
        result.curves[f"{result.method}@positions"] = ranked
        result.curves[f"{result.method}@summed"] = summed


def _write_graph(loaded, result, p, out_dir, slug: str, scan: str) -> None:
    """The attribution graph files (heads.attribution_graph) of `result` on the first pair."""
    from minigpt.heads.attribution_graph import graph_document, write

    doc = graph_document(loaded.model, loaded.tokenizer, result, p.clean, slug=slug, scan=scan)
    for path in write(doc, out_dir):
        say(f"wrote {path}")
    say(f"graph: {len(doc['nodes'])} nodes, {len(doc['links'])} links after pruning; open it "
        f"with circuit-tracer's viewer (docs/export.md): python -m circuit_tracer start-server "
        f"--graph_file_dir {out_dir}")


def position_table(result, top: int, strs: list[str]):
    """The `top` strongest position-aware edges: each writer and reader with its position and
    that position's token."""
    from rich import box
    from rich.table import Table

    steps = f", {result.ig_steps} steps" if result.ig_steps > 1 else ""
    table = Table(title=printable(f"strongest edges by position ({result.method.upper()}"
                                  f"{steps}, {result.direction}) of {result.n_edges} edges"),
                  caption="at: the position the writer writes at and the reader reads at (a key "
                  "or value is read at its own position by the query at the reader's); score: "
                  "the edge's part at those positions; * = its edge is in the circuit",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("#", "from", "at", "to", "input", "at ", "score", ""):
        table.add_column(name, justify="right" if name in ("#", "score") else "left",
                         no_wrap=True)
    g = result.graph
    for i, (u, v, a, b, x) in enumerate(result.positions.top(max(0, top)), start=1):
        node, inp = g.reader_name(v)
        table.add_row(str(i), g.writer_name(u), _at(a, strs), node, inp, _at(b, strs),
                      f"{x:+.4f}", "*" if bool(result.circuit[u, v]) else "")
    return table


def _at(t: int, strs: list[str]) -> str:
    from minigpt.display import visible_token

    return f"{t} {visible_token(strs[t], 12)}"
