"""Corpus files on disk: find them, fingerprint them, stream them as text pieces.

Shared by the tokenizer (BPE training) and the data pipeline (tokenization), so it sits between
them in the import order: config -> corpus -> tokenizer -> data.

Streaming contract: no function here holds more than about `chunk_bytes` (plus one line) of a
file in memory, so a corpus larger than RAM works. Pieces are cut at the start of a line that
begins with a non-space character; for the GPT-4 split pattern that is an exact pre-token
boundary, so tokenizing piece by piece gives the same ids as tokenizing the whole text.

The train/validation split is defined on the corpus BYTES, before any tokenizer exists
(`split_corpus`): the corpus is its files' bytes concatenated in order, total N; the target is
N - round(N * val_fraction); the split point is the first line start at or after the target
(the start of a file, or the byte after a `\n`), not counting the very end of the corpus; in a
last file with no line break after the target, the first UTF-8 character start at or after
it. Bytes before the split point are the training text (the BPE is trained on them alone), the
rest is the validation text; the two are tokenized separately. At a line start the point
depends only on the bytes before it (the `\n` that makes it a line start is training text),
so editing the validation text never changes the tokenizer; in the fallback case the point
moves only if the edit adds a line break to that last file.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import MinigptError, WriteError
from minigpt.paths import is_glob, resolve_path

CHUNK_BYTES = 1 << 20  # read size; pieces are about this long
_WS = b" \t\r\n\x0b\x0c"
_BOM = b"\xef\xbb\xbf"
_HASH_CACHE: dict[tuple, str] = {}
SPLIT_RULE = "bytes-at-line-start-v1"  # part of every cache key built on the split


def list_corpus(spec: str) -> list[Path]:
    """The corpus files named by `data.corpus`: a file, a directory (its *.txt files, recursive,
    sorted by relative path) or a glob (sorted). Raises a one-line MinigptError for a missing
    path, a dangling symlink, a directory without .txt files or a glob matching nothing."""
    if not spec.strip():
        raise MinigptError("data.corpus is empty: give a .txt file, a directory of .txt files "
                           "or a glob (the bundled corpus is data/tinyshakespeare.txt)")
    if is_glob(spec):
        pattern = resolve_path(spec)
        matches = sorted(Path(m) for m in glob.glob(str(pattern), recursive=True))
        files = [m for m in matches if not m.is_dir()]
        if not files:
            raise MinigptError(f"data.corpus: the glob {spec} matches no files; check the "
                               "pattern (quote it in the shell) or give a file or directory")
    else:
        p = resolve_path(spec)
        if p.is_symlink() and not p.exists():
            raise MinigptError(f"data.corpus: {p} is a dangling symlink (to {os.readlink(p)}); "
                               "point data.corpus at an existing text file")
        if not p.exists():
            raise MinigptError(f"data.corpus: {p} not found; give a .txt file, a directory of "
                               ".txt files or a glob (bundled: data/tinyshakespeare.txt)")
        if p.is_dir():
            files = sorted((q for q in p.rglob("*.txt") if not q.is_dir()),
                           key=lambda q: q.relative_to(p).as_posix())
            if not files:
                raise MinigptError(f"data.corpus: directory {p} contains no .txt files; add "
                                   "some or point data.corpus at a file or glob")
        else:
            files = [p]
    for q in files:
        if q.is_symlink() and not q.exists():
            raise MinigptError(f"data.corpus: {q} is a dangling symlink (to {os.readlink(q)}); "
                               "remove it or fix its target")
        if not q.is_file():  # a device (/dev/zero), FIFO or socket: endless or read-once
            raise MinigptError(f"data.corpus: {q} is not a regular file (a device, pipe or "
                               "socket); the corpus is read more than once, so give a text file")
        if not os.access(q, os.R_OK):
            raise MinigptError(f"data.corpus: cannot read {q} (permission denied)")
    return files


def corpus_hash(files: list[Path]) -> str:
    """sha256 (hex) over the files' contents and lengths, in order; not their names, so a moved
    corpus keeps its caches. Memoised per process by (path, size, mtime, inode)."""
    stats = tuple((str(q), st.st_size, st.st_mtime_ns, st.st_ino)
                  for q in files for st in [q.stat()])
    if stats in _HASH_CACHE:
        return _HASH_CACHE[stats]
    h = hashlib.sha256(b"minigpt-corpus-v1\0")
    for q in files:
        h.update(str(q.stat().st_size).encode() + b"\0")
        with _open(q) as fh:
            while block := fh.read(CHUNK_BYTES * 4):
                h.update(block)
    _HASH_CACHE[stats] = digest = h.hexdigest()
    return digest


def _open(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise MinigptError(f"data.corpus: cannot read {path}: {e.strerror}") from None


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
    """Yield (text, n_bytes) pieces of bytes [start, end) of one file (default: all of it), in
    order, about `chunk_bytes` each. `start` must be a UTF-8 character start.

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
                                   "the corpus must be UTF-8 text")
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
# The train/validation split on bytes (module docstring).


@dataclass(frozen=True)
class Span:
    """Bytes [start, end) of corpus file number `index`; `start == 0` begins the file (the
    token stream puts `<|endoftext|>` before it)."""
    index: int
    path: Path
    start: int
    end: int


@dataclass(frozen=True)
class CorpusSplit:
    at: int                 # corpus byte offset of the first validation byte
    total: int              # corpus bytes (all files)
    train: tuple[Span, ...]
    val: tuple[Span, ...]

    @property
    def train_bytes(self) -> int:
        return self.at


def split_corpus(files: Sequence[Path], val_fraction: float) -> CorpusSplit:
    """The byte split of the module docstring: the training spans hold the corpus bytes
    [0, at), the validation spans [at, total); every file appears in order, a file that the
    point falls inside is cut in two, and an empty file at the point counts as validation."""
    sizes = [q.stat().st_size for q in files]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    target = total - round(total * val_fraction)
    at = total
    for i, (q, s0, n) in enumerate(zip(files, starts, sizes)):
        if s0 >= target:  # a file start is a line start
            at = s0
            break
        if s0 + n <= target:
            continue
        nl = _find_newline(q, target - s0 - 1)  # the '\n' before a line start >= target
        at = s0 + n if nl is None else s0 + nl + 1
        if at >= total:  # no line start left in the corpus: a character start instead
            at = s0 + _char_start(q, target - s0)
        break
    train = tuple(Span(i, q, 0, min(n, at - s0))
                  for i, (q, s0, n) in enumerate(zip(files, starts, sizes)) if s0 < at)
    val = tuple(Span(i, q, max(0, at - s0), n)
                for i, (q, s0, n) in enumerate(zip(files, starts, sizes)) if s0 + n > at or s0 >= at)
    return CorpusSplit(at, total, train, val)


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


def spans_hash(spans: Sequence[Span]) -> str:
    """sha256 (hex) over the spans' bytes and lengths, in order (not the file names): what a
    BPE trained on these spans depends on. Memoised per process like `corpus_hash`."""
    stats = tuple((str(s.path), s.start, s.end, st.st_size, st.st_mtime_ns, st.st_ino)
                  for s in spans for st in [s.path.stat()])
    if stats in _HASH_CACHE:
        return _HASH_CACHE[stats]
    h = hashlib.sha256(b"minigpt-spans-v1\0")
    for s in spans:
        h.update(f"{s.start}:{s.end}".encode() + b"\0")
        with _open(s.path) as fh:
            fh.seek(s.start)
            left = s.end - s.start
            while left > 0 and (block := fh.read(min(CHUNK_BYTES * 4, left))):
                h.update(block)
                left -= len(block)
    _HASH_CACHE[stats] = digest = h.hexdigest()
    return digest


def empty_corpus_error(spec: str, files: list[Path]) -> MinigptError:
    where = files[0] if len(files) == 1 else f"{spec} ({len(files)} files)"
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
