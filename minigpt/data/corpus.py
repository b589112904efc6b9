"""Corpus files on disk: find them, fingerprint them, stream their documents, split them.

Shared by the tokenizer (BPE training) and the data pipeline (tokenization), so it sits between
them in the import order: config -> corpus -> tokenizer -> data.

A corpus is a sequence of documents: a text file is one document, each record of a JSON Lines
or Parquet file (minigpt.data.records) is one. The train/validation split (`split_corpus`) is made
on the documents' bytes before any tokenizer exists; its rule, the formats and the document
rule are written once, in docs/data.md.

Streaming contract: no function here holds more than about `chunk_bytes` (plus one line) of a
text file, or one record (one Parquet batch of rows), in memory, so a corpus larger than RAM
works. Text pieces are cut at the start of a line that begins with a non-space character; for
the GPT-4 split pattern that is an exact pre-token boundary, so tokenizing piece by piece gives
the same ids as tokenizing the whole text.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minigpt.data.records import SUFFIXES, RecordScan, digest, iter_records, record_format, scan
from minigpt.errors import MinigptError, WriteError
from minigpt.events import CorpusProgress, OnEvent, no_events
from minigpt.files import open_regular, read_problem
from minigpt.paths import is_glob, resolve_path

CHUNK_BYTES = 1 << 20  # read size; pieces are about this long
PROGRESS_BYTES = 64 << 20  # a CorpusProgress event every this many bytes of a long pass
_WS = b" \t\r\n\x0b\x0c"
_BOM = b"\xef\xbb\xbf"
_MEMO: dict[tuple, object] = {}  # per process, keyed by the files' (path, size, mtime, inode)
SPLIT_RULE = "bytes-at-line-start-v1"  # part of every cache key built on the split
# What a directory contributes. Not a plain .json: in a directory that is more often metadata
# (tokenizer.json, dataset_info.json) than data; a file path or a glob names one.
DIRECTORY_SUFFIXES = tuple(s for s in (".txt", *SUFFIXES) if s != ".json")
_KINDS = ".txt, .jsonl, .json, .jsonl.gz, .json.gz or .parquet"


def list_corpus(spec: str) -> list[Path]:
    """The corpus files named by `data.corpus`: a file, a directory (its files ending in one
    of DIRECTORY_SUFFIXES, recursive, sorted by relative path) or a glob (sorted). Raises a
    one-line MinigptError for a missing path, a dangling symlink, a directory without corpus
    files or a glob matching nothing."""
    if not spec.strip():
        raise MinigptError(f"data.corpus is empty: give a {_KINDS} file, a directory of them "
                           "or a glob (the bundled corpus is data/tinyshakespeare.txt)")
    named = resolve_path(spec)  # a file literally named `we[ir]d.txt` is that file
    files = _glob_files(spec) if is_glob(spec) and not named.exists() else _path_files(named)
    for q in files:
        if q.is_symlink() and not q.exists():
            raise MinigptError(f"data.corpus: {q} is a dangling symlink (to {os.readlink(q)}); "
                               "remove it or fix its target")
        if not q.is_file():  # a device (/dev/zero), FIFO or socket: endless or read-once
            raise MinigptError(f"data.corpus: {q} is not a regular file (a device, pipe or "
                               "socket); the corpus is read more than once, so give a file")
        if not os.access(q, os.R_OK):
            raise MinigptError(f"data.corpus: cannot read {q} (permission denied)")
    return files


def _glob_files(spec: str) -> list[Path]:
    matches = sorted(Path(m) for m in glob.glob(str(resolve_path(spec)), recursive=True))
    files = [m for m in matches if not m.is_dir()]
    if not files:
        raise MinigptError(f"data.corpus: the glob {spec} matches no files; check the "
                           "pattern (quote it in the shell) or give a file or directory")
    return files


def _path_files(p: Path) -> list[Path]:
    """A file named by data.corpus, or the corpus files of a directory."""
    if p.is_symlink() and not p.exists():
        raise MinigptError(f"data.corpus: {p} is a dangling symlink (to {os.readlink(p)}); "
                           "point data.corpus at an existing corpus file")
    if not p.exists():
        raise MinigptError(f"data.corpus: {p} not found; give a {_KINDS} file, a "
                           "directory of them or a glob (bundled: data/tinyshakespeare.txt)")
    if not p.is_dir():
        return [p]
    files = sorted((q for q in _walk(p) if q.name.lower().endswith(DIRECTORY_SUFFIXES)
                    and not q.is_dir()), key=lambda q: q.relative_to(p).as_posix())
    if not files:
        raise MinigptError(f"data.corpus: directory {p} contains no corpus files "
                           "(.txt, .jsonl, .jsonl.gz, .json.gz, .parquet); add some or "
                           "point data.corpus at a file or a glob (dir/*.json)")
    return files


def _walk(root: Path) -> Iterator[Path]:
    """Every entry under `root` (links to directories not followed, as rglob does); a
    subdirectory that cannot be listed is an error, never silently left out of the corpus."""
    def refuse(e: OSError) -> None:
        raise MinigptError(f"data.corpus: cannot list {e.filename} ({read_problem(e)}); make "
                           "it readable or move it out of the corpus directory")

    for dirpath, dirnames, filenames in os.walk(root, onerror=refuse):
        for name in dirnames + filenames:
            yield Path(dirpath) / name


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns, st.st_ino


def _memo(key: tuple, make: Callable[[], object]):
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]


def _open(path: Path):
    try:
        return open_regular(path)
    except OSError as e:
        raise MinigptError(f"data.corpus: cannot read {path}: {read_problem(e)}") from None


# --------------------------------------------------------------------------------------------
# Record files: measured once per process (their document bytes are known only by reading).


def scan_records(path: Path, text_field: str, invalid_utf8: str,
                 progress: Callable[[int], None] | None = None) -> RecordScan:
    """`records.scan` of one JSON Lines or Parquet file, memoised per process; `progress(n)`
    hears the file's bytes read while it is scanned."""
    return _memo(("scan", _stat_key(path), text_field, invalid_utf8),
                 lambda: scan(path, text_field, invalid_utf8, progress))


def records_digest(path: Path, text_field: str, invalid_utf8: str, start: int, end: int) -> str:
    """`records.digest` of records [start, end), memoised per process; [0, k) starts from the
    scan's saved state (records.py)."""
    key = ("digest", _stat_key(path), text_field, invalid_utf8, start, end)
    return _memo(key, lambda: digest(path, text_field, invalid_utf8, start, end,
                                     scan_records(path, text_field, invalid_utf8)))


def corpus_hash(files: list[Path], text_field: str = "text", invalid_utf8: str = "error") -> str:
    """sha256 (hex) over the documents, in order: a text file's length and bytes, a record
    file's `records_digest`; not the file names, so a moved corpus keeps its caches. Memoised
    per process by (path, size, mtime, inode)."""
    def digest() -> str:
        h = hashlib.sha256(b"minigpt-corpus-v1\0")
        for q in files:
            if record_format(q) is not None:
                scan = scan_records(q, text_field, invalid_utf8)
                h.update(f"records:{scan.n_docs}\0{scan.digest}".encode())
                continue
            h.update(str(q.stat().st_size).encode() + b"\0")
            with _open(q) as fh:
                while block := fh.read(CHUNK_BYTES * 4):
                    h.update(block)
        return h.hexdigest()

    return _memo(("corpus", tuple(_stat_key(q) for q in files), text_field, invalid_utf8), digest)


# --------------------------------------------------------------------------------------------
# Streaming text.


def _cut(buf: bytes) -> int:
    """Where to end a piece of `buf` (not at EOF): after a newline followed by non-space, else
    before the last space, else at the last UTF-8 character start."""
    i = buf.rfind(b"\n")
    while i != -1 and (i + 1 >= len(buf) or buf[i + 1] in _WS):
        i = buf.rfind(b"\n", 0, i)
    if i > 0:
        return i + 1
    i = buf.rfind(b" ")
    if i > 0:
        return i
    i = len(buf) - 1
    while i > 0 and len(buf) - i < 4 and (buf[i] & 0xC0) == 0x80:  # continuation byte
        i -= 1
    return i if i > 0 else len(buf)


def iter_pieces(path: Path, invalid_utf8: str = "error", chunk_bytes: int = CHUNK_BYTES,
                start: int = 0, end: int | None = None) -> Iterator[tuple[str, int]]:
    """Yield (text, n_bytes) pieces of bytes [start, end) of one text file (default: all of
    it), in order, about `chunk_bytes` each. `start` must be a UTF-8 character start.

    A leading UTF-8 BOM (at byte 0) is dropped. NUL bytes mean a binary file: MinigptError.
    Invalid UTF-8 raises a MinigptError naming the file and byte offset unless
    `invalid_utf8 == "replace"`."""
    offset = start  # file offset of buf[0]
    left = None if end is None else max(0, end - start)  # bytes still to read; None = to EOF
    buf = b""
    with _open(path) as fh:
        if start:
            fh.seek(start)
        while True:
            want = chunk_bytes if left is None else min(chunk_bytes, left)
            data = fh.read(want) if want else b""
            if left is not None:
                left -= len(data)
            buf += data
            if not buf:
                return
            if offset == 0 and buf.startswith(_BOM):
                buf, offset = buf[3:], 3
            cut = len(buf) if not data else _cut(buf)
            if data and len(buf) < chunk_bytes and cut < len(buf):
                continue  # keep a short tail until the next read
            piece, buf = buf[:cut], buf[cut:]
            nul = piece.find(b"\x00")
            if nul != -1:
                raise MinigptError(f"{path}: binary file (NUL byte at offset {offset + nul}); "
                                   "a text corpus file must be UTF-8 text")
            try:
                text = piece.decode("utf-8", errors="strict" if invalid_utf8 == "error"
                                    else "replace")
            except UnicodeDecodeError as e:
                raise MinigptError(
                    f"{path}: not valid UTF-8 at byte offset {offset + e.start}; fix the file "
                    "or set data.invalid_utf8: replace") from None
            offset += len(piece)
            yield text, len(piece)
            if not data and not buf:
                return


# --------------------------------------------------------------------------------------------
# The train/validation split (docs/data.md).


@dataclass(frozen=True)
class Span:
    """Part of corpus file number `index`: bytes [start, end) of a text file, records
    [start, end) of a record file. `start == 0` begins the file: a text file's first document
    (the token stream puts `<|endoftext|>` before it); every record is a document."""
    index: int
    path: Path
    start: int
    end: int


@dataclass(frozen=True)
class CorpusSplit:
    at: int                 # corpus byte offset of the first validation byte
    total: int              # corpus bytes (all documents)
    train: tuple[Span, ...]
    val: tuple[Span, ...]


def iter_span(span: Span, text_field: str = "text", invalid_utf8: str = "error"
              ) -> Iterator[tuple[str, int, bool]]:
    """(text, n_bytes, starts_document) pieces of a span, in order: a text file's pieces (an
    empty first piece for an empty file, so that every document starts), one per record."""
    if record_format(span.path) is not None:
        for text, n in iter_records(span.path, text_field, invalid_utf8, span.start, span.end):
            yield text, n, True
        return
    first = span.start == 0
    for text, n in iter_pieces(span.path, invalid_utf8, start=span.start, end=span.end):
        yield text, n, first
        first = False
    if first:  # an empty file is still a document
        yield "", 0, True


def split_corpus(files: Sequence[Path], val_fraction: float, text_field: str = "text",
                 invalid_utf8: str = "error", emit: OnEvent = no_events) -> CorpusSplit:
    """The byte split of docs/data.md: the training spans hold the corpus bytes [0, at), the
    validation spans [at, total); every file appears in order, a file that the point falls
    inside is cut in two, and an empty file at the point counts as validation. Memoised per
    process."""
    key = ("split", tuple(_stat_key(q) for q in files), val_fraction, text_field, invalid_utf8)
    return _memo(key, lambda: _split(files, val_fraction, text_field, invalid_utf8, emit))


def _split(files: Sequence[Path], val_fraction: float, text_field: str, invalid_utf8: str,
           emit: OnEvent) -> CorpusSplit:
    scans = _scan_all(files, text_field, invalid_utf8, emit)
    sizes = [q.stat().st_size if s is None else s.n_bytes for q, s in zip(files, scans)]
    counts = [None if s is None else s.n_docs for s in scans]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    target = total - round(total * val_fraction)
    at, cut = total, None  # cut: (file number, its first validation unit: byte or record)
    for i, (q, s0, n) in enumerate(zip(files, starts, sizes)):
        if s0 >= target:  # a document start
            at = s0
            break
        if s0 + n <= target:
            continue
        if counts[i] is None:  # a text file: the first line start >= target
            nl = _find_newline(q, target - s0 - 1)  # the '\n' before it
            local = n if nl is None else nl + 1
            if s0 + local >= total:  # no line start left in the corpus: a character start
                local = _char_start(q, target - s0)
            at, cut = s0 + local, (i, local)
        else:
            local, k = _record_cut(scans[i], target - s0, s0 + n >= total)
            at, cut = s0 + local, (i, k)
        break
    train, val = [], []
    for i, (q, s0, n) in enumerate(zip(files, starts, sizes)):
        end = n if counts[i] is None else counts[i]
        if cut is not None and cut[0] == i:
            if cut[1] > 0:
                train.append(Span(i, q, 0, cut[1]))
            if cut[1] < end:
                val.append(Span(i, q, cut[1], end))
        elif s0 < at:
            train.append(Span(i, q, 0, end))
        else:
            val.append(Span(i, q, 0, end))
    return CorpusSplit(at, total, tuple(train), tuple(val))


def _scan_all(files: Sequence[Path], text_field: str, invalid_utf8: str, emit: OnEvent
              ) -> list[RecordScan | None]:
    """`scan_records` of each record file (None for a text file), reporting file bytes read."""
    sizes = {q: q.stat().st_size for q in files if record_format(q) is not None}
    total, done, out = sum(sizes.values()), 0, []
    if sizes:
        emit(CorpusProgress("scan", 0, total))
    for q in files:
        if q not in sizes:
            out.append(None)
            continue
        out.append(scan_records(q, text_field, invalid_utf8, lambda n, at=done, size=sizes[q]:
                                emit(CorpusProgress("scan", at + min(n, size), total))))
        done += sizes[q]
        emit(CorpusProgress("scan", done, total))
    return out


def _record_cut(scan: RecordScan, target: int, last: bool) -> tuple[int, int]:
    """(byte offset, record number) in a record file of the first record starting at or after
    byte `target` (not at the end of the corpus: `last` says the file ends it); when there is
    none in the last file, the record holding the target byte. No reading: the scan's lengths."""
    lengths = np.frombuffer(scan.lengths, dtype=np.uint64).astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    k = int(np.searchsorted(starts, target, side="left"))
    if k < scan.n_docs and not (last and starts[k] >= scan.n_bytes):
        return int(starts[k]), k
    j = int(np.searchsorted(starts, target, side="right")) - 1  # the last record starting <= it
    if last and j >= 0 and starts[j] + lengths[j] > target:
        return int(starts[j]), j
    return scan.n_bytes, scan.n_docs


def _find_newline(path: Path, pos: int) -> int | None:
    """File offset of the first b'\n' at or after `pos`, or None; reads in blocks."""
    with _open(path) as fh:
        fh.seek(pos)
        while block := fh.read(CHUNK_BYTES):
            i = block.find(b"\n")
            if i != -1:
                return pos + i
            pos += len(block)
    return None


def _char_start(path: Path, pos: int) -> int:
    """The first offset >= `pos` whose byte is not a UTF-8 continuation byte (or EOF)."""
    with _open(path) as fh:
        fh.seek(pos)
        for b in fh.read(4):
            if b & 0xC0 != 0x80:
                return pos
            pos += 1
    return pos


def spans_hash(spans: Sequence[Span], text_field: str = "text",
               invalid_utf8: str = "error") -> str:
    """sha256 (hex) over the spans' documents, in order (not the file names): what a BPE
    trained on these spans depends on. Memoised per process like `corpus_hash`."""
    def digest() -> str:
        h = hashlib.sha256(b"minigpt-spans-v1\0")
        for s in spans:
            if record_format(s.path) is not None:
                d = records_digest(s.path, text_field, invalid_utf8, s.start, s.end)
                h.update(f"records {s.start}:{s.end}\0{d}".encode())
                continue
            h.update(f"{s.start}:{s.end}".encode() + b"\0")
            with _open(s.path) as fh:
                fh.seek(s.start)
                left = s.end - s.start
                while left > 0 and (block := fh.read(min(CHUNK_BYTES * 4, left))):
                    h.update(block)
                    left -= len(block)
        return h.hexdigest()

    key = ("spans", tuple((_stat_key(s.path), s.start, s.end) for s in spans), text_field,
           invalid_utf8)
    return _memo(key, digest)


def empty_corpus_error(spec: str, files: list[Path], text_field: str = "text") -> MinigptError:
    where = files[0] if len(files) == 1 else f"{spec} ({len(files)} files)"
    if any(record_format(q) for q in files):
        return MinigptError(f"data.corpus: {where} holds no text: no records, or only empty or "
                            f"whitespace \"{text_field}\" values; give a corpus with some content")
    return MinigptError(f"data.corpus: {where} is empty or only whitespace; give a text corpus "
                        "with some content")


@contextmanager
def cache_writes(directory: Path):
    """Writing a cache entry under `directory`: a failed write (unwritable or missing parent,
    disk full) becomes a one-line MinigptError naming the cache and the setting that moves it."""
    try:
        yield
    except (OSError, WriteError) as e:
        why = e.strerror if isinstance(e, OSError) else (os.strerror(e.errno) if e.errno else '')
        raise MinigptError(f"cannot write the cache {directory}: {why or e}; set "
                           "data.cache_dir (or $MINIGPT_CACHE) to a writable directory with "
                           "free space") from None
