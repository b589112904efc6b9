"""The `minigpt` command line. The only module that imports typer and rich: library modules
return data (dataclasses, tensors) and report progress through callbacks; this file renders.

Each command lives in its own section below. Errors the user can fix are MinigptError: printed
as one line on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from minigpt import __version__
from minigpt.config import MinigptError

app = typer.Typer(
    name="minigpt",
    help="Train tiny GPT models on a laptop and look inside their attention heads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# Progress, logs and timings go to stderr; stdout carries only what a command was asked for.
err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error on stderr and return the Exit to raise."""
    err_console.print(f"error: {message}", markup=False, soft_wrap=True)
    return typer.Exit(code)


def version_callback(value: bool) -> None:
    if value:
        out_console.print(f"minigpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=version_callback, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Train tiny GPT models on a laptop and look inside their attention heads."""


# ==== train ===================================================================================


@app.command("train")
def train_command(
    config: Annotated[str | None, typer.Option(
        "--config", "-c", help="YAML config file or bundled name (default: "
        "configs/default.yaml).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override one setting: section.key=value (repeatable), e.g. "
        "--set train.max_steps=500.")] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Run directory (default: <run.out_dir>/<run.name>, i.e. "
        "runs/<config name>).")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue the run in --out from its last checkpoint, with its own "
        "config.yaml (--set may change train.* except batch_size, and run.device).")] = False,
    device: Annotated[str | None, typer.Option(
        "--device", help="auto, cpu, cuda or mps (overrides run.device).")] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", help="Print the resolved config as YAML on stdout and exit.")] = False,
    stop_after: Annotated[int | None, typer.Option(
        "--stop-after", min=1, help="Stop cleanly after this step (checkpoint saved; continue "
        "later with --resume).")] = None,
) -> None:
    """Train a model; progress on stderr, everything saved in the run directory."""
    try:
        code = _train_cli(config, set_ or [], out, resume, device, print_config, stop_after)
    except MinigptError as e:
        raise fail(str(e)) from None
    if code:
        raise typer.Exit(code)


def _train_cli(config, sets, out, resume, device, print_config, stop_after) -> int:
    import os

    from minigpt.config import ConfigError, load_config, to_yaml
    from minigpt.device import DEVICE_CHOICES

    if device is not None and device not in DEVICE_CHOICES:
        raise ConfigError(f"--device: '{device}' is not one of {', '.join(DEVICE_CHOICES)}")
    if resume and config is not None:
        raise ConfigError("--config cannot be combined with --resume: a run continues with its "
                          "own config.yaml (change train.* with --set)")
    cfg = load_config(config, [] if resume else sets)  # validated before any work
    if device:
        cfg.run.device = device
    from minigpt.train import resume_config, run_dir_for, train  # after validation: imports torch

    run_dir = run_dir_for(cfg, out)
    if resume:
        cfg = resume_config(run_dir, sets, device)
    if print_config:
        out_console.print(to_yaml(cfg), end="", markup=False, highlight=False, soft_wrap=True)
        return 0
    view = _TrainView(quiet=os.environ.get("RANK", "0") != "0")
    try:
        done = train(cfg, run_dir, resume=resume, on_event=view.on_event, stop_after=stop_after)
    finally:
        view.close()
    if view.quiet:
        return {"SIGINT": 130, "SIGTERM": 143}.get(done.signal, 0)
    import shlex

    resume_cmd = f"minigpt train --out {shlex.quote(str(run_dir))} --resume"
    if done.reason == "interrupted":
        err_console.print(f"interrupted by {done.signal} after step {done.step}; checkpoint "
                          f"saved in {done.checkpoint}\nresume with: {resume_cmd}",
                          markup=False, highlight=False, soft_wrap=True)
        return 143 if done.signal == "SIGTERM" else 130
    if done.reason == "stopped":
        err_console.print(f"stopped after step {done.step} as asked (--stop-after); resume "
                          f"with: {resume_cmd}", markup=False, highlight=False, soft_wrap=True)
    view.summary(done)
    return 0


_CONTROL = str.maketrans({c: "\ufffd" for c in [*range(9), *range(11, 32), 127]})


def _clean(text: str) -> str:
    """Generated/corpus text with control characters (ESC, CR, ...) made harmless."""
    return text.translate(_CONTROL)


class _TrainView:
    """Renders train events: a rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.tty = err_console.is_terminal and not quiet
        self.progress = None
        self.task = None

    def line(self, text: str) -> None:
        if self.quiet:
            return
        if self.progress is not None:
            self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
        elif self.tty:
            err_console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def on_event(self, e) -> None:
        import math

        from minigpt import train as tr

        if self.quiet:
            return
        if isinstance(e, tr.StartEvent):
            what = "resuming" if e.start_step else "training"
            self.line(f"{what} {e.run_dir}: {e.params:,} parameters, vocab {e.n_vocab}, "
                      f"{e.tokens_per_step:,} tokens/step, device {e.device}"
                      + (f" x {e.world_size} processes" if e.world_size > 1 else "")
                      + (f", from step {e.start_step}" if e.start_step else ""))
            if self.tty:
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self.progress = Progress(
                    TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                    TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(),
                    console=err_console, transient=False)
                self.progress.start()
                self.task = self.progress.add_task("train", total=e.max_steps,
                                                   completed=e.start_step, stats="")
        elif isinstance(e, tr.StepEvent):
            stats = (f"loss {e.loss:.4f} | lr {e.lr:.2e} | {e.tokens_per_s:,.0f} tok/s")
            if self.progress is not None:
                self.progress.update(self.task, completed=e.step, stats=stats)
            else:
                rate = e.step / e.elapsed if e.elapsed > 0 else 0.0
                eta = (e.max_steps - e.step) / rate if rate > 0 else math.nan
                eta_s = f"{eta // 60:.0f}m{eta % 60:02.0f}s" if math.isfinite(eta) else "?"
                self.line(f"step {e.step}/{e.max_steps} | {stats} | grad norm "
                          f"{e.grad_norm:.3f} | {e.elapsed:.1f}s | ETA {eta_s}")
        elif isinstance(e, tr.EvalEvent):
            self.line(f"eval step {e.step}: val loss {e.val_loss:.4f} | ppl {e.val_ppl:.2f} | "
                      f"{e.val_bpb:.4f} bits/byte (best {e.best_val_bpb:.4f}) | "
                      f"{e.elapsed:.1f}s")
            for prompt, text in e.samples:
                body = _clean(prompt + text).replace("\n", "\n  | ")
                self.line(f"  | {body}")
        elif isinstance(e, tr.CheckpointEvent):
            if self.progress is None:
                self.line(f"checkpoint step {e.step}: {e.path}")
        elif type(e).__name__ == "TrainingBPE":
            self.line("training the BPE tokenizer on the corpus (cached for next time) ...")
        elif type(e).__name__ == "DatasetReady":
            self.line(f"data: {e.n_train:,} train / {e.n_val:,} val tokens"
                      + (" (cached)" if e.cached else ""))
            if e.corpus_files:  # say what the config's paths resolved to
                more = f" (+{len(e.corpus_files) - 1} more files)" if len(e.corpus_files) > 1 else ""
                self.line(f"data: corpus {e.corpus_files[0]}{more}; token cache {e.cache_path}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, done) -> None:
        from rich.table import Table

        from minigpt.train import summary_rows

        table = Table(title="training summary", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        for k, v in summary_rows(done):
            table.add_row(k, v)
        if self.tty:
            err_console.print(table)
        else:
            for k, v in summary_rows(done):
                self.line(f"{k}: {v}")


# ==== sample ==================================================================================

from pathlib import Path  # the annotations below are resolved by name at run time
from typing import Annotated


@app.command("sample")
def sample_command(
    run: Annotated[Path | None, typer.Option(
        "--run", help="Run directory. Default: the latest run under runs/.")] = None,
    prompt: Annotated[str | None, typer.Option(
        "-p", "--prompt", help="Text to continue. Default: start from <|endoftext|>.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(
        "--prompt-file", help="Read the prompt from this UTF-8 file.")] = None,
    max_new_tokens: Annotated[int, typer.Option(
        "-n", "--max-new-tokens", help="Tokens to generate per sample.")] = 200,
    temperature: Annotated[float, typer.Option(
        "-t", "--temperature", help="Softmax temperature; 0 = greedy (argmax).")] = 1.0,
    top_k: Annotated[int, typer.Option(
        "-k", "--top-k", help="Keep the k most likely tokens; 0 = off.")] = 0,
    top_p: Annotated[float, typer.Option(
        "--top-p", help="Nucleus sampling: keep the top tokens holding this much probability, "
        "in (0, 1]; 1 = off.")] = 1.0,
    seed: Annotated[int | None, typer.Option(
        "--seed", help="Random seed (same seed, same output). Default: a fresh one, printed on "
        "stderr.")] = None,
    num_samples: Annotated[int, typer.Option(
        "--num-samples", help="Independent samples to draw.")] = 1,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", metavar="TEXT",
        help="End a sample when this text appears (not printed); repeatable.")] = None,
    stream: Annotated[bool | None, typer.Option(
        "--stream/--no-stream", help="Print tokens as they come. Default: on a terminal.")] = None,
    no_kv_cache: Annotated[bool, typer.Option(
        "--no-kv-cache", help="Recompute the whole context for every token (slow).")] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
    json_out: Annotated[bool, typer.Option(
        "--json", help="One JSON document per sample on stdout.")] = False,
    allow_special: Annotated[bool, typer.Option(
        "--allow-special", help="Read <|endoftext|> in the prompt as the special token.")] = False,
) -> None:
    """Generate text from a trained run (text on stdout, timings on stderr)."""
    try:
        _sample(run, prompt, prompt_file, max_new_tokens, temperature, top_k, top_p, seed,
                num_samples, stop or [], stream, no_kv_cache, device, json_out, allow_special)
    except MinigptError as e:
        raise fail(str(e)) from None


def _sample(run, prompt, prompt_file, max_new_tokens, temperature, top_k, top_p, seed,
            num_samples, stops, stream, no_kv_cache, device, json_out, allow_special) -> None:
    import json
    import os
    import time

    t_start = time.perf_counter()  # before torch is imported: "first token N s after start"
    from minigpt import sample as smp
    from minigpt.checkpoint import load_run
    from minigpt.device import resolve_device

    smp.check_sampling_args(temperature, top_k, top_p, max_new_tokens, num_samples)
    if seed is not None:
        smp.check_seed(seed)
    if prompt is not None and prompt_file is not None:
        raise MinigptError("--prompt and --prompt-file: give one of them, not both")
    text = smp.read_prompt_file(prompt_file) if prompt_file is not None else (prompt or "")
    dev = resolve_device(device)
    loaded = load_run(run, dev)  # run None = the latest run under runs/
    tok, block = loaded.tokenizer, loaded.model.cfg.block_size
    ids = tok.encode(text, allow_special=allow_special) if text else [tok.eot_id]
    ids, dropped = smp.truncate_prompt(ids, block)
    if dropped:
        err_console.print(f"note: the prompt is {len(ids) + dropped} tokens, longer than the "
                          f"model's context ({block}); using its last {block} tokens",
                          markup=False, soft_wrap=True)
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    which = "the latest run, " if run is None else ""
    err_console.print(f"sampling from {which}{loaded.run_dir} (step {loaded.step}) on {dev}, "
                      f"seed {seed}", markup=False, soft_wrap=True)
    streaming = (sys.stdout.isatty() if stream is None else stream) and not json_out

    def on_text(index: int, piece: str) -> None:
        if streaming:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def on_done(r) -> None:
        if json_out:
            doc = {"sample": r.index, "prompt": text, "prompt_tokens": len(ids), "text": r.text,
                   "tokens": len(r.token_ids),
                   "tokens_per_s": round(r.tokens_per_s, 2),
                   "time_to_first_token_s": round(r.first_token_s, 4),
                   "finish_reason": r.finish_reason, "seed": seed}
            sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        elif not streaming:
            sys.stdout.write(r.text)
        if not json_out:
            sys.stdout.write("\n")
        sys.stdout.flush()
        since = "" if r.index else f", {t_gen - t_start + r.first_token_s:.2f} s after start"
        err_console.print(f"[sample {r.index + 1}/{num_samples}: {len(r.token_ids)} tokens, "
                          f"{r.tokens_per_s:.0f} tokens/s, first token "
                          f"{r.first_token_s * 1000:.0f} ms{since}; {r.finish_reason}]",
                          markup=False, soft_wrap=True)
        if r.index + 1 < num_samples and not json_out:
            sys.stdout.write(f"----- sample {r.index + 2}/{num_samples} -----\n")

    import torch

    threads = torch.get_num_threads()
    t_gen = time.perf_counter()
    try:
        if dev.type == "cpu":
            # Batch-1 decoding is a chain of tiny ops: a second intra-op thread adds a
            # fork/join per matmul, and when other processes share the cores each join waits
            # for a time slice (measured: ~10x slower with 2 threads on a busy 2-core machine).
            torch.set_num_threads(1)
        smp.sample(loaded.model, ids, tok.decode, max_new_tokens=max_new_tokens,
                   num_samples=num_samples, temperature=temperature, top_k=top_k, top_p=top_p,
                   seed=seed, stops=stops, stop_ids=[tok.eot_id],
                   use_kv_cache=not no_kv_cache, on_text=on_text, on_done=on_done)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `minigpt sample | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests, notebooks) keep theirs


# ==== inspect-heads ===========================================================================


def _inspect_load_run(run: Path | None, device: str):
    """Load the run to inspect (a seam: the CLI tests swap in a tiny random-init model)."""
    from minigpt.checkpoint import find_latest_run, load_run
    from minigpt.device import resolve_device

    dev = resolve_device(device)
    if run is None:
        run = find_latest_run()
        err_console.print(f"using the latest run: {run}", markup=False)
    return load_run(run, dev)


@app.command("inspect-heads")
def inspect_heads_command(
    run: Annotated[Path | None, typer.Option(
        "--run", help="Run directory. Default: the latest run under runs/.")] = None,
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
    device: Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")] = "auto",
) -> None:
    """What every attention head attends to: head scores, dominant types, attention maps."""
    try:
        _inspect_heads(run, text, text_file, probe, layer or [], head or [], formats or [], out,
                       max_tokens, seed, json_out, device)
    except MinigptError as e:
        raise fail(str(e)) from None


def _inspect_heads(run, text, text_file, probe, layers, heads, formats, out, max_tokens, seed,
                   json_out, device) -> None:
    import json

    from minigpt import inspection as ins

    fmts = ins.parse_formats(formats)
    if probe is not None and probe not in ins.PROBES:
        raise MinigptError(f"--probe: '{probe}' is not a probe; valid: {', '.join(ins.PROBES)}")
    loaded = _inspect_load_run(run, device)
    mcfg = loaded.cfg.model
    layers, heads = ins.select_heads(mcfg.n_layer, mcfg.n_head, layers, heads)
    file_fmts = [f for f in fmts if f != "table"]
    out_dir = None
    if file_fmts:  # fail before the work, not after it
        out_dir = ins.check_out_dir(Path(out) if out is not None else loaded.run_dir / "heads")
    inp = ins.prepare_input(loaded.cfg, loaded.tokenizer, text=text, text_file=text_file,
                            probe=probe, max_tokens=max_tokens, seed=seed)
    for note in inp.notes:
        err_console.print(f"note: {note}", markup=False, soft_wrap=True)
    dev = next(loaded.model.parameters()).device
    insp = ins.inspect(loaded.model, inp.tokens, inp.token_strs, device=dev, source=inp.source,
                       run=str(loaded.run_dir), step=loaded.step)
    verdict = "ok" if insp.parity_ok else "MISMATCH: the explicit path disagrees with SDPA"
    err_console.print(f"run {loaded.run_dir} (step {loaded.step}), {len(insp.tokens)} tokens "
                      f"({insp.source}); explicit vs SDPA logits: max |diff| = "
                      f"{insp.parity_max_diff:.2e} (tolerance {insp.parity_tol:.0e}: {verdict})",
                      markup=False, soft_wrap=True)
    pairs = [(la, h) for la in layers for h in heads]
    written = []
    if "png" in file_fmts:
        from minigpt.heatmap import write_pngs

        written += write_pngs(insp, out_dir, pairs)
    if "html" in file_fmts:
        from minigpt.viewer import write_html

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

    from minigpt.inspection import SCORE_NAMES

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

    from minigpt.inspection import visible_token

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


# ==== bench ===================================================================================


import typing as _typing  # bench section; typer resolves the annotations by name

_BOpt = typer.Option


@app.command("bench")
def bench_command(
    device: _typing.Annotated[str, _BOpt("--device", help="auto, cpu, cuda or mps.")] = "auto",
    suite: _typing.Annotated[list[str] | None, _BOpt(
        "--suite", help="attention, train, sample or all; repeatable. Default: all.")] = None,
    seq_lens: _typing.Annotated[str | None, _BOpt(
        "--seq-lens", help="Attention sequence lengths, e.g. 128,256,512. "
        "Default: 256,512,1024,2048 (--quick: 128,256,512).")] = None,
    dtype: _typing.Annotated[str, _BOpt(
        "--dtype", help="auto (bf16 on CUDA, fp32 elsewhere), float32, bfloat16, "
        "float16.")] = "auto",
    quick: _typing.Annotated[bool, _BOpt(
        "--quick", help="Small sizes and few repeats: under a minute on 2 CPU cores.")] = False,
    json_path: _typing.Annotated[str | None, _BOpt(
        "--json", help="Also write every figure and the environment to this JSON file.")] = None,
    compile_: _typing.Annotated[bool, _BOpt(
        "--compile", help="Also time the train step under torch.compile (slow to warm up on "
        "CPU: about a minute per shape).")] = False,
    peak_tflops: _typing.Annotated[float | None, _BOpt(
        "--peak-tflops", help="Peak TFLOP/s for MFU (default: measured matmul rate on CPU, "
        "datasheet table on known GPUs).")] = None,
) -> None:
    """Time attention kernels (naive vs SDPA), a training step (MFU) and decoding (KV cache)
    on this machine. Tables on stdout; the last stdout line is a JSON summary."""
    from minigpt import bench

    opts = bench.BenchOptions(device=device, suites=list(suite or []), seq_lens=seq_lens,
                              dtype=dtype, quick=quick, compile=compile_,
                              peak_tflops=peak_tflops)
    try:
        if json_path is not None:  # fail before the work, not after it
            bench.check_json_path(json_path)
        result = bench.run_bench(opts, on_event=lambda e: err_console.print(
            f"[bench] {e.suite}: {e.message}", markup=False, highlight=False))
        _bench_render(result)
        if json_path is not None:
            bench.write_json(json_path, result)
            err_console.print(f"wrote {json_path}", markup=False)
    except MinigptError as e:
        raise fail(str(e)) from None
    import json

    # The contract for scripts: the LAST stdout line is one compact JSON object.
    sys.stdout.write(json.dumps(bench._finite(result.summary()), separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _bench_render(result) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text  # plain cells: "sdpa[math]" is not rich markup

    env = result.environment
    load = "/".join(str(x) for x in env.get("load_avg", [])) or "n/a"
    out_console.print(
        f"device {env['device']} ({env['device_name']}) | torch {env['torch']} | threads "
        f"{env['threads']} of {env['cpu_count']} cpus | dtype {env['dtype']} | load {load}"
        + (" | quick" if env["quick"] else ""), markup=False, soft_wrap=True)
    out_console.print("note: times are medians after warm-up; IQR = (q3 - q1) / median of the "
                      "repeats (quartiles in --json); on a shared or busy machine timings are "
                      "noisy", markup=False, soft_wrap=True)

    def g(x: float) -> str:  # 3 significant digits, no exponent for big numbers
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    def spread(t) -> str:  # interquartile range relative to the median
        return f"{100 * (t.q3_ms - t.q1_ms) / t.median_ms:.0f}%" if t.median_ms > 0 else "n/a"

    def num(x, fmt: str = "{:.3g}") -> str:
        return "n/a" if x is None else fmt.format(x)

    a = result.attention
    if a is not None:
        c = a.config
        t = Table(title=f"attention: batch {c['batch']}, {c['n_head']} heads, head_dim "
                  f"{c['head_dim']}, causal, {c['dtype']}", box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="faster / less mem: ratios vs naive; MiB: peak memory above the "
                  "inputs; diff: max |out - naive| (fwd) or |grad - naive| (fwd+bwd)")
        for col in ("T", "impl", "pass", "ms", "IQR", "MiB", "faster", "less mem", "diff"):
            t.add_column(col, justify="left" if col in ("impl", "pass") else "right",
                         no_wrap=True)
        for r in a.rows:
            if r.status != "ok":
                t.add_row(str(r.seq_len), Text(r.impl), r.pass_, "skipped", Text(r.reason[:60]),
                          "", "", "", "")
                continue
            t.add_row(str(r.seq_len), Text(r.impl), r.pass_, g(r.timing.median_ms),
                      spread(r.timing), num(r.peak_mem_mib), num(r.speedup_vs_naive, "{:.2f}x"),
                      num(r.mem_ratio_vs_naive, "{:.1f}x"), num(r.max_abs_diff, "{:.0e}"))
        out_console.print(t)
        out_console.print(f"memory method: {a.memory_method or a.memory_note}", markup=False,
                          soft_wrap=True)
        for v in a.verdicts:
            out_console.print(f"verdict: {v}", markup=False, soft_wrap=True)
    tr = result.train
    if tr is not None:
        p = tr.peak
        peak = f"{p.tflops:.3g} TFLOP/s ({p.source})" if p.tflops else f"n/a ({p.note})"
        t = Table(title=f"train step (AdamW, random tokens): MFU vs peak {peak}",
                  box=box.SIMPLE_HEAD, pad_edge=False,
                  caption="1st s = first step in seconds (includes compilation for compile); "
                  + ", ".join(f"{r.shape.name} = {r.shape.n_layer} layers x {r.shape.n_embd}, "
                              f"{r.params / 1e6:.2f}M params" for r in tr.rows
                              if r.mode == "eager"))
        for col in ("shape", "mode", "BxT", "ms/step", "IQR", "tok/s", "TFLOP/s", "MFU",
                    "1st s"):
            t.add_column(col, justify="left" if col in ("shape", "mode") else "right",
                         no_wrap=True)
        for r in tr.rows:
            s = r.shape
            t.add_row(Text(s.name), r.mode, f"{s.batch_size}x{s.block_size}", g(r.timing.median_ms),
                      spread(r.timing), f"{r.tokens_per_s:,.0f}", f"{r.achieved_tflops:.3g}",
                      num(r.mfu, "{:.1%}"), g(r.first_step_s))
        out_console.print(t)
        for dt, m in p.measured.items():
            out_console.print(f"measured {m['n']}x{m['n']} {dt} matmul: {m['tflops']:.3g} "
                              "TFLOP/s", markup=False)
        for v in tr.verdicts:
            out_console.print(f"verdict: {v}", markup=False, soft_wrap=True)
    sm = result.sample
    if sm is not None:
        s = sm.settings
        t = Table(title=f"greedy decoding, batch 1: {s.n_layer}L {s.n_embd}d, prompt "
                  f"{s.prompt_len} + {s.new_tokens} new tokens", box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("KV cache", "TTFT ms", "prefill tok/s", "decode ms/tok", "IQR",
                    "decode tok/s"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in sm.rows:
            t.add_row("yes" if r.kv_cache else "no", g(r.ttft.median_ms),
                      f"{r.prefill_tokens_per_s:,.0f}", g(r.decode.median_ms),
                      spread(r.decode), f"{r.decode_tokens_per_s:,.0f}")
        out_console.print(t)
        for v in sm.verdicts:
            out_console.print(f"verdict: {v}", markup=False, soft_wrap=True)



def main() -> None:
    """Console entry point: user errors become one line and exit code 2."""
    try:
        # Non-standalone click *returns* the code of a typer.Exit raised in a command (fail()).
        code = app(standalone_mode=False)
        if code == 130:  # typer turns a KeyboardInterrupt outside the training loop into 130
            err_console.print("interrupted (Ctrl-C); anything already saved is kept",
                              markup=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except MinigptError as e:
        err_console.print(f"error: {e}", markup=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        err_console.print("aborted", markup=False)
        sys.exit(130)
    except Exception as e:  # click usage errors carry their own exit code (2)
        import click

        # typer >= 0.20 vendors click as typer._click: its exceptions are not click's classes.
        vendored = getattr(getattr(typer, "_click", None), "exceptions", None)
        usage = (click.ClickException, getattr(vendored, "ClickException", click.ClickException))
        if isinstance(e, usage):
            e.show()
            sys.exit(e.exit_code)
        raise
