"""Tokenizer: bytes / trained BPE / saved rank files / named encodings, and their invariants."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil

import pytest
import tiktoken
import tiktoken.load

from minigpt.config import Config, MinigptError, from_dict
from minigpt.data.corpus import split_corpus
from minigpt.data.tokenizer import (
    EOT,
    NAMED_ENCODINGS,
    PATTERNS,
    RANKS_FILE,
    SIDECAR_FILE,
    Tokenizer,
    build_tokenizer,
    bytes_tokenizer,
    tiktoken_cache_dir,
)
from minigpt.events import BPETrained, TokenizerCacheHit, TrainingBPE
from minigpt.paths import DATA_DIR

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3.14, isn't it?\n",
    "code": "def f(x: int) -> int:\n\treturn x ** 2  # square\n\nprint({'a': [1, 2]})\r\n",
    "emoji": "ok 👍🏽 family: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 ✨",
    "cjk": "日本語のテキスト、中文文本，한국어 텍스트。",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0351\u0356\u0330 \u0928\u093f (devanagari)",
    "whitespace": "  leading\n\n\n   trailing   \t\n",
    "special-looking": f"before {EOT} after <|fim_prefix|>",
}


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """~100 KB of Shakespeare: enough for a few hundred merges, fast to train."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    text = (DATA_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")[:100_000]
    path.write_text(text, encoding="utf-8")
    return path


def bpe_config(corpus, cache_dir, vocab_size=400, **tok) -> Config:
    return from_dict({"tokenizer": {"vocab_size": vocab_size, **tok},
                      "data": {"corpus": str(corpus), "cache_dir": str(cache_dir)}})


@pytest.fixture(scope="module")
def bpe(small_corpus, tmp_path_factory):
    return build_tokenizer(bpe_config(small_corpus, tmp_path_factory.mktemp("cache")))


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_round_trip(name, bpe):
    text = TEXTS[name]
    for tok in (bytes_tokenizer(), bpe):
        ids = tok.encode(text)
        assert all(0 <= i < tok.n_vocab and i != tok.eot_id for i in ids)
        assert tok.decode(ids) == text


def test_bytes_tokenizer_is_raw_bytes():
    tok = bytes_tokenizer()
    assert (tok.n_vocab, tok.eot_id) == (257, 256)
    for text in TEXTS.values():
        assert tok.encode(text) == list(text.encode("utf-8"))
    assert [tok.token_bytes(i) for i in range(256)] == [bytes([i]) for i in range(256)]
    cfg = from_dict({"tokenizer": {"vocab_size": 256}, "data": {"corpus": "/nonexistent"}})
    assert build_tokenizer(cfg).hash == tok.hash  # no corpus read for raw bytes


def test_trained_bpe_compresses_and_keeps_bytes(bpe, small_corpus):
    assert bpe.n_vocab == 401 and bpe.eot_id == 400
    assert all(bpe.ranks[bytes([b])] == b for b in range(256))
    text = small_corpus.read_text(encoding="utf-8")
    ids = bpe.encode(text)
    assert len(ids) < 0.6 * len(text.encode())
    assert bpe.decode(ids) == text


def test_special_token_text_is_ordinary_unless_allowed(bpe):
    for tok in (bytes_tokenizer(), bpe):
        ids = tok.encode(f"a{EOT}b")
        assert tok.eot_id not in ids
        assert tok.decode(ids) == f"a{EOT}b"
        allowed = tok.encode(f"a{EOT}b", allow_special=True)
        assert allowed.count(tok.eot_id) == 1
        assert tok.decode(allowed) == f"a{EOT}b"


def test_decode_never_raises_on_junk_ids(bpe):
    rng = random.Random(0)
    for tok in (bytes_tokenizer(), bpe):
        for _ in range(200):
            ids = [rng.randrange(-5, tok.n_vocab + 5) for _ in range(rng.randrange(0, 12))]
            assert isinstance(tok.decode(ids), str)
        assert tok.decode([0xE2, 0x82]) == "\ufffd"          # truncated 3-byte character
        assert tok.decode([-1, tok.n_vocab, 10**12, 2**70]) == "\ufffd" * 4
        assert tok.decode([104, 10**9, 105]) == "h\ufffdi"
    assert bytes_tokenizer().token_str(0xE2) == "\\xe2"
    assert bytes_tokenizer().token_str(256) == EOT


def test_saved_rank_file_loads_with_plain_tiktoken(bpe, tmp_path):
    bpe.save(tmp_path)
    ranks = tiktoken.load.load_tiktoken_bpe(str(tmp_path / RANKS_FILE))
    side = json.loads((tmp_path / SIDECAR_FILE).read_text())
    assert ranks == bpe.ranks
    assert side["n_vocab"] == bpe.n_vocab and side["hash"] == bpe.hash
    first = (tmp_path / RANKS_FILE).read_text().splitlines()[0]
    assert first == base64.b64encode(bytes([0])).decode() + " 0"
    plain = tiktoken.Encoding("plain", pat_str=side["pattern"], mergeable_ranks=ranks,
                              special_tokens=side["special_tokens"])
    for text in TEXTS.values():
        assert plain.encode_ordinary(text) == bpe.encode(text)
    loaded = Tokenizer.load(tmp_path)
    assert (loaded.hash, loaded.n_vocab, loaded.eot_id) == (bpe.hash, bpe.n_vocab, bpe.eot_id)


def test_load_rejects_missing_and_corrupt_files(bpe, tmp_path):
    with pytest.raises(MinigptError, match=SIDECAR_FILE):
        Tokenizer.load(tmp_path)
    bpe.save(tmp_path)
    rank_path = tmp_path / RANKS_FILE
    lines = rank_path.read_text().splitlines()
    rank_path.write_text("\n".join(lines[:-1]) + "\n")  # drop the last merge
    with pytest.raises(MinigptError, match="hash"):
        Tokenizer.load(tmp_path)
    rank_path.write_text("not base64 at all\n")
    with pytest.raises(MinigptError, match=RANKS_FILE):
        Tokenizer.load(tmp_path)
    (tmp_path / SIDECAR_FILE).write_text("{broken")
    with pytest.raises(MinigptError, match="corrupt"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("edit, why", [
    (lambda side: [side], "a JSON list, not an object"),
    (lambda side: {k: v for k, v in side.items() if k != "pattern"}, '"pattern" is missing'),
    (lambda side: {**side, "hash": 7}, '"hash" is missing or not a string'),
    (lambda side: {**side, "special_tokens": {EOT: "256"}}, '"special_tokens" is not'),
    (lambda side: {**side, "special_tokens": [EOT]}, '"special_tokens" is not'),
])
def test_a_damaged_sidecar_is_named_and_a_bug_is_not(bpe, tmp_path, monkeypatch, edit, why):
    """A sidecar of the wrong shape is one line naming the file and the field; an error inside
    minigpt while loading is not relabelled as a damaged file (it keeps its traceback)."""
    bpe.save(tmp_path)
    side = json.loads((tmp_path / SIDECAR_FILE).read_text())
    (tmp_path / SIDECAR_FILE).write_text(json.dumps(edit(side)))
    with pytest.raises(MinigptError, match=re.escape(f"corrupt tokenizer sidecar ({why}")):
        Tokenizer.load(tmp_path)
    bpe.save(tmp_path)

    def broken(*args, **kwargs):
        raise TypeError("a bug")

    monkeypatch.setattr(json, "loads", broken)  # (the old broad except called this corrupt)
    with pytest.raises(TypeError, match="a bug"):
        Tokenizer.load(tmp_path)


def test_trained_tokenizer_cache_reused_and_invalidated(small_corpus, tmp_path):
    events = []
    cfg = bpe_config(small_corpus, tmp_path / "c", vocab_size=300)
    first = build_tokenizer(cfg, events.append)
    assert [type(e) for e in events] == [TrainingBPE, BPETrained]
    events.clear()
    again = build_tokenizer(cfg, events.append)
    assert [type(e) for e in events] == [TokenizerCacheHit] and again.hash == first.hash

    for changed in (bpe_config(small_corpus, tmp_path / "c", vocab_size=310),
                    bpe_config(small_corpus, tmp_path / "c", vocab_size=300, pattern="gpt2"),
                    bpe_config(small_corpus, tmp_path / "c", vocab_size=300,
                               train_max_bytes=20_000)):
        events.clear()
        other = build_tokenizer(changed, events.append)
        assert isinstance(events[0], TrainingBPE) and other.hash != first.hash

    edited = tmp_path / "edited.txt"  # new training text (at the start): trained anew
    edited.write_text("A new first line, so new training text.\n" + small_corpus.read_text())
    events.clear()
    build_tokenizer(bpe_config(edited, tmp_path / "c", vocab_size=300), events.append)
    assert isinstance(events[0], TrainingBPE)
    split = split_corpus([small_corpus], 0.1)
    text = small_corpus.read_bytes()
    val_edited = tmp_path / "val-edited.txt"  # only validation text changed: the cache serves
    val_edited.write_bytes(text[:split.at] + text[split.at:].upper())
    events.clear()
    cached = build_tokenizer(bpe_config(val_edited, tmp_path / "c", vocab_size=300), events.append)
    assert [type(e) for e in events] == [TokenizerCacheHit] and cached.hash == first.hash
    # Training is deterministic: a fresh cache dir reproduces the same ranks.
    assert build_tokenizer(bpe_config(small_corpus, tmp_path / "d", vocab_size=300)).hash \
        == first.hash


def _saved_files(tok: Tokenizer, directory) -> dict[str, bytes]:
    tok.save(directory)
    return {name: (directory / name).read_bytes() for name in (RANKS_FILE, SIDECAR_FILE)}


def test_validation_text_never_shapes_the_tokenizer(small_corpus, tmp_path):
    """The BPE trains on the bytes before the split point only: replacing every validation
    byte (same length, so the split point stays) leaves both tokenizer files byte-identical,
    though the new validation text is one made-up word that a BPE trained on it would learn;
    changing the training text (same length) changes them."""
    text = small_corpus.read_bytes()
    at = split_corpus([small_corpus], 0.1).at
    assert 0.89 * len(text) < at < 0.91 * len(text) and text[at - 1:at] == b"\n"
    word = b"Zqxjvbrk zqxjvbrk Zqxjvbrk!\n"
    val = (word * (len(text) // len(word) + 1))[: len(text) - at - 1] + b"\n"
    variants = {"original": text, "new-val": text[:at] + val,
                "new-train": text[:at].replace(b"Citizen", b"Citizan") + text[at:],
                "val-as-train": val + text[:at]}  # the made-up word where the BPE sees it
    assert variants["new-train"] != text and len(variants["new-train"]) == len(text)
    files, ranks = {}, {}
    for name, body in variants.items():
        path = tmp_path / name / "corpus.txt"
        path.parent.mkdir()
        path.write_bytes(body)
        if name != "val-as-train":
            assert split_corpus([path], 0.1).at == at
        tok = build_tokenizer(bpe_config(path, tmp_path / name / "cache", vocab_size=400))
        files[name], ranks[name] = _saved_files(tok, tmp_path / name / "tok"), tok.ranks
    assert files["new-val"] == files["original"]
    assert files["new-train"] != files["original"]
    learned = lambda r: any(b"qxjv" in t for t in r)
    assert learned(ranks["val-as-train"]) and not learned(ranks["new-val"])


def test_validation_records_never_shape_the_tokenizer(small_corpus, tmp_path):
    """JSON Lines: the BPE trains on the records before the split point only. Rewriting the
    validation records (same lengths: the point stays) serves the cached tokenizer and equals
    a fresh one; rewriting a training record trains anew."""
    docs = [p + "\n" for p in small_corpus.read_text().split("\n\n")]
    split = None

    def tokenizer(texts: list[str], name: str, events: list | None = None) -> Tokenizer:
        nonlocal split
        path = tmp_path / name / "c.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        split = split_corpus([path], 0.1)
        return build_tokenizer(bpe_config(path, tmp_path / "cache", vocab_size=350),
                               (events if events is not None else []).append)

    first = tokenizer(docs, "original")
    k = split.train[0].end  # records [0, k) are the training text
    assert 0 < k < len(docs) and split.val[0].start == k
    made_up = ["".join(ch if ch in " \n" else "q" for ch in d) for d in docs[k:]]
    events: list = []
    again = tokenizer(docs[:k] + made_up, "new-val", events)
    assert [type(e) for e in events] == [TokenizerCacheHit] and again.hash == first.hash
    assert split_corpus([tmp_path / "new-val" / "c.jsonl"], 0.1).at == split.at
    fresh = build_tokenizer(bpe_config(tmp_path / "new-val" / "c.jsonl", tmp_path / "other",
                                       vocab_size=350))
    assert fresh.hash == first.hash and not any(b"qqq" in t for t in fresh.ranks)
    events.clear()
    other = tokenizer([docs[0].upper()] + docs[1:], "new-train", events)
    assert isinstance(events[0], TrainingBPE) and other.hash != first.hash


def test_train_max_bytes_limits_training_text(small_corpus, tmp_path):
    events = []
    build_tokenizer(bpe_config(small_corpus, tmp_path, vocab_size=300, train_max_bytes=5000),
                    events.append)
    assert events[0].n_bytes == 5000


def test_gpt2_pattern_round_trips(small_corpus, tmp_path):
    tok = build_tokenizer(bpe_config(small_corpus, tmp_path, vocab_size=300, pattern="gpt2"))
    assert tok.pattern == PATTERNS["gpt2"]
    for text in TEXTS.values():
        assert tok.decode(tok.encode(text)) == text


def test_encoding_from_a_tiktoken_file_or_directory(bpe, tmp_path):
    bpe.save(tmp_path / "saved")
    for spec in (tmp_path / "saved", tmp_path / "saved" / RANKS_FILE):
        cfg = from_dict({"tokenizer": {"encoding": str(spec)}})
        assert build_tokenizer(cfg).hash == bpe.hash
    bare = tmp_path / "bare" / "mine.tiktoken"  # no sidecar: pattern from the config, eot last
    bare.parent.mkdir()
    shutil.copy(tmp_path / "saved" / RANKS_FILE, bare)
    tok = build_tokenizer(from_dict({"tokenizer": {"encoding": str(bare)}}))
    assert tok.eot_id == len(bpe.ranks) and tok.encode(TEXTS["english"]) == \
        bpe.encode(TEXTS["english"])
    with pytest.raises(MinigptError, match="nope.tiktoken"):
        build_tokenizer(from_dict({"tokenizer": {"encoding": str(tmp_path / "nope.tiktoken")}}))


def test_named_encoding_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))

    def no_network(*args, **kwargs):
        raise AssertionError("tiktoken tried to download")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    for name in ("gpt2", "cl100k_base", "o200k_base"):
        cfg = from_dict({"tokenizer": {"encoding": name}})
        with pytest.raises(MinigptError, match=f"{name}.*tokenizer.encoding: ''") as err:
            build_tokenizer(cfg)
        assert "\n" not in str(err.value)
    # A cached file with the wrong contents is refused too (tiktoken would delete + refetch).
    url = NAMED_ENCODINGS["cl100k_base"][0][0]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"truncated")
    with pytest.raises(MinigptError, match="cl100k_base is not in tiktoken's local cache"):
        build_tokenizer(from_dict({"tokenizer": {"encoding": "cl100k_base"}}))


def test_named_encoding_from_local_cache():
    try:
        expected = tiktoken.get_encoding("gpt2") if _gpt2_cached() else None
    except Exception:  # noqa: BLE001 - only a probe of the local cache
        expected = None
    if expected is None:
        pytest.skip("gpt2 is not in tiktoken's local cache on this machine")
    tok = build_tokenizer(from_dict({"tokenizer": {"encoding": "gpt2"}}))
    assert tok.n_vocab == 50257 and tok.eot_id == 50256
    assert tok.encode(TEXTS["english"]) == expected.encode_ordinary(TEXTS["english"])


def _gpt2_cached() -> bool:
    return all(os.path.isfile(os.path.join(tiktoken_cache_dir(),
                                           hashlib.sha1(url.encode()).hexdigest()))
               for url, _ in NAMED_ENCODINGS["gpt2"])


def test_induction_source_refuses_a_corpus_bpe():
    """Checked once, when the config loads, before any tokenizer is built."""
    with pytest.raises(MinigptError, match="tokenizer.vocab_size: 256"):
        from_dict({"tokenizer": {"vocab_size": 512}, "data": {"source": "induction"}})


@pytest.mark.parametrize("line,needle", [
    ("YWI= 1000000000", "1,000,000,000"),   # a table of a billion entries otherwise
    ("YWI= 1000000000000", "line 257"),     # OverflowError in tiktoken otherwise
    ("YWI= -5", "-5"),
    ("YWI= 7", "share the id 7"),           # tiktoken's Rust side panics otherwise
    ("!!!! 256", "line 257"),               # invalid base64
    ("YQ== 256", "line 257 repeats"),       # the token b"a" twice
])
def test_hostile_rank_files_are_one_line_naming_the_file(tmp_path, line, needle):
    """A .tiktoken file named by tokenizer.encoding: every rank checked before tiktoken sees
    it (issue 32)."""
    ranks = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path = tmp_path / "hostile.tiktoken"
    path.write_text("\n".join([*ranks, line]) + "\n")
    cfg = from_dict({"tokenizer": {"encoding": str(path)}})
    with pytest.raises(MinigptError, match=re.escape(needle)) as e:
        build_tokenizer(cfg)
    assert "hostile.tiktoken" in str(e.value)


def test_a_rank_file_without_every_single_byte_is_refused_when_read(tmp_path, monkeypatch):
    """A .tiktoken file missing single-byte tokens is refused as it is read, naming the file
    and the bytes (tiktoken's encoder would panic on them, while encoding the corpus): before
    tiktoken builds anything, and a saved run's tokenizer the same (issue 39)."""
    kept = [b for b in range(256) if b not in (0x00, 0x0A, 0x7F)]
    lines = [f"{base64.b64encode(bytes([b])).decode()} {i}" for i, b in enumerate(kept)]
    path = tmp_path / "holes.tiktoken"
    path.write_text("\n".join([*lines, "dGg= 253"]) + "\n")

    def never(*a, **k):
        raise AssertionError("tiktoken built an encoding from a file missing bytes")

    monkeypatch.setattr(tiktoken, "Encoding", never)
    with pytest.raises(MinigptError) as e:
        build_tokenizer(from_dict({"tokenizer": {"encoding": str(path)}}))
    assert str(e.value).startswith(f"{path}: 3 of the 256 single-byte tokens are missing "
                                   "(0x00, 0x0a, 0x7f)")
    many = tmp_path / "ascii.tiktoken"  # only 0..127: the first 8 missing named, the count
    many.write_text("\n".join(f"{base64.b64encode(bytes([b])).decode()} {b}"
                              for b in range(128)) + "\n")
    with pytest.raises(MinigptError, match=r"128 of the 256 .* \(0x80, 0x81, .*0x87 and 120 "
                                           r"more\)"):
        build_tokenizer(from_dict({"tokenizer": {"encoding": str(many)}}))

def test_a_tokenizer_built_in_code_checks_its_ids_too():
    from minigpt.data.tokenizer import EOT, PATTERNS, Tokenizer

    ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(MinigptError, match="share the id 5"):
        Tokenizer(ranks, PATTERNS["gpt4"], {EOT: 5}, "t")
    with pytest.raises(MinigptError, match="contiguous"):
        Tokenizer(ranks, PATTERNS["gpt4"], {EOT: 10**9}, "t")
