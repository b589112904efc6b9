"""Reading and writing files: the one durable write, the one text read, strict YAML.

Durable write (`atomic_file`, `atomic_write_bytes`): a temp file in the same directory, flush +
fsync, os.replace, fsync the directory. After a crash (kill -9, power loss) a reader sees the
old file or the new one, never a torn mix; a failed write leaves the old file untouched and no
temp file behind, and raises WriteError (a one-line MinigptError naming the path). The temp a
kill -9 leaves (`.NAME.PID-XXXXXXXX.tmp`) is deleted by a later write in the same directory
once its process is gone and nothing wrote it for an hour (`remove_abandoned_temps`).

Strict YAML (`parse_yaml`): YAML 1.2-style scalars (no `yes`/`on` booleans, no octal `0123`,
`1e-3` is a float) and duplicate keys rejected, because PyYAML's YAML 1.1 defaults silently do
otherwise; nesting, alias expansion and integer length bounded, complex keys refused.

The one door for files (`read_file`, `read_utf8`, `load_json`, `load_yaml`, `open_file`;
`check_replaceable` for writes): every file minigpt reads that a user or another program could
have put there goes through it. Reads take only regular files (a FIFO is never waited on, a
device never read), hold at most a cap in memory, parse with depth, alias and integer-length
limits, and fail as one ReadError / ConfigError line naming the file; writes never replace
anything but a regular file. tests/test_security.py scans the package for reads outside it.
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import yaml

from minigpt import display
from minigpt.errors import ArgumentError, ConfigError, MinigptError, WriteError


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: directories cannot be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` (no rename) and fsync it: for files inside a directory that is
    itself committed by a rename (checkpoints). Raises OSError."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def disk_error(e: OSError, path: Path) -> WriteError:
    """Turn an OSError from a write into a one-line user error naming the path."""
    if e.errno == errno_mod.ENOSPC:
        msg = (f"no space left on device while writing {path}; free some space "
               "(nothing already saved was changed)")
    elif e.errno in (errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS):
        msg = f"cannot write {path}: {e.strerror}; choose a writable --out"
    else:
        msg = f"cannot write {path}: {e.strerror or e}"
    return WriteError(msg, path, e.errno)


def not_replaceable(path: str | Path) -> str | None:
    """Why a write must not replace what is at `path` ("it is a FIFO, not a regular file"), or
    None: nothing is there, or a regular file (a symlink to one included)."""
    import stat

    try:
        st = os.stat(path)
    except OSError:
        return None  # nothing there (or a dangling link): the write itself says what fails
    if stat.S_ISREG(st.st_mode):
        return None
    return (f"it is {_kind(st.st_mode)}, not a regular file, and is never replaced; give the "
            "path of a new or regular file")


def check_replaceable(path: Path) -> Path:
    """`path`, if a write may replace what is there (`not_replaceable`); else WriteError. A
    FIFO, a device, a socket or a directory is never replaced: a write to `--out /dev/null`
    would otherwise put a regular file where the device was."""
    why = not_replaceable(path)
    if why is not None:
        raise WriteError(f"will not write {_shorten(Path(path))}: {why}", path,
                         errno_mod.EINVAL)
    return path


@contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """Open a temp file next to `path` (`temp_sibling`) for binary writing; on a clean exit it
    replaces `path` durably, on an exception it is deleted and `path` is untouched. What
    killed writers left in the directory is deleted first (`remove_abandoned_temps`).
    OSError -> WriteError."""
    path = check_replaceable(Path(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_abandoned_temps(path)
        tmp = temp_sibling(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                     0o666)  # the mode open() gives (the umask applies)
    except OSError as e:
        raise disk_error(e, path) from None
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise disk_error(e, path) from None
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    with atomic_file(path) as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def read_text(path: str | Path, param: str) -> str:
    """A UTF-8 text file's contents (a leading BOM is kept), at most 16 MiB of it, a regular
    file only (`read_regular`). ArgumentError(param, ...) naming the file when it is missing,
    a directory, a FIFO or device, too large, unreadable, not UTF-8 or binary (NUL bytes)."""
    path = Path(path)
    try:
        data = read_regular(path, SMALL_CAP)
    except FileNotFoundError:
        raise ArgumentError(param, "no such file", subject=path) from None
    except NotRegularFile as e:
        if os.path.isdir(path):
            raise ArgumentError(param, "is a directory; give a text file", subject=path) from None
        raise ArgumentError(param, f"cannot read it ({e.strerror})", subject=path) from None
    except OSError as e:
        raise ArgumentError(param, f"cannot read it ({read_problem(e)})", subject=path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArgumentError(param, f"not UTF-8 text (invalid byte at offset {e.start}); give a "
                            "UTF-8 text file", subject=path) from None
    if "\x00" in text:
        raise ArgumentError(param, "contains NUL bytes (a binary file?); give a text file",
                            subject=path)
    return text


# --------------------------------------------------------------------------------------------
# Strict YAML.


class _StrictLoader(yaml.SafeLoader):
    pass


_StrictLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in (
        "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9][0-9_]*$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+"
               r"|[-+]?[0-9][0-9_]*\.[0-9_]*"
               r"|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


MAX_YAML_DEPTH = 64          # real configs nest 3 deep
MAX_YAML_VALUES = 100_000  # values after alias expansion (a config holds ~100)
MAX_INT_DIGITS = 400         # far past any size; Python refuses past 4300


def _compose_node(loader: _StrictLoader, parent: Any, index: Any) -> Any:
    """PyYAML's compose_node with a depth limit: nesting is an error line, not a stack."""
    loader._depth = getattr(loader, "_depth", 0) + 1
    try:
        if loader._depth > MAX_YAML_DEPTH:
            mark = loader.peek_event().start_mark
            raise ConfigError(f"nested more than {MAX_YAML_DEPTH} deep at line {mark.line + 1}")
        return yaml.SafeLoader.compose_node(loader, parent, index)
    finally:
        loader._depth -= 1


def _expandedsize(root: yaml.Node) -> int:
    """How many values `root` stands for once every alias is expanded (an alias shares its
    anchor's node, so a "billion laughs" document is small as nodes and huge as values);
    linear in the number of distinct nodes."""
    sizes: dict[int, int] = {}
    order, stack = [], [root]
    while stack:  # post-order without recursion
        node = stack.pop()
        if id(node) in sizes:
            continue
        sizes[id(node)] = -1
        order.append(node)
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(x for pair in node.value for x in pair)
    for node in reversed(order):
        kids = (node.value if isinstance(node, yaml.SequenceNode) else
                [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode)
                else [])
        sizes[id(node)] = min(1 + sum(sizes[id(k)] for k in kids), MAX_YAML_VALUES + 1)
    return sizes[id(root)]


def _get_single_node(loader: _StrictLoader) -> Any:
    node = yaml.SafeLoader.get_single_node(loader)
    if node is not None and _expandedsize(node) > MAX_YAML_VALUES:
        raise ConfigError(f"expands to more than {MAX_YAML_VALUES:,} values through aliases "
                          "(&anchor / *alias); write the values out")
    return node


_StrictLoader.compose_node = _compose_node
_StrictLoader.get_single_node = _get_single_node


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, (list, dict, set)):
            raise ConfigError(f"a key at line {key_node.start_mark.line + 1} is a "
                              f"{'list' if isinstance(key, list) else 'mapping'} (`? [a, b]`); "
                              "keys must be plain names")
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1}: "
                "each key may appear once; delete one of them")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# Decimal integers only: PyYAML would read `0123` as octal 83.
def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    digits = loader.construct_scalar(node).replace("_", "")
    if len(digits.lstrip("+-")) > MAX_INT_DIGITS:
        raise ConfigError(f"an integer of {len(digits.lstrip('+-')):,} digits at line "
                          f"{node.start_mark.line + 1}; no setting takes more than "
                          f"{MAX_INT_DIGITS}")
    return int(digits, 10)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text strictly; errors become one-line ConfigErrors naming `source` and line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except ValueError as e:  # a constructor's (a float or timestamp PyYAML cannot read)
        raise ConfigError(f"{source}: invalid YAML: {shown(str(e), 120)}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = " ".join((e.problem or e.context or "invalid YAML").split())
        raise ConfigError(f"{source}: invalid YAML at {where}: {problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None


# --------------------------------------------------------------------------------------------
# Reading files that come from elsewhere: regular files only, a size cap, JSON nested too
# deeply as an error.
# A FIFO would block the reader forever, /dev/zero would fill memory, a directory raises
# IsADirectoryError deep in a caller: `open_regular` refuses all of them before reading a byte.


class NotRegularFile(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a socket, a directory)."""


class FileTooLarge(OSError):
    """A regular file larger than the reader's cap."""


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path) -> IO[bytes]:
    """Open an existing regular file for binary reading (symlinks followed). Anything else is
    refused without being opened for reading (a FIFO is never waited on, a device never read):
    NotRegularFile (an OSError whose strerror says what it is). Other OSErrors as `open` raises
    them (FileNotFoundError, PermissionError, ...)."""
    import stat

    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno_mod.EINVAL, f"not a regular file ({_kind(st.st_mode)})",
                             str(path))
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)  # what was opened, if the path changed since the stat above
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno_mod.EINVAL, f"not a regular file ({_kind(st.st_mode)})",
                                 str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most `max_bytes` (`open_regular`'s rules; a larger
    file is FileTooLarge, an OSError, before anything is read)."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise FileTooLarge(errno_mod.EFBIG, f"larger than {display.size(max_bytes)} "
                               f"({display.size(size)}): not the file expected here", str(path))
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while being read
        raise FileTooLarge(errno_mod.EFBIG, f"larger than {display.size(max_bytes)}", str(path))
    return data


def read_problem(e: OSError) -> str:
    """Why a read failed, in a few words for an error line: 'permission denied', 'no such
    file', 'not a regular file (a FIFO)', 'larger than 16 MiB ...'."""
    if isinstance(e, (NotRegularFile, FileTooLarge)):
        return e.strerror
    if e.errno in (errno_mod.EACCES, errno_mod.EPERM):
        return "permission denied"
    if e.errno == errno_mod.ENOENT:
        return "no such file"
    if e.errno == errno_mod.ELOOP:
        return "a symlink loop"
    return (e.strerror or str(e)).lower()


def parse_json(data: bytes) -> Any:
    """A UTF-8 JSON text. ValueError (one short sentence) for anything else: not UTF-8, not
    JSON, a number too long to convert, or nested deeper than the interpreter's recursion limit
    (about 1000 levels; real files nest 5): the parser raises RecursionError there, before the
    stack is in danger, as `parse_yaml` relies on too. Linear in the size of the text."""
    import json

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (invalid byte at offset {e.start})") from None
    try:
        return json.loads(text, parse_int=json_int)
    except RecursionError:
        raise ValueError("nested too deeply (more than about 1000 levels)") from None
    except ValueError as e:
        raise ValueError(f"not valid JSON ({str(e).splitlines()[0][:120]})") from None


def json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-')):,} digits; at most "
                         f"{MAX_INT_DIGITS}")
    return int(digits)


def shown(value: object, limit: int = 80) -> str:
    """`value` (a str as is, anything else as its repr) for an error line: at most `limit`
    characters, the middle cut ("...") so a huge value never floods the terminal."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    half = max(1, (limit - 5) // 2)
    head, tail = text[:half], text[-half:]
    if " " in head[half // 2:]:  # cut between words where there are words
        head = head[:head.rfind(" ")]
    if " " in tail[:half // 2]:
        tail = tail[tail.find(" ") + 1:]
    return f"{head} ... {tail}"


# --------------------------------------------------------------------------------------------
# The reader every file from elsewhere goes through: regular files only, at most `cap` bytes
# held, parsed with limits, every failure one line naming the file.

SMALL_CAP = 16 << 20   # configs, manifests, sidecars, cache metadata: a few KiB when real
LARGE_CAP = 1 << 30    # metrics.jsonl (a million logged steps: ~150 MB)


class ReadError(MinigptError):
    """A file could not be read or parsed: one line naming it and why."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{_shorten(Path(path))}: {problem}")


def read_file(path: str | Path, cap: int = SMALL_CAP) -> bytes:
    """The bytes of the regular file `path`, at most `cap` of them (`read_regular`'s rules).
    ReadError naming the file: missing, not a regular file, unreadable, larger than `cap`."""
    try:
        return read_regular(path, cap)
    except OSError as e:
        raise ReadError(path, f"cannot read it ({read_problem(e)})") from None


def read_utf8(path: str | Path, cap: int = SMALL_CAP) -> str:
    """`read_file` decoded as UTF-8; ReadError for a file that is not UTF-8."""
    data = read_file(path, cap)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ReadError(path, f"not UTF-8 text (invalid byte at offset {e.start})") from None


def load_json(path: str | Path, cap: int = SMALL_CAP) -> Any:
    """The JSON value of the file `path` (`read_file`, then `parse_json`'s limits); ReadError
    naming the file for anything else."""
    data = read_file(path, cap)
    try:
        return parse_json(data)
    except ValueError as e:
        raise ReadError(path, str(e)) from None


def load_yaml(path: str | Path, cap: int = SMALL_CAP) -> Any:
    """The strict YAML value of the UTF-8 file `path` (`read_utf8`, then `parse_yaml`'s
    limits); ReadError / ConfigError naming the file."""
    return parse_yaml(read_utf8(path, cap), str(_shorten(Path(path))))


def denied(e: PermissionError) -> ReadError:
    """A PermissionError as one line: the path that stops minigpt (the first directory on the
    way to the file that cannot be entered, else the file itself; symlinks followed as far
    as they can be), `permission denied`, and the fix."""
    path = Path(os.path.abspath(e.filename if e.filename is not None else "."))
    real = Path(os.path.realpath(path))  # through the links that can be read (latest -> step)
    blocked = next((d for d in reversed(real.parents)
                    if os.path.isdir(d) and not os.access(d, os.X_OK)), real)
    also = "" if blocked in (path, real) else f" (reading {_shorten(path)})"
    return ReadError(blocked, f"permission denied{also}; make it readable (chmod u+rwX) or "
                     "run minigpt as its owner")


@contextmanager
def permission_denied_as_error() -> Iterator[None]:
    """A PermissionError inside (an unreadable run, checkpoint or `runs/` directory met by a
    `Path.is_file`, `iterdir` or `open` anywhere below) becomes `denied`'s one-line ReadError.
    Usable as a decorator."""
    try:
        yield
    except PermissionError as e:
        raise denied(e) from None


def open_file(path: str | Path) -> IO[bytes]:
    """A regular file opened for streaming (corpora, hashing): `open_regular`'s rules, every
    failure a ReadError naming the file."""
    try:
        return open_regular(path)
    except OSError as e:
        raise ReadError(path, f"cannot read it ({read_problem(e)})") from None


# --------------------------------------------------------------------------------------------
# New outputs (exports): created whole or not at all, never replacing anything, and what a
# killed writer left behind deleted by the next writer of the same name.

_NEW = ".tmp"  # temp siblings are `.NAME.PID-XXXXXXXX.tmp`: the pid says whose they are


def check_new_path(path: str | Path, param: str) -> Path:
    """`path` made absolute, or ArgumentError(param) when nothing can ever be created there:
    a name longer than the file system allows, a parent that is a file, a parent that cannot
    be searched. Whether `path` itself may already exist is the caller's rule."""
    path = Path(path).expanduser().absolute()
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        blocker = next(p for p in reversed(path.parents) if p.exists() and not p.is_dir())
        raise ArgumentError(param, f"{blocker} is a file, not a directory; give a path whose "
                            "parents are directories", subject=path) from None
    except OSError as e:
        if e.errno == errno_mod.ENAMETOOLONG:
            raise ArgumentError(param, "a name in it is longer than the file system allows; "
                                "give a shorter name", subject=_shorten(path)) from None
        raise ArgumentError(param, f"cannot look it up ({e.strerror})", subject=path) from None
    return path


def read_only_dir(path: str | Path) -> str | None:
    """Why files may not be written into the directory `path` (None: they may): it has no
    write bit (made read-only: refused even for root, who could write it anyway), or this
    process may not write and search it (a read-only file system included). Asked without
    writing anything, so no probe file is ever left behind."""
    mode = os.stat(path).st_mode
    if not mode & 0o222 or not os.access(path, os.W_OK | os.X_OK):
        return f"is a read-only directory (mode {mode & 0o777:o})"
    return None


def _shorten(path: Path) -> str:
    s = str(path)
    return s if len(s) <= 120 else f"{s[:60]}...{s[-40:]}"


def temp_sibling(path: Path) -> Path:
    """A new name for the temp sibling of `path` that a durable write fills:
    `.NAME.PID-XXXXXXXX.tmp` (hidden; the pid says whose it is)."""
    import secrets

    return path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{_NEW}"


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete the temp siblings of `path` that `new_output` made in a process that no longer
    runs (killed mid-write: nothing else ever deletes them); a live process's are kept."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)-[0-9a-f]{{8}}{re.escape(_NEW)}")
    return [p for p in _siblings(path)
            if (m := pattern.fullmatch(p.name)) and not _alive(int(m.group(1))) and _remove(p)]


STALE_TEMP_S = 3600  # a temp nobody wrote for an hour, of a process that is gone: abandoned
_ANY_TEMP = re.compile(rf"\..+\.(\d+)-[0-9a-f]{{8}}{re.escape(_NEW)}")


def remove_abandoned_temps(path: Path, age: float = STALE_TEMP_S) -> list[Path]:
    """Delete what killed durable writes (`atomic_file`, `new_output`) left beside `path`: each
    temp sibling named as minigpt names them (`.NAME.PID-XXXXXXXX.tmp`) whose process no
    longer runs (this one counts as running), and `path`'s own temps as minigpt named them
    before they carried a pid (`.NAME.XXXXXXXX.tmp`), each only when nothing has written it
    for `age` seconds (a writer on another machine sharing the directory, whose pid means
    nothing here, is never that slow). A file of any other name is never touched."""
    import time

    legacy = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}{re.escape(_NEW)}")
    now, removed = time.time(), []
    for p in _siblings(path):
        m = _ANY_TEMP.fullmatch(p.name)
        if m is None and not legacy.fullmatch(p.name):
            continue
        if m is not None and (int(m.group(1)) == os.getpid() or _alive(int(m.group(1)))):
            continue
        try:
            old = now - p.lstat().st_mtime > age
        except OSError:
            continue
        if old and _remove(p):
            removed.append(p)
    return removed


def _siblings(path: Path) -> list[Path]:
    try:
        return list(path.parent.iterdir())
    except OSError:
        return []


def _remove(p: Path) -> bool:
    """Delete the file or directory tree `p` (True), whatever a failure leaves."""
    import shutil

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            return False
    return True


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # ours from before (a recycled pid): this process is not writing it
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's live process (or a pid we cannot judge): keep it
    return True


@contextmanager
def new_output(path: Path, *, directory: bool = False) -> Iterator[Path]:
    """Create `path`, a file or (`directory`) a directory, whole or not at all, never replacing
    anything. Yields a temp sibling (an empty file or directory) for the caller to fill; files
    written into a directory must be fsynced (`write_file_synced`). On a clean exit the temp is
    fsynced and moved to `path`: a file by a hard link (which fails if `path` appeared
    meanwhile), a directory by a rename (which replaces only an empty directory, keeping its
    mode). A new output gets the mode a plain open() / mkdir would give (the umask). On an
    exception the temp is deleted; OSError -> WriteError. Temps left by killed writers of the
    same `path` are deleted first (`remove_stale_temps`)."""
    import shutil

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        tmp = temp_sibling(path)
        umask = os.umask(0)
        os.umask(umask)
        if directory:
            mode = path.stat().st_mode & 0o7777 if path.is_dir() else 0o777 & ~umask
            tmp.mkdir(mode=0o700)
        else:
            mode = 0o666 & ~umask
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as e:
        raise disk_error(e, path) from None
    try:
        yield tmp
        if directory:
            fsync_dir(tmp)
            os.chmod(tmp, mode)
            os.rename(tmp, path)  # over an empty directory only: ENOTEMPTY / ENOTDIR otherwise
        else:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(tmp, mode)
            _link_new(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise disk_error(e, path) from None
        raise


def _link_new(tmp: Path, path: Path) -> None:
    """Move the file `tmp` to `path` unless `path` exists (FileExistsError then)."""
    try:
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in (errno_mod.EPERM, errno_mod.ENOTSUP, errno_mod.EMLINK,
                           errno_mod.EOPNOTSUPP):
            raise
        if os.path.lexists(path):  # no hard links here (FAT, some FUSE): check, then rename
            raise FileExistsError(errno_mod.EEXIST, os.strerror(errno_mod.EEXIST), str(path)) \
                from None
        os.rename(tmp, path)
        return
    tmp.unlink()


# --------------------------------------------------------------------------------------------
# Reading a text a user names (--prompt-file, --text-file): only a regular file, only as much
# of it as can be used.


def read_text_part(path: str | Path, param: str, limit: int, *, tail: bool = False
                   ) -> tuple[str, int]:
    """At most `limit` bytes of a UTF-8 text file, decoded: its first bytes, or with `tail`
    its last; and the file's size in bytes (> `limit`: the text is a part of the file).

    Only a regular file is read (`open_regular`): a FIFO, a device (/dev/zero, /dev/urandom),
    a socket or a directory is an ArgumentError naming it, found before any read, so nothing
    blocks and memory stays within `limit`.
    A cut inside a UTF-8 character drops the character's partial bytes. ArgumentError(param,
    ...) naming the file when it is missing, not a regular file, unreadable, not UTF-8 or
    binary (NUL bytes); a leading BOM is kept."""
    import codecs

    path = Path(path)
    try:
        with open_regular(path) as fh:  # never waits on a FIFO, never reads a device
            size = os.fstat(fh.fileno()).st_size
            start = max(0, size - limit) if tail else 0
            fh.seek(start)
            data = fh.read(limit)
    except OSError as e:
        why = read_problem(e)
        raise ArgumentError(param, why if why == "no such file" else
                            f"cannot read it ({why}); give a text file", subject=path) from None
    skip = 0
    if start:  # the cut fell inside a character: drop its continuation bytes
        while skip < min(3, len(data)) and 0x80 <= data[skip] < 0xC0:
            skip += 1
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:  # final=False at a cut end: a partial last character is dropped, not an error
        text = decoder.decode(data[skip:], final=tail or start + len(data) >= size)
    except UnicodeDecodeError as e:
        raise ArgumentError(param, f"not UTF-8 text (invalid byte at offset "
                            f"{start + skip + e.start}); give a UTF-8 text file",
                            subject=path) from None
    if "\x00" in text:
        raise ArgumentError(param, "contains NUL bytes (a binary file?); give a text file",
                            subject=path)
    return text, size
