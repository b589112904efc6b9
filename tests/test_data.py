"""Corpus pipeline: listing, streaming, the token cache, splits, batches, induction, bad input."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from minigpt.config import Config, MinigptError, from_dict
from minigpt.corpus import iter_pieces, list_corpus
from minigpt.data import Dataset, prepare_dataset
from minigpt.events import DatasetReady, TokenizingFile
from minigpt.paths import DATA_DIR
from minigpt.tokenizer import EOT, Tokenizer, build_tokenizer, bytes_tokenizer

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
    assert 7_500 < at < 7_600 and ds.info["split_at_byte"] == at and ds.split == "bytes"
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
    """The byte split written out from its definition (README, corpus.py), by brute force."""
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
    one <|endoftext|>; the point is where the README's definition puts it (a line start, a file
    start, or in a last file without a line break after the target, a character start)."""
    bodies = {"one-line": "no line break in here at all " * 20, "empty": "",
              "lines": "".join(f"line {i} of a few\n" for i in range(40)),
              "lines2": "".join(f"more {i}\n" for i in range(30)), "cjk": "日本語のテキスト" * 30}
    files = [write(tmp_path / "d" / f"{i}-{n}.txt", bodies[n]) for i, n in enumerate(names)]
    ds = prepare(cfg_for(tmp_path / "d", block_size=4, val_fraction=fraction))
    at = _split_at(files, fraction)
    assert ds.info["split_at_byte"] == at
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


def test_token_split_of_old_runs_is_kept(tmp_path):
    """split="tokens" (runs made before the byte split): the whole corpus in one token stream,
    the last round(n * val_fraction) tokens are val; it has its own cache entry."""
    text = SHAKESPEARE[:10_000]
    path = write(tmp_path / "c.txt", text)
    old = prepare_dataset(cfg_for(path, val_fraction=0.25), bytes_tokenizer(), split="tokens")
    full = [256] + list(text.encode())
    assert old.split == "tokens" and old.info["split_at_byte"] is None
    assert old.train.tolist() == full[:-round(len(full) * 0.25)]
    assert old.val.tolist() == full[-round(len(full) * 0.25):]
    new = prepare(cfg_for(path, val_fraction=0.25))
    assert new.info["cache"] != old.info["cache"] and len(new.val) != len(old.val)
    with pytest.raises(MinigptError, match="unknown data split 'lines'.*newer minigpt"):
        prepare_dataset(cfg_for(path), bytes_tokenizer(), split="lines")


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
    events.clear()
    again = prepare(cfg_for(path), events=events)
    assert [type(e) for e in events] == [DatasetReady] and events[0].cached
    assert np.array_equal(again.val, first.val)

    def rebuilt(cfg, tok=None) -> Dataset:
        events.clear()
        ds = prepare(cfg, tok, events)
        assert events[-1].cached is False and events[-1].cache_path != first.info["cache"]
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
    ds = prepare(cfg_for(path))
    cache = Path(ds.info["cache"])
    del ds
    with open(cache, "r+b") as fh:
        fh.truncate(100)
    events: list = []
    ds = prepare(cfg_for(path), events=events)
    assert events[-1].cached is False and len(ds.train) + len(ds.val) == 5001


def test_split_is_deterministic(tmp_path):
    path = write(tmp_path / "c.txt", SHAKESPEARE[:8000])
    a = prepare(cfg_for(path, cache_dir=str(tmp_path / "one")))
    b = prepare(cfg_for(path, cache_dir=str(tmp_path / "two")))
    assert a.info["cache"] != b.info["cache"]
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


# --------------------------------------------------------------------------------------------
# Batches.


def test_offsets_reproducible_from_generator_state(tmp_path):
    ds = prepare(cfg_for(write(tmp_path / "c.txt", SHAKESPEARE[:20_000])))
    g = torch.Generator().manual_seed(123)
    ds.sample_offsets("train", 5, g)  # advance: the saved state is mid-run
    state = g.get_state()
    first = ds.sample_offsets("train", 64, g)
    g2 = torch.Generator()
    g2.set_state(state)
    assert torch.equal(ds.sample_offsets("train", 64, g2), first)
    assert first.dtype == torch.long and first.shape == (64,)
    assert int(first.min()) >= 0 and int(first.max()) <= len(ds.train) - ds.block_size - 1
    x, y = ds.get_batch("train", first, "cpu")
    assert x.shape == y.shape == (64, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    o = int(first[0])
    assert x[0].tolist() == ds.train[o: o + 16].tolist()
    assert y[0, -1].item() == ds.train[o + 16]


def test_induction_batches_repeat(tmp_path):
    cfg = from_dict({"model": {"block_size": 32}, "tokenizer": {"vocab_size": 256},
                     "data": {"source": "induction", "induction_vocab": 20,
                              "corpus": str(tmp_path / "never-read.txt")}})
    ds = prepare_dataset(cfg, bytes_tokenizer())
    assert ds.source == "induction" and ds.bytes_per_token == 1.0
    g = torch.Generator().manual_seed(0)
    offsets = ds.sample_offsets("train", 8, g)
    x, y = ds.get_batch("train", offsets)
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(x[:, :16], x[:, 16:])          # [r, r]
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, -1], x[:, 0])
    assert int(x.min()) >= 0 and int(x.max()) < 20
    assert len({tuple(row) for row in x[:, :16].tolist()}) == 8
    x2, _ = ds.get_batch("train", offsets)
    assert torch.equal(x, x2)                          # a function of the offsets
    xv, _ = ds.get_batch("val", offsets)
    assert not torch.equal(x, xv)


def test_induction_odd_block_size():
    cfg = from_dict({"model": {"block_size": 9}, "tokenizer": {"vocab_size": 256},
                     "data": {"source": "induction", "induction_vocab": 5}})
    ds = prepare_dataset(cfg, bytes_tokenizer())
    x, y = ds.get_batch("val", ds.sample_offsets("val", 3, torch.Generator().manual_seed(1)))
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
                 if (lo <= n <= hi or n == rem // 2) and row[pos + n: pos + 2 * n] == row[pos: pos + n])
        lengths.append(n)
        pos += 2 * n
    return lengths


def test_induction_pairs_layout_defeats_fixed_offset_heads():
    """induction_min_period > 0: rows are back-to-back (segment, copy) pairs of varying lengths,
    so no single attention offset predicts the copies (a fixed-offset head is no induction)."""
    def batch(**data):
        cfg = from_dict({"model": {"block_size": 64}, "tokenizer": {"vocab_size": 256},
                         "data": {"source": "induction", "induction_vocab": 64, **data}})
        ds = prepare_dataset(cfg, bytes_tokenizer())
        return ds.get_batch("train", ds.sample_offsets("train", 64, torch.Generator()
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
        ds = prepare_dataset(cfg, bytes_tokenizer())
        x, y = ds.get_batch("train", ds.sample_offsets("train", 200, torch.Generator()
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
    assert "no .txt files" in _error(cfg_for(tmp_path / "d"))


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
