"""The rows of token ids a training session reads, made by `rows_for` from the `data.*` settings.
Each is block_size + 1 ids; a row maker draws offsets (`sample_offsets`) from a generator it is
given and reads the rows at them (`rows`), so a batch is a function of its offsets.
`minigpt.train.batches` decides which offsets each optimizer step and evaluation reads.

Corpus rows (`TokenRows`): an offset is a start position in the token cache cache.py prepares.

A text file's rows (`TextRows`, `text_rows`: `minigpt features --text-file`): an offset is a
start position in the file's tokens, its first 90% for training, the rest held out.

A compiled program's rows (`ProgramRows`, `data.source: program`; `minigpt features` on a run of
`minigpt compile`): the program's beginning token, then tokens of its vocabulary drawn uniformly
at random; an offset is a row's seed, as below.

Synthetic induction rows (`InductionRows`, `data.source: induction`): no corpus; an offset is a
per-sequence seed and the row is drawn from it, so a batch is a function of its offsets, as
the corpus's batches are. Its ids are in [0, data.induction_vocab), in one of two layouts:
- induction_min_period = 0: a random block r of block_size // 2 ids repeated, x = [r, r] (plus
  r[0] when block_size is odd); the second half is predictable from the first.
- induction_min_period = m > 0: back-to-back pairs (s, s) of random segments, each segment's
  length drawn from [m, induction_max_period or block_size // 2] (the last one shortened to fit,
  at least 2; a tail too short for that stays random). The distance between a token and its
  copy changes from pair to pair, so only content matching (an induction head) predicts the
  copies: one fixed period, or a sequence repeated periodically, can be predicted by heads that
  attend at fixed offsets, which is not induction.
With induction_distinct, a row's new ids (segments and tail) are drawn without replacement, so
every repeated id in a row is part of a copy, as in the induction probe: no chance repeats that
an induction head would mispredict. Measured on an earlier configs/induction.yaml: without it
the induction score sank from ~0.95 to 0.74-0.87 as training went on; with it 0.897-0.981.

induction_groups = k > 0: the ids form k groups of consecutive ids ([0, V/k), [V/k, 2V/k), ...),
every id has a fixed random group (`pick`, the same for every run, as many ids picking each
group), and a new id is drawn from the group that the id two places before it picks (the first
two ids of a row from a random group). So the token before a position tells which group the
next new id comes from (log2 k bits of it): a layer-0 head that attends to the previous token
lowers the loss on every new id from the first steps, which is what an induction head then
builds on. The rest of a new id stays random, and a copy is predicted only by copying.

induction_runs = p > 0 (pairs layout): each pair is, with chance p, a run, one new id written 2n
times, instead of n new ids and their copy. A copy can be predicted by the textbook circuit
(layer 1 matches the current id against what a previous-token head wrote one place after its
earlier occurrence) or by a lag-k one (matching what a layer-0 head looking k back wrote, reading
what a head looking k - 1 back wrote): both are right whenever the earlier occurrence is at least
k places back, and in plain pairs it always is (a segment has at least induction_min_period ids),
so which lag a seed learns is chance while the induction probe scores lag 1 only. Inside a run
the earlier occurrence is one place back, where only lag 1 predicts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from minigpt.config import Config
from minigpt.data.cache import Dataset, prepare_dataset
from minigpt.data.tokenizer import Tokenizer
from minigpt.errors import ArgumentError, MinigptError
from minigpt.events import DatasetReady, OnEvent, no_events
from minigpt.files import read_text

HELD_OUT_FRACTION = 0.1  # of a text file's tokens (`text_rows`), of a file of activations


def held_out_count(n: int) -> int:
    """How many of `n` tokens or rows are held out: the last HELD_OUT_FRACTION of them, at
    least one."""
    return max(1, n - int(n * (1 - HELD_OUT_FRACTION)))

_SALT = {"train": 0, "val": 1}  # induction: train and val rows come from different streams


def _salt(split: str) -> int:
    if split not in _SALT:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return _SALT[split]


@dataclass
class TokenRows:
    """Rows of the corpus's token cache: an offset is a start position in a split."""

    data: Dataset
    block_size: int

    @property
    def bytes_per_token(self) -> float:
        return self.data.bytes_per_token

    def _split(self, split: str) -> np.ndarray:
        _salt(split)
        return self.data.train if split == "train" else self.data.val

    def sample_offsets(self, split: str, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n,) int64 start positions in [0, len(split) - block_size), drawn from `generator`."""
        arr = self._split(split)
        return torch.randint(len(arr) - self.block_size, (n,), generator=generator,
                             dtype=torch.long)

    def epoch_offsets(self, first: int, n: int, seed: int) -> torch.Tensor:
        """(n,) start positions of training rows `first` .. `first + n - 1` read in epochs
        (train.data_order epochs): epoch e holds the W = (len(train) - block_size) //
        block_size back-to-back windows that start at a phase p_e in [0, block_size), in a
        shuffled order; p_e and the order are drawn from a generator seeded by (seed, e), so a
        row's offset is a function of its number (a resumed run reads what an uninterrupted
        one would). Row r is window r % W of epoch r // W."""
        T = self.block_size
        per_epoch = (len(self.data.train) - T) // T  # windows that fit at any phase
        if per_epoch < 1:
            raise MinigptError(f"the training split holds {len(self.data.train)} tokens, too few "
                               f"for one window of model.block_size={T} at every phase; use "
                               "train.data_order random")
        rows = torch.arange(first, first + n)
        out = torch.empty(n, dtype=torch.long)
        for e in torch.unique(rows // per_epoch).tolist():
            phase, order = self._epoch(e, per_epoch, seed)
            here = rows // per_epoch == e
            out[here] = phase + order[rows[here] % per_epoch] * T
        return out

    def _epoch(self, e: int, per_epoch: int, seed: int) -> tuple[int, torch.Tensor]:
        """Epoch e's phase and window order (the last epoch asked for is kept)."""
        if getattr(self, "_last_epoch", (None,))[0] != e:
            g = torch.Generator().manual_seed((seed * 1_000_003 + e) % 2**63)
            phase = int(torch.randint(self.block_size, (1,), generator=g))
            self._last_epoch = (e, phase, torch.randperm(per_epoch, generator=g))
        return self._last_epoch[1], self._last_epoch[2]

    def rows(self, split: str, offsets: torch.Tensor) -> torch.Tensor:
        """(n, block_size + 1) int64: the tokens at each offset (on the CPU)."""
        T, arr = self.block_size, self._split(split)
        return torch.from_numpy(np.stack([arr[o: o + T + 1] for o in offsets.tolist()])
                                .astype(np.int64))

    def seen(self, n_vocab: int) -> torch.Tensor:
        """(n_vocab,) bool: the ids the training split holds."""
        counts = np.bincount(np.asarray(self.data.train), minlength=n_vocab)[:n_vocab]
        return torch.from_numpy(counts > 0)


@dataclass
class ProgramRows:
    """A compiled program's random inputs (the module docstring): an offset is a row's seed."""

    block_size: int
    ids: list[int]     # the program's tokens
    bos: int           # its beginning token, first in every row
    bytes_per_token: float = 1.0  # no text: bits per "byte" are bits per token

    def sample_offsets(self, split: str, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n,) int64 sequence seeds drawn from `generator`."""
        _salt(split)
        return torch.randint(2**62, (n,), generator=generator, dtype=torch.long)

    def rows(self, split: str, offsets: torch.Tensor) -> torch.Tensor:
        """(n, block_size + 1) ids: BOS, then ids of the program drawn from seed offsets[i]."""
        salt, g = _salt(split), torch.Generator()
        ids = torch.tensor(self.ids, dtype=torch.long)
        rows = torch.full((len(offsets), self.block_size + 1), self.bos, dtype=torch.long)
        for i, seed in enumerate(offsets.tolist()):
            g.manual_seed(int(seed) * 2 + salt)
            rows[i, 1:] = ids[torch.randint(len(ids), (self.block_size,), generator=g)]
        return rows


@dataclass
class InductionRows:
    """Synthetic induction rows (the module docstring): an offset is a row's seed."""

    block_size: int
    vocab: int               # data.induction_vocab: ids in [0, vocab)
    min_period: int = 0      # > 0: pairs layout, segment lengths from [this, max_period]
    max_period: int = 0      # 0: block_size // 2
    distinct: bool = False   # new ids of a row drawn without replacement
    groups: int = 0          # data.induction_groups: a new id's group set by the id two back
    runs: float = 0.0        # data.induction_runs: the chance a pair is a run of one id
    bytes_per_token: float = 1.0  # no text: bits per "byte" are bits per token

    def __post_init__(self) -> None:
        # groups: one fixed random group per id (as many ids pick each), the same for every run
        k = max(1, self.groups)
        self.pick = (torch.randperm(self.vocab, generator=torch.Generator().manual_seed(0)) % k
                     ).tolist()
        # group g holds the ids [bounds[g], bounds[g + 1]): contiguous, sizes differ by <= 1
        self.bounds = [self.vocab * g // k for g in range(k + 1)]

    def seen(self, n_vocab: int) -> torch.Tensor:
        """(n_vocab,) bool: the ids the rows can hold, [0, vocab)."""
        return torch.arange(n_vocab) < self.vocab

    def sample_offsets(self, split: str, n: int, generator: torch.Generator) -> torch.Tensor:
        """(n,) int64 sequence seeds drawn from `generator`."""
        _salt(split)
        return torch.randint(2**62, (n,), generator=generator, dtype=torch.long)

    def rows(self, split: str, offsets: torch.Tensor) -> torch.Tensor:
        """(n, block_size + 1) ids: row i is drawn from seed offsets[i] (module docstring)."""
        salt = _salt(split)
        T1 = self.block_size + 1
        half = max(1, self.block_size // 2)
        g = torch.Generator()
        rows = torch.empty(len(offsets), T1, dtype=torch.long)
        for i, seed in enumerate(offsets.tolist()):
            if self.groups:  # drawn id by id: Python's generator is the faster one for that
                rows[i] = torch.tensor(self._groups_row(random.Random(int(seed) * 2 + salt),
                                                        T1, half))
                continue
            g.manual_seed(int(seed) * 2 + salt)
            # New ids: i.i.d. draws, or (distinct) a permutation's prefix: no id repeats by chance.
            fresh = (torch.randperm(self.vocab, generator=g) if self.distinct
                     else torch.randint(self.vocab, (T1,), generator=g))
            if not self.min_period:  # [r, r]: one block of `half` ids repeated
                rows[i] = fresh[:half].repeat(math.ceil(T1 / half))[:T1]
            else:
                rows[i] = self._pairs(fresh, g, T1, half)
        return rows

    def _pairs(self, fresh: torch.Tensor, g: torch.Generator, T1: int, half: int) -> torch.Tensor:
        """One row of back-to-back pairs (s, s) of segments (module docstring)."""
        lo, hi = self.min_period, self.max_period or half
        # i.i.d.: each segment is the draws at its own positions; distinct: filled below
        row = torch.empty(T1, dtype=torch.long) if self.distinct else fresh.clone()
        pos, used = 0, 0  # positions filled; ids of `fresh` consumed (distinct)
        while (T1 - pos) // 2 >= 2:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), (T1 - pos) // 2)
            run = self.runs and float(torch.rand((), generator=g)) < self.runs
            if self.distinct:
                row[pos: pos + n] = fresh[used] if run else fresh[used: used + n]
                used += 1 if run else n
            elif run:
                row[pos: pos + n] = row[pos]
            row[pos + n: pos + 2 * n] = row[pos: pos + n]  # the copy of this segment
            pos += 2 * n
        if self.distinct:
            row[pos:] = fresh[used: used + T1 - pos]  # a tail too short for a pair: new ids
        return row

    def _groups_row(self, rng: random.Random, T1: int, half: int) -> list[int]:
        """One row (either layout) whose new ids follow the groups rule (module docstring)."""
        k, bounds = self.groups, self.bounds
        row: list[int] = []
        used: set[int] = set()
        left = [bounds[g + 1] - bounds[g] for g in range(k)]  # ids not used yet (distinct)

        def new() -> int:
            g = self.pick[row[-2]] if len(row) >= 2 else rng.randrange(k)
            while self.distinct and not left[g]:
                g = (g + 1) % k  # this group is used up (a tiny vocabulary)
            lo, hi = bounds[g], bounds[g + 1]
            while True:  # distinct: draw again until the id is new to the row
                v = lo + int(rng.random() * (hi - lo))
                if not self.distinct or v not in used:
                    used.add(v)
                    left[g] -= 1
                    return v

        if not self.min_period:  # [r, r]
            for _ in range(half):
                row.append(new())
            return (row * math.ceil(T1 / half))[:T1]
        lo, hi = self.min_period, self.max_period or half
        while (T1 - len(row)) // 2 >= 2:
            n = min(rng.randint(lo, hi), (T1 - len(row)) // 2)
            start = len(row)
            if self.runs and rng.random() < self.runs:
                row += [new()] * n
            else:
                for _ in range(n):
                    row.append(new())
            row += row[start:]  # the copy of this segment
        while len(row) < T1:  # a tail too short for a pair: new ids
            row.append(new())
        return row


@dataclass
class TextRows:
    """Rows of a text file's tokens, with the interface of data.rows.TokenRows."""

    train: Tensor  # 1-D int64
    val: Tensor
    block_size: int

    def _split(self, split: str) -> Tensor:
        return self.train if split == "train" else self.val

    def sample_offsets(self, split: str, n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(len(self._split(split)) - self.block_size, (n,),
                             generator=generator, dtype=torch.long)

    def rows(self, split: str, offsets: Tensor) -> Tensor:
        arr, T = self._split(split), self.block_size
        return torch.stack([arr[o:o + T + 1] for o in offsets.tolist()])

    def seen(self, n_vocab: int) -> Tensor:
        """(n_vocab,) bool: the ids the training part holds."""
        return torch.bincount(self.train, minlength=n_vocab)[:n_vocab] > 0


def text_rows(path: Path, tokenizer, block_size: int) -> TextRows:
    """The rows of the text file `path` (its tokens, 90% / 10%); an ArgumentError naming
    --text-file when either part is shorter than one row of block_size + 1 tokens."""
    ids = torch.tensor(tokenizer.encode(read_text(path, "text_file")), dtype=torch.long)
    cut = len(ids) - held_out_count(len(ids))
    need = block_size + 1
    if len(ids) - cut < need + 1 or cut < need + 1:
        raise ArgumentError("text_file", f"has {len(ids)} tokens; features need at least "
                            f"{math.ceil((need + 1) / HELD_OUT_FRACTION)} (a row of "
                            f"block_size + 1 = {need} held out, the last "
                            f"{HELD_OUT_FRACTION:.0%}, and the rest to train on); give a "
                            "longer text", subject=path)
    return TextRows(ids[:cut], ids[cut:], block_size)


def rows_for(cfg: Config, tokenizer: Tokenizer, on_event: OnEvent | None = None
             ) -> TokenRows | InductionRows:
    """The rows `cfg.data` trains on: synthetic induction rows, or the corpus's token cache
    (`cache.prepare_dataset`: built once, then read from the cache)."""
    on_event = on_event or no_events
    dc, T = cfg.data, cfg.model.block_size
    if dc.source == "program":
        return ProgramRows(T, sorted(set(tokenizer.ranks.values())), tokenizer.eot_id)
    if dc.source != "induction":
        return TokenRows(prepare_dataset(cfg, tokenizer, on_event), T)
    if dc.induction_vocab > tokenizer.n_vocab:
        raise MinigptError(f"data.induction_vocab: {dc.induction_vocab} exceeds the "
                           f"tokenizer's {tokenizer.n_vocab} ids; lower it")
    lo, hi = dc.induction_min_period, dc.induction_max_period or T // 2
    rows = (f"segments of {lo}-{hi} random ids, each followed by its copy" if lo else
            f"a block of {T // 2} random ids repeated")
    on_event(DatasetReady(None, 0, 0, cached=False, synthetic=(
        f"synthetic induction rows of {T + 1} ids from 0..{dc.induction_vocab - 1} ("
        f"{rows}{', no id twice' if dc.induction_distinct else ''}), drawn fresh for "
        "every batch")))
    return InductionRows(T, dc.induction_vocab, dc.induction_min_period,
                         dc.induction_max_period, dc.induction_distinct, dc.induction_groups,
                         dc.induction_runs)


