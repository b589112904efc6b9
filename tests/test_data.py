"""Corpus pipeline: listing, streaming, the token cache, splits, batches, induction, bad input."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from minigpt.config import Config, ConfigError, MinigptError, from_dict
from minigpt.data.cache import Dataset, prepare_dataset
from minigpt.data.corpus import iter_pieces, list_corpus, records_digest, split_corpus
from minigpt.data.records import iter_records
from minigpt.data.rows import InductionRows, TokenRows, rows_for
from minigpt.data.tokenizer import EOT, Tokenizer, build_tokenizer, bytes_tokenizer
from minigpt.events import DatasetReady, TokenizingFile
from minigpt.paths import DATA_DIR
from minigpt.train.batches import to_device

SHAKESPEARE = (DATA_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))


def cfg_for(corpus, block_size=16, **data) -> Config:
    return from_dict({"model": {"block_size": block_size},
                      "tokenizer": {"vocab_size": 256},
                      "data": {"corpus": str(corpus), **data}})


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode("utf-8")
    path.write_bytes(content)
    return path


def prepare(cfg: Config, tok: Tokenizer | None = None, events: list | None = None) -> Dataset:
    return prepare_dataset(cfg, tok or bytes_tokenizer(),
                           events.append if events is not None else None)


def xy(rows: TokenRows | InductionRows, split: str, offsets: torch.Tensor):
    """The trainer's batch (x, y) of the rows at `offsets`, on the CPU."""
    return to_device(rows.rows(split, offsets), torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# Corpus listing and streaming.


def test_list_corpus_file_directory_and_glob(tmp_path):
    a = write(tmp_path / "d" / "b.txt", "b")
    b = write(tmp_path / "d" / "sub" / "a.txt", "a")
    c = write(tmp_path / "d" / "a.txt", "a")
    write(tmp_path / "d" / "notes.md", "ignored")
    assert list_corpus(str(a)) == [a]
    assert list_corpus(str(tmp_path / "d")) == [c, a, b]  # sorted by relative path
    assert list_corpus(str(tmp_path / "d" / "*.txt")) == [c, a]
    assert list_corpus(str(tmp_path / "d" / "**" / "*.txt")) == [c, a, b]


def test_bundled_corpus_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = list_corpus("data/tinyshakespeare.txt")
    assert files == [DATA_DIR / "tinyshakespeare.txt"]
    assert files[0].stat().st_size == 1_115_394


@pytest.mark.parametrize("chunk", [5, 7, 64, 300])
def test_iter_pieces_streams_the_exact_text(tmp_path, chunk):
    text = ("héllo wörld 日本語 👍🏽\n  indented\nno-newline-" + "é" * 40 + " end\n") * 5
    path = write(tmp_path / "t.txt", text)
    pieces = list(iter_pieces(path, chunk_bytes=chunk))
    assert "".join(t for t, _ in pieces) == text
    assert sum(n for _, n in pieces) == len(text.encode())
    assert len(pieces) > 1


def test_chunked_tokenization_equals_whole_text(tmp_path):
    tok = build_tokenizer(from_dict({"tokenizer": {"vocab_size": 300},
                                     "data": {"corpus": str(write(tmp_path / "s.txt",
                                                                  SHAKESPEARE[:50_000]))}}))
    path = write(tmp_path / "t.txt", SHAKESPEARE[:20_000])
    ids = [i for t, _ in iter_pieces(path, chunk_bytes=512) for i in tok.encode(t)]
    assert ids == tok.encode(SHAKESPEARE[:20_000])


# --------------------------------------------------------------------------------------------
# The token cache and the split.


def test_tokens_split_and_bytes_per_token(tmp_path):
    text = SHAKESPEARE[:10_000]
    path = write(tmp_path / "c.txt", text)
    events: list = []
    ds = prepare(cfg_for(path, val_fraction=0.25), events=events)
    at = text.index("\n", 7_500 - 1) + 1  # the first line start at or after the last quarter
    assert 7_500 < at < 7_600 and split_corpus([path], 0.25).at == at
    assert ds.train.tolist() == [256] + list(text[:at].encode())
    assert ds.val.tolist() == list(text[at:].encode())
    assert ds.train.dtype == np.uint16 and isinstance(ds.train, np.memmap)
    assert ds.bytes_per_token == 1.0
    assert isinstance(events[0], TokenizingFile) and events[0].n_bytes == 10_000
    assert isinstance(events[-1], DatasetReady) and not events[-1].cached


def test_bpe_bytes_per_token_is_measured_on_val(tmp_path):
    path = write(tmp_path / "c.txt", SHAKESPEARE[:60_000])
    cfg = from_dict({"model": {"block_size": 16}, "tokenizer": {"vocab_size": 350},
                     "data": {"corpus": str(path)}})
    tok = build_tokenizer(cfg)
    ds = prepare_dataset(cfg, tok)
    val_bytes = len(tok.decode(ds.val.tolist()).encode("utf-8"))
    assert ds.bytes_per_token == pytest.approx(val_bytes / len(ds.val))
    assert ds.bytes_per_token > 1.5


def _split_at(files: list[Path], val_fraction: float) -> int:
    """The byte split of text files written out from its definition (docs/data.md), by brute
    force."""
    data = [f.read_bytes() for f in files]
    corpus = b"".join(data)
    starts = {sum(map(len, data[:i])) for i in range(len(data))}
    target = len(corpus) - round(len(corpus) * val_fraction)
    for p in range(target, len(corpus)):
        if p in starts or corpus[p - 1:p] == b"\n":
            return p
    return next((p for p in range(target, len(corpus)) if corpus[p] & 0xC0 != 0x80), len(corpus))


@pytest.mark.parametrize("names, fraction", [
    (["one-line"], 0.1), (["lines"], 0.3), (["lines", "one-line"], 0.1), (["lines", "cjk"], 0.05),
    (["one-line", "lines"], 0.5), (["lines", "one-line"], 0.9), (["cjk"], 0.07),
    (["lines", "empty", "lines2"], 0.5)])
def test_byte_split_follows_its_definition(tmp_path, names, fraction):
    """Train = the corpus bytes before the split point, val = the rest, each file still after
    one <|endoftext|>; the point is where docs/data.md's definition puts it (a line start, a file
    start, or in a last file without a line break after the target, a character start)."""
    bodies = {"one-line": "no line break in here at all " * 20, "empty": "",
              "lines": "".join(f"line {i} of a few\n" for i in range(40)),
              "lines2": "".join(f"more {i}\n" for i in range(30)), "cjk": "日本語のテキスト" * 30}
    files = [write(tmp_path / "d" / f"{i}-{n}.txt", bodies[n]) for i, n in enumerate(names)]
    ds = prepare(cfg_for(tmp_path / "d", block_size=4, val_fraction=fraction))
    at = _split_at(files, fraction)
    assert split_corpus(files, fraction).at == at
    corpus = b"".join(f.read_bytes() for f in files)
    sizes = [len(f.read_bytes()) for f in files]
    starts = [sum(sizes[:i]) for i in range(len(files))]
    eot = EOT.encode()
    expect_train = b"".join(eot + corpus[s:min(at, s + n)]
                            for n, s in zip(sizes, starts) if s < at)
    expect_val = b"".join((eot if s >= at else b"") + corpus[max(s, at):s + n]
                          for n, s in zip(sizes, starts) if s + n > at or s >= at)
    tok = bytes_tokenizer()
    assert tok.decode(ds.train.tolist()).encode() == expect_train
    assert tok.decode(ds.val.tolist()).encode() == expect_val
    # val bytes per val token: an <|endoftext|> stands for no corpus byte
    assert ds.bytes_per_token == pytest.approx(len(corpus[at:]) / len(ds.val))


def test_bpe_split_tokenizes_each_side_separately(tmp_path):
    """With a BPE, no token straddles the split point: train decodes to exactly the training
    text and val to the validation text; bytes_per_token is the val text's bytes per token."""
    text = SHAKESPEARE[:60_000]
    path = write(tmp_path / "c.txt", text)
    cfg = from_dict({"model": {"block_size": 16}, "tokenizer": {"vocab_size": 400},
                     "data": {"corpus": str(path)}})
    tok = build_tokenizer(cfg)
    ds = prepare_dataset(cfg, tok)
    at = _split_at([path], 0.1)
    assert tok.decode(ds.train.tolist()) == EOT + text[:at]
    assert tok.decode(ds.val.tolist()) == text[at:]
    assert ds.val.tolist() == tok.encode(text[at:])
    assert ds.bytes_per_token == pytest.approx(len(text[at:].encode()) / len(ds.val))


def test_multiple_files_each_start_with_eot(tmp_path):
    write(tmp_path / "d" / "2.txt", "second file " * 10)
    write(tmp_path / "d" / "1.txt", f"first {EOT} file " * 10)
    ds = prepare(cfg_for(tmp_path / "d", block_size=8, val_fraction=0.1))
    full = np.concatenate([ds.train, ds.val]).tolist()
    assert full.count(256) == 2 and full[0] == 256  # the literal EOT text stays bytes
    text = bytes_tokenizer().decode(full)
    assert text == EOT + f"first {EOT} file " * 10 + EOT + "second file " * 10


def test_uint32_cache_for_large_vocabularies(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({bytes([a, b]): 256 + 256 * a + b for a in range(256) for b in range(256)})
    big = Tokenizer(ranks, bytes_tokenizer().pattern, {EOT: len(ranks)}, "big")
    assert big.n_vocab > 65536
    path = write(tmp_path / "c.txt", SHAKESPEARE[:4000])
    ds = prepare(cfg_for(path), big)
    assert ds.train.dtype == np.uint32
    assert big.decode(np.concatenate([ds.train, ds.val]).tolist()) == EOT + SHAKESPEARE[:4000]


def test_cache_reused_and_invalidated(tmp_path):
    path = write(tmp_path / "c.txt", SHAKESPEARE[:5000])
    events: list = []
    first = prepare(cfg_for(path), events=events)
    assert events[-1].cached is False
    first_cache = events[-1].cache_path
    events.clear()
    again = prepare(cfg_for(path), events=events)
    assert [type(e) for e in events] == [DatasetReady] and events[0].cached
    assert np.array_equal(again.val, first.val)

    def rebuilt(cfg, tok=None) -> Dataset:
        events.clear()
        ds = prepare(cfg, tok, events)
        assert events[-1].cached is False and events[-1].cache_path != first_cache
        return ds

    rebuilt(cfg_for(path, val_fraction=0.2))
    bpe_cfg = from_dict({"model": {"block_size": 16}, "tokenizer": {"vocab_size": 300},
                         "data": {"corpus": str(path)}})
    rebuilt(cfg_for(path), build_tokenizer(bpe_cfg))
    path.write_text(SHAKESPEARE[:5000].replace("First", "Second"))  # same size, new contents
    changed = rebuilt(cfg_for(path))
    assert not np.array_equal(np.concatenate([changed.train, changed.val]),
                              np.concatenate([first.train, first.val]))


def test_truncated_cache_is_rebuilt(tmp_path):
    path = write(tmp_path / "c.txt", SHAKESPEARE[:5000])
    events: list = []
    ds = prepare(cfg_for(path), events=events)
    cache = events[-1].cache_path
    del ds
    with open(cache, "r+b") as fh:
        fh.truncate(100)
    events.clear()
    ds = prepare(cfg_for(path), events=events)
    assert events[-1].cached is False and len(ds.train) + len(ds.val) == 5001


def test_split_is_deterministic(tmp_path):
    path = write(tmp_path / "c.txt", SHAKESPEARE[:8000])
    events: list = []
    a = prepare(cfg_for(path, cache_dir=str(tmp_path / "one")), events=events)
    b = prepare(cfg_for(path, cache_dir=str(tmp_path / "two")), events=events)
    ready = [e.cache_path for e in events if isinstance(e, DatasetReady)]
    assert len(ready) == 2 and ready[0] != ready[1]
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


# --------------------------------------------------------------------------------------------
# Batches.


def test_offsets_reproducible_from_generator_state(tmp_path):
    data = prepare(cfg_for(write(tmp_path / "c.txt", SHAKESPEARE[:20_000])))
    ds = TokenRows(data, 16)
    g = torch.Generator().manual_seed(123)
    ds.sample_offsets("train", 5, g)  # advance: the saved state is mid-run
    state = g.get_state()
    first = ds.sample_offsets("train", 64, g)
    g2 = torch.Generator()
    g2.set_state(state)
    assert torch.equal(ds.sample_offsets("train", 64, g2), first)
    assert first.dtype == torch.long and first.shape == (64,)
    assert int(first.min()) >= 0 and int(first.max()) <= len(data.train) - ds.block_size - 1
    x, y = xy(ds, "train", first)
    assert x.shape == y.shape == (64, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    o = int(first[0])
    assert x[0].tolist() == data.train[o: o + 16].tolist()
    assert y[0, -1].item() == data.train[o + 16]


def test_epoch_order_reads_every_window_once_per_epoch(tmp_path):
    """train.data_order epochs: within an epoch the rows are back-to-back windows at one phase,
    each once, in a shuffled order; the next epoch has its own phase and order; an offset is a
    function of (row number, seed), however the rows are asked for."""
    data = prepare(cfg_for(write(tmp_path / "c.txt", SHAKESPEARE[:20_000])))
    ds = TokenRows(data, 16)
    per_epoch = (len(data.train) - 16) // 16
    rows = ds.epoch_offsets(0, 3 * per_epoch, seed=7)
    assert int(rows.min()) >= 0 and int(rows.max()) <= len(data.train) - 16 - 1
    phases = []
    for e in range(3):
        epoch = rows[e * per_epoch:(e + 1) * per_epoch]
        phase = int(epoch.min())
        assert phase < 16 and sorted(epoch.tolist()) == [phase + 16 * j for j in range(per_epoch)]
        assert epoch.tolist() != sorted(epoch.tolist())  # shuffled
        phases.append((phase, epoch.tolist()))
    assert phases[0] != phases[1] != phases[2]
    pieces = torch.cat([ds.epoch_offsets(i, 5, seed=7) for i in range(0, 3 * per_epoch, 5)])
    assert torch.equal(pieces[:len(rows)], rows)  # asked in batches: the same rows
    assert not torch.equal(ds.epoch_offsets(0, per_epoch, seed=8), rows[:per_epoch])


def test_induction_batches_repeat(tmp_path):
    cfg = from_dict({"model": {"block_size": 32}, "tokenizer": {"vocab_size": 256},
                     "data": {"source": "induction", "induction_vocab": 20,
                              "corpus": str(tmp_path / "never-read.txt")}})
    ds = rows_for(cfg, bytes_tokenizer())
    assert ds.vocab == 20 and ds.bytes_per_token == 1.0
    g = torch.Generator().manual_seed(0)
    offsets = ds.sample_offsets("train", 8, g)
    x, y = xy(ds, "train", offsets)
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, :16], x[:, 16:])          # [r, r]
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, 0])
    assert int(x.min()) >= 0 and int(x.max()) < 20
    assert len({tuple(row) for row in x[:, :16].tolist()}) == 8
    x2, _ = xy(ds, "train", offsets)
    assert torch.equal(x, x2)                          # a function of the offsets
    xv, _ = xy(ds, "val", offsets)
    assert not torch.equal(x, xv)


def test_induction_odd_block_size():
    cfg = from_dict({"model": {"block_size": 9}, "tokenizer": {"vocab_size": 256},
                     "data": {"source": "induction", "induction_vocab": 5}})
    ds = rows_for(cfg, bytes_tokenizer())
    x, y = xy(ds, "val", ds.sample_offsets("val", 3, torch.Generator().manual_seed(1)))
    assert x.shape == y.shape == (3, 9)
    assert torch.equal(x[:, :4], x[:, 4:8]) and torch.equal(x[:, 8], x[:, 0])
    assert torch.equal(y[:, :8], x[:, 1:]) and torch.equal(y[:, 8], x[:, 1])


def _pair_lengths(row: list[int], lo: int, hi: int) -> list[int]:
    """Segment lengths of a pairs-layout row, parsed back: at each position the shortest n with
    row[pos+n : pos+2n] == row[pos : pos+n] that is in [lo, hi] or is the shortened last one."""
    lengths, pos = [], 0
    while (len(row) - pos) // 2 >= 2:
        rem = len(row) - pos
        n = next(n for n in range(2, rem // 2 + 1)
                 if (lo <= n <= hi or n == rem // 2)
                 and row[pos + n: pos + 2 * n] == row[pos: pos + n])
        lengths.append(n)
        pos += 2 * n
    return lengths


def test_induction_pairs_layout_defeats_fixed_offset_heads():
    """induction_min_period > 0: rows are back-to-back (segment, copy) pairs of varying lengths,
    so no single attention offset predicts the copies (a fixed-offset head is no induction)."""
    def batch(**data):
        cfg = from_dict({"model": {"block_size": 64}, "tokenizer": {"vocab_size": 256},
                         "data": {"source": "induction", "induction_vocab": 64, **data}})
        ds = rows_for(cfg, bytes_tokenizer())
        return xy(ds, "train", ds.sample_offsets("train", 64, torch.Generator()
                                                       .manual_seed(0)))

    x, y = batch(induction_min_period=4, induction_max_period=24)
    assert x.shape == (64, 64) and torch.equal(x[:, 1:], y[:, :-1])
    rows = torch.cat([x, y[:, -1:]], 1).tolist()  # the full block_size + 1 ids
    all_lengths = [_pair_lengths(r, 4, 24) for r in rows]
    assert all(sum(2 * n for n in ls) >= 62 for ls in all_lengths)  # tail of <= 3 random ids
    flat = [n for ls in all_lengths for n in ls]
    assert max(flat) <= 24 and len(set(flat)) > 10
    assert sum(len(set(ls)) > 1 for ls in all_lengths) > 32  # distances vary inside rows
    # copy targets: position t inside the copy of a pair; the best fixed offset d misses most
    targets = []
    for r, ls in zip(rows, all_lengths):
        pos = 0
        for n in ls:
            targets += [(r, t) for t in range(pos + n, pos + 2 * n)]
            pos += 2 * n
    best = max(sum(r[t] == r[t - d] for r, t in targets if t >= d) / len(targets)
               for d in range(1, 33))
    assert best < 0.3
    assert torch.equal(x, batch(induction_min_period=4, induction_max_period=24)[0])
    x0, _ = batch()  # min_period 0 keeps the classic [r, r]
    assert torch.equal(x0[:, :32], x0[:, 32:])


@pytest.mark.parametrize("block, min_period", [(32, 4), (33, 4), (32, 0), (9, 2)])
def test_induction_distinct_rows_repeat_only_inside_copies(block, min_period):
    """induction_distinct: the new ids of a row never repeat, so every repeated id is part of a
    copy: pairs rows parse into the same pairs, and each id occurs once per segment + copy."""
    def rows(distinct: bool) -> list[list[int]]:
        cfg = from_dict({"model": {"block_size": block}, "tokenizer": {"vocab_size": 256},
                         "data": {"source": "induction", "induction_vocab": 20,
                                  "induction_min_period": min_period,
                                  "induction_distinct": distinct}})
        ds = rows_for(cfg, bytes_tokenizer())
        x, y = xy(ds, "train", ds.sample_offsets("train", 200, torch.Generator()
                                                       .manual_seed(3)))
        assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 20
        return torch.cat([x, y[:, -1:]], 1).tolist()

    distinct, iid = rows(True), rows(False)
    half = block // 2
    for r in distinct:
        if min_period:
            lengths = _pair_lengths(r, min_period, half)
            new = [r[p] for p in _new_positions(lengths, len(r))]
            assert sum(2 * n for n in lengths) >= len(r) - 3
        else:
            assert r[half:2 * half] == r[:half]
            new = r[:half]
        assert len(set(new)) == len(new) == len(set(r))  # new ids all differ; nothing else new
    # without it, ids repeat by chance outside the copies in most rows (20 ids, 6-18 draws)
    chance = 0
    for r in iid:
        lengths = _pair_lengths(r, min_period, half) if min_period else [half]
        new = [r[p] for p in _new_positions(lengths, len(r))] if min_period else r[:half]
        chance += len(set(new)) < len(new)
    assert chance > len(iid) // 2


def _new_positions(lengths: list[int], row_len: int) -> list[int]:
    """Positions holding new ids in a pairs row: each segment's first copy, then the tail."""
    out, pos = [], 0
    for n in lengths:
        out += range(pos, pos + n)
        pos += 2 * n
    return out + list(range(pos, row_len))


def test_induction_distinct_needs_enough_ids():
    with pytest.raises(MinigptError, match=re.escape(
            "data.induction_distinct: a row of model.block_size=32 needs up to 18 distinct ids "
            "but data.induction_vocab is 17")):
        from_dict({"model": {"block_size": 32}, "tokenizer": {"vocab_size": 256}, "data": {
            "source": "induction", "induction_vocab": 17, "induction_distinct": True}})
    from_dict({"model": {"block_size": 32}, "tokenizer": {"vocab_size": 256}, "data": {
        "source": "induction", "induction_vocab": 18, "induction_distinct": True}})  # enough
    from_dict({"model": {"block_size": 32}, "tokenizer": {"vocab_size": 256},
               "data": {"source": "induction", "induction_vocab": 2}})  # unused when off


@pytest.mark.parametrize("data, msg", [
    ({"induction_min_period": 17}, "data.induction_min_period: 17 exceeds the longest segment"),
    ({"induction_min_period": 9, "induction_max_period": 8},
     "data.induction_min_period: 9 exceeds the longest segment (8"),
    ({"induction_max_period": 17}, "data.induction_max_period: 17 exceeds model.block_size//2=16"),
])
def test_induction_period_bounds_are_checked(data, msg):
    with pytest.raises(MinigptError, match=re.escape(msg)):
        from_dict({"model": {"block_size": 32}, "data": data})


# --------------------------------------------------------------------------------------------
# Bad input: one line, naming the file and the fix.


def _error(cfg: Config) -> str:
    with pytest.raises(MinigptError) as err:
        prepare(cfg)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_missing_path(tmp_path):
    msg = _error(cfg_for(tmp_path / "nope.txt"))
    assert "nope.txt" in msg and "not found" in msg


def test_directory_without_txt(tmp_path):
    write(tmp_path / "d" / "a.md", "x")
    assert "no corpus files" in _error(cfg_for(tmp_path / "d"))


def test_glob_matching_nothing(tmp_path):
    assert "matches no files" in _error(cfg_for(tmp_path / "*.txt"))


def test_dangling_symlink(tmp_path):
    os.symlink(tmp_path / "gone.txt", tmp_path / "link.txt")
    msg = _error(cfg_for(tmp_path / "link.txt"))
    assert "link.txt" in msg and "dangling symlink" in msg
    write(tmp_path / "d" / "ok.txt", SHAKESPEARE[:1000])
    os.symlink(tmp_path / "gone.txt", tmp_path / "d" / "bad.txt")
    assert "bad.txt" in _error(cfg_for(tmp_path / "d"))


@pytest.mark.parametrize("content", ["", "  \n\t\n   \r\n"])
def test_empty_or_whitespace_corpus(tmp_path, content):
    msg = _error(cfg_for(write(tmp_path / "empty.txt", content)))
    assert "empty.txt" in msg and "empty" in msg


def test_empty_corpus_when_training_bpe(tmp_path):
    path = write(tmp_path / "blank.txt", "\n\n  \n")
    cfg = from_dict({"tokenizer": {"vocab_size": 300}, "data": {"corpus": str(path)}})
    with pytest.raises(MinigptError, match="blank.txt.*empty"):
        build_tokenizer(cfg)


def test_split_too_short(tmp_path):
    path = write(tmp_path / "short.txt", "x" * 200)
    msg = _error(cfg_for(path, block_size=64, val_fraction=0.1))
    assert "short.txt" in msg and "val split of 20 tokens" in msg and "65" in msg
    assert "model.block_size" in msg and "data.val_fraction" in msg
    msg = _error(cfg_for(path, block_size=64, val_fraction=0.9))
    assert "train split of 21 tokens" in msg  # <|endoftext|> + the first 20 bytes


def test_invalid_utf8_names_offset_and_switch(tmp_path):
    good = "fine text\n" * 300  # 3000 bytes: the bad byte is past the first small chunk
    path = write(tmp_path / "latin1.txt", good.encode() + "café\n".encode("latin-1") + b"ok\n")
    msg = _error(cfg_for(path))
    assert "latin1.txt" in msg and f"byte offset {3000 + 3}" in msg
    assert "data.invalid_utf8: replace" in msg
    list(iter_pieces(path, chunk_bytes=64, invalid_utf8="replace"))
    with pytest.raises(MinigptError, match=f"offset {3003}"):
        list(iter_pieces(path, chunk_bytes=64))
    ds = prepare(cfg_for(path, invalid_utf8="replace"))
    text = bytes_tokenizer().decode(np.concatenate([ds.train, ds.val]).tolist())
    assert text.endswith("caf\ufffd\nok\n")


def test_binary_file_rejected(tmp_path):
    path = write(tmp_path / "model.bin", b"PK\x03\x04\x00\x00binary" * 10)
    msg = _error(cfg_for(path))
    assert "model.bin" in msg and "binary" in msg


# --------------------------------------------------------------------------------------------
# Record files: JSON Lines and Parquet, one document per record (docs/data.md).

RECORD_SUFFIXES = [".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet"]


def paragraphs(n: int, offset: int = 0) -> list[str]:
    """n multi-line documents: Shakespeare's speeches, each ending with a line break."""
    return [p + "\n" for p in SHAKESPEARE.split("\n\n")[offset: offset + n]]


def write_records(path: Path, rows: list, field: str = "text", row_group: int = 7) -> Path:
    """Records {"id": i, field: value} as JSON Lines (gzipped for .gz) or Parquet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        schema = pa.schema([("id", pa.int64()), (field, pa.string())])
        pq.write_table(pa.table({"id": list(range(len(rows))), field: rows}, schema=schema),
                       path, row_group_size=row_group)
        return path
    body = "".join(json.dumps({"id": i, field: r}) + "\n" for i, r in enumerate(rows)).encode()
    path.write_bytes(gzip.compress(body) if path.suffix == ".gz" else body)
    return path


def bpe_cfg(corpus, **data) -> Config:
    return from_dict({"model": {"block_size": 8}, "tokenizer": {"vocab_size": 300},
                      "data": {"corpus": str(corpus), **data}})


@pytest.mark.parametrize("suffix", RECORD_SUFFIXES)
def test_records_give_the_tokens_of_the_same_texts(tmp_path, suffix):
    """Each record is one document, as each .txt file is: one-line documents as JSON Lines or
    Parquet give the same BPE and the same train and val tokens as one .txt file each."""
    docs = [line + "\n" for line in SHAKESPEARE.splitlines()[:300] if line.strip()]
    for i, doc in enumerate(docs):
        write(tmp_path / "txt" / f"{i:04d}.txt", doc)
    records = write_records(tmp_path / f"corpus{suffix}", docs)
    (tok_t, ds_t), (tok_r, ds_r) = [(tok, prepare_dataset(cfg, tok)) for cfg in
                                    (bpe_cfg(tmp_path / "txt"), bpe_cfg(records))
                                    for tok in [build_tokenizer(cfg)]]
    assert tok_r.hash == tok_t.hash
    assert ds_r.train.tolist() == ds_t.train.tolist() and ds_r.val.tolist() == ds_t.val.tolist()
    assert ds_r.bytes_per_token == ds_t.bytes_per_token
    every = np.concatenate([ds_r.train, ds_r.val]).tolist()
    assert every.count(tok_r.eot_id) == len(docs) and len(ds_r.val) > 0


def _first_val_doc(docs: list[str], fraction: float) -> int:
    """The document rule of docs/data.md by brute force: the first document starting at or
    after the target (not at the very end), else the one holding the target byte."""
    sizes = [len(d.encode()) for d in docs]
    total = sum(sizes)
    target = total - round(total * fraction)
    starts = [sum(sizes[:i]) for i in range(len(docs))]
    return next((i for i, s in enumerate(starts) if target <= s < total),
                next(i for i, (s, n) in enumerate(zip(starts, sizes)) if s <= target < s + n))


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.3, 0.5])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_records_hold_out_whole_documents(tmp_path, suffix, fraction):
    """The split point is a document start: train is the documents before it, val the rest,
    each after one <|endoftext|>; non-ASCII and empty documents count by their UTF-8 bytes."""
    docs = paragraphs(30) + ["", "日本語のテキスト\n" * 20] + paragraphs(10, 30)
    path = write_records(tmp_path / f"c{suffix}", docs)
    k = _first_val_doc(docs, fraction)
    split = split_corpus([path], fraction)
    assert split.at == sum(len(d.encode()) for d in docs[:k])
    assert split.total == sum(len(d.encode()) for d in docs)
    ds = prepare(cfg_for(path, block_size=4, val_fraction=fraction))
    tok = bytes_tokenizer()
    assert tok.decode(ds.train.tolist()) == "".join(EOT + d for d in docs[:k])
    assert tok.decode(ds.val.tolist()) == "".join(EOT + d for d in docs[k:])
    assert ds.bytes_per_token == pytest.approx((split.total - split.at) / len(ds.val))


def test_a_last_document_over_the_fraction_is_validation_whole(tmp_path):
    """No document starts after the target: the last document, which holds it, is held out
    whole (more than val_fraction); a text file would be cut at a line start instead."""
    docs = paragraphs(5) + ["".join(paragraphs(40, 5))]
    path = write_records(tmp_path / "c.jsonl", docs)
    ds = prepare(cfg_for(path, block_size=4, val_fraction=0.1))
    assert bytes_tokenizer().decode(ds.val.tolist()) == EOT + docs[-1]
    assert len(ds.val) > 0.5 * (len(ds.train) + len(ds.val))


def test_a_directory_mixes_formats_in_path_order(tmp_path):
    pytest.importorskip("pyarrow")
    d = tmp_path / "d"
    write(d / "a.txt", "a text file\nof two lines\n")
    write_records(d / "b.jsonl", ["one\n", "two\n"])
    write_records(d / "c" / "d.parquet", ["three\n"])
    write_records(d / "e.json.gz", ["four\n", "five\n"])
    write(d / "notes.md", "not a corpus file")
    write(d / "tokenizer.json", "{}")  # a plain .json is read when named, not from a directory
    assert [p.name for p in list_corpus(str(d))] == ["a.txt", "b.jsonl", "d.parquet",
                                                      "e.json.gz"]
    ds = prepare(cfg_for(d, block_size=4, val_fraction=0.2))
    text = bytes_tokenizer().decode(np.concatenate([ds.train, ds.val]).tolist())
    assert text == "".join(EOT + t for t in ["a text file\nof two lines\n", "one\n", "two\n",
                                             "three\n", "four\n", "five\n"])
    # 50 bytes, target 50 - 10: "four" starts at byte 40
    assert bytes_tokenizer().decode(ds.val.tolist()) == EOT + "four\n" + EOT + "five\n"


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".parquet"])
def test_iter_records_reads_a_range(tmp_path, suffix):
    """Records [start, end): Parquet row groups outside the range are skipped, blank JSON
    Lines lines are not records."""
    docs = [f"doc {i}\n" for i in range(40)]
    path = write_records(tmp_path / f"c{suffix}", docs, row_group=6)
    if suffix == ".jsonl":  # blank lines (the end of a file, a stray one) are not records
        path.write_bytes(path.read_bytes().replace(b"\n", b"\n\n", 3) + b"\n  \n")
    assert [t for t, _ in iter_records(path, "text")] == docs
    assert [t for t, _ in iter_records(path, "text", start=5, end=13)] == docs[5:13]
    assert [n for _, n in iter_records(path, "text", start=38)] == [7, 7]


def test_json_lines_stream_in_bounded_memory(tmp_path):
    """Reading a 24 MB JSON Lines corpus holds a few records at a time, never the file."""
    doc = json.dumps({"text": SHAKESPEARE[:3000]}) + "\n"
    path = tmp_path / "big.jsonl"
    with open(path, "w") as fh:
        fh.writelines(doc for _ in range(8000))
    assert path.stat().st_size > 24e6
    tracemalloc.start()
    try:
        n = sum(1 for _ in iter_records(path, "text"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 8000 and peak < 2e6


def test_token_cache_keys_on_the_texts(tmp_path):
    """Editing a record's text re-tokenizes; a change outside the text field (another field,
    the JSON formatting) keeps the cache, since the tokens are the same."""
    docs = paragraphs(20)
    path = write_records(tmp_path / "c.jsonl", docs)
    events: list = []
    first = prepare(cfg_for(path), events=events)
    path.write_text("".join(json.dumps({"text": d, "source": "x"}, indent=None,
                                       separators=(", ", " : ")) + "\n" for d in docs))
    events.clear()
    again = prepare(cfg_for(path), events=events)
    assert events[-1].cached and np.array_equal(again.train, first.train)
    write_records(path, docs[:3] + [docs[3].upper()] + docs[4:])  # the same length
    events.clear()
    edited = prepare(cfg_for(path), events=events)
    assert not events[-1].cached and not np.array_equal(edited.train, first.train)


def test_text_field_names_the_field(tmp_path):
    path = write_records(tmp_path / "c.jsonl", paragraphs(20), field="content")
    ds = prepare(cfg_for(path, text_field="content"))
    assert bytes_tokenizer().decode(ds.train.tolist()).startswith(EOT + paragraphs(1)[0])
    with pytest.raises(MinigptError, match="data.text_field: must not be empty"):
        cfg_for(path, text_field=" ")


# --------------------------------------------------------------------------------------------
# Record files: bad input is one line naming the file and the line or row, and nothing is
# cached (neither tokens nor a BPE).


def _parquet(path: Path, **columns) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=4)
    return path


def _bad_records(tmp: Path, case: str) -> Path:
    good = [json.dumps({"id": i, "text": d}) for i, d in enumerate(paragraphs(3))]
    lines = {
        "not-json": good + ["this is plain text"],
        "array": good[:1] + ['["a", "list"]'],
        "no-field": good[:1] + ['{"id": 1, "body": "the text is here"}'],
        "null": good[:1] + ['{"text": null}'],
        "number": good[:1] + ['{"text": 42}'],
        "surrogate": good[:1] + ['{"text": "half a pair \\ud800 here"}'],
        "blank-only": ["", "   ", ""],
        "whitespace-texts": ['{"text": ""}', '{"text": "  \\n "}'],
    }
    if case in lines:
        return write(tmp / "c.jsonl", "\n".join(lines[case]) + "\n")
    if case == "latin1":
        return write(tmp / "c.jsonl", ("\n".join(good[:1]) + "\n").encode()
                     + '{"text": "café"}\n'.encode("latin-1"))
    if case == "plain-text-jsonl":
        return write(tmp / "notes.jsonl", SHAKESPEARE[:2000])
    if case == "truncated-gz":
        body = gzip.compress(("\n".join(good * 50) + "\n").encode())
        return write(tmp / "c.jsonl.gz", body[: len(body) // 2])
    texts = paragraphs(10)
    if case == "pq-no-column":
        return _parquet(tmp / "c.parquet", id=list(range(10)), body=texts)
    if case == "pq-not-strings":
        return _parquet(tmp / "c.parquet", text=list(range(10)))
    if case == "pq-null":
        return _parquet(tmp / "c.parquet", text=texts[:9] + [None])
    if case == "pq-garbage":
        return write(tmp / "c.parquet", b"PAR1" + b"\x00not parquet at all" * 50)
    if case == "pq-truncated":
        path = _parquet(tmp / "c.parquet", text=texts)
        return write(path, path.read_bytes()[:-30])
    if case == "pq-damaged-page":  # the footer is fine, a page of row group 1 is not
        path = _parquet(tmp / "c.parquet", text=texts)
        import pyarrow.parquet as pq

        at = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset + 2
        data = bytearray(path.read_bytes())
        data[at: at + 8] = bytes(b ^ 0xFF for b in data[at: at + 8])
        return write(path, bytes(data))
    raise AssertionError(case)


BAD_RECORDS = [
    ("not-json", ["c.jsonl: line 4 is not JSON", "one JSON object per line"]),
    ("array", ["c.jsonl: line 2 is a JSON array, not an object"]),
    ("no-field", ['c.jsonl: line 2 has no "text" field (its fields: "id", "body")',
                  "data.text_field"]),
    ("null", ['c.jsonl: line 2: "text" is null, not a string']),
    ("number", ['c.jsonl: line 2: "text" is number, not a string']),
    ("surrogate", ["c.jsonl: line 2", "lone surrogate", "data.invalid_utf8: replace"]),
    ("latin1", ["c.jsonl: line 2 is not valid UTF-8", "data.invalid_utf8: replace"]),
    ("plain-text-jsonl", ["notes.jsonl: line 1 is not JSON"]),
    ("truncated-gz", ["c.jsonl.gz: cannot read it after line"]),
    ("blank-only", ["c.jsonl holds no text"]),
    ("whitespace-texts", ["c.jsonl holds no text", '"text"']),
    ("pq-no-column", ['c.parquet: no column "text" (its columns: "id", "body")',
                      "data.text_field"]),
    ("pq-not-strings", ['c.parquet: column "text" holds int64, not strings']),
    ("pq-null", ['c.parquet: row 9: "text" is null']),
    ("pq-garbage", ["c.parquet: not a readable Parquet file"]),
    ("pq-truncated", ["c.parquet: not a readable Parquet file"]),
    ("pq-damaged-page", ["c.parquet: row group 1 (rows 4-7) cannot be read", "damaged"]),
]


@pytest.mark.parametrize("case, needles", BAD_RECORDS, ids=[c for c, _ in BAD_RECORDS])
def test_bad_records_fail_in_one_line_and_cache_nothing(tmp_path, case, needles):
    path = _bad_records(tmp_path / "in", case)
    cache = tmp_path / "cache"
    for call in (lambda: build_tokenizer(bpe_cfg(path, cache_dir=str(cache))),
                 lambda: prepare(cfg_for(path, cache_dir=str(cache)))):
        with pytest.raises(MinigptError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and all(n in msg for n in needles), msg
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_replace_mends_bad_utf8_in_records(tmp_path):
    path = _bad_records(tmp_path, "latin1")
    ds = prepare(cfg_for(path, block_size=4, invalid_utf8="replace"))
    assert bytes_tokenizer().decode(ds.val.tolist()) == EOT + "caf\ufffd"
    path = _bad_records(tmp_path / "s", "surrogate")
    ds = prepare(cfg_for(path, block_size=4, invalid_utf8="replace"))
    assert bytes_tokenizer().decode(ds.val.tolist()) == EOT + "half a pair \ufffd here"


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "c.parquet", text=paragraphs(10))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(MinigptError, match=re.escape("pip install 'minigpt-lab[parquet]'")):
        prepare(cfg_for(path))


# --------------------------------------------------------------------------------------------
# Through the installed command: a run trains from records as it does from text files (the
# quick tier checks the tokens: test_records_give_the_tokens_of_the_same_texts).

MINIGPT = shutil.which("minigpt")


@pytest.mark.slow
@pytest.mark.skipif(MINIGPT is None, reason="the minigpt console script is not installed")
def test_a_run_trains_from_json_lines_and_parquet_as_from_text(tmp_path):
    """The same one-line documents as .txt files, a .jsonl and a .parquet: `minigpt train`
    reports the same token counts and logs the same losses, step for step."""
    pytest.importorskip("pyarrow")
    docs = [line + "\n" for line in SHAKESPEARE.splitlines()[:400] if line.strip()]
    for i, doc in enumerate(docs):
        write(tmp_path / "txt" / f"{i:05d}.txt", doc)
    corpora = {"txt": tmp_path / "txt", "jsonl": write_records(tmp_path / "c.jsonl", docs),
               "parquet": write_records(tmp_path / "c.parquet", docs, row_group=100)}
    sets = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
            "tokenizer.vocab_size": 256, "train.batch_size": 4, "train.max_steps": 4,
            "train.warmup_steps": 1, "train.eval_interval": 2, "train.eval_batches": 1,
            "train.log_interval": 1, "train.sample_tokens": 0, "train.head_scores_interval": "off"}
    logs, data_lines = {}, {}
    for name, corpus in corpora.items():
        argv = [MINIGPT, "train", "--out", str(tmp_path / "runs" / name),
                "--set", f"data.corpus={corpus}"]
        argv += [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                           check=False,
                           env={**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache" / name)})
        assert r.returncode == 0, r.stderr
        data_lines[name] = [x for x in r.stderr.splitlines() if " train / " in x]
        metrics = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        logs[name] = [(m["step"], m.get("loss"), m.get("val_loss"))
                      for m in map(json.loads, metrics)]
    assert len(logs["txt"]) >= 6 and data_lines["txt"]
    assert logs["jsonl"] == logs["txt"] and logs["parquet"] == logs["txt"]
    assert data_lines["jsonl"] == data_lines["txt"] == data_lines["parquet"]


@pytest.mark.parametrize("fraction, at", [(0.4, 65), (0.6, 40), (0.3, 65)])
def test_the_worked_example_of_docs_data_md(tmp_path, fraction, at):
    docs = ["a" * 39 + "\n", "b" * 24 + "\n", "c" * 34 + "\n"]  # 40, 25 and 35 bytes
    path = write_records(tmp_path / "c.jsonl", docs)
    split = split_corpus([path], fraction)
    assert (split.total, split.at) == (100, at)
    assert split_corpus([DATA_DIR / "tinyshakespeare.txt"], 0.1).at == 1_003_856


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_digest_of_the_first_records_equals_a_file_of_them(tmp_path, suffix):
    """records_digest of records [0, k) (the BPE's key when the split falls in that file) is
    the digest of a file holding only those records, across the scan's snapshot blocks."""
    docs = [f"record {i} " * (i % 5) for i in range(2600)]
    path = write_records(tmp_path / f"all{suffix}", docs, row_group=500)
    for k in (0, 1, 1023, 1024, 1025, 2048, 2599, 2600):
        part = write_records(tmp_path / f"first-{k}{suffix}", docs[:k], row_group=500)
        assert records_digest(path, "text", "error", 0, k) == \
            records_digest(part, "text", "error", 0, k), k


def test_special_token_text_in_a_record_stays_text(tmp_path):
    """Small records are encoded together, `<|endoftext|>` between them; a record that spells
    `<|endoftext|>` (or another tokenizer's special token) still gets its characters' ids."""
    docs = ["plain one\n", f"spells {EOT} inside\n", "<|fim_prefix|> too\n", "last\n"] * 20
    path = write_records(tmp_path / "c.jsonl", docs)
    cfg = bpe_cfg(path, val_fraction=0.3)
    tok = build_tokenizer(cfg)
    ds = prepare_dataset(cfg, tok)
    every = np.concatenate([ds.train, ds.val]).tolist()
    assert every.count(tok.eot_id) == len(docs)
    expected = [i for d in docs for i in [tok.eot_id, *tok.encode(d)]]
    assert every == expected


# --------------------------------------------------------------------------------------------
# Bounded reads of record files and caches (issue 32).


def test_gzip_records_are_bounded_per_line_and_report_compressed_progress(tmp_path, monkeypatch):
    """A line past MAX_RECORD_BYTES is one error, read no further than the cap; a run of
    blank lines is skipped at C speed, line numbers kept; progress counts the compressed
    bytes read, up to the file's size."""
    import minigpt.data.records as rec
    from minigpt.data.corpus import scan_records

    monkeypatch.setattr(rec, "MAX_RECORD_BYTES", 1 << 20)
    long = tmp_path / "long.jsonl.gz"
    with gzip.open(long, "wb") as fh:
        fh.write(b'{"text": "ok"}\n{"text": "' + b"a" * (3 << 20) + b'"}\n')
    with pytest.raises(MinigptError, match=r"long.jsonl.gz: line 2 is longer than 1 MiB"):
        list(iter_records(long, "text"))
    blank = tmp_path / "blank.jsonl.gz"
    with gzip.open(blank, "wb") as fh:
        fh.write(b'{"text": "first"}\n' + b"\n" * (8 << 20) + b'  {"text": "last"}')
    seen: list[int] = []
    scan = scan_records(blank, "text", "error", seen.append)
    assert scan.n_docs == 2
    assert [w for _, w in rec._jsonl(blank, "text", "error", 0, None)] == [
        "line 1", f"line {(8 << 20) + 2}"]
    assert seen == sorted(seen) and len(seen) > 8 and seen[-1] == blank.stat().st_size


def test_a_parquet_file_with_two_text_columns_is_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "two.parquet"
    pq.write_table(pa.table([pa.array(["x"]), pa.array(["y"])], names=["text", "text"]), path)
    with pytest.raises(MinigptError, match='two.parquet: 2 columns are named "text"'):
        list(iter_records(path, "text"))


def _tiny_data(tmp_path: Path, **over) -> Config:
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    return from_dict({"data": {"corpus": str(corpus), "cache_dir": str(tmp_path / "cache"),
                               "val_fraction": 0.1}, "tokenizer": {"vocab_size": 256},
                      "model": {"block_size": 16, **over}})


def test_a_token_cache_damaged_in_place_is_one_line(tmp_path):
    cfg = _tiny_data(tmp_path)
    tok = build_tokenizer(cfg)
    prepare_dataset(cfg, tok)
    (meta,) = (tmp_path / "cache" / "tokens").glob("*.json")
    good = meta.read_text()
    for key, value, needle in (("bytes_per_token", "x", "bytes_per_token x"),
                               ("bytes_per_token", 0, "bytes_per_token 0"),
                               ("n_train", -3, "n_train -3")):
        meta.write_text(json.dumps({**json.loads(good), key: value}))
        with pytest.raises(MinigptError, match=re.escape(needle)):
            prepare_dataset(cfg, tok)
    meta.write_text(good)
    bin_ = meta.with_suffix(".bin")
    data = bytearray(bin_.read_bytes())
    data[:4] = b"\xff" * 4
    bin_.write_bytes(bytes(data))
    with pytest.raises(MinigptError, match="token id 65535, past the tokenizer's 257"):
        prepare_dataset(cfg, tok)


def test_a_split_too_short_for_the_context_is_not_cached(tmp_path):
    cfg = _tiny_data(tmp_path, block_size=1000)
    with pytest.raises(MinigptError, match="model.block_size=1000"):
        prepare_dataset(cfg, build_tokenizer(cfg))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_a_file_named_like_a_glob_is_that_file_and_unlisted_subdirectories_are_errors(tmp_path):
    weird = tmp_path / "we[ir]d.txt"
    weird.write_text("hello\n")
    assert list_corpus(str(weird)) == [weird]
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("a\n")
    assert list_corpus(str(d)) == [d / "a.txt"]
    if os.geteuid() == 0:
        pytest.skip("root lists any directory; tests/test_file_door.py drops the capability")
    (d / "sub").chmod(0)
    try:
        with pytest.raises(MinigptError, match="cannot list .*sub"):
            list_corpus(str(d))
    finally:
        (d / "sub").chmod(0o755)


@pytest.mark.parametrize("min_period", [4, 0])
def test_induction_groups_a_new_id_follows_the_id_two_places_before(min_period):
    """induction_groups = 2: every new id after the first two is low (< vocab/2) or high as the
    fixed group of the id two places before it says; copies stay copies, and new ids stay
    distinct. Without it the group of a new id is a coin toss."""
    def rows(groups: int):
        cfg = from_dict({"model": {"block_size": 24}, "tokenizer": {"vocab_size": 256},
                         "data": {"source": "induction", "induction_vocab": 64,
                                  "induction_min_period": min_period,
                                  "induction_distinct": True, "induction_groups": groups}})
        ds = rows_for(cfg, bytes_tokenizer())
        x, y = xy(ds, "train", ds.sample_offsets("train", 100, torch.Generator().manual_seed(5)))
        return ds, torch.cat([x, y[:, -1:]], 1).tolist()

    def follows(ds, rs) -> tuple[int, int]:
        hits = total = 0
        for r in rs:
            lengths = _pair_lengths(r, min_period, 12) if min_period else [12]
            new = _new_positions(lengths, len(r)) if min_period else range(12)
            assert len({r[p] for p in new}) == len(new) == len(set(r))
            for p in new:
                if p >= 2:
                    total += 1
                    hits += (r[p] >= 32) == ds.pick[r[p - 2]]
        return hits, total

    ds, on = rows(2)
    assert sum(ds.pick) == 32  # one fixed group per id, as many ids pick each
    hits, total = follows(ds, on)
    assert total > 500 and hits == total
    hits, total = follows(*rows(0))
    assert 0.4 < hits / total < 0.6


def _blocks(row: list[int]) -> list[tuple[int, int]]:
    """(id, length) of each maximal stretch of one id."""
    out: list[tuple[int, int]] = []
    for v in row:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((v, 1))
    return out


@pytest.mark.parametrize("groups", [0, 2])
def test_induction_runs_are_pairs_of_one_id_and_the_only_immediate_repeats(groups):
    """induction_runs: a pair is, with the given chance, one new id written 2n times (n >= the
    shortest segment), the only place an id follows itself (ids stay distinct otherwise); with
    0 no id ever follows itself, with 1 a row is runs and a short tail."""
    def rows(runs: float) -> list[list[int]]:
        cfg = from_dict({"model": {"block_size": 24}, "tokenizer": {"vocab_size": 256},
                         "data": {"source": "induction", "induction_vocab": 64,
                                  "induction_min_period": 2, "induction_distinct": True,
                                  "induction_groups": groups, "induction_runs": runs}})
        ds = rows_for(cfg, bytes_tokenizer())
        x, y = xy(ds, "train", ds.sample_offsets("train", 200, torch.Generator().manual_seed(3)))
        return torch.cat([x, y[:, -1:]], 1).tolist()

    assert all(n == 1 for r in rows(0.0) for _, n in _blocks(r))
    some = rows(0.25)
    runs = [(v, n) for r in some for v, n in _blocks(r) if n > 1]
    assert len(runs) > 50 and all(n % 2 == 0 and n >= 4 for _, n in runs)
    for r in some:  # an id in a run appears nowhere else in its row
        assert all(r.count(v) == n for v, n in _blocks(r) if n > 1)
    share = sum(1 for r in some for _, n in _blocks(r) if n > 1) / len(some)
    assert 0.3 < share < 1.5  # ~4 pairs a row, a quarter of them runs
    for r in rows(1.0):
        blocks = _blocks(r)
        assert all(n >= 4 for _, n in blocks[:-3]) and sum(n for _, n in blocks if n > 1) >= 21


def test_induction_runs_need_the_pairs_layout():
    with pytest.raises(ConfigError, match=re.escape(
            "data.induction_runs: 0.5 needs the pairs layout")):
        from_dict({"model": {"block_size": 24}, "tokenizer": {"vocab_size": 256}, "data": {
            "source": "induction", "induction_min_period": 0, "induction_runs": 0.5}})


def test_epoch_order_needs_a_corpus():
    with pytest.raises(ConfigError, match=re.escape(
            "train.data_order: epochs reads a corpus epoch by epoch, but data.source induction")):
        from_dict({"tokenizer": {"vocab_size": 256}, "train": {"data_order": "epochs"},
                   "data": {"source": "induction"}})
