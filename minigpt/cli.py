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

# ==== sample ==================================================================================

# ==== inspect-heads ===========================================================================

# ==== bench ===================================================================================


def main() -> None:
    """Console entry point: user errors become one line and exit code 2."""
    try:
        app(standalone_mode=False)
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

        if isinstance(e, click.ClickException):
            e.show()
            sys.exit(e.exit_code)
        raise
