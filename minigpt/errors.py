"""The error types. Every error a user can fix is a MinigptError: the CLI prints `str(err)` as
one `error: ...` line on stderr and exits with code 2, never a traceback.

The library words its errors in its own terms (setting names such as `model.n_head`, parameter
names such as `temperature`); only `minigpt.cli` turns a parameter name into the flag a user
typed (ArgumentError.param -> `--temperature`).
"""

from __future__ import annotations


class MinigptError(Exception):
    """A user-facing error: one line naming the file, setting or value and the fix."""


class ConfigError(MinigptError):
    """A configuration file or `section.key=value` override is invalid."""


class ArgumentError(MinigptError):
    """A bad value for the parameter `param` of a library call (e.g. `temperature`), optionally
    about one `subject` (a file the parameter names).

    `str(err)` is "<param>[ <subject>]: <problem>"; the CLI shows the flag instead of `param`
    (`--temperature: ...`, `--prompt-file notes.txt: ...`). A literal `{name}` in `problem`
    stands for the parameter's name wherever it is shown."""

    def __init__(self, param: str, problem: str, subject: object = None):
        self.param, self.problem, self.subject = param, problem, subject
        super().__init__(self.render(param))

    def render(self, name: str) -> str:
        """The message with `name` (a flag) in place of the parameter name; `{name}` inside
        the problem (a suggested fix such as "use {name} cpu") is replaced too."""
        where = name if self.subject is None else f"{name} {self.subject}"
        return f"{where}: {self.problem.replace('{name}', name)}"


class WriteError(MinigptError):
    """Writing a file failed (disk full, permissions); nothing already saved was changed."""

    def __init__(self, message: str, path, errno: int | None = None):
        super().__init__(message)
        self.path, self.errno = path, errno


class TrainingDiverged(MinigptError):
    """The loss or gradient became NaN/inf (exit code 2, the last good checkpoint is kept)."""


class ConflictError(MinigptError):
    """Parameters that exclude each other, given together (`prompt` and `prompt_file`).

    `str(err)` is "<a> and <b> exclude each other: <fix>" in the library's parameter names;
    `render(name_of)` maps each name first (the CLI shows the flags the user typed)."""

    def __init__(self, params, fix: str = "give one of them"):
        self.params, self.fix = tuple(params), fix
        super().__init__(self.render(str))

    def render(self, name_of) -> str:
        return f"{' and '.join(name_of(p) for p in self.params)} exclude each other: {self.fix}"
