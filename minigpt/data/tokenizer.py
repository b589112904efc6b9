"""Byte-level BPE through tiktoken: raw bytes, a BPE trained on the corpus with rustbpe, a named
tiktoken encoding from tiktoken's local cache, or a saved `.tiktoken` rank file.

Ids: the mergeable ranks are ids 0..len(ranks)-1 (ids 0..255 are the single bytes for bytes and
trained tokenizers); `<|endoftext|>` follows them (id = len(ranks)). So `tokenizer.vocab_size`
counts ranks and `n_vocab` = vocab_size + 1 for bytes/trained tokenizers (256 -> 257).

On disk (a run directory or the tokenizer cache): `tokenizer.tiktoken` in tiktoken's own format
(`<base64 token> <rank>` per line, readable by `tiktoken.load.load_tiktoken_bpe`) and
`tokenizer.json` (name, split pattern, special tokens, n_vocab, hash); the JSON is written last.

A compiled program's vocabulary (`minigpt compile`) is a `WordTokenizer`: its tokens are words
(the program's own: `a`, `(`, `10`), an input is those words written with spaces between them,
and its one special token is the beginning token `BOS` (where `<|endoftext|>` stands in a text
tokenizer: `eot_id`), which every input starts with, as tracr adds it. Saved the same way, with
`"kind": "words"` in tokenizer.json.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tiktoken

from minigpt.config import Config
from minigpt.data.corpus import (
    CHUNK_BYTES,
    PROGRESS_BYTES,
    SPLIT_RULE,
    CorpusSplit,
    cache_writes,
    empty_corpus_error,
    iter_span,
    list_corpus,
    scan_records,
    spans_hash,
    split_corpus,
)
from minigpt.data.records import record_format
from minigpt.errors import MinigptError
from minigpt.events import (
    BPETrained,
    CorpusProgress,
    OnEvent,
    TokenizerCacheHit,
    TrainingBPE,
    no_events,
)
from minigpt.files import atomic_write_bytes, parse_json, read_file, shown
from minigpt.paths import cache_root, resolve_path

EOT = "<|endoftext|>"
RANKS_FILE = "tokenizer.tiktoken"
SIDECAR_FILE = "tokenizer.json"
FORMAT_VERSION = 1
RANKS_CAP = 256 << 20  # a .tiktoken file (o200k_base: 3.6 MB)

# Split patterns, as tiktoken ships them: gpt4 = cl100k_base's, gpt2 = r50k_base's.
PATTERNS = {
    "gpt4": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",  # noqa: E501
    "gpt2": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
}

# Named encodings: the blob URLs tiktoken fetches and their sha256, to find them in tiktoken's
# cache ourselves (cache key = sha1 of the URL) instead of letting tiktoken retry the network.
_BLOB = "https://openaipublic.blob.core.windows.net"
NAMED_ENCODINGS: dict[str, list[tuple[str, str]]] = {
    "gpt2": [
        (f"{_BLOB}/gpt-2/encodings/main/vocab.bpe",
         "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
        (f"{_BLOB}/gpt-2/encodings/main/encoder.json",
         "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    ],
    "cl100k_base": [(f"{_BLOB}/encodings/cl100k_base.tiktoken",
                     "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7")],
    "o200k_base": [(f"{_BLOB}/encodings/o200k_base.tiktoken",
                    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d")],
}


# --------------------------------------------------------------------------------------------


MAX_ID_GAPS = 1 << 16  # unused ids a vocabulary may have (cl100k_base: 2)


def check_ids(ranks: dict[bytes, int], special_tokens: dict[str, int], what: str) -> None:
    """Ids tiktoken can take without a panic or a huge table: integers, none negative, no two
    tokens with one id, at most MAX_ID_GAPS unused ids below the largest (an id of 10^9 would
    make tables of a billion entries). MinigptError naming `what`."""
    seen: dict[int, object] = {}
    for tok, r in [*ranks.items(), *special_tokens.items()]:
        if type(r) is not int or r < 0:
            raise MinigptError(f"{what}: token {shown(tok, 40)} has id {shown(r, 40)}; ids are "
                               "integers >= 0")
        if r in seen:
            raise MinigptError(f"{what}: tokens {shown(seen[r], 40)} and {shown(tok, 40)} "
                               f"share the id {r}; each id names one token")
        seen[r] = tok
    top = max(seen, default=-1)
    if top + 1 - len(seen) > MAX_ID_GAPS:
        raise MinigptError(f"{what}: the largest id is {top:,} but there are only "
                           f"{len(seen):,} tokens; ids must be (nearly) contiguous from 0")


def rank_file_bytes(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's rank-file format: `<base64 token> <rank>\\n`, in rank order."""
    lines = [base64.b64encode(tok) + b" " + str(r).encode()
             for tok, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    return b"\n".join(lines) + b"\n"


class Tokenizer:
    """A tiktoken.Encoding plus what minigpt needs around it (eot id, hash, save/load).

    `encode` treats special-token text as plain text unless `allow_special`; `decode` never
    raises: broken UTF-8 and ids that are not in the vocabulary (negative, >= n_vocab, gaps)
    both become U+FFFD."""

    def __init__(self, ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int],
                 name: str, start: str = EOT):
        if start not in special_tokens:
            raise MinigptError(f"tokenizer {name}: has no {start} special token")
        check_ids(ranks, special_tokens, f"tokenizer {name}")
        try:
            self.encoding = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                              special_tokens=special_tokens)
        except BaseException as e:  # tiktoken's Rust side panics (pyo3 PanicException)
            if type(e).__name__ != "PanicException":
                raise
            raise MinigptError(f"tokenizer {name}: tiktoken refused its ranks "
                               f"({shown(str(e).splitlines()[0] if str(e) else e, 120)})"
                               ) from None
        self.name = name
        self.pattern = pattern
        self.special_tokens = dict(special_tokens)
        self.ranks = ranks
        self.n_vocab: int = self.encoding.n_vocab
        self.eot_id: int = special_tokens[start]  # <|endoftext|>, or a program's BOS
        self._rank_bytes = rank_file_bytes(ranks)
        h = hashlib.sha256(self._rank_bytes)
        h.update(b"\0" + pattern.encode() + b"\0")
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode())
        self.hash: str = h.hexdigest()[:16]
        ids = set(ranks.values()) | set(special_tokens.values())
        self._gaps = frozenset(set(range(self.n_vocab)) - ids)  # cl100k has unused ids
        self._lengths: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, hash={self.hash})"

    # -- encode / decode ----------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str], eot_between: bool = False) -> list[list[int]]:
        """Ordinary (special text = plain text) encoding of several texts on tiktoken's threads.
        `eot_between`: `<|endoftext|>` in the texts is the special token and separates them
        (each part is encoded on its own, as if alone); any other special text stays text."""
        threads = os.cpu_count() or 1
        if eot_between:
            return self.encoding.encode_batch(texts, num_threads=threads, allowed_special={EOT},
                                              disallowed_special=())
        return self.encoding.encode_ordinary_batch(texts, num_threads=threads)

    def _valid(self, i: int) -> bool:
        return 0 <= i < self.n_vocab and i not in self._gaps

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]  # accepts tensors / numpy arrays
        if all(self._valid(i) for i in ids):
            return self.encoding.decode(ids, errors="replace")
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, id: int) -> bytes:
        """The bytes of one token (special tokens: their text); invalid ids: U+FFFD's bytes."""
        id = int(id)
        if not self._valid(id):
            return "\ufffd".encode()
        return self.encoding.decode_single_token_bytes(id)

    def token_str(self, id: int) -> str:
        """One token's text for labels: UTF-8 if it decodes, else with \\xNN escapes for the
        partial bytes (a lone byte of a multi-byte character would otherwise show as U+FFFD)."""
        return self.token_bytes(id).decode("utf-8", errors="backslashreplace")

    def token_byte_lengths(self) -> np.ndarray:
        """(n_vocab,) int64: UTF-8 bytes each id stands for in the corpus (specials and gaps 0)."""
        if self._lengths is None:
            lengths = np.zeros(self.n_vocab, dtype=np.int64)
            for tok, r in self.ranks.items():
                lengths[r] = len(tok)
            self._lengths = lengths
        return self._lengths

    # -- persistence --------------------------------------------------------------------------
    def sidecar(self) -> dict:
        return {"format": FORMAT_VERSION, "name": self.name, "pattern": self.pattern,
                "special_tokens": self.special_tokens, "n_ranks": len(self.ranks),
                "n_vocab": self.n_vocab, "hash": self.hash}

    def save(self, directory: Path) -> None:
        """Write tokenizer.tiktoken then tokenizer.json (durably; the JSON marks completion)."""
        directory = Path(directory)
        atomic_write_bytes(directory / RANKS_FILE, self._rank_bytes)
        atomic_write_bytes(directory / SIDECAR_FILE,
                           (json.dumps(self.sidecar(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        """Load a saved tokenizer; MinigptError if a file is missing, corrupt or mismatched."""
        directory = Path(directory)
        side_path, rank_path = directory / SIDECAR_FILE, directory / RANKS_FILE
        for p in (side_path, rank_path):
            if not p.is_file():
                raise MinigptError(f"tokenizer file missing: {p}; the directory must hold "
                                   f"{RANKS_FILE} and {SIDECAR_FILE} (saved by minigpt)")
        side = _read_sidecar(side_path)
        words = side.get("kind") == WordTokenizer.KIND
        ranks = _read_ranks(rank_path, words)
        tok = WordTokenizer(ranks, side["special_tokens"], side["name"]) if words else \
            cls(ranks, side["pattern"], side["special_tokens"], side["name"])
        expected = side["hash"]
        if tok.hash != expected:
            raise MinigptError(f"{rank_path}: does not match the hash in {side_path} "
                               f"({tok.hash} != {expected}); the tokenizer files are corrupt")
        return tok


class WordTokenizer(Tokenizer):
    """A compiled program's vocabulary (module docstring): `ranks` {word bytes: id}, one
    special token (`BOS`, {name: id}); ids as the compiled model numbers them (an id of
    neither, such as tracr's padding token, is unused)."""

    KIND = "words"
    PATTERN = r"\S+"  # tiktoken's view: each run of non-space characters is one piece

    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int],
                 name: str) -> None:
        if len(special_tokens) != 1:
            raise MinigptError(f"tokenizer {name}: a program's vocabulary has one special "
                               f"token (its beginning token), not {len(special_tokens)}")
        super().__init__(ranks, self.PATTERN, special_tokens, name,
                         start=next(iter(special_tokens)))
        self.words = {tok.decode("utf-8", "replace"): i for tok, i in ranks.items()}
        self.start = next(iter(special_tokens))

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """The ids of the words of `text` (split at whitespace); a word outside the
        vocabulary is a MinigptError naming it and the vocabulary. The beginning token is
        added by whoever builds an input (as tracr adds it); typed, it is refused unless
        `allow_special`."""
        out = []
        for w in text.split():
            if w in self.words:
                out.append(self.words[w])
            elif w == self.start and allow_special:
                out.append(self.eot_id)
            else:
                why = ("is the beginning token, which every input starts with already"
                       if w == self.start else "is not a token of the program's vocabulary")
                raise MinigptError(f"{shown(repr(w), 40)} {why} ({', '.join(self.words)}); "
                                   "write the program's tokens with spaces between them, e.g. "
                                   f"'{' '.join(list(self.words)[:3])}'")
        return out

    def encode_batch(self, texts: list[str], eot_between: bool = False) -> list[list[int]]:
        return [self.encode(t, allow_special=eot_between) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The tokens' text with a space between them."""
        return " ".join(self.token_str(i) for i in ids)

    def sidecar(self) -> dict:
        return {**super().sidecar(), "kind": self.KIND}


def _read_sidecar(path: Path) -> dict:
    """tokenizer.json, checked: string name, pattern and hash, special tokens {str: int}."""
    def corrupt(why: str) -> MinigptError:
        return MinigptError(f"{path}: corrupt tokenizer sidecar ({why}); re-save the tokenizer "
                            "or retrain")

    data = read_file(path)
    try:
        side = parse_json(data)
    except ValueError as e:  # not UTF-8, not JSON, nested too deeply, a huge integer
        raise corrupt(str(e)) from None
    if not isinstance(side, dict):
        raise corrupt(f"a JSON {type(side).__name__}, not an object")
    for key in ("name", "pattern", "hash"):
        if not isinstance(side.get(key), str):
            raise corrupt(f'"{key}" is missing or not a string')
    specials = side.get("special_tokens")
    if not isinstance(specials, dict) or not all(
            type(v) is int for v in specials.values()):  # (bool is not an id)
        raise corrupt('"special_tokens" is not an object of integer ids')
    return side


def _read_ranks(path: Path, words: bool = False) -> dict[bytes, int]:
    """Parse a tiktoken rank file (`<base64 token> <rank>` per line, as
    tiktoken.load.load_tiktoken_bpe does). Not through tiktoken itself: it copies every file it
    reads, local ones too, into its download cache ($TMPDIR/data-gym-cache), which would write
    outside the run and cache directories on every load."""
    line_no = 0
    ranks: dict[bytes, int] = {}
    try:
        for line_no, line in enumerate(read_file(path, RANKS_CAP).splitlines(), 1):
            if line:
                token, rank = line.split()
                if len(rank) > 12:  # no vocabulary has a trillion tokens
                    raise ValueError(rank)
                tok = base64.b64decode(token, validate=True)
                if tok in ranks:
                    raise MinigptError(f"{path}: line {line_no} repeats the token of rank "
                                       f"{ranks[tok]}; each token appears once")
                ranks[tok] = int(rank)
    except ValueError:  # also binascii.Error (bad base64)
        raise MinigptError(f"{path}: not a tiktoken rank file (line {line_no} is not "
                           "'<base64 token> <rank>')") from None
    if not ranks:
        raise MinigptError(f"{path}: empty tiktoken rank file")
    check_ids(ranks, {}, str(path))
    if not words:  # a program's words are whole tokens: no byte-level BPE
        check_bytes(ranks, str(path))
    return ranks


def check_bytes(ranks: dict[bytes, int], what: str) -> None:
    """Every one of the 256 bytes is a token of its own: byte-level BPE starts each piece
    from single bytes, and tiktoken's Rust encoder panics on a byte it has no rank for (while
    encoding the corpus, long after the file was read). MinigptError naming `what` and the
    bytes missing."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        shown_bytes = ", ".join(f"0x{b:02x}" for b in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MinigptError(f"{what}: {len(missing)} of the 256 single-byte tokens are missing "
                           f"({shown_bytes}{more}); a byte-level BPE needs a token for every "
                           "byte, or text holding those bytes cannot be encoded")


# --------------------------------------------------------------------------------------------
# Building from the config.


def bytes_tokenizer(pattern: str = "gpt4") -> Tokenizer:
    """256 single-byte ranks, no merges: ids 0..255 are the bytes, 256 is <|endoftext|>."""
    ranks = {bytes([b]): b for b in range(256)}
    return Tokenizer(ranks, PATTERNS[pattern], {EOT: 256}, "bytes")


def build_tokenizer(cfg: Config, on_event: OnEvent | None = None) -> Tokenizer:
    """The tokenizer the config asks for:

    - `tokenizer.encoding` set: a named tiktoken encoding (from tiktoken's local cache only),
      a `.tiktoken` file, or a directory holding a saved minigpt tokenizer;
    - else `vocab_size: 256`: raw bytes;
    - else a BPE trained with rustbpe on the training documents of the corpus only (the
      split of docs/data.md: the validation text never shapes the vocabulary), cached under
      the cache dir by the training text's hash + settings (a second call with the same
      training text and settings loads it)."""
    on_event = on_event or no_events
    tc = cfg.tokenizer
    if tc.encoding:
        return _from_encoding(tc.encoding, tc.pattern)
    if tc.vocab_size == 256:
        return bytes_tokenizer(tc.pattern)
    return _trained(cfg, on_event)  # config/load.py refuses a BPE for the induction source


def _trained(cfg: Config, emit: OnEvent) -> Tokenizer:
    tc, dc = cfg.tokenizer, cfg.data
    files = list_corpus(dc.corpus)
    cut = split_corpus(files, dc.val_fraction, dc.text_field, dc.invalid_utf8, emit)
    # Keyed by the training text itself: val_fraction matters only through where the split
    # falls, and editing the validation text reuses the cached tokenizer.
    key_src = {"v": FORMAT_VERSION, "split": SPLIT_RULE,
               "train_text": spans_hash(cut.train, dc.text_field, dc.invalid_utf8),
               "vocab_size": tc.vocab_size, "pattern": tc.pattern,
               "train_max_bytes": tc.train_max_bytes, "invalid_utf8": dc.invalid_utf8,
               "chunk": CHUNK_BYTES}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:24]
    directory = cache_root(dc.cache_dir) / "tokenizers" / key
    if (directory / SIDECAR_FILE).is_file():
        try:
            tok = Tokenizer.load(directory)
            emit(TokenizerCacheHit(directory))
            return tok
        except MinigptError:
            pass  # a corrupt cache entry is retrained and overwritten

    limit = tc.train_max_bytes or None
    total = min(cut.at, limit) if limit else cut.at  # the training text's bytes
    emit(TrainingBPE(dc.corpus, total, tc.vocab_size))
    seen = {"bytes": 0, "text": False}

    def texts():
        report = PROGRESS_BYTES
        for sp in cut.train:
            for text, n, _ in iter_span(sp, dc.text_field, dc.invalid_utf8):
                if limit is not None and seen["bytes"] >= limit:
                    return
                if limit is not None and seen["bytes"] + n > limit:
                    # Truncate at a character boundary (approximately: chars, not bytes).
                    text = text[: limit - seen["bytes"]]
                seen["bytes"] += n
                seen["text"] = seen["text"] or not text.isspace() and bool(text)
                if seen["bytes"] >= report:
                    emit(CorpusProgress("bpe", min(seen["bytes"], total), total))
                    report += PROGRESS_BYTES
                yield text

    import rustbpe  # heavy-ish native module: only needed when training

    t0 = time.perf_counter()
    bpe = rustbpe.Tokenizer()
    # buffer_size = texts held at once (pieces of ~1 MB, or records): ~16 MB, whatever the
    # documents' size, bounds memory for huge corpora and keeps rustbpe's threads busy.
    bpe.train_from_iterator(texts(), tc.vocab_size, buffer_size=_bpe_buffer(cut, dc),
                            pattern=PATTERNS[tc.pattern])
    if not seen["text"]:
        raise empty_corpus_error(dc.corpus, files, dc.text_field)
    ranks = {bytes(tok): int(r) for tok, r in bpe.get_mergeable_ranks()}
    tok = Tokenizer(ranks, PATTERNS[tc.pattern], {EOT: len(ranks)},
                    f"bpe{len(ranks)}-{tc.pattern}")
    with cache_writes(directory):
        tok.save(directory)
    emit(BPETrained(len(ranks), time.perf_counter() - t0, directory))
    return tok


def _bpe_buffer(cut: CorpusSplit, dc) -> int:
    """rustbpe's buffer (texts held at once) for about 16 MB: 16 pieces of a text file, or
    more records when the training text is all records, small on average."""
    scans = [scan_records(sp.path, dc.text_field, dc.invalid_utf8) for sp in cut.train
             if record_format(sp.path) is not None]
    if len(scans) < len(cut.train) or not scans:  # text pieces (~1 MB each) among the texts
        return 16
    n_docs, n_bytes = sum(s.n_docs for s in scans), sum(s.n_bytes for s in scans)
    return max(16, min(1 << 16, 16 * CHUNK_BYTES * n_docs // max(1, n_bytes)))


def _from_encoding(spec: str, pattern_name: str) -> Tokenizer:
    if spec in NAMED_ENCODINGS:
        return _named(spec)
    p = resolve_path(spec)
    if p.is_dir():
        return Tokenizer.load(p)
    if p.is_file():
        side = p.parent / SIDECAR_FILE
        if p.name == RANKS_FILE and side.is_file():
            return Tokenizer.load(p.parent)
        ranks = _read_ranks(p)
        eot = max(ranks.values()) + 1
        return Tokenizer(ranks, PATTERNS[pattern_name], {EOT: eot}, p.stem)
    raise MinigptError(
        f"tokenizer.encoding: '{spec}' is neither a tiktoken name ({', '.join(NAMED_ENCODINGS)}) "
        "nor an existing .tiktoken file or tokenizer directory; use tokenizer.encoding: '' "
        "to train a BPE on the corpus")


def tiktoken_cache_dir() -> str:
    """Where tiktoken caches downloads (same rule as tiktoken.load.read_file_cached)."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _named(name: str) -> Tokenizer:
    """A named encoding, only if every file is already in tiktoken's cache with the right hash:
    offline, tiktoken itself would retry the network for minutes."""
    cache = tiktoken_cache_dir()
    for url, sha in NAMED_ENCODINGS[name]:
        path = os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()) if cache else ""
        ok = bool(path) and os.path.isfile(path)
        if ok:
            ok = hashlib.sha256(read_file(path, RANKS_CAP)).hexdigest() == sha
        if not ok:
            raise MinigptError(
                f"tokenizer.encoding: {name} is not in tiktoken's local cache ({cache or 'off'}); "
                f"download it once online (python -c \"import tiktoken; "
                f"tiktoken.get_encoding('{name}')\"), or use tokenizer.encoding: '' (BPE "
                "trained on the corpus) or a local .tiktoken file")
    import tiktoken_ext.openai_public as public

    spec = getattr(public, name)()
    return Tokenizer(spec["mergeable_ranks"], spec["pat_str"], spec["special_tokens"], name)
