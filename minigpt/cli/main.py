"""The `minigpt` application: the one error path and the entry point (the options several
commands share are declared in options.py).

The only package that imports typer and rich. Library modules return data and report progress
through callbacks; the command modules (train.py, sample.py, heads.py, bench.py) render it.

One error path for every command (`_Group.invoke`): a MinigptError becomes one `error: ...`
line on stderr and exit code 2, with library parameter names shown as the flags the user typed
(`temperature` -> `--temperature`); Ctrl-C outside the training loop exits 130. Usage errors
(unknown command or flag, a value of the wrong type) are the parser's message with a
did-you-mean, on stderr, exit 2. Never a traceback for any of these.

Names that come from elsewhere (run directories, file paths, error messages quoting them) reach
the terminal through `minigpt.display.printable`: a run named with an escape sequence cannot
move the cursor, recolour the terminal or forge a line.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup

from minigpt import __version__
from minigpt.display import duration, printable
from minigpt.errors import ArgumentError, ConflictError, MinigptError
from minigpt.events import Progress
from minigpt.files import denied, shown
from minigpt.threads import quiet_openmp

# Progress, logs and timings go to stderr; stdout carries only what a command was asked for.
err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)


def flag_for(param: str) -> str:
    """The command-line flag of a library parameter name: `top_k` -> `--top-k`."""
    return "--" + param.replace("_", "-")


def user_message(e: MinigptError) -> str:
    """A library error in the user's terms: parameter names become the flags they typed."""
    if isinstance(e, ConflictError):
        return e.render(flag_for)
    return e.render(flag_for(e.param)) if isinstance(e, ArgumentError) else str(e)


def say(text: str) -> None:
    """One plain line on stderr (no markup, no highlighting, no wrapping, controls escaped)."""
    err_console.print(printable(text), markup=False, highlight=False, soft_wrap=True)


class EtaLines:
    """A long analysis's progress (its events.Progress events; other events pass by) as plain
    lines on stderr with an ETA from the stage's own pace: the first after FIRST seconds (a
    quick analysis says nothing), then one every EVERY seconds and one as each stage ends."""

    FIRST, EVERY = 2.0, 10.0

    def __init__(self, command: str) -> None:
        import time

        self.command, self.clock = command, time.monotonic
        self.start = self.last = self.prev = self.clock()
        self.stage, self.stage_start, self.said = "", self.start, False

    def __call__(self, e: object) -> None:
        if not isinstance(e, Progress):
            return
        stage, done, total = e.stage, e.done, e.total
        now, prev = self.clock(), self.prev
        self.prev = now
        if stage != self.stage:
            self.stage, self.stage_start = stage, prev  # the stage began as the last ended
        ended = done >= total
        if now - self.start < self.FIRST or (now - self.last < self.EVERY and not
                                             (ended and self.said)):
            return
        pace = (now - self.stage_start) / max(done, 1)
        eta = "" if ended else f", ETA {duration(pace * (total - done))}"
        say(f"{self.command}: {stage} {done}/{total}, {duration(now - self.start)}{eta}")
        self.last, self.said = now, True


# The parser's own error type, found through typer's public BadParameter (typer vendors click:
# never `import click`).
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_PARSER_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def usage_line(e: Exception) -> str:
    """A parser error (an unknown flag, a value of the wrong type) as one line, like every
    other error: the parser's message and where the flags are listed."""
    message = " ".join(e.format_message().split())
    ctx = getattr(e, "ctx", None)
    if isinstance(e, _USAGE_ERROR) and ctx is not None:
        message += f" (see {ctx.command_path} --help)"
    return f"error: {message}"


class _Group(TyperGroup):
    """The command group with minigpt's error path and a did-you-mean for commands."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True,
             **extra):
        """The parser's errors as one line on stderr, exit 2 (`usage_line`), not its usage
        block; help with no arguments as the parser shows it."""
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _PARSER_ERROR as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()
            else:
                say(shown(usage_line(e), 1000))
            rv = e.exit_code
        except typer.Abort:
            say("aborted")
            rv = 1
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)

    def resolve_command(self, ctx, args):
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            hint = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            ctx.fail(f"No such command '{name}'."
                     + (f" Did you mean '{hint[0]}'?" if hint else ""))
        return super().resolve_command(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MinigptError as e:
            say(f"error: {shown(user_message(e), 1000)}")  # a huge value never floods
            raise typer.Exit(2) from None
        except PermissionError as e:  # one the library did not word itself: still one line
            say(f"error: {shown(str(denied(e)), 1000)}")
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            say("interrupted (Ctrl-C); anything already saved is kept")
            raise typer.Exit(130) from None


class OldSpellingCommand(TyperCommand):
    """A command with a hidden argument that keeps an old spelling working for scripts
    (`bench --json PATH`): the argument stays out of the usage line as it does out of --help."""

    def collect_usage_pieces(self, ctx):
        rv = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if not getattr(param, "hidden", False):
                rv.extend(param.get_usage_pieces(ctx))
        return rv


app = typer.Typer(
    name="minigpt",
    cls=_Group,
    help="Train tiny GPT models on a laptop and look inside their attention heads.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        out_console.print(f"minigpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """Train tiny GPT models on a laptop and look inside their attention heads."""


def latest_run(fits=None, *, require_fit: bool = True, wanted: str = "a run",
               kind: str = "run") -> tuple[Path, str]:
    """The run a command given no --run uses (`minigpt.run.choice.pick_run`: the latest
    finished run that `fits`), and how to name it in the command's log line ("the latest
    finished run", or how it stands when it did not finish). Each newer run passed over gets
    a note on stderr saying why."""
    from minigpt.run.choice import pick_run

    pick = pick_run(fits, require_fit=require_fit, wanted=wanted)
    for d, why, usable in pick.passed:
        say(f"note: passing over {d} ({why})"
            + (f"; give --run {d} to use it anyway" if usable else ""))
    if pick.misfit is not None:
        return pick.run_dir, f"the latest run ({pick.misfit}), "
    if pick.status.done:
        return pick.run_dir, f"the latest finished {kind}, "
    return pick.run_dir, f"the latest {kind}, {pick.status.phrase()}: "


def load_inspected(run: Path | None, model: str | None, device: str, checkpoint: int | None,
                   probe: str | None = None):
    """The run or model `inspect-heads` and `circuit` study: without --run and --model, the
    latest finished run of any kind, named with what it was trained on (and what newer run was
    passed over; a run on induction ids suggests --probe induction unless it is `probe`)."""
    from minigpt.infer.inputs import load_run_or_model
    from minigpt.run.listing import data_kind

    if run is not None or model is not None:
        return load_run_or_model(run, model, device, checkpoint)
    run, which = latest_run()
    loaded = load_run_or_model(run, None, device, checkpoint)
    kind = data_kind(run)
    hint = "" if probe == "induction" else " (try --probe induction)"
    tokens = kind.get("tokenizer", f"a vocabulary of {loaded.tokenizer.n_vocab}")
    trained = {"induction": f"trained on synthetic induction data{hint}",  # the checkpoint's
               "program": "a compiled program"}.get(loaded.cfg.data.source,
                                                    f"trained on text, {tokens}")
    say(f"using {which}{loaded.label}, {trained}")
    return loaded


class StdoutError(MinigptError):
    """stdout cannot be written (a full disk, `> /dev/full`, an I/O error)."""


class ReaderLeft(SystemExit):
    """The reader of stdout closed the pipe (`minigpt ... | head`): the command stops where it
    is, quietly, with exit code 0 (docs/cli.md, "Streams")."""

    def __init__(self) -> None:
        super().__init__(0)


def _to_devnull(stream) -> None:
    """Point `stream`'s descriptor at /dev/null: what is still buffered, and the interpreter's
    last flush at exit, then fail no more."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError):
        pass


class _GuardedStdout:
    """sys.stdout, whose write failures are one `error:` line through the one error path (a
    StdoutError) instead of an OSError traceback, and a reader that leaves (BrokenPipeError)
    ReaderLeft. The failure is kept (`error`): one that a library swallows (the parser's
    probe of the stream before `--help`) still ends the command with exit 2 (`main`)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.error: StdoutError | None = None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def _failed(self, e: OSError) -> StdoutError | ReaderLeft:
        _to_devnull(self._stream)
        if isinstance(e, BrokenPipeError):
            return ReaderLeft()
        if self.error is None:
            self.error = StdoutError(f"cannot write to stdout ({e.strerror or e}); free some "
                                     "space or send the output elsewhere")
        return self.error

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise self._failed(e) from None

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise self._failed(e) from None


class _QuietStderr:
    """sys.stderr, whose write failures (a full disk, a reader that left) lose the line and
    nothing else: stderr carries progress, timings and error lines, so a command goes on as
    if it had been written and exits with its own code (2 for an error it could not show)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            _to_devnull(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            _to_devnull(self._stream)


def main() -> None:
    """Console entry point (`minigpt`, `python -m minigpt`). OpenMP's wait policy first, before
    any command loads torch (`minigpt.threads.quiet_openmp`). stdout closed (`>&-`): one line,
    exit 2, before anything runs; stdout that fails while a command writes: one line, exit 2
    (`_GuardedStdout`); its reader leaving: exit 0 (ReaderLeft); stderr that fails: the lines
    are lost, the exit code is the command's (`_QuietStderr`)."""
    quiet_openmp()
    if sys.stderr is not None:
        sys.stderr = _QuietStderr(sys.stderr)
    if sys.stdout is None:
        if sys.stderr is not None:
            sys.stderr.write("error: stdout is closed (>&-); give the output somewhere to go, "
                             "e.g. > /dev/null to discard it\n")
        sys.exit(2)
    guard = sys.stdout = _GuardedStdout(sys.stdout)
    code: object = 0
    try:
        app(prog_name="minigpt")
    except SystemExit as e:  # ReaderLeft included
        code = e.code
    except StdoutError as e:  # raised outside a command (the parser's help)
        say(f"error: {e}")
        sys.exit(2)
    try:
        sys.stdout.flush()  # what is still buffered: a failure here is the command's too
    except StdoutError:
        pass
    except ReaderLeft:
        sys.exit(0)
    if guard.error is not None and code in (0, None):  # a failure a library swallowed
        say(f"error: {guard.error}")
        sys.exit(2)
    sys.exit(code)
