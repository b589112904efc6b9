"""Record files: JSON Lines (`.jsonl`, `.json`, gzipped `.jsonl.gz` / `.json.gz`) and Parquet
(`.parquet`), each record one document whose text is the string under `data.text_field`.

`iter_records` streams the texts of a file's records in order, never the whole file: JSON Lines
line by line, Parquet one row group at a time (in batches of rows). `scan` reads them once to
measure them (the split needs each record's length) and `digest` hashes their texts (what the
caches key on). Bad input is a one-line MinigptError naming the file and the line (JSON Lines,
counted from 1 as editors do) or the row (Parquet, counted from 0 as pyarrow and pandas do).
Blank lines are not records.

pyarrow (the `parquet` extra) is imported only when a Parquet file is read. The formats and
the document rule: docs/data.md.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from minigpt.display import size
from minigpt.errors import MinigptError
from minigpt.files import json_int, open_file

Progress = Callable[[int], None]  # bytes of the file read so far

JSONL, PARQUET = "jsonl", "parquet"
SUFFIXES = {".jsonl": JSONL, ".json": JSONL, ".jsonl.gz": JSONL, ".json.gz": JSONL,
            ".parquet": PARQUET}
_BATCH_ROWS = 1024  # Parquet rows turned into Python strings at a time
_SURROGATE = re.compile("[\ud800-\udfff]")
_BOM = b"\xef\xbb\xbf"


def record_format(path: Path) -> str | None:
    """JSONL or PARQUET by the file name's suffix (case-insensitive), None for a text file."""
    name = path.name.lower()
    return next((kind for suffix, kind in SUFFIXES.items() if name.endswith(suffix)), None)


def iter_records(path: Path, text_field: str, invalid_utf8: str = "error", start: int = 0,
                 end: int | None = None, progress: Progress | None = None
                 ) -> Iterator[tuple[str, int]]:
    """(text, UTF-8 bytes of the text) of records [start, end) of `path` (default: all), in
    order. Records before `start` are counted, not checked. `progress(n)`: the file's bytes
    read so far (compressed bytes for a .gz; JSON Lines only), every 256 KiB or so."""
    if record_format(path) == PARQUET:
        texts = _parquet(path, text_field, invalid_utf8, start, end)
    else:
        texts = _jsonl(path, text_field, invalid_utf8, start, end, progress)
    for text, where in texts:
        if text.isascii():
            yield text, len(text)
            continue
        try:
            yield text, len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate, from an escape such as "\ud800"
            if invalid_utf8 == "error":
                raise MinigptError(
                    f"{path}: {where}: the text holds a lone surrogate "
                    f"(\\u{ord(text[e.start]):04x}), which is not UTF-8; fix the record or set "
                    "data.invalid_utf8: replace") from None
            text = _SURROGATE.sub("\ufffd", text)
            yield text, len(text.encode("utf-8"))


@dataclass(frozen=True)
class RecordScan:
    n_docs: int                  # records
    n_bytes: int                 # UTF-8 bytes of their texts
    digest: str                  # `digest` of all of them
    lengths: array               # each record's bytes ("Q": 8 bytes a record in memory)
    states: tuple                # the digest's sha256 state before every SNAPSHOT-th record


SNAPSHOT = 1024


def scan(path: Path, text_field: str, invalid_utf8: str, progress: Progress | None = None
         ) -> RecordScan:
    """Read every record once, checking each (a bad one is a one-line MinigptError naming the
    line or row). What the split needs later comes from this pass: each record's length, and
    the digest's state every SNAPSHOT records (for the digest of the first k records)."""
    h, lengths, states = _hash(), array("Q"), []
    for text, n in iter_records(path, text_field, invalid_utf8, progress=progress):
        if len(lengths) % SNAPSHOT == 0:
            states.append(h.copy())
        _add(h, text, n)
        lengths.append(n)
    return RecordScan(len(lengths), sum(lengths), h.hexdigest(), lengths, tuple(states))


def digest(path: Path, text_field: str, invalid_utf8: str, start: int, end: int,
           scanned: RecordScan | None = None) -> str:
    """sha256 (hex) over the texts of records [start, end), each with its length: what a BPE
    trained on them or the tokens made from them depend on (not the other fields, not the
    formatting). With the file's scan, [0, k) resumes from the state before k's SNAPSHOT block
    and reads at most SNAPSHOT - 1 records."""
    h, first = _hash(), start
    if scanned is not None and start == 0:
        if end == scanned.n_docs:
            return scanned.digest
        first = min(end // SNAPSHOT, len(scanned.states) - 1) * SNAPSHOT
        h = scanned.states[first // SNAPSHOT].copy()
    for text, n in iter_records(path, text_field, invalid_utf8, first, end):
        _add(h, text, n)
    return h.hexdigest()


def _hash():
    return hashlib.sha256(b"minigpt-records-v1\0")


def _add(h, text: str, n: int) -> None:
    h.update(str(n).encode() + b"\0")
    h.update(text.encode("utf-8"))


# --------------------------------------------------------------------------------------------
# JSON Lines.


MAX_RECORD_BYTES = 64 << 20  # one JSON Lines record (line); a book is a few MB
_READ_BYTES = 256 << 10  # decompressed bytes read at a time
_NONSPACE = re.compile(rb"\S")


def _jsonl(path: Path, field: str, invalid_utf8: str, start: int, end: int | None,
           progress: Progress | None = None) -> Iterator[tuple[str, str]]:
    index, line_no = 0, 0
    try:
        with open_file(path) as raw, (gzip.GzipFile(fileobj=raw, mode="rb")
                                      if path.name.lower().endswith(".gz") else raw) as fh:
            for line_no, line in _lines(fh, raw, path, progress):
                if end is not None and index >= end:
                    return
                index += 1
                if index > start:
                    yield _text(path, line_no, line, field, invalid_utf8), f"line {line_no}"
    except (OSError, EOFError, zlib.error) as e:  # unreadable, or a damaged / truncated gzip
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise MinigptError(f"{path}: cannot read it after line {line_no} ({why}); "
                           "fix or remove the file") from None


def _lines(fh, raw, path: Path, progress: Progress | None) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of each line of `fh` that is not blank, read _READ_BYTES at a time
    (decompressed): a line longer than MAX_RECORD_BYTES is an error, never held whole, and a
    run of blank lines costs a scan in C, not a Python step per line. `progress(n)` after each
    read gets the bytes read from the file itself (`raw`: compressed bytes for a .gz)."""
    line_no, tail = 1, b""  # tail: the start of a line not yet ended
    while True:
        block = fh.read(_READ_BYTES)
        if progress is not None:
            progress(raw.tell())
        data = tail + block if tail else block
        last = data.rfind(b"\n") if block else len(data) - 1
        head, tail = data[: last + 1], data[last + 1:]
        if not block and head and not head.endswith(b"\n"):
            head += b"\n"  # the last line, without its newline
        if len(tail) > MAX_RECORD_BYTES:
            raise _too_long(path, line_no + head.count(b"\n"))
        i = 0 if head.strip() else len(head)  # (strip: a blank block at C speed)
        if i:
            line_no += head.count(b"\n")
        while (m := _NONSPACE.search(head, i)) is not None:
            s = max(i, head.rfind(b"\n", i, m.start()) + 1)
            e = head.find(b"\n", m.start())
            line_no += head.count(b"\n", i, s)
            line = head[s:e]
            if line_no == 1 and line.startswith(_BOM):
                line = line[3:]
            if len(line) > MAX_RECORD_BYTES:
                raise _too_long(path, line_no)
            if line.strip():
                yield line_no, line
            line_no += 1
            i = e + 1
        line_no += head.count(b"\n", i) if i < len(head) else 0
        if not block:
            return


def _too_long(path: Path, line_no: int) -> MinigptError:
    return MinigptError(f"{path}: line {line_no} is longer than {size(MAX_RECORD_BYTES)}; "
                        "a JSON Lines record is one document of at most that size")


def _text(path: Path, line_no: int, raw: bytes, field: str, invalid_utf8: str) -> str:
    where = f"{path}: line {line_no}"
    try:
        line = raw.decode("utf-8", errors="strict" if invalid_utf8 == "error" else "replace")
    except UnicodeDecodeError as e:
        raise MinigptError(f"{where} is not valid UTF-8 (byte {e.start + 1} of the line); fix "
                           "the file or set data.invalid_utf8: replace") from None
    try:
        record = json.loads(line, parse_int=json_int)
    except json.JSONDecodeError as e:
        raise MinigptError(f"{where} is not JSON ({e.msg} at column {e.colno}); a JSON Lines "
                           "file holds one JSON object per line") from None
    except RecursionError:
        raise MinigptError(f"{where} is JSON nested too deeply to read") from None
    except ValueError as e:  # an integer too long to convert
        raise MinigptError(f"{where}: {e}") from None
    if not isinstance(record, dict):
        raise MinigptError(f"{where} is a JSON {_json_type(record)}, not an object; a JSON "
                           f"Lines corpus holds one object per line, its text under \"{field}\"")
    if field not in record:
        keys = ", ".join(f'"{k}"' for k in list(record)[:8]) or "none"
        raise MinigptError(f"{where} has no \"{field}\" field (its fields: {keys}); set "
                           "data.text_field to the field that holds the text")
    text = record[field]
    if not isinstance(text, str):
        raise MinigptError(f"{where}: \"{field}\" is {_json_type(text)}, not a string")
    return text


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object"}.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------------------------
# Parquet.


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise MinigptError("reading a .parquet corpus needs pyarrow: pip install "
                           "'minigpt-lab[parquet]' (or pip install pyarrow)") from None
    return pyarrow, pyarrow.parquet


def _parquet(path: Path, field: str, invalid_utf8: str, start: int, end: int | None
             ) -> Iterator[tuple[str, str]]:
    pa, pq = _pyarrow()
    open_file(path).close()  # the file door's check: a regular file (pyarrow opens it then)
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise MinigptError(f"{path}: not a readable Parquet file ({_first_line(e)}); fix or "
                           "remove it") from None
    with pf:
        schema = pf.schema_arrow
        if field not in schema.names:
            cols = ", ".join(f'"{c}"' for c in schema.names[:8]) or "none"
            raise MinigptError(f"{path}: no column \"{field}\" (its columns: {cols}); set "
                               "data.text_field to the column that holds the text")
        if schema.names.count(field) > 1:
            raise MinigptError(f"{path}: {schema.names.count(field)} columns are named "
                               f"\"{field}\"; give the text one column (rename the others)")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_string_view(kind)):
            raise MinigptError(f"{path}: column \"{field}\" holds {kind}, not strings; set "
                               "data.text_field to the column that holds the text")
        row = 0  # index of the first row of the row group
        for group in range(pf.num_row_groups):
            n = pf.metadata.row_group(group).num_rows
            if (end is not None and row >= end) or row + n <= start:
                row += n  # outside [start, end): not read at all
                continue
            try:
                batches = pf.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group],
                                          columns=[field])
                at = row
                for batch in batches:
                    for i, text in enumerate(_texts(batch.column(0), path, at, invalid_utf8)):
                        r = at + i
                        if r < start or (end is not None and r >= end):
                            continue
                        if text is None:
                            raise MinigptError(f"{path}: row {r}: \"{field}\" is null, not a "
                                               "string")
                        yield text, f"row {r}"
                    at += len(batch)
            except (pa.ArrowException, OSError) as e:
                raise MinigptError(f"{path}: row group {group} (rows {row}-{row + n - 1}) "
                                   f"cannot be read ({_first_line(e)}); the file is damaged"
                                   ) from None
            row += n


def _texts(column, path: Path, first_row: int, invalid_utf8: str) -> list:
    """The column's values as Python strings (None for nulls). pyarrow does not check that a
    Parquet string column is UTF-8; bytes that are not get the file's and the row's name."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    import pyarrow as pa

    out = []
    for i, raw in enumerate(column.view(pa.large_binary() if pa.types.is_large_string(
            column.type) else pa.binary()).to_pylist()):
        try:
            out.append(None if raw is None else raw.decode(
                "utf-8", errors="strict" if invalid_utf8 == "error" else "replace"))
        except UnicodeDecodeError as e:
            raise MinigptError(f"{path}: row {first_row + i} is not valid UTF-8 (byte "
                               f"{e.start} of the text); fix the file or set "
                               "data.invalid_utf8: replace") from None
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
