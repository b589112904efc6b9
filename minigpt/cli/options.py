"""The options several commands share, each declared once with one spelling, type, default
and help text (tests/test_cli_options.py walks every command's options and holds them to it).
A command module imports the namespace, `import minigpt.cli.options as opt`, and names
them as `run: opt.Run = None`; options that are one command's own live in its module, and
where one flag means something of its own in several commands (`--out`: a run directory, a
picture, a report) each still shows the one metavar declared here (`OUT`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

OUT = "PATH"  # every --out's metavar: a directory or a file, as each command's help says
RUN = "RUN"   # every --run's: a run's directory or its name under runs/ (run.listing.named_run)

Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or mps.")]
Run = Annotated[Path | None, typer.Option(
    "--run", metavar=RUN, help="A run: its directory, or its name under runs/. Default: the "
    "latest finished run under runs/ that the command can use (named on stderr, with any newer "
    "run it passed over).")]
Threads = Annotated[int, typer.Option(
    "--threads", help="CPU threads to compute on (torch intra-op), as train.threads: 0 = "
    "automatic, else 1 to the CPUs this process may use.")]
Runs = Annotated[list[str] | None, typer.Option(
    "--run", metavar=RUN, help="A run: its directory, or its name under runs/. Repeatable; "
    "runs given as arguments count the same.")]
Model = Annotated[str | None, typer.Option(
    "--model", metavar="PATH|hf:REPO_ID[@REV]",
    help="A Hugging Face GPT-2 / GPT-NeoX model instead of a run: a local model directory, or "
    "hf:REPO_ID[@REVISION] from the Hub (needs pip install 'minigpt-lab[hf]').")]

# inspect-heads and circuit: the input, the checkpoint, the metric and the corrupted input.
Checkpoint = Annotated[int | None, typer.Option(
    "--checkpoint", metavar="STEP", help="Inspect the run's kept checkpoint of this step "
    "(train.keep_checkpoints sets how many are kept). Default: the latest.")]
Text = Annotated[str | None, typer.Option(
    "--text", help="Text to run through the model. Default: a built-in passage.")]
TextFile = Annotated[Path | None, typer.Option(
    "--text-file", help="Read the text from this UTF-8 file.")]
Probe = Annotated[str | None, typer.Option(
    "--probe", help="Built-in synthetic input instead of text: induction (random tokens "
    "repeated twice), previous (no repeats), duplicate (8 ids, many repeats).")]
MaxTokens = Annotated[int | None, typer.Option(
    "--max-tokens", help="Inspect at most this many tokens (2..block_size; longer text is "
    "cut). Default: block_size.")]
ProbeSeed = Annotated[int, typer.Option(
    "--seed", help="Seed of the synthetic probes and corrupted inputs (the same seed, the same "
    "input; default 0).")]
Target = Annotated[str | None, typer.Option(
    "--target", metavar="TOKEN", help="Score this token at every scored position instead of "
    "the actual next token. One token of the vocabulary.")]
Answer = Annotated[str | None, typer.Option(
    "--answer", metavar="TOKEN", help="With --wrong: the metric is logit[answer] - "
    "logit[wrong] at the last position (e.g. --answer ' Mary' --wrong ' John').")]
Wrong = Annotated[str | None, typer.Option(
    "--wrong", metavar="TOKEN", help="The token --answer is compared with (one token).")]
PatchFrom = Annotated[str | None, typer.Option(
    "--patch-from", metavar="TEXT|corrupted-second|corrupted-first|zero|mean", help="The "
    "corrupted input (circuit needs it): a text of the same length (with --text / "
    "--text-file), or, with --probe induction, `corrupted-second` (alias `corrupted`: its "
    "second copy's tokens replaced) or `corrupted-first` (its first copy's tokens replaced: "
    "what the previous-token head carries shows here); circuit only: `zero` or `mean`, an "
    "ablation of every edge's source instead of a corrupted input.")]
PatchDirection = Annotated[str | None, typer.Option(
    "--patch-direction", help="With --patch-from. noising (the default): the clean run with "
    "a head's or an edge's input from the corrupted run (what it destroys); denoising: the "
    "corrupted run with the clean one (what it restores; TransformerLens's sign).")]
Lens = Annotated[bool, typer.Option(
    "--lens", help="Also the logit lens of the (first) input: the residual stream after the "
    "embedding and after each layer read through the final norm and the unembedding, at the "
    "scored positions (tables, and `lens` in the JSON; inspect-heads draws lens.png with --format "
    "png).")]
Json = Annotated[bool, typer.Option(
    "--json", help="Print the result as one JSON document on stdout instead of the table(s).")]
Force = Annotated[bool, typer.Option(
    "--force", help="Run even when the work is estimated to take longer than its bound (an "
    "hour for an analysis, a week for train and features train) or more memory than is free: "
    "refused otherwise, in one line naming the estimate and the largest value that fits "
    "(docs/cli.md#cost-bounds).")]
FilesOut = Annotated[Path | None, typer.Option(
    "--out", "-o", metavar=OUT, help="Directory for the files. Default: <run>/heads/.")]
