"""The `minigpt` command line: the app with its one error path, the options several commands
share (declared once), and one module per command, the only code that renders (rich tables,
progress bars, one `error:` line). Importing this package registers every command on `app`.

Before any command module is imported (they import torch, whose MKL dies with "Intel oneMKL
FATAL ERROR" and no word of why when the working directory was deleted): the working
directory must exist, else one `error:` line and exit 2.
"""

import os as _os
import sys as _sys

try:
    _os.getcwd()
except FileNotFoundError:
    _sys.stderr.write("error: the working directory no longer exists (deleted or moved "
                      "while the shell was in it); cd to an existing directory and run again\n")
    raise SystemExit(2) from None

from minigpt.cli import (  # noqa: F401 - importing registers the commands
    bench,
    circuit,
    compile,
    curves,
    export,
    features,
    heads,
    runs,
    sample,
    train,
)
from minigpt.cli.main import app, main

__all__ = ["app", "main"]
