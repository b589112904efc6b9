"""What inspect-heads reads: built-in synthetic probes (token ids only, seeded, valid for the
run's vocabulary) or text, cut to the model's context."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import ArgumentError, ConflictError
from minigpt.files import read_text_part
from minigpt.infer.inputs import text_budget

PROBES = ("induction", "previous", "duplicate")
PROBE_HELP = {
    "induction": "random tokens repeated twice (induction heads attend to the token after the "
                 "earlier occurrence)",
    "previous": "random tokens without repeats (positional heads only)",
    "duplicate": "random tokens from 8 ids, so every token repeats often",
}
DEFAULT_TEXT = ("First Citizen: Before we proceed any further, hear me speak.\n"
                "All: Speak, speak.\nFirst Citizen: You are all resolved rather to die than to "
                "famish?\nAll: Resolved. resolved.\n")


def probe_tokens(name: str, length: int, pool: Sequence[int], seed: int = 0) -> list[int]:
    """Token ids of the built-in probe `name` (one of PROBES), `length` tokens drawn from `pool`.

    induction: n = length // 2 tokens (distinct when the pool allows) repeated twice (length is
    rounded down to even); previous: distinct tokens when the pool allows; duplicate: tokens from
    8 ids of the pool. Deterministic in (name, length, pool, seed)."""
    if name not in PROBES:
        raise ArgumentError("probe", f"'{name}' is not a probe; valid: {', '.join(PROBES)}")
    if length < 2:
        raise ArgumentError("probe", f"needs at least 2 tokens, got {length}", subject=name)
    pool = list(pool)
    if not pool:
        raise ArgumentError("probe", "the run's vocabulary has no ordinary tokens", subject=name)
    rng = random.Random(f"{name}:{seed}")

    def draw(n: int, ids: list[int]) -> list[int]:
        return rng.sample(ids, n) if n <= len(ids) else [rng.choice(ids) for _ in range(n)]

    if name == "induction":
        half = draw(length // 2, pool)
        return half + half
    if name == "previous":
        return draw(length, pool)
    alphabet = draw(min(8, len(pool)), pool)
    return [rng.choice(alphabet) for _ in range(length)]


EVERY_PREDICTION = "every next-token prediction"


@dataclass
class ProbeInput:
    """The token ids to inspect, their strings and where they came from. `n_text_tokens` > len
    (tokens) when a longer text was cut to its first `len(tokens)` tokens; `file_bytes` is a
    text file's size when only its start was read (the text has more tokens than counted).

    Where a loss is defined on this input (for ablation): `positions`, the query positions
    whose next-token prediction is scored (None: every one), described by `scored`;
    `min_tokens`, the shortest input of this kind with a prediction to score. `is_text` False:
    a synthetic probe of random ids, whose whitespace or punctuation tokens are no sentence
    structure (the delimiter score then does not apply)."""

    tokens: list[int]
    token_strs: list[str]
    source: str
    n_text_tokens: int = 0
    file_bytes: int | None = None
    positions: list[int] | None = None
    scored: str = EVERY_PREDICTION
    min_tokens: int = 2
    is_text: bool = True

    @property
    def truncated(self) -> bool:
        return self.n_text_tokens > len(self.tokens)


def probe_pool(cfg, tokenizer) -> list[int]:
    """Token ids a probe may use: [0, data.induction_vocab) for a run trained on the induction
    source (the ids it has seen), else every ordinary (non-special) id of the tokenizer."""
    if cfg.data.source == "induction":
        return list(range(min(cfg.data.induction_vocab, tokenizer.n_vocab)))
    ranks = getattr(tokenizer, "ranks", None)  # ordinary tokens: no specials, no unused ids
    if ranks:
        return sorted(set(ranks.values()))
    return [i for i in range(tokenizer.n_vocab) if i != tokenizer.eot_id]


def prepare_input(cfg, tokenizer, *, text: str | None = None, text_file: Path | None = None,
                  probe: str | None = None, max_tokens: int | None = None,
                  seed: int = 0, eot_first: bool = False) -> ProbeInput:
    """Tokens for inspect-heads from at most one of text / text_file / probe (none:
    DEFAULT_TEXT, or for a compiled program the `previous` probe, random tokens of its
    vocabulary; more than one: a ConflictError). A text file is read only as far as
    `max_tokens` tokens can reach (`minigpt.infer.inputs.text_budget`; regular files only).

    At most `max_tokens` tokens (default and maximum: model.block_size); longer text is cut to
    its first `max_tokens` tokens (see ProbeInput.truncated). Probes are `max_tokens` long.

    `eot_first`: the input starts with <|endoftext|> and the text or probe follows it in the
    remaining `max_tokens - 1` tokens. For a model pretrained on documents that follow
    <|endoftext|> (GPT-2): that is what its first position saw in training, and heads use it
    as their resting place; without it the first real token plays that role and every score
    shifts (TransformerLens prepends it, BOS = EOT for GPT-2, for the same reason)."""
    given = [n for n, v in (("text", text), ("text_file", text_file), ("probe", probe))
             if v is not None]
    if len(given) > 1:
        raise ConflictError(given)
    if not given and cfg.data.source == "program":  # a compiled program reads no prose
        probe = "previous"  # random tokens of its vocabulary
    block = cfg.model.block_size
    first = [tokenizer.eot_id] if eot_first else []
    low = len(first) + (4 if probe == "induction" else 2)  # induction: two copies of 2 tokens
    checked = max_tokens is not None or probe is not None  # the default text: any block_size
    max_tokens = block if max_tokens is None else max_tokens
    if checked and not low <= max_tokens <= block:
        raise ArgumentError("max_tokens", f"out of range; valid: {low}..{block} (the model's "
                            "block_size" + (", and the first token is <|endoftext|>" if first
                                            else "")
                            + ("; the induction probe needs two copies of at least 2 tokens "
                               "to predict one by copying)" if probe == "induction" else ")"),
                            subject=max_tokens)
    if probe is not None:
        ids = first + probe_tokens(probe, max_tokens - len(first), probe_pool(cfg, tokenizer),
                                   seed)
        inp = ProbeInput(ids, [tokenizer.token_str(i) for i in ids], f"probe:{probe}",
                         min_tokens=len(first) + 2, is_text=False)
        if probe == "induction":  # only the second copy can be predicted, by copying
            half = (len(ids) - len(first)) // 2
            second = len(first) + half  # its first token predicts the second, and so on
            inp.positions = list(range(second, len(ids) - 1))
            inp.scored = (f"the {len(inp.positions)} predictions inside the probe's second "
                          "copy, where copying is possible")
            inp.min_tokens = len(first) + 4
        return inp
    source, file_bytes = "text", None
    if text_file is not None:
        budget = text_budget(tokenizer, max_tokens)
        text, size = read_text_part(text_file, "text_file", budget)
        source, file_bytes = f"file:{text_file}", (size if size > budget else None)
    elif text is None:
        text, source = DEFAULT_TEXT, "default text"
    if not text.strip() and file_bytes is None:
        raise ArgumentError("text_file" if text_file is not None else "text",
                            "the text is empty; give some text to inspect")
    ids = first + tokenizer.encode(text)
    return ProbeInput(ids[:max_tokens], [tokenizer.token_str(i) for i in ids[:max_tokens]],
                      source, len(ids), file_bytes, min_tokens=len(first) + 2)


def token_id(tokenizer, text: str, param: str) -> int:
    """The id of `text` when it is exactly one token of `tokenizer` (a leading space is part of
    a GPT-2 word: " Mary"); ArgumentError naming `param` otherwise."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        shown = ", ".join(repr(tokenizer.token_str(i)) for i in ids[:6])
        raise ArgumentError(param, f"{text!r} is {len(ids)} tokens ({shown or 'none'}), not "
                            "one; give a single token of the model's vocabulary")
    return ids[0]


# The corrupted inputs of the induction probe (`--patch-from NAME`): which copy's tokens are
# replaced by tokens of neither copy. `corrupted` is `corrupted-second`, the first one offered.
CORRUPTIONS = {
    "corrupted-second": "the induction probe with its second copy's tokens replaced (the first "
                        "copy kept: the tokens to copy are there, but no query asks for them)",
    "corrupted-first": "the induction probe with its first copy's tokens replaced (the second "
                       "copy kept: its queries find no earlier occurrence to copy from)",
}
CORRUPTION_ALIASES = {"corrupted": "corrupted-second"}


def corrupted_input(cfg, tokenizer, inp: ProbeInput, patch_from: str, *,
                    max_tokens: int | None = None, seed: int = 0,
                    eot_first: bool = False) -> tuple[list[int], str]:
    """The corrupted input patched from (token ids, a description) for the clean `inp`: with
    the induction probe, `patch_from` is one of CORRUPTIONS (or its alias `corrupted`): the
    probe with one copy's tokens replaced by tokens of neither copy; with text, it is the
    corrupted text, read like the clean one (the same `max_tokens`, <|endoftext|> first
    alike). The lengths are checked by the caller (`circuits.check_same_length`)."""
    if not inp.is_text:
        name = CORRUPTION_ALIASES.get(patch_from, patch_from)
        if inp.source != "probe:induction" or name not in CORRUPTIONS:
            raise ArgumentError("patch_from", "with a probe the corrupted input is "
                                "`corrupted-second` (alias `corrupted`) or `corrupted-first` "
                                "(the induction probe with that copy's tokens replaced); give "
                                "--probe induction --patch-from corrupted-first, or a --text "
                                "and a corrupted text")
        first = 1 if eot_first else 0
        copy = 1 if name == "corrupted-first" else 2
        ids = corrupt_copy(inp.tokens, first, probe_pool(cfg, tokenizer), seed, copy=copy)
        return ids, f"{name}: {CORRUPTIONS[name]}"
    if not patch_from.strip():
        raise ArgumentError("patch_from", "the corrupted text is empty")
    other = prepare_input(cfg, tokenizer, text=patch_from, max_tokens=max_tokens,
                          eot_first=eot_first)
    return other.tokens, f"text: {patch_from}"


def corrupt_copy(tokens: Sequence[int], first: int, pool: Sequence[int], seed: int = 0, *,
                 copy: int = 2) -> list[int]:
    """The induction probe `tokens` (its two copies start at `first`) with every token of copy
    `copy` (1 or 2) replaced by a different one from `pool`, none of them in either copy: the
    same length and the other copy unchanged, but nothing to copy."""
    half = (len(tokens) - first) // 2
    start = first + half
    lo, hi = (first, start) if copy == 1 else (start, len(tokens))
    used = set(tokens[first:])
    spare = [t for t in pool if t not in used]
    if len(spare) < 1:
        raise ArgumentError("patch_from", "the probe's vocabulary has no token outside its "
                            "copies to corrupt a copy with")
    rng = random.Random(f"corrupt:{seed}" if copy == 2 else f"corrupt-first:{seed}")
    n = hi - lo
    fresh = rng.sample(spare, n) if len(spare) >= n else [rng.choice(spare) for _ in range(n)]
    return list(tokens[:lo]) + fresh + list(tokens[hi:])


def corrupt_second_copy(tokens: Sequence[int], first: int, pool: Sequence[int],
                        seed: int = 0) -> list[int]:
    """`corrupt_copy` of the second copy."""
    return corrupt_copy(tokens, first, pool, seed, copy=2)
