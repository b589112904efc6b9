"""The RASP programs `minigpt compile` knows by name, and a user's own program file.

Each built-in program is causal (every position's output depends on that position and the
ones before it only, so a causal model computes it), small (a vocabulary of 3-4 tokens, 8
positions) and chosen so that its circuit differs from the others': one attention head that
selects by position; two heads composing (induction); an MLP feeding a numerical head; a
head and an MLP computing one operation together (SelectorWidth); two MLPs and two heads in
parallel feeding a third MLP; an MLP between two attention layers. tracr (the optional extra
`minigpt-lab[truth]`) is imported only when a program is built.

A program file is Python that defines `PROGRAM` (a RASP expression), `VOCAB` (a set of token
strings) and `MAX_SEQ_LEN` (the longest input, BOS not counted); it runs as `python FILE`
would, so give only files you wrote or trust.
"""

from __future__ import annotations

import runpy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from minigpt.errors import ArgumentError, MinigptError
from minigpt.files import shown

BOS = "BOS"  # tracr's compiler_bos as minigpt compiles: the first token of every input
PAD = "compiler_pad"  # tracr's padding token: an id of the model that no input uses
MAX_SEQ_LEN = 64  # the longest program input a compile accepts (benchmarks/README.md)
MAX_VOCAB = 64  # the most tokens a program's vocabulary may have
INSTALL = "pip install 'minigpt-lab[truth]'"


@dataclass(frozen=True)
class Program:
    """A RASP program to compile: its name, what it computes (one line), its vocabulary, its
    longest input (BOS not counted), the expression itself (`build()` makes it, importing
    tracr), and where it came from (`built-in` or a file's path)."""

    name: str
    summary: str
    vocab: tuple[str, ...]
    max_seq_len: int
    build: Callable[[], object]
    source: str = "built-in"


def tracr_modules():
    """(rasp, compiler modules) of tracr, or a MinigptError saying how to install it."""
    try:
        from tracr.compiler import (
            assemble,
            basis_inference,
            craft_graph_to_model,
            craft_model_to_transformer,
            expr_to_craft_graph,
            nodes,
            rasp_to_graph,
            validating,
        )
        from tracr.craft import bases, transformers
        from tracr.rasp import rasp
    except ImportError as e:
        raise MinigptError(f"minigpt compile needs tracr, which is not installed ({e.name} is "
                           f"missing): {INSTALL}") from None
    return rasp, {"assemble": assemble, "basis_inference": basis_inference,
                  "craft_graph_to_model": craft_graph_to_model,
                  "craft_model_to_transformer": craft_model_to_transformer,
                  "expr_to_craft_graph": expr_to_craft_graph, "nodes": nodes,
                  "rasp_to_graph": rasp_to_graph, "validating": validating, "bases": bases,
                  "transformers": transformers}


# --------------------------------------------------------------------------------------------
# The built-in programs.


def _shift(rasp, sop, name: str):
    """`sop` one position back (the value at the position before; None at the first): an
    attention head that selects the key whose index is the query's minus one."""
    select = rasp.Select(rasp.indices, rasp.indices, lambda k, q: q == k + 1)
    return rasp.Aggregate(select.named(f"{name}_select"), sop, default=None).named(name)


def _previous_token():
    rasp, _ = tracr_modules()
    return _shift(rasp, rasp.tokens, "previous_token")


def _induction():
    rasp, _ = tracr_modules()
    prev = _shift(rasp, rasp.tokens, "previous_token")
    match = rasp.Select(prev, rasp.tokens, rasp.Comparison.EQ).named("after_same_token")
    return rasp.Aggregate(match, rasp.tokens, default=None).named("induction")


def _frac_prevs():
    rasp, _ = tracr_modules()
    is_x = rasp.numerical(rasp.Map(lambda t: 1 if t == "x" else 0, rasp.tokens)).named("is_x")
    upto = rasp.Select(rasp.indices, rasp.indices, rasp.Comparison.LEQ).named("up_to_here")
    return rasp.numerical(rasp.Aggregate(upto, is_x, default=0)).named("frac_x")


def _count_token():
    rasp, _ = tracr_modules()
    same = rasp.Select(rasp.tokens, rasp.tokens, rasp.Comparison.EQ).named("same_token")
    return rasp.SelectorWidth(same).named("count")


def _paren_balance():
    rasp, _ = tracr_modules()

    def frac(token: str, name: str):
        hit = rasp.numerical(rasp.Map(lambda t: 1 if t == token else 0, rasp.tokens))
        upto = rasp.Select(rasp.indices, rasp.indices, rasp.Comparison.LEQ)
        return rasp.numerical(rasp.Aggregate(upto.named(f"{name}_upto"), hit.named(f"is_{name}"),
                                             default=0)).named(f"frac_{name}")

    opens, closes = frac("(", "open"), frac(")", "close")
    return rasp.numerical(rasp.LinearSequenceMap(opens, closes, 1, -1)).named("balance")


def _repeat_before():
    rasp, _ = tracr_modules()
    prev = _shift(rasp, rasp.tokens, "previous_token")
    repeat = rasp.SequenceMap(lambda a, b: 1 if a == b else 0, prev, rasp.tokens)
    return _shift(rasp, repeat.named("repeat"), "repeat_before")


BUILT_IN = {p.name: p for p in (
    Program("previous_token", "the previous token (one head selecting by position)",
            ("a", "b", "c", "d"), 8, _previous_token),
    Program("induction", "the token after the earlier occurrence of the current token (a "
            "previous-token head composing into a second head through its keys)",
            ("a", "b", "c", "d"), 8, _induction),
    Program("frac_prevs", "the fraction of the tokens so far that are x (an MLP feeding a "
            "numerical head; tracr's frac_prevs)", ("x", "y", "z"), 8, _frac_prevs),
    Program("count_token", "how often the current token has occurred so far (a head and an "
            "MLP computing one SelectorWidth)", ("a", "b", "c"), 8, _count_token),
    Program("paren_balance", "the fraction of ( minus the fraction of ) so far (two MLP -> "
            "head paths in parallel, summed by an MLP)", ("(", ")", "x"), 8, _paren_balance),
    Program("repeat_before", "whether the previous token repeated the one before it (an MLP "
            "between two attention layers)", ("a", "b", "c"), 8, _repeat_before),
)}


def built_in(name: str) -> Program:
    """The built-in program `name`, or an ArgumentError listing them."""
    if name not in BUILT_IN:
        raise ArgumentError("program", f"'{name}' is not a built-in program; valid: "
                            f"{', '.join(BUILT_IN)} (minigpt compile --list), or give your own "
                            "with --program-file FILE")
    return BUILT_IN[name]


# --------------------------------------------------------------------------------------------
# A user's program file.


def program_file(path: Path) -> Program:
    """The program a Python file defines (module docstring), checked: `PROGRAM` a RASP
    expression, `VOCAB` a set of 1..MAX_VOCAB token strings (no spaces, not BOS), `MAX_SEQ_LEN`
    an integer in 1..MAX_SEQ_LEN. Running the file is running its code; whatever it raises is
    one ArgumentError naming the file, the exception and its line."""
    where = Path(path)
    if not where.is_file():
        raise ArgumentError("program_file", "is not a file", subject=where)
    rasp, _ = tracr_modules()
    try:
        names = runpy.run_path(str(where), run_name="minigpt_program")
    except SystemExit as e:
        raise ArgumentError("program_file", f"exited (SystemExit {e.code}) while it ran; a "
                            "program file only defines PROGRAM, VOCAB and MAX_SEQ_LEN",
                            subject=where) from None
    except Exception as e:  # noqa: BLE001 - the user's code: whatever it raises is one line
        raise ArgumentError("program_file", f"raised {type(e).__name__}: {_first_line(e)}"
                            f"{_line_of(e, where)}; fix the file", subject=where) from None
    missing = [n for n in ("PROGRAM", "VOCAB", "MAX_SEQ_LEN") if n not in names]
    if missing:
        raise ArgumentError("program_file", f"defines no {', '.join(missing)}; a program file "
                            "defines PROGRAM (a RASP expression), VOCAB (a set of token "
                            "strings) and MAX_SEQ_LEN (the longest input)", subject=where)
    expr = names["PROGRAM"]
    if not isinstance(expr, rasp.SOp):
        raise ArgumentError("program_file", f"PROGRAM is a {type(expr).__name__}, not a RASP "
                            "sequence operation (rasp.SOp)", subject=where)
    vocab = check_vocab(names["VOCAB"], where)
    n = check_max_seq_len(names["MAX_SEQ_LEN"], where)
    return Program(where.stem, f"a program from {where.name}", vocab, n, lambda: expr,
                   source=str(where))


def check_vocab(vocab: object, where: Path) -> tuple[str, ...]:
    """VOCAB as a sorted tuple of its tokens, or an ArgumentError saying what is wrong."""
    if not isinstance(vocab, (set, frozenset, list, tuple)) or not vocab:
        raise ArgumentError("program_file", "VOCAB must be a non-empty set of token strings, "
                            f"e.g. {{'a', 'b', 'c'}}; got {_shown(vocab)}", subject=where)
    bad = [t for t in vocab if not isinstance(t, str) or not t or t.split() != [t]]
    if bad:
        raise ArgumentError("program_file", f"VOCAB holds {_shown(bad[0])}: every token is a "
                            "non-empty string without spaces (inputs are the tokens written "
                            "with spaces between them)", subject=where)
    if BOS in vocab or PAD in vocab:
        raise ArgumentError("program_file", f"VOCAB holds {BOS if BOS in vocab else PAD}, the "
                            "name tracr gives its own beginning (padding) token; rename it",
                            subject=where)
    if len(set(vocab)) > MAX_VOCAB:
        raise ArgumentError("program_file", f"VOCAB has {len(set(vocab))} tokens; at most "
                            f"{MAX_VOCAB} (the compiled model grows with it)", subject=where)
    return tuple(sorted(set(vocab)))


def check_max_seq_len(n: object, where: Path) -> int:
    if type(n) is not int or not 1 <= n <= MAX_SEQ_LEN:
        raise ArgumentError("program_file", f"MAX_SEQ_LEN is {_shown(n)}; valid: an integer in "
                            f"1..{MAX_SEQ_LEN} (the compiled model and the time to compile it "
                            "grow with it)", subject=where)
    return n


def _shown(value: object) -> str:
    return shown(repr(value), 60)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return shown(text[0], 120) if text else "(no message)"


def _line_of(e: BaseException, where: Path) -> str:
    """' (line N)' of the deepest frame of the traceback inside the file, or ''."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == where.resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None and isinstance(e, SyntaxError) and e.lineno:
        line = e.lineno
    return f" (line {line})" if line is not None else ""
