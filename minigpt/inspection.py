"""What each attention head attends to: attention extraction, head scores, synthetic probes.

Everything here returns data (tensors, dataclasses, dicts); `cli.py` renders tables, and
`heatmap.py` / `viewer.py` turn an `Inspection` into PNG / HTML files.

Attention patterns are `[layer, head, query, key]` after the batch dimension is dropped: row `t`
of a map is query position `t`'s probability distribution over key positions `0..t` (causal),
so every row sums to 1 and the upper triangle is 0.

Head scores (each in [0, 1], one number per (layer, head); NaN when the input has no query the
score applies to, e.g. no repeated token for `induction`). `A[t, j]` is the attention from query
t to key j, T the number of tokens, `x` the token ids:

- previous: mean over t = 1..T-1 of A[t, t-1].
- induction: over queries t whose token occurred before at some s with s+1 < t, the attention
  mass on those positions s+1 (the token right after each earlier occurrence), averaged over such
  queries. On the `induction` probe (random tokens r_0..r_{n-1} repeated twice, no repeats
  within a copy) the queries are exactly the second copy and the target of query n+i is i+1.
- duplicate: over queries t whose token occurred before, the attention mass on the earlier
  occurrences s < t with x[s] == x[t], averaged over such queries.
- first (sink): mean over t = 1..T-1 of A[t, 0] (t = 0 is excluded: it can only attend to 0).
- self: mean over t = 1..T-1 of A[t, t].
- local: mean over t = W..T-1 of the mass on keys t-W..t (the query and the W tokens before it),
  W = LOCAL_WINDOW; queries t < W see nothing outside the window and are excluded.
- delimiter: over queries t that see an earlier delimiter token (whitespace-only or punctuation),
  the attention mass m_t on delimiter keys j < t in excess of a uniform head's f_t = (number of
  such keys) / (t+1): max(0, (m_t - f_t) / (1 - f_t)), averaged (needs the token strings).
- entropy: mean over t = 1..T-1 of H_t / ln(t+1), H_t = -sum_j A[t,j] ln A[t,j]: 0 = all
  attention on one key, 1 = uniform over the t+1 visible keys.

Dominant type (`dominant_type`): the pattern score (induction, previous, duplicate, first, self,
delimiter) with the highest value if it is >= DOMINANT_THRESHOLD; otherwise `diffuse` if
entropy >= DIFFUSE_ENTROPY (close to uniform); otherwise `local` if the local score is
>= DOMINANT_THRESHOLD; otherwise `mixed`. Ties go to the earlier type in that list. `n/a`
when no score applies (a single token). Thresholds: DOMINANT_THRESHOLD = 0.4, DIFFUSE_ENTROPY =
0.7, LOCAL_WINDOW = 3.
"""

from __future__ import annotations

import json
import math
import random
import string
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from minigpt.config import MinigptError
from minigpt.rundir import atomic_write_bytes

LOCAL_WINDOW = 3
DOMINANT_THRESHOLD = 0.4
DIFFUSE_ENTROPY = 0.7
# Order matters twice: table columns, and ties in `dominant_type` go to the earlier name.
PATTERN_SCORES = ("induction", "previous", "duplicate", "first", "self", "delimiter")
SCORE_NAMES = PATTERN_SCORES + ("local", "entropy")
SCORE_HELP = {
    "induction": "attention to the token right after an earlier occurrence of the query's token",
    "previous": "attention from position t to t-1",
    "duplicate": "attention to earlier occurrences of the query's own token",
    "first": "attention to position 0 (attention sink)",
    "self": "attention to the query's own position (diagonal)",
    "delimiter": "attention to earlier whitespace/punctuation tokens beyond a uniform head's",
    "local": f"attention to the query and the {LOCAL_WINDOW} tokens before it",
    "entropy": "entropy of each query's distribution / ln(visible keys): 0 focused, 1 uniform",
}
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
FORMATS = ("table", "png", "html", "safetensors", "json")
_DELIMITER_CHARS = set(string.punctuation) | set(" \t\r\n\f\v")


# --------------------------------------------------------------------------------------------
# Scores on an attention tensor (..., T, T); leading dims are kept, e.g. (n_layer, n_head).


def _masked_mean(mass: Tensor, rows: Tensor) -> Tensor:
    """Mean of `mass[..., t]` over query positions where `rows[t]`; NaN when no row qualifies."""
    n = int(rows.sum())
    if n == 0:
        return torch.full(mass.shape[:-1], float("nan"))
    return (mass * rows).sum(-1) / n


def score_heads(attn: Tensor, tokens: Sequence[int],
                token_strs: Sequence[str] | None = None) -> dict[str, Tensor]:
    """All head scores (see the module docstring) for `attn` of shape (..., T, T), float.

    Returns {name: tensor of shape attn.shape[:-2]} for every name in SCORE_NAMES, in [0, 1] or
    NaN. `tokens` (length T) are the ids; `token_strs` (length T) enable the delimiter score."""
    attn = attn.detach().to(torch.float64).cpu()
    T = attn.shape[-1]
    if attn.shape[-2] != T or len(tokens) != T:
        raise ValueError(f"attention (..., {attn.shape[-2]}, {T}) does not match "
                         f"{len(tokens)} tokens")
    x = torch.as_tensor(list(tokens))
    q = torch.arange(T).unsqueeze(1)   # (T, 1) query positions
    k = torch.arange(T).unsqueeze(0)   # (1, T) key positions
    after_first = torch.arange(T) >= 1  # queries t = 1..T-1
    diag = attn.diagonal(dim1=-2, dim2=-1)  # (..., T): A[t, t]
    scores: dict[str, Tensor] = {}

    # previous: A[t, t-1]; diagonal(offset=-1)[i] = A[i+1, i]
    prev = attn.diagonal(offset=-1, dim1=-2, dim2=-1)
    scores["previous"] = prev.mean(-1) if T >= 2 else torch.full(attn.shape[:-2], float("nan"))

    # same[t, j]: key j holds the query's token and lies strictly before it
    same = (x.unsqueeze(1) == x.unsqueeze(0)) & (k < q)
    scores["duplicate"] = _masked_mean((attn * same).sum(-1), same.any(-1))

    # induction targets: key j = s+1 where x[s] == x[t], s+1 < t
    ind = torch.zeros(T, T, dtype=torch.bool)
    ind[:, 1:] = same[:, :-1] & (k[:, 1:] < q)
    scores["induction"] = _masked_mean((attn * ind).sum(-1), ind.any(-1))

    scores["first"] = _masked_mean(attn[..., :, 0], after_first)
    scores["self"] = _masked_mean(diag, after_first)

    if token_strs is not None and len(token_strs) == T:
        is_delim = torch.tensor([bool(s) and set(s) <= _DELIMITER_CHARS for s in token_strs])
        delim = is_delim.unsqueeze(0) & (k < q)  # (T, T): earlier delimiter keys
        # excess over a uniform head, whose mass on them is f_t = (#earlier delimiters) / (t+1):
        # otherwise a diffuse head on whitespace-heavy text would look like a delimiter head
        f = delim.sum(-1).double() / (torch.arange(T) + 1)  # (T,), < 1 (the query is no key)
        excess = ((attn * delim).sum(-1) - f) / (1 - f)
        scores["delimiter"] = _masked_mean(excess.clamp_min(0.0), delim.any(-1))
    else:
        scores["delimiter"] = torch.full(attn.shape[:-2], float("nan"))

    window = (k <= q) & (k >= q - LOCAL_WINDOW)
    scores["local"] = _masked_mean((attn * window).sum(-1), torch.arange(T) >= LOCAL_WINDOW)

    # entropy with 0 ln 0 = 0, normalised by ln(t+1) = the entropy of a uniform row
    plogp = torch.where(attn > 0, attn * attn.clamp_min(1e-300).log(), torch.zeros(()))
    norm = torch.log(torch.arange(T, dtype=torch.float64) + 1).clamp_min(1e-12)
    scores["entropy"] = _masked_mean(-plogp.sum(-1) / norm, after_first)
    return {name: scores[name].to(torch.float32) for name in SCORE_NAMES}


def dominant_type(scores: dict[str, float]) -> str:
    """The head's dominant type under the rule in the module docstring."""
    def val(name: str) -> float:
        v = scores.get(name, float("nan"))
        return -1.0 if v is None or math.isnan(v) else float(v)

    if all(val(n) < 0 for n in SCORE_NAMES):
        return "n/a"  # a single token: nothing to score
    best = max(PATTERN_SCORES, key=lambda n: (val(n), -PATTERN_SCORES.index(n)))
    if val(best) >= DOMINANT_THRESHOLD:
        return best
    if val("entropy") >= DIFFUSE_ENTROPY:
        return "diffuse"
    if val("local") >= DOMINANT_THRESHOLD:
        return "local"
    return "mixed"


# --------------------------------------------------------------------------------------------
# Synthetic probes: token ids only, seeded, valid for the run's vocabulary.


def probe_tokens(name: str, length: int, pool: Sequence[int], seed: int = 0) -> list[int]:
    """Token ids of the built-in probe `name` (one of PROBES), `length` tokens drawn from `pool`.

    induction: n = length // 2 tokens (distinct when the pool allows) repeated twice (length is
    rounded down to even); previous: distinct tokens when the pool allows; duplicate: tokens from
    8 ids of the pool. Deterministic in (name, length, pool, seed)."""
    if name not in PROBES:
        raise MinigptError(f"--probe: '{name}' is not a probe; valid: {', '.join(PROBES)}")
    if length < 2:
        raise MinigptError(f"--probe {name}: needs at least 2 tokens, got {length}")
    pool = list(pool)
    if not pool:
        raise MinigptError(f"--probe {name}: the run's vocabulary has no ordinary tokens")
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


def visible_token(s: str, max_len: int = 0) -> str:
    """A token's text for labels: whitespace made visible (space ·, newline ↵, tab →), other
    control characters as \\xNN, shortened to `max_len` characters with … (0 = no limit)."""
    out = []
    for ch in s:
        if ch == " ":
            out.append("·")
        elif ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("→")
        elif ch == "\r":
            out.append("␍")
        elif ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    text = "".join(out) or "∅"
    if max_len and len(text) > max_len:
        text = text[: max_len - 1] + "…"
    return text


# --------------------------------------------------------------------------------------------
# Attention from a model.


@dataclass
class Inspection:
    """Attention of every head on one input, with the head scores.

    attention: (n_layer, n_head, T, T) float32 on CPU, from the explicit attention path.
    scores: name -> (n_layer, n_head) float32 (NaN = not applicable to this input).
    parity_max_diff: max |logits_explicit - logits_sdpa| on the same input."""

    tokens: list[int]
    token_strs: list[str]
    attention: Tensor
    scores: dict[str, Tensor]
    parity_max_diff: float
    parity_tol: float
    source: str                      # "text", "probe:induction", ...
    run: str = ""
    step: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def n_layer(self) -> int:
        return self.attention.shape[0]

    @property
    def n_head(self) -> int:
        return self.attention.shape[1]

    @property
    def parity_ok(self) -> bool:
        return self.parity_max_diff <= self.parity_tol

    def head_scores(self, layer: int, head: int) -> dict[str, float]:
        return {n: float(self.scores[n][layer, head]) for n in SCORE_NAMES}

    def dominant(self, layer: int, head: int) -> str:
        return dominant_type(self.head_scores(layer, head))

    def to_json(self, layers: Sequence[int] | None = None,
                heads: Sequence[int] | None = None) -> dict:
        """The scores as a JSON-ready dict (NaN -> null), for `--json` and `--format json`."""
        layers = list(range(self.n_layer)) if layers is None else list(layers)
        heads = list(range(self.n_head)) if heads is None else list(heads)
        rows = []
        for layer in layers:
            for head in heads:
                s = self.head_scores(layer, head)
                rows.append({"layer": layer, "head": head, "dominant": dominant_type(s),
                             **{n: (None if math.isnan(v) else round(v, 6))
                                for n, v in s.items()}})
        return {"run": self.run, "step": self.step, "source": self.source,
                "n_layer": self.n_layer, "n_head": self.n_head, "n_tokens": len(self.tokens),
                "tokens": self.tokens, "token_strs": self.token_strs,
                "parity_max_abs_diff": self.parity_max_diff, "parity_ok": self.parity_ok,
                "score_definitions": SCORE_HELP, "heads": rows}


@torch.no_grad()
def attention_maps(model, tokens: Sequence[int], device: torch.device | str = "cpu"
                   ) -> tuple[Tensor, float]:
    """Run `model` on `tokens` (one sequence) through the explicit attention path and the SDPA
    path. Returns (attention (n_layer, n_head, T, T) float32 CPU, max |logit difference|)."""
    was_training = model.training
    model.eval()
    try:
        idx = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # (1, T)
        logits_explicit, maps = model.forward_with_attention(idx)
        logits_sdpa = _sdpa_logits(model, idx)
    finally:
        model.train(was_training)
    attn = torch.stack([m[0] for m in maps]).float().cpu()  # n_layer x (H, T, T)
    diff = (logits_explicit.float() - logits_sdpa.float()).abs().max().item()
    return attn, diff


def _sdpa_logits(model, idx: Tensor) -> Tensor:
    """Logits from the fused (SDPA) path, whatever attn_impl the run was trained with."""
    cfg = model.cfg
    saved = cfg.attn_impl
    cfg.attn_impl = "sdpa"
    try:
        logits, _ = model(idx)
    finally:
        cfg.attn_impl = saved
    return logits


def inspect(model, tokens: Sequence[int], token_strs: Sequence[str], *,
            device: torch.device | str = "cpu", source: str = "text", run: str = "",
            step: int = 0) -> Inspection:
    """Attention maps and head scores of `model` on `tokens` (already within block_size)."""
    if not tokens:
        raise MinigptError("the input has no tokens; give some text")
    attn, diff = attention_maps(model, tokens, device)
    # probes are random ids: their "whitespace/punctuation" tokens are no sentence structure
    strs_for_scores = None if source.startswith("probe:") else token_strs
    dev = torch.device(device)
    # fp32 on CPU agrees to ~1e-6; GPU kernels (TF32, other reduction orders) drift further
    tol = 1e-4 if dev.type == "cpu" else 1e-2
    return Inspection(tokens=list(tokens), token_strs=list(token_strs), attention=attn,
                      scores=score_heads(attn, tokens, strs_for_scores), parity_max_diff=diff,
                      parity_tol=tol, source=source, run=run, step=step)


# --------------------------------------------------------------------------------------------
# Files: durable writes (rundir.atomic_write_bytes: temp file, fsync, rename, fsync the dir).


def check_out_dir(out_dir: Path) -> Path:
    """Create `out_dir` if needed and prove it is writable; MinigptError (one line) if not."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise MinigptError(f"--out {out_dir}: cannot write there ({e.strerror or e}); "
                           "give a writable directory with --out") from None
    return out_dir


def write_output(path: Path, data: bytes) -> Path:
    atomic_write_bytes(path, data)
    return path


def write_json(insp: Inspection, path: Path, layers: Sequence[int] | None = None,
               heads: Sequence[int] | None = None) -> Path:
    text = json.dumps(insp.to_json(layers, heads), indent=2, ensure_ascii=False)
    return write_output(path, (text + "\n").encode("utf-8"))


def write_safetensors(insp: Inspection, path: Path) -> Path:
    """The raw attention `attention` (n_layer, n_head, T, T) float32 and `tokens` (T,) int64;
    metadata (strings): tokens / token_strs as JSON, run, step, source, layout."""
    from safetensors.torch import save

    meta = {"tokens": json.dumps(insp.tokens), "token_strs": json.dumps(insp.token_strs),
            "run": insp.run, "step": str(insp.step), "source": insp.source,
            "layout": "attention[layer, head, query, key]", "format": "minigpt-attention/1"}
    blob = save({"attention": insp.attention.contiguous(),
                 "tokens": torch.tensor(insp.tokens, dtype=torch.int64)}, metadata=meta)
    return write_output(path, blob)


# --------------------------------------------------------------------------------------------
# Choosing the input and the heads (the command's argument checks, as one-line MinigptErrors).


@dataclass
class ProbeInput:
    """The token ids to inspect, their strings, where they came from, and notes for the user."""

    tokens: list[int]
    token_strs: list[str]
    source: str
    notes: list[str] = field(default_factory=list)


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
                  seed: int = 0) -> ProbeInput:
    """Tokens for inspect-heads from exactly one of text / text_file / probe (none: DEFAULT_TEXT).

    At most `max_tokens` tokens (default and maximum: model.block_size); longer text is cut to
    its first `max_tokens` tokens with a note. Probes are `max_tokens` tokens long."""
    given = [n for n, v in (("--text", text), ("--text-file", text_file), ("--probe", probe))
             if v is not None]
    if len(given) > 1:
        raise MinigptError(f"{' and '.join(given)} exclude each other: give one input")
    block = cfg.model.block_size
    if max_tokens is None:
        max_tokens = block
    elif not 2 <= max_tokens <= block:
        raise MinigptError(f"--max-tokens {max_tokens}: out of range; valid: 2..{block} "
                           f"(the run's model.block_size)")
    notes: list[str] = []
    if probe is not None:
        ids = probe_tokens(probe, max_tokens, probe_pool(cfg, tokenizer), seed)
        return ProbeInput(ids, [tokenizer.token_str(i) for i in ids], f"probe:{probe}", notes)
    source = "text"
    if text_file is not None:
        text = read_text_file(text_file)
        source = f"file:{text_file}"
    elif text is None:
        text, source = DEFAULT_TEXT, "default text"
    if not text.strip():
        flag = "--text-file" if text_file is not None else "--text"
        raise MinigptError(f"{flag}: the text is empty; give some text to inspect")
    ids = tokenizer.encode(text)
    if len(ids) > max_tokens:
        notes.append(f"the text has {len(ids)} tokens; inspecting the first {max_tokens} "
                     f"(block_size {block}; see --max-tokens)")
        ids = ids[:max_tokens]
    return ProbeInput(ids, [tokenizer.token_str(i) for i in ids], source, notes)


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's contents, or a one-line MinigptError saying what is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise MinigptError(f"--text-file {path}: is a directory; give a text file") from None
    except OSError as e:
        raise MinigptError(f"--text-file {path}: cannot read it ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MinigptError(f"--text-file {path}: not UTF-8 text (invalid byte at offset "
                           f"{e.start}); give a UTF-8 text file") from None
    if "\x00" in text:
        raise MinigptError(f"--text-file {path}: contains NUL bytes (a binary file?); give a "
                           "text file")
    return text


def select_heads(n_layer: int, n_head: int, layers: Sequence[int] = (),
                 heads: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Validate --layer / --head values (empty = all); MinigptError names the valid range."""
    for flag, values, n in (("--layer", layers, n_layer), ("--head", heads, n_head)):
        for v in values:
            if not 0 <= v < n:
                raise MinigptError(f"{flag} {v}: out of range; valid: 0..{n - 1}")
    return (sorted(set(layers)) or list(range(n_layer)), sorted(set(heads)) or list(range(n_head)))


def parse_formats(values: Sequence[str]) -> list[str]:
    """--format values (repeatable, or comma-separated), validated against FORMATS."""
    out: list[str] = []
    for value in values:
        for name in (v.strip().lower() for v in value.split(",")):
            if name not in FORMATS:
                raise MinigptError(f"--format: '{name}' is not a format; valid: "
                                   f"{', '.join(FORMATS)}")
            if name not in out:
                out.append(name)
    return out or ["table"]
