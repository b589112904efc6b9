"""`minigpt sample`: generated text on stdout (streamed on a terminal, or one JSON document per
sample), the run, seed and timings on stderr."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

import minigpt.cli.options as opt
from minigpt.cli.main import app, latest_run, say
from minigpt.display import printable

PromptOpt = Annotated[str | None, typer.Option(
    "-p", "--prompt", help="Text to continue. Default: start from <|endoftext|>.")]
PromptFileOpt = Annotated[Path | None, typer.Option(
    "--prompt-file", help="Read the prompt from this UTF-8 file.")]
MaxNewOpt = Annotated[int, typer.Option(
    "-n", "--max-new-tokens", help="Tokens to generate per sample.")]
TemperatureOpt = Annotated[float, typer.Option(
    "-t", "--temperature", help="Softmax temperature; 0 = greedy (argmax).")]
TopKOpt = Annotated[int, typer.Option(
    "-k", "--top-k", help="Keep the k most likely tokens; 0 = off.")]
TopPOpt = Annotated[float, typer.Option(
    "--top-p", help="Nucleus sampling: keep the top tokens holding this much probability, "
    "in (0, 1]; 1 = off.")]
SeedOpt = Annotated[int | None, typer.Option(
    "--seed", help="Random seed (same seed, same output). Default: a fresh one, printed on "
    "stderr.")]
NumSamplesOpt = Annotated[int, typer.Option(
    "--num-samples", help="Independent samples to draw.")]
StopOpt = Annotated[list[str] | None, typer.Option(
    "--stop", metavar="TEXT",
    help="End a sample when this text appears (not printed); repeatable. \\n, \\t and "
    "\\\\ stand for a newline, a tab and one backslash (--stop '\\n\\n' = a blank line).")]
StreamOpt = Annotated[bool | None, typer.Option(
    "--stream/--no-stream", help="Print tokens as they come. Default: on a terminal.")]
NoKvCacheOpt = Annotated[bool, typer.Option(
    "--no-kv-cache", help="Recompute the whole context for every token (slow).")]
CompileOpt = Annotated[bool, typer.Option(
    "--compile", help="Decode through the compiled one-token step (torch.compile: tens of "
    "seconds to compile a shape the first time, faster per token after; docs/cli.md).")]
JsonOpt = Annotated[bool, typer.Option(
    "--json", help="One JSON document per sample on stdout.")]
AllowSpecialOpt = Annotated[bool, typer.Option(
    "--allow-special", help="Read <|endoftext|> in the prompt as the special token.")]


@app.command("sample")
def sample_command(
    run: opt.Run = None, prompt: PromptOpt = None, prompt_file: PromptFileOpt = None,
    max_new_tokens: MaxNewOpt = 200, temperature: TemperatureOpt = 1.0, top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0, seed: SeedOpt = None, num_samples: NumSamplesOpt = 1,
    stop: StopOpt = None, stream: StreamOpt = None, no_kv_cache: NoKvCacheOpt = False,
    device: opt.Device = "auto", json_out: JsonOpt = False,
    allow_special: AllowSpecialOpt = False, model: opt.Model = None, threads: opt.Threads = 0,
    force: opt.Force = False, compile_: CompileOpt = False,
) -> None:
    """Generate text from a trained run or a Hugging Face model (text on stdout, timings on
    stderr)."""
    t_start = time.perf_counter()  # before torch is imported: "first token N s after start"
    from minigpt.core.sampling import Sampling, check_seed
    from minigpt.threads import check_threads

    # The flags first: a typo is refused before torch loads (seconds on a busy laptop).
    how = Sampling(temperature, top_k, top_p, max_new_tokens, num_samples)  # validated
    if seed is not None:
        check_seed(seed)
    check_threads(threads)
    from minigpt.device import decoding_threads
    from minigpt.infer import sample as smp
    from minigpt.infer.inputs import load_run_or_model, read_prompt

    which = ""
    if run is None and model is None:
        run, which = latest_run(_trained_on_text, require_fit=False,
                                kind="run trained on text")
    loaded = load_run_or_model(run, model, device)
    if loaded.cfg.data.source == "program":
        _program(loaded, prompt, prompt_file, json_out)
        return
    tok, block = loaded.tokenizer, loaded.model.cfg.block_size
    p = read_prompt(tok, block, prompt, prompt_file, allow_special)
    if p.cut:
        size = f"{p.n_tokens} tokens" if p.file_bytes is None else f"{p.file_bytes:,} bytes"
        say(f"note: the prompt is {size}, longer than the model's context ({block}); using its "
            f"last {block} tokens")
    with decoding_threads(loaded.model, threads):
        smp.check_sample_cost(loaded.model, len(p.ids), how, not no_kv_cache, force)
    compiled = smp.decode_compiles(not no_kv_cache, compile_)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    dev = loaded.device
    say(f"sampling from {which}{loaded.label} on {dev}, seed {seed}"
        + (", compiled decode step (the first step compiles it)" if compiled else ""))
    if loaded.cfg.data.source == "induction":
        say("note: this run was trained on synthetic induction data (random token ids, each "
            "segment repeated), not on text: its output is ids shown as bytes; see it with "
            "`minigpt inspect-heads --probe induction`")
    streaming = (sys.stdout.isatty() if stream is None else stream) and not json_out
    # On a terminal the prompt is shown first (dimmed), so the text reads from its start.
    shown = ("" if json_out or not sys.stdout.isatty() else
             ("…" + tok.decode(p.ids)) if p.cut else p.text)
    view = _SampleView(p, seed, num_samples, json_out=json_out, streaming=streaming,
                       t_start=t_start, shown_prompt=shown)
    with _stdout_to_the_end(), decoding_threads(loaded.model, threads):
        smp.sample(loaded.model, p.ids, tok.decode, how, seed=seed,
                   stops=[unescape_stop(s) for s in stop or []], stop_ids=[tok.eot_id],
                   use_kv_cache=not no_kv_cache, on_text=view.on_text, on_done=view.on_done,
                   compile_step=compiled)


def _program(loaded, prompt: str | None, prompt_file: Path | None, json_out: bool) -> None:
    """A compiled program generates nothing: its output at every position of the prompt (its
    tokens, BOS put first) goes to stdout, one value per position after BOS."""
    from minigpt.errors import ArgumentError
    from minigpt.infer.inputs import read_prompt
    from minigpt.truth.inputs import program_outputs
    from minigpt.truth.store import read_truth

    truth = read_truth(loaded.run_dir)
    if truth is None:
        raise ArgumentError("run", f"{loaded.run_dir} says it is a compiled program "
                            "(data.source: program) but has no truth.json; compile it again")
    block = loaded.model.cfg.block_size
    p = read_prompt(loaded.tokenizer, block - 1, prompt, prompt_file)
    ids = [loaded.tokenizer.eot_id, *(i for i in p.ids if i != loaded.tokenizer.eot_id)]
    if p.cut:
        say(f"note: the program reads at most {block - 1} tokens; using the last {block - 1}")
    out = program_outputs(loaded.model, truth, ids)[1:]
    words = [loaded.tokenizer.token_str(i) for i in ids[1:]]
    say(f"{loaded.label} is the compiled program {truth.program['name']} "
        f"({truth.program['summary']}): it computes its output at every position and "
        "generates nothing; its output after each token of the prompt follows")
    if json_out:
        sys.stdout.write(json.dumps({"program": truth.program["name"], "input": words,
                                     "output": out}, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write(" ".join(str(v) for v in out) + "\n")


def _trained_on_text(run_dir: Path) -> str | None:
    """Why `sample` passes over a run (None: it samples text)."""
    from minigpt.run.listing import data_kind

    source = data_kind(run_dir).get("source", "text")
    if source == "text":
        return None
    return ("a compiled program, not a language model" if source == "program"
            else "trained on synthetic induction data, not text")


class _SampleView:
    """Prints what `infer.sample.sample` reports: text on stdout (streamed, whole, or one JSON
    document per sample) and one line of timings per sample on stderr."""

    def __init__(self, prompt, seed: int, num_samples: int, *, json_out: bool, streaming: bool,
                 t_start: float, shown_prompt: str = ""):
        self.prompt, self.seed, self.n, self.json_out = prompt, seed, num_samples, json_out
        self.streaming, self.t_start, self.shown = streaming, t_start, shown_prompt
        self.started: set[int] = set()  # samples whose prompt is already shown
        self.t_gen = time.perf_counter()  # generation starts right after this is made

    def _prompt_once(self, index: int) -> None:
        """On a terminal, the prompt (dimmed: it is not generated) before sample `index`."""
        if self.shown and index not in self.started:
            self.started.add(index)
            shown = printable(self.shown, keep="\n\t")  # a prompt file's escapes, shown
            sys.stdout.write(f"\x1b[2m{shown}\x1b[0m")

    def on_text(self, index: int, piece: str) -> None:
        self._prompt_once(index)
        if self.streaming:
            sys.stdout.write(piece)
            sys.stdout.flush()

    def on_done(self, r) -> None:
        if self.json_out:
            doc = {"sample": r.index, "prompt": self.prompt.text,
                   "prompt_tokens": len(self.prompt.ids), "text": r.text,
                   "tokens": len(r.token_ids), "tokens_per_s": round(r.tokens_per_s, 2),
                   "time_to_first_token_s": round(r.first_token_s, 4),
                   "finish_reason": r.finish_reason, "seed": self.seed}
            sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
        else:
            self._prompt_once(r.index)
            sys.stdout.write(("" if self.streaming else r.text) + "\n")
        sys.stdout.flush()
        since = ("" if r.index else
                 f", {self.t_gen - self.t_start + r.first_token_s:.2f} s after start")
        say(f"[sample {r.index + 1}/{self.n}: {len(r.token_ids)} tokens, {r.tokens_per_s:.0f} "
            f"tokens/s, first token {r.first_token_s * 1000:.0f} ms{since}; "
            f"{r.finish_reason}]")
        if r.index + 1 < self.n and not self.json_out:
            sys.stdout.write(f"----- sample {r.index + 2}/{self.n} -----\n")


@contextlib.contextmanager
def _stdout_to_the_end():
    """Ctrl-C ends the line and exits 130. (A reader that leaves, `minigpt sample | head`,
    ends every command the same way: quietly, exit 0; `cli.main.ReaderLeft`.)"""
    try:
        yield
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise typer.Exit(130) from None


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape_stop(text: str) -> str:
    """`--stop` as typed -> the stop string: a shell passes `"\\n"` as backslash + n, which
    no generated text would contain. `\\n`, `\\t` and `\\\\` become a newline, a tab and one
    backslash, read left to right (`\\\\n` = backslash + n); any other backslash is kept."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
