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
from collections import Counter
from pathlib import Path

from minigpt.data.tokenizer import EOT, PATTERNS, Tokenizer
from minigpt.errors import MinigptError
from minigpt.hf.arch import brief
from minigpt.hf.hub import model_file, read_model_file, read_model_json

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


# Real tokenizers add a few to a few thousand; tiktoken's build time grows with the count
# (a million: over a minute).
MAX_SPECIAL_TOKENS = 65_536


def ranks_from_hf(vocab: dict[str, int], merges: list[tuple[str, str]], added: dict[str, int],
                  where: str, vocab_size: int) -> tuple[dict[bytes, int], dict[str, int]]:
    """(ranks, special tokens) from a byte-level BPE's vocabulary, merges and added tokens.
    MinigptError (naming `where`) when it is not a byte-level BPE whose ids follow its merges,
    or when an id is outside the model's `vocab_size` embedding rows (checked first: nothing of
    an id's size is built before)."""
    _check_ids(vocab, added, where, vocab_size)
    raw_of = {token: text_to_bytes(token) for token in vocab}  # None: not byte-level text
    ranks = _byte_ranks(vocab, added, raw_of, where)
    _rank_merges(ranks, vocab, merges, raw_of, where)
    return ranks, _specials(vocab, added, ranks, raw_of, where)


def _check_ids(vocab: dict, added: dict[str, int], where: str, vocab_size: int) -> None:
    """Token text to ids in [0, vocab_size), no empty text."""
    if not isinstance(vocab, dict) or not all(isinstance(k, str) and type(v) is int
                                              for k, v in vocab.items()):
        raise MinigptError(f"{where}: the vocabulary is not a mapping of token text to id")
    for what, ids in (("token", vocab), ("added token", added)):
        bad = next(((t, i) for t, i in ids.items() if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise MinigptError(f"{where}: {what} {brief(bad[0])} has id {bad[1]}, outside the "
                               f"model's vocabulary 0..{vocab_size - 1} (config.json's "
                               "vocab_size, the embedding's rows)")
    if "" in added or "" in vocab:
        raise MinigptError(f"{where}: a token with empty text; every token has at least one "
                           "character")


def _byte_ranks(vocab: dict[str, int], added: dict[str, int], raw_of: dict,
                where: str) -> dict[bytes, int]:
    """The 256 single-byte tokens' ranks; MinigptError when a byte has none."""
    ranks = {raw: i for token, i in vocab.items()
             if (raw := raw_of[token]) is not None and len(raw) == 1 and token not in added}
    missing = sorted(set(range(256)) - {b[0] for b in ranks})
    if missing:
        raise MinigptError(f"{where}: not a byte-level BPE (no token for byte "
                           f"0x{missing[0]:02x}, {len(missing)} bytes missing); minigpt imports "
                           "GPT-2's byte-level BPE")
    return ranks


def _rank_merges(ranks: dict[bytes, int], vocab: dict[str, int], merges: list, raw_of: dict,
                 where: str) -> None:
    """Add each merge's result to `ranks` (rank = id), checking the ids follow merge order."""
    last = -1  # the id of the previous merge's token: merge priority = id order
    for n, pair in enumerate(merges):
        if len(pair) != 2 or not all(isinstance(t, str) for t in pair):
            raise MinigptError(f"{where}: merge {n + 1} is not a pair of tokens: {brief(pair)}")
        a, b = pair
        result = a + b
        raw = raw_of.get(result)
        if raw is None or raw_of.get(a) not in ranks or raw_of.get(b) not in ranks:
            raise MinigptError(f"{where}: merge {n + 1} ({brief(a)} + {brief(b)}) does not "
                               "join two "
                               "byte-level tokens of the vocabulary into a third")
        if raw in ranks:
            continue  # the same token reached by a second merge: its first merge ranks it
        i = vocab[result]
        if i <= last:
            raise MinigptError(
                f"{where}: token {brief(result)} (id {i}) of merge {n + 1} comes before an earlier "
                "merge's token: the ids do not follow the merge order, which tiktoken (minigpt's "
                "BPE) needs (rank = id)")
        ranks[raw] = last = i
    if len(set(ranks.values())) != len(ranks):
        raise MinigptError(f"{where}: two byte-level tokens share an id")


def _specials(vocab: dict[str, int], added: dict[str, int], ranks: dict[bytes, int],
              raw_of: dict, where: str) -> dict[str, int]:
    """Every added token and every vocabulary entry no merge makes, with distinct ids."""
    specials = dict(added)
    for token, i in vocab.items():
        raw = raw_of[token]
        if (raw is None or ranks.get(raw) != i) and token not in specials:
            specials[token] = i  # e.g. GPT-2's <|endoftext|>: in vocab.json, not a merge
    clash = set(specials.values()) & set(ranks.values())
    if clash:
        raise MinigptError(f"{where}: id {min(clash)} is both an added token and a BPE token")
    if len(specials) > MAX_SPECIAL_TOKENS:
        raise MinigptError(f"{where}: {len(specials):,} special tokens (added tokens and "
                           "vocabulary entries no merge makes); minigpt takes at most "
                           f"{MAX_SPECIAL_TOKENS:,} (tiktoken matches them with one regex)")
    shared = [i for i, n in Counter(specials.values()).items() if n > 1]
    if shared:
        raise MinigptError(f"{where}: two added tokens share id {min(shared)}")
    return specials


# The split patterns a tokenizer.json may name: minigpt's own (what `tokenizer_json` writes),
# tiktoken's o200k_base and the cl100k pattern as Hugging Face tokenizers write it (without
# possessive quantifiers). A regex from a file is otherwise refused: an invalid, empty, huge
# or catastrophically backtracking one fails or hangs inside tiktoken's regex engine, where
# no check before it can tell.
KNOWN_PATTERNS = {
    **PATTERNS,
    "cl100k (Hugging Face)": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",  # noqa: E501 - a regex reads whole
    "o200k": (
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
        r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
}


def _pattern(pre: object, where: str) -> str:
    """The split pattern of a tokenizer.json pre_tokenizer: GPT-2's own ByteLevel regex, or a
    Split(regex) followed by a regex-free ByteLevel (what `tokenizer_json` writes), whose
    regex is one of KNOWN_PATTERNS."""
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
        regex = steps[0]["pattern"]["Regex"]
        if regex not in KNOWN_PATTERNS.values():
            raise MinigptError(f"{where}: pre_tokenizer's Split regex {brief(regex)} is not one "
                               f"minigpt knows ({', '.join(KNOWN_PATTERNS)}); minigpt runs no "
                               "other regex from a file (one can hang or crash the regex engine)")
        return regex
    kind = pre.get("type") if isinstance(pre, dict) else pre
    raise MinigptError(f"{where}: pre_tokenizer {brief(kind)} is not GPT-2's byte-level one; "
                       "minigpt imports byte-level BPE tokenizers")


MAX_TOKENIZER_BYTES = 128 << 20  # GPT-2's tokenizer.json is 1.3 MiB, a 256k vocabulary's ~35


def _from_tokenizer_json(path: Path) -> tuple[dict, list, dict, str]:
    d = read_model_json(path, MAX_TOKENIZER_BYTES)
    model = d.get("model") if isinstance(d, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        kind = model.get("type") if isinstance(model, dict) else None
        raise MinigptError(f"{path}: model type {brief(kind)} is not a BPE; minigpt imports "
                           "GPT-2's byte-level BPE")
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "dropout"):
        if model.get(key):
            raise MinigptError(f"{path}: model.{key} is set; minigpt's BPE does not implement it")
    if d.get("normalizer") is not None:
        raise MinigptError(f"{path}: has a normalizer; GPT-2's byte-level BPE has none and "
                           "minigpt does not implement one")
    pattern = _pattern(d.get("pre_tokenizer"), str(path))
    merges, added = model.get("merges") or [], d.get("added_tokens") or []
    if not isinstance(merges, list):
        raise MinigptError(f"{path}: model.merges is not a list of merges")
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and isinstance(t.get("content"), str) and type(t.get("id")) is int
            for t in added):
        raise MinigptError(f"{path}: added_tokens is not a list of {{\"id\": integer, "
                           "\"content\": text}} objects")
    merges = [m.split(" ") if isinstance(m, str) else m for m in merges]
    return model.get("vocab"), merges, {t["content"]: t["id"] for t in added}, pattern


def _from_vocab_merges(vocab_json: Path, merges_txt: Path) -> tuple[dict, list, dict, str]:
    vocab = read_model_json(vocab_json, MAX_TOKENIZER_BYTES)
    try:
        lines = read_model_file(merges_txt, MAX_TOKENIZER_BYTES).decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise MinigptError(f"{merges_txt}: not UTF-8 text") from None
    merges = [line.split(" ") for line in lines if line and not line.startswith("#version")]
    return vocab, merges, {}, PATTERNS["gpt2"]


def load_hf_tokenizer(directory: Path, name: str, vocab_size: int) -> Tokenizer:
    """The tokenizer of a Hugging Face model directory: tokenizer.json, else vocab.json +
    merges.txt (GPT-2's split pattern), its ids within the model's `vocab_size`. One-line
    MinigptError when there is none or it is not a byte-level BPE minigpt can run exactly."""
    if (where := model_file(directory, TOKENIZER_JSON)) is not None:
        vocab, merges, added, pattern = _from_tokenizer_json(where)
    elif ((where := model_file(directory, VOCAB_JSON)) is not None
          and (merges_txt := model_file(directory, MERGES_TXT)) is not None):
        vocab, merges, added, pattern = _from_vocab_merges(where, merges_txt)
    else:
        raise MinigptError(f"{directory}: no tokenizer ({TOKENIZER_JSON}, or {VOCAB_JSON} and "
                           f"{MERGES_TXT}); a model directory needs its tokenizer files")
    ranks, specials = ranks_from_hf(vocab, merges, added, str(where), vocab_size)
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
