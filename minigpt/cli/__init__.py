"""The `minigpt` command line: `main.py` (the app, the one error path, shared options) and one
module per command. Importing this package registers every command on `app`."""

from minigpt.cli import (  # noqa: F401 - importing registers the commands
    bench,
    curves,
    export,
    heads,
    runs,
    sample,
    train,
)
from minigpt.cli.main import app, main

__all__ = ["app", "main"]
