"""Head scores: what one attention pattern does, as numbers in [0, 1].

Attention patterns are `[..., query, key]` (TransformerLens's `[batch, head, query, key]` with
the batch dimension dropped): row `t` is query position `t`'s probability distribution over
key positions `0..t` (causal), so every row sums to 1 and the upper triangle is 0.

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

import math
import string
from collections.abc import Sequence

import torch
from torch import Tensor

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
