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
    "--format", help="Files to write as well: png (circuit.png, faithfulness.png), html "
    "(circuit.html), json (circuit.json) (table: none); repeatable or comma-separated. The "
    "table is printed in every case, except with --json.")]


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
) -> None:
    """The circuit: which edges between heads, MLPs, embedding and logits carry a behaviour."""
    from minigpt.heads.flags import CIRCUIT_FORMATS, check_early
    from minigpt.interp.edge_args import check_ablation, check_search

    fmts = check_early(formats, seed, threads, valid=CIRCUIT_FORMATS)  # before torch loads
    patch_direction = patch_direction or "noising"
    check_search(edges, recover, ig_steps, patch_direction)
    check_ablation(patch_from or "", patch_direction)
    from minigpt.device import cpu_threads
    from minigpt.heads import output
    from minigpt.heads.edge_circuit import circuit_file_names, circuit_pairs
    from minigpt.interp.edge_graph import graph_of
    from minigpt.truth.store import read_truth

    loaded = load_inspected(run, model, device, checkpoint, probe)
    graph_of(loaded.cfg.model)  # a model with no head: refused before any work
    truth = read_truth(loaded.run_dir)  # a compiled program's known circuit, or None
    out_dir = output.out_dir(fmts, out, loaded.run_dir, circuit_file_names(fmts, curve))
    cost = []  # the estimate, made once the first pair's length is known
    check = _cost_check(loaded, threads, pairs, ig_steps, curve, force, cost)
    if truth is not None:
        p = _program_pairs(loaded, truth, patch_from, pairs, seed, max_tokens, check,
                           text=text, text_file=text_file, probe=probe, metric=metric,
                           target=target, answer=answer, wrong=wrong)
    else:
        p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from=patch_from, text=text,
                          text_file=text_file, probe=probe, max_tokens=max_tokens, seed=seed,
                          eot_first=loaded.eot_first, pairs=pairs, metric=metric,
                          target=target, answer=answer, wrong=wrong, device=loaded.device,
                          check=check)
    say(f"{'run' if loaded.run_dir is not None else 'model'} {loaded.label}: scoring every "
        f"edge on {p.clean.shape[0]} pair(s) of {p.clean.shape[1]} tokens ({p.source}; "
        f"corrupted: {shown(p.corrupted_source, 240)}); metric: {p.metric.describe()}; estimated "
        f"{cost[0].describe()}")
    with cpu_threads(threads, loaded.model):
        result, seen = _measure(loaded.model, p, patch_direction, ig_steps, edges, recover,
                                curve, lens, EtaLines("circuit"))
        scored = _truth(loaded, result, truth, p, seed) if truth is not None else None
    out_str = truth.output_str if truth is not None else loaded.tokenizer.token_str
    _report(loaded, p, result, seen, scored, out_dir, fmts, json_out, top, out_str)


def _report(loaded, p, result, seen, scored, out_dir, fmts, json_out: bool, top: int,
            out_str) -> None:
    """What the search found: the summary on stderr, the files asked for, and the JSON or the
    tables (with a compiled program's truth, `scored`, when there is one); `out_str(i)` names
    the model's output i (a token, or a compiled program's output value)."""
    from minigpt.heads.edge_circuit import circuit_title

    tok = loaded.tokenizer
    lens_records = seen.records(token_str=out_str) if seen is not None else None
    say(summary_line(result))
    for note in result.notes:
        say(f"note: {note}")
    if out_dir is not None:
        _write(result, out_dir, fmts, circuit_title(loaded.label, p), lens_records)
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


def _program_pairs(loaded, truth, patch_from, pairs, seed, max_tokens, check, **unused):
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


def _cost_check(loaded, threads: int, pairs: int, ig_steps: int, curve: bool, force: bool,
                cost: list):
    """circuit_pairs' `check`: the search's cost estimated from the first pair's length and
    refused when too large (heads.edge_circuit.check_circuit_cost); the estimate appended to
    `cost`."""
    from minigpt.device import cpu_threads
    from minigpt.heads.edge_circuit import check_circuit_cost

    def check(n_tokens: int) -> None:
        with cpu_threads(threads, loaded.model):
            cost.append(check_circuit_cost(loaded.model, n_tokens, pairs, ig_steps, curve, force))
    return check


def _write(result, out_dir, fmts, title: str, lens_records) -> None:
    from minigpt.heads.edge_circuit import write_circuit_files

    for path in write_circuit_files(result, out_dir, fmts, title, lens=lens_records):
        say(f"wrote {path}")


def _print_tables(result, top: int, seen, tok, tokens: list[int], out_str) -> None:
    """The top edges, and the logit lens's tables when it was asked for."""
    out_console.print(edges_table(result, top))
    if seen is not None:
        from minigpt.cli.lens_tables import lens_tables

        strs = [tok.token_str(t) for t in tokens]
        for table in lens_tables(seen, strs, out_str, out_console.width):
            out_console.print(table)


def _measure(model, p, direction, ig_steps, edges, recover, curve, lens, progress=None):
    """The circuit of the pairs `p` and, with `lens`, the logit lens (interp.lens.Lens) of the
    first clean input at the metric's positions, of the metric's token (with --answer: the
    answer's, at the last position); None without."""
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.interp.lens import logit_lens

    result = find_circuit(model, p.clean, p.corrupted, p.metric, p.targets,
                          direction=direction, ig_steps=ig_steps, edges=edges,
                          recover=recover, curves=curve, progress=progress)
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
    table = Table(title=printable(f"strongest edges ({result.method.upper()}{steps}, "
                                  f"{result.direction}) of {result.n_edges}"),
                  caption="score: the estimated change of the metric when the edge alone is "
                  "patched; of gap: score / the change when every edge is; * = in the "
                  "circuit", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("#", "from", "to", "input", "score", "of gap", ""):
        table.add_column(name, justify="left" if name in ("from", "to", "input") else "right",
                         no_wrap=True)
    gap = result.gap
    for i, e in enumerate(result.edges()[:max(0, top)], start=1):
        table.add_row(str(i), e["from"], e["to"], e["input"], f"{e['score']:+.4f}",
                      f"{e['score'] / gap:+.3f}" if gap else "-",
                      "*" if e["in_circuit"] else "")
    return table
