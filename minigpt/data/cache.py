"""Token data: the corpus tokenized once into a memory-mapped cache (rows.py reads the
rows a training session trains on from it).

Token cache (under `<cache dir>/tokens/`): `<key>.bin` holds every token of the corpus, each
document preceded by `<|endoftext|>`, as uint16 when n_vocab <= 65536 else uint32: the
training tokens, then the validation tokens; `<key>.json` (written last, so it marks a
complete cache) holds counts and bytes_per_token. The key hashes the documents, the tokenizer
hash and the split settings and rule: any change builds a new cache, nothing stale is read.
The split, the document rule and bits/byte: docs/data.md. The training and the validation
documents are tokenized separately, so no token straddles the split point.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minigpt.config import Config, DataConfig
from minigpt.data.corpus import (
    CHUNK_BYTES,
    SPLIT_RULE,
    CorpusSplit,
    cache_writes,
    corpus_hash,
    empty_corpus_error,
    iter_span,
    list_corpus,
    split_corpus,
)
from minigpt.data.tokenizer import EOT, Tokenizer
from minigpt.errors import MinigptError
from minigpt.events import CorpusProgress, DatasetReady, OnEvent, TokenizingFile, no_events
from minigpt.files import (
    SMALL_CAP,
    atomic_file,
    atomic_write_bytes,
    open_regular,
    parse_json,
    read_regular,
    shown,
)
from minigpt.paths import cache_root

CACHE_VERSION = 3  # 3: documents of record files; an empty corpus is never cached
DATA_SPLIT = "bytes"  # the split every run uses; checkpoints record it as data_split
_BATCH_BYTES = 8 * CHUNK_BYTES  # document bytes encoded together on tiktoken's threads


# --------------------------------------------------------------------------------------------


@dataclass
class Dataset:
    """The tokenized corpus, memory-mapped."""

    train: np.ndarray          # 1-D token ids (np.memmap, uint16 or uint32)
    val: np.ndarray
    bytes_per_token: float     # UTF-8 bytes / tokens on the val split


def prepare_dataset(cfg: Config, tokenizer: Tokenizer, on_event: OnEvent | None = None
                    ) -> Dataset:
    """The Dataset of the corpus `cfg.data` names (from the cache when corpus, tokenizer and
    split settings are unchanged, else built and cached atomically). Raises one-line
    MinigptErrors for unusable corpora (nothing is cached then) and for splits shorter than
    model.block_size + 1 tokens."""
    on_event = on_event or no_events
    dc, T = cfg.data, cfg.model.block_size
    files = list_corpus(dc.corpus)
    cut = split_corpus(files, dc.val_fraction, dc.text_field, dc.invalid_utf8, on_event)
    key_src = {"v": CACHE_VERSION, "corpus": corpus_hash(files, dc.text_field, dc.invalid_utf8),
               "tokenizer": tokenizer.hash, "val_fraction": dc.val_fraction,
               "invalid_utf8": dc.invalid_utf8, "split": SPLIT_RULE,
               "chunk": CHUNK_BYTES}  # piece cuts can shift gpt2-pattern tokens: part of the key
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:24]
    directory = cache_root(dc.cache_dir) / "tokens"
    bin_path, meta_path = directory / f"{key}.bin", directory / f"{key}.json"
    meta = _read_meta(meta_path, bin_path, tokenizer.n_vocab)
    cached = meta is not None
    where = files[0] if len(files) == 1 else dc.corpus
    if meta is None:
        with cache_writes(directory):
            meta = _build(cut, dc, tokenizer, bin_path, on_event, files)
            try:
                _check_splits(meta, T, where)
            except MinigptError:
                bin_path.unlink(missing_ok=True)  # a corpus too short is not cached
                raise
            meta.update(key_src, split_at=cut.at)
            atomic_write_bytes(meta_path, (json.dumps(meta, indent=2) + "\n").encode())
    _check_splits(meta, T, where)
    tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r")
    n_train = meta["n_train"]
    train, val = tokens[:n_train], tokens[n_train:]
    on_event(DatasetReady(bin_path, len(train), len(val), cached=cached, corpus_files=tuple(files)))
    return Dataset(train, val, meta["bytes_per_token"])


def _check_splits(meta: dict, T: int, where: object) -> None:
    """Both splits hold at least block_size + 1 tokens, or a MinigptError saying what to do."""
    larger = "or use a larger corpus"
    for name, n, fix in (("train", meta["n_train"], f"lower data.val_fraction {larger}"),
                         ("val", meta["n_tokens"] - meta["n_train"],
                          f"raise data.val_fraction {larger}")):
        if n < T + 1:
            raise MinigptError(
                f"data.corpus: {where} gives a {name} split of {n} tokens, but "
                f"model.block_size={T} needs at least {T + 1}; lower model.block_size or {fix}")


def _read_meta(meta_path: Path, bin_path: Path, n_vocab: int) -> dict | None:
    """The cache's metadata if the cache is complete (None: missing or torn, rebuild it).
    A complete cache damaged in place (metadata of the wrong type, an id past the vocabulary)
    is a MinigptError naming the file: deleting it rebuilds it."""
    try:
        meta = parse_json(read_regular(meta_path, SMALL_CAP))
        itemsize = np.dtype(meta["dtype"]).itemsize
        with open_regular(bin_path) as fh:  # memory-mapped below: a regular file only
            if os.fstat(fh.fileno()).st_size != meta["n_tokens"] * itemsize:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    bpt, n_train = meta.get("bytes_per_token"), meta.get("n_train")
    damaged = (None if meta["dtype"] in ("uint16", "uint32") else f'dtype {shown(meta["dtype"])}')
    if not damaged and (type(bpt) not in (int, float) or not 0 < bpt < 1e6):
        damaged = f"bytes_per_token {shown(bpt)}"
    if not damaged and (type(n_train) is not int or not 0 <= n_train <= meta["n_tokens"]):
        damaged = f"n_train {shown(n_train)}"
    if not damaged:
        tokens = np.memmap(bin_path, dtype=np.dtype(meta["dtype"]), mode="r")
        top = max((int(tokens[i: i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24)),
                  default=0)
        del tokens
        damaged = f"token id {top}, past the tokenizer's {n_vocab}" if top >= n_vocab else None
    if damaged:
        raise MinigptError(f"the token cache {meta_path.with_suffix('')}.{{json,bin}} is damaged "
                           f"({damaged}); delete both files and run again to rebuild them")
    return meta


def _build(cut: CorpusSplit, dc: DataConfig, tokenizer: Tokenizer, bin_path: Path,
           emit: OnEvent, files: list[Path]) -> dict:
    """Stream-tokenize the training documents, then the validation documents, into `bin_path`
    (atomically) and return the cache metadata. A corpus without any text raises before the
    file is committed."""
    dtype = np.uint16 if tokenizer.n_vocab <= 2**16 else np.uint32
    n_files = len(files)
    done, has_text, counts = 0, False, []
    with atomic_file(bin_path) as fh:
        for part in (cut.train, cut.val):
            n_part, batch, batch_bytes = 0, [], 0
            for span in part:
                if span.start == 0:
                    emit(TokenizingFile(span.path, span.path.stat().st_size, span.index, n_files))
                for text, n, starts in iter_span(span, dc.text_field, dc.invalid_utf8):
                    batch.append((text, starts))
                    batch_bytes += n
                    done += n
                    has_text = has_text or (bool(text) and not text.isspace())
                    if batch_bytes >= _BATCH_BYTES:
                        n_part += _write(batch, tokenizer, dtype, fh)
                        batch, batch_bytes = [], 0
                        emit(CorpusProgress("tokenize", done, cut.total))
            n_part += _write(batch, tokenizer, dtype, fh)
            emit(CorpusProgress("tokenize", done, cut.total))
            counts.append(n_part)
        if not has_text:
            raise empty_corpus_error(dc.corpus, files, dc.text_field)
    n_train, n_val = counts
    # bytes_per_token on the val split, in blocks so a huge split is never copied whole.
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    lengths = tokenizer.token_byte_lengths()
    val_bytes = sum(int(lengths[tokens[i: i + (1 << 22)]].sum())
                    for i in range(n_train, n_train + n_val, 1 << 22))
    del tokens
    bpt = val_bytes / n_val if n_val and val_bytes else 1.0
    return {"dtype": np.dtype(dtype).name, "n_tokens": n_train + n_val, "n_train": n_train,
            "n_val": n_val, "val_bytes": val_bytes, "bytes_per_token": bpt,
            "n_files": n_files, "corpus_bytes": cut.total}


def _write(batch: list[tuple[str, bool]], tokenizer: Tokenizer, dtype, fh) -> int:
    """Encode the texts on tiktoken's threads and append their ids, `<|endoftext|>` before
    each one that starts a document; returns the number of ids written.

    Texts that start a document are joined into parts of about CHUNK_BYTES, `<|endoftext|>`
    before each, and encoded with it as the one special token: the same ids as one text at a
    time (tiktoken encodes the text between two specials on its own), without a thread
    hand-off per small record. A text that spells `<|endoftext|>` itself is encoded alone."""
    parts: list[list[str]] = []  # texts joined into one part
    alone: dict[int, bool] = {}  # part number -> starts a document, for a text encoded alone
    size = 0
    for text, starts in batch:
        if EOT in text:
            alone[len(parts)] = starts
            parts.append([text])
        elif starts and parts and len(parts) - 1 not in alone and size < CHUNK_BYTES:
            parts[-1].append(EOT + text)  # (characters; a bound on memory, not exact)
            size += len(text)
        else:
            parts.append([EOT + text if starts else text])
            size = len(text)
    joined = [i for i in range(len(parts)) if i not in alone]
    ids = dict(zip(joined, tokenizer.encode_batch(["".join(parts[i]) for i in joined],
                                                  eot_between=True)))
    ids.update(zip(alone, tokenizer.encode_batch([parts[i][0] for i in alone])))
    written = 0
    for i in range(len(parts)):  # in order; one array per part, no copy of the whole batch
        if alone.get(i):
            np.asarray([tokenizer.eot_id], dtype=dtype).tofile(fh)
            written += 1
        np.asarray(ids[i], dtype=dtype).tofile(fh)
        written += len(ids[i])
    return written
