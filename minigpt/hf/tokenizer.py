"""GPT-2's byte-level BPE as Hugging Face stores it <-> minigpt's Tokenizer (tiktoken ranks).

Hugging Face writes a byte-level BPE as text: every byte is shown as one printable character
(`byte_chars`, GPT-2's table: the 188 printable latin-1 bytes stand for themselves, the other
68 become U+0100..U+0143), and `vocab.json` (token text -> id) and `merges.txt` (one merge
"a b" per line, in priority order) -- or the same two inside `tokenizer.json` -- hold tokens in
that alphabet. tiktoken wants raw bytes -> rank, where the rank is both the id and the merge
priority. For GPT-2 the id order IS the merge order (ids 0..255 the bytes, id 256 + i the
result of merge i), so ranks = ids; `ranks_from_hf` checks that instead of assuming it.

Ordinary tokens are the 256 single bytes and the merge results; every other vocabulary entry
(GPT-2's `<|endoftext|>`, tokens added by a fine-tune) is a special token: ordinary text when
typed, unless the caller allows special tokens.

Export goes the other way: the merge pair of every multi-byte rank is recovered by running
BPE on the token's own bytes with only the lower ranks (`merge_pair`; a BPE trained by merging
pairs, as rustbpe does, always splits into exactly two earlier tokens), and `tokenizer_json`
writes a tokenizer.json that `AutoTokenizer.from_pretrained` loads with no custom code: a Split
pre-tokenizer with minigpt's split pattern, byte-level mapping, BPE with `ignore_merges` (a
whole pre-token that is in the vocabulary is one token, as tiktoken does).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from minigpt.errors import MinigptError
from minigpt.tokenizer import EOT, PATTERNS, Tokenizer

TOKENIZER_JSON = "tokenizer.json"
VOCAB_JSON = "vocab.json"
MERGES_TXT = "merges.txt"


@functools.cache
def byte_chars() -> tuple[str, ...]:
    """GPT-2's bytes_to_unicode table: `byte_chars()[b]` is the character that stands for byte
    b in vocab.json / merges.txt."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


@functools.cache
def _to_latin1() -> dict[int, int]:
    """str.translate table: each alphabet character -> the latin-1 character of its byte; the
    latin-1 characters outside the alphabet -> U+FFFF (which latin-1 cannot encode)."""
    table = {ord(c): b for b, c in enumerate(byte_chars())}
    for b in range(256):
        table.setdefault(b, 0xFFFF)
    return table


def text_to_bytes(token: str) -> bytes | None:
    """A vocabulary entry's bytes, or None when it is not written in the byte alphabet."""
    try:
        return token.translate(_to_latin1()).encode("latin-1")
    except UnicodeEncodeError:
        return None


def bytes_to_text(token: bytes) -> str:
    chars = byte_chars()
    return "".join(chars[b] for b in token)


# --------------------------------------------------------------------------------------------
# Import.


def ranks_from_hf(vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int],
                  where: str) -> tuple[dict[bytes, int], dict[str, int]]:
    """(ranks, special tokens) from a byte-level BPE's vocabulary, merges and added tokens.
    MinigptError (naming `where`) when it is not a byte-level BPE whose ids follow its merges."""
    if not isinstance(vocab, dict) or not all(isinstance(k, str) and type(v) is int
                                              for k, v in vocab.items()):
        raise MinigptError(f"{where}: the vocabulary is not a mapping of token text to id")
    raw_of = {token: text_to_bytes(token) for token in vocab}  # None: not byte-level text
    ranks: dict[bytes, int] = {}
    for token, i in vocab.items():
        raw = raw_of[token]
        if raw is not None and len(raw) == 1 and token not in added:
            ranks[raw] = i
    missing = sorted(set(range(256)) - {b[0] for b in ranks})
    if missing:
        raise MinigptError(f"{where}: not a byte-level BPE (no token for byte "
                           f"0x{missing[0]:02x}, {len(missing)} bytes missing); minigpt imports "
                           "GPT-2's byte-level BPE")
    last = -1  # the id of the previous merge's token: merge priority = id order
    for n, pair in enumerate(merges):
        if len(pair) != 2:
            raise MinigptError(f"{where}: merge {n + 1} is not a pair of tokens: {pair!r}")
        a, b = pair
        result = a + b
        raw = raw_of.get(result)
        if raw is None or raw_of.get(a) not in ranks or raw_of.get(b) not in ranks:
            raise MinigptError(f"{where}: merge {n + 1} ({a!r} + {b!r}) does not join two "
                               "byte-level tokens of the vocabulary into a third")
        if raw in ranks:
            continue  # the same token reached by a second merge: its first merge ranks it
        i = vocab[result]
        if i <= last:
            raise MinigptError(
                f"{where}: token {result!r} (id {i}) of merge {n + 1} comes before an earlier "
                "merge's token: the ids do not follow the merge order, which tiktoken (minigpt's "
                "BPE) needs (rank = id)")
        ranks[raw] = last = i
    if len(set(ranks.values())) != len(ranks):
        raise MinigptError(f"{where}: two byte-level tokens share an id")
    specials = dict(added)
    for token, i in vocab.items():
        raw = raw_of[token]
        if (raw is None or ranks.get(raw) != i) and token not in specials:
            specials[token] = i  # e.g. GPT-2's <|endoftext|>: in vocab.json, not a merge
    clash = set(specials.values()) & set(ranks.values())
    if clash:
        raise MinigptError(f"{where}: id {min(clash)} is both an added token and a BPE token")
    return ranks, specials


def _pattern(pre: object, where: str) -> str:
    """The split pattern of a tokenizer.json pre_tokenizer: GPT-2's own ByteLevel regex, or a
    Split(regex) followed by a regex-free ByteLevel (what `tokenizer_json` writes)."""
    def byte_level(p: dict, regex: bool) -> bool:
        if p.get("add_prefix_space"):
            raise MinigptError(f"{where}: pre_tokenizer.add_prefix_space is true; minigpt "
                               "imports GPT-2's byte-level BPE, which adds no prefix space")
        return p.get("type") == "ByteLevel" and bool(p.get("use_regex", True)) == regex

    if isinstance(pre, dict) and byte_level(pre, True):
        return PATTERNS["gpt2"]
    steps = pre.get("pretokenizers") if isinstance(pre, dict) else None
    if (isinstance(steps, list) and len(steps) == 2 and all(isinstance(s, dict) for s in steps)
            and steps[0].get("type") == "Split" and steps[0].get("behavior") == "Isolated"
            and not steps[0].get("invert") and isinstance(steps[0].get("pattern"), dict)
            and isinstance(steps[0]["pattern"].get("Regex"), str)
            and byte_level(steps[1], False)):
        return steps[0]["pattern"]["Regex"]
    kind = pre.get("type") if isinstance(pre, dict) else pre
    raise MinigptError(f"{where}: pre_tokenizer {kind!r} is not GPT-2's byte-level one; "
                       "minigpt imports byte-level BPE tokenizers")


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise MinigptError(f"{path}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, ValueError):
        raise MinigptError(f"{path}: not valid JSON") from None


def _from_tokenizer_json(path: Path) -> tuple[dict, list, dict, str]:
    d = _read_json(path)
    model = d.get("model") if isinstance(d, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise MinigptError(f"{path}: model type {kind!r} is not a BPE; minigpt imports GPT-2's "
                           "byte-level BPE")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "dropout"):
        if model.get(key):
            raise MinigptError(f"{path}: model.{key} is set; minigpt's BPE does not implement it")
    if d.get("normalizer") is not None:
        raise MinigptError(f"{path}: has a normalizer; GPT-2's byte-level BPE has none and "
                           "minigpt does not implement one")
    pattern = _pattern(d.get("pre_tokenizer"), str(path))
    merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges") or []]
    added = {t["content"]: t["id"] for t in d.get("added_tokens") or []
             if isinstance(t, dict) and isinstance(t.get("content"), str)
             and type(t.get("id")) is int}
    return model.get("vocab"), merges, added, pattern


def _from_vocab_merges(directory: Path) -> tuple[dict, list, dict, str]:
    vocab = _read_json(directory / VOCAB_JSON)
    try:
        lines = (directory / MERGES_TXT).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise MinigptError(f"{directory / MERGES_TXT}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise MinigptError(f"{directory / MERGES_TXT}: not UTF-8 text") from None
    merges = [line.split(" ") for line in lines if line and not line.startswith("#version")]
    return vocab, merges, {}, PATTERNS["gpt2"]


def load_hf_tokenizer(directory: Path, name: str) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, else vocab.json +
    merges.txt (GPT-2's split pattern). One-line MinigptError when there is none or it is not
    a byte-level BPE."""
    if (directory / TOKENIZER_JSON).is_file():
        where = directory / TOKENIZER_JSON
        vocab, merges, added, pattern = _from_tokenizer_json(where)
    elif (directory / VOCAB_JSON).is_file() and (directory / MERGES_TXT).is_file():
        where = directory / VOCAB_JSON
        vocab, merges, added, pattern = _from_vocab_merges(directory)
    else:
        raise MinigptError(f"{directory}: no tokenizer ({TOKENIZER_JSON}, or {VOCAB_JSON} and "
                           f"{MERGES_TXT}); a model directory needs its tokenizer files")
    ranks, specials = ranks_from_hf(vocab, merges, added, str(where))
    if EOT not in specials:
        raise MinigptError(f"{where}: has no {EOT} token; minigpt imports GPT-2-style "
                           "tokenizers, which end documents with it")
    return Tokenizer(ranks, pattern, specials, name)


# --------------------------------------------------------------------------------------------
# Export.


def merge_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two tokens BPE joined last to make `token`: BPE on its bytes with only the ranks
    below its own (tiktoken's educational recovery of merges from ranks)."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while True:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise MinigptError(f"token {token!r} (rank {limit}) is not the merge of two earlier "
                           "tokens; these ranks are not a BPE that tokenizer.json can express")
    return parts[0], parts[1]


def bpe_vocab(tok: Tokenizer) -> tuple[dict[str, int], list[list[str]]]:
    """A minigpt byte-level Tokenizer as Hugging Face and llama.cpp store a BPE: {token text:
    id} of every rank (in rank order) and the merges [a, b] in priority order, in GPT-2's byte
    alphabet. MinigptError when a byte has no token."""
    missing = [b for b in range(256) if bytes([b]) not in tok.ranks]
    if missing:
        raise MinigptError(f"tokenizer {tok.name}: no token for byte 0x{missing[0]:02x}; only a "
                           "byte-level BPE (every byte a token) exports")
    ordered = sorted(tok.ranks.items(), key=lambda kv: kv[1])
    merges = [[bytes_to_text(a), bytes_to_text(b)] for a, b in
              (merge_pair(tok.ranks, t) for t, _ in ordered if len(t) > 1)]
    return {bytes_to_text(t): r for t, r in ordered}, merges


def tokenizer_json(tok: Tokenizer) -> dict:
    """tokenizer.json (the `tokenizers` library's format) for a minigpt byte-level Tokenizer."""
    vocab, merges = bpe_vocab(tok)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated",
             "invert": False}, byte_level]},
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }


def tokenizer_files(tok: Tokenizer, max_length: int) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json for AutoTokenizer (`<|endoftext|>` is the bos,
    eos and unk token, as in GPT-2)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "bos_token": EOT, "eos_token": EOT, "unk_token": EOT,
              "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces":
              False}
    return {TOKENIZER_JSON: (json.dumps(tokenizer_json(tok), ensure_ascii=False) + "\n").encode(),
            "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}
