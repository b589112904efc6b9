"""`minigpt sample`: generated text on stdout (streamed on a terminal, or one JSON document per
sample), the run, seed and timings on stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from minigpt.cli.main import DeviceOpt, ModelOpt, RunOpt, app, err_console, load_weights
from minigpt.errors import MinigptError


@app.command("sample")
def sample_command(
    run: RunOpt = None,
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
        help="End a sample when this text appears (not printed); repeatable. \\n, \\t and "
        "\\\\ stand for a newline, a tab and one backslash (--stop '\\n\\n' = a blank "
        "line).")] = None,
    stream: Annotated[bool | None, typer.Option(
        "--stream/--no-stream", help="Print tokens as they come. Default: on a terminal.")] = None,
    no_kv_cache: Annotated[bool, typer.Option(
        "--no-kv-cache", help="Recompute the whole context for every token (slow).")] = False,
    device: DeviceOpt = "auto",
    json_out: Annotated[bool, typer.Option(
        "--json", help="One JSON document per sample on stdout.")] = False,
    allow_special: Annotated[bool, typer.Option(
        "--allow-special", help="Read <|endoftext|> in the prompt as the special token.")] = False,
    model: ModelOpt = None,
) -> None:
    """Generate text from a trained run or a Hugging Face model (text on stdout, timings on
    stderr)."""
    stops = [unescape_stop(s) for s in stop or []]
    _sample(run, prompt, prompt_file, max_new_tokens, temperature, top_k, top_p, seed,
            num_samples, stops, stream, no_kv_cache, device, json_out, allow_special, model)


def _sample(run, prompt, prompt_file, max_new_tokens, temperature, top_k, top_p, seed,
            num_samples, stops, stream, no_kv_cache, device, json_out, allow_special,
            model=None) -> None:
    import json
    import os
    import time

    t_start = time.perf_counter()  # before torch is imported: "first token N s after start"
    from minigpt import sample as smp
    from minigpt.device import resolve_device

    how = smp.Sampling(temperature, top_k, top_p, max_new_tokens, num_samples)  # validated
    if seed is not None:
        smp.check_seed(seed)
    if prompt is not None and prompt_file is not None:
        raise MinigptError("--prompt and --prompt-file: give one of them, not both")
    text = _read_prompt_file(prompt_file) if prompt_file is not None else (prompt or "")
    dev = resolve_device(device)
    loaded = load_weights(run, model, dev)  # neither: the latest run under runs/
    tok, block = loaded.tokenizer, loaded.model.cfg.block_size
    ids = tok.encode(text, allow_special=allow_special) if text else [tok.eot_id]
    ids, dropped = smp.truncate_prompt(ids, block)
    if dropped:
        err_console.print(f"note: the prompt is {len(ids) + dropped} tokens, longer than the "
                          f"model's context ({block}); using its last {block} tokens",
                          markup=False, soft_wrap=True)
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    which = "the latest run, " if run is None and model is None else ""
    err_console.print(f"sampling from {which}{loaded.label} on {dev}, "
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
        smp.sample(loaded.model, ids, tok.decode, how, seed=seed, stops=stops,
                   stop_ids=[tok.eot_id], use_kv_cache=not no_kv_cache, on_text=on_text,
                   on_done=on_done)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `minigpt sample | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests, notebooks) keep theirs



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


def _read_prompt_file(path: Path) -> str:
    """The text of `--prompt-file` (UTF-8, not empty)."""
    from minigpt.files import read_text

    text = read_text(path, "prompt_file")
    if not text:
        raise MinigptError(f"--prompt-file {path}: the file is empty; put a prompt in it, or "
                           "leave out --prompt-file to start from <|endoftext|>")
    return text
