"""The batches a training session reads: its tokenizer, the rows of token ids (the corpus's
token cache, or synthetic induction rows), which rows each optimizer step takes, and their copy
to the device. `open_batches` builds them in set-up; `Batches.train` and `Batches.val` are what
a step and an evaluation read.

Which rows. Every optimizer step draws the GLOBAL batch of `train.batch_size` offsets from one
torch.Generator seeded by run.seed (identical on every rank; its state is saved with every
checkpoint, so a resumed run draws what an uninterrupted one would); rank r takes the r-th
contiguous slice and splits it into micro-batches of `micro_batch_size`. Each micro-loss is
divided by the number of micro-batches per rank and DDP averages over ranks, so the gradient is
the mean over the global batch: a DDP run equals a single-process run up to float summation
order. Every evaluation reads the same validation offsets, drawn once from run.seed + 1.

A row is block_size + 1 ids; its batch is x, y = rows[:, :-1], rows[:, 1:], each (n,
block_size) int64 (y[:, t] is the token after x[:, t]), copied to the device: through pinned
memory, without waiting, to CUDA; contiguous copies elsewhere.

Corpus rows (`TokenRows`): an offset is a start position in the token cache data/cache.py prepares.

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
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from minigpt.config import Config, TrainConfig
from minigpt.data.cache import Dataset, prepare_dataset
from minigpt.data.tokenizer import Tokenizer, build_tokenizer
from minigpt.errors import ConfigError, MinigptError
from minigpt.events import DatasetReady, OnEvent, no_events
from minigpt.run.resume import Resumed
from minigpt.train.distributed import DistInfo, main_first
from minigpt.train.safety import check_memory

Batch = tuple[torch.Tensor, torch.Tensor]  # x, y: (n, block_size) int64 on the device
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

    def rows(self, split: str, offsets: torch.Tensor) -> torch.Tensor:
        """(n, block_size + 1) int64: the tokens at each offset (on the CPU)."""
        T, arr = self.block_size, self._split(split)
        return torch.from_numpy(np.stack([arr[o: o + T + 1] for o in offsets.tolist()])
                                .astype(np.int64))


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


def rows_for(cfg: Config, tokenizer: Tokenizer, on_event: OnEvent | None = None
             ) -> TokenRows | InductionRows:
    """The rows `cfg.data` trains on: synthetic induction rows, or the corpus's token cache
    (`data.prepare_dataset`: built once, then read from the cache)."""
    on_event = on_event or no_events
    dc, T = cfg.data, cfg.model.block_size
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


def to_device(rows: torch.Tensor, device: torch.device) -> Batch:
    """x, y of CPU rows (n, block_size + 1) on `device` (module docstring)."""
    x, y = rows[:, :-1], rows[:, 1:]
    if device.type == "cuda":
        return (x.pin_memory().to(device, non_blocking=True),
                y.pin_memory().to(device, non_blocking=True))
    return x.contiguous().to(device), y.contiguous().to(device)


# --------------------------------------------------------------------------------------------
# The session's batches.


@dataclass
class Batches:
    """What one session reads, as `open_batches` builds it (the module docstring)."""

    tokenizer: Tokenizer
    rows: TokenRows | InductionRows
    generator: torch.Generator  # the training batches' order (saved with every checkpoint)
    batch_size: int             # train.batch_size: the global batch, every rank's together
    micro: int                  # sequences per forward pass
    n_micro: int                # forward passes per step on this rank
    rank: int
    world: int
    device: torch.device
    eval_offsets: torch.Tensor  # the validation rows every evaluation reads

    def train(self) -> Iterator[Batch]:
        """This rank's micro-batches of the next global batch (its offsets drawn now, the rows
        read as the step consumes them)."""
        offsets = self.rows.sample_offsets("train", self.batch_size, self.generator)  # global
        per_rank = self.n_micro * self.micro
        mine = offsets[self.rank * per_rank:(self.rank + 1) * per_rank]
        return (self.get_batch("train", mine[m * self.micro:(m + 1) * self.micro])
                for m in range(self.n_micro))

    def val(self, every_rank: bool = False) -> Iterator[Batch]:
        """Micro-batches of the evaluation rows: this rank's share (every rank's rows with
        `every_rank`)."""
        mine = self.eval_offsets if every_rank else self.eval_offsets[self.rank::self.world]
        return (self.get_batch("val", mine[i:i + self.micro])
                for i in range(0, len(mine), self.micro))

    def get_batch(self, split: str, offsets: torch.Tensor) -> Batch:
        """The rows at `offsets` as x, y on the session's device."""
        return to_device(self.rows.rows(split, offsets), self.device)


def open_batches(cfg: Config, start: Resumed | None, device: torch.device, info: DistInfo,
                 on_event: OnEvent) -> Batches:
    """The batches of a session: the batch geometry, the tokenizer (the checkpoint's on resume,
    else built, rank 0 first), model.vocab_size fitted to it, the memory check, the rows (rank 0
    prepares the token cache first) and the data-order generator (seeded, or where the run left
    it). Rank 0 reports the tokenizer's and the data's preparation."""
    report = on_event if info.is_main else no_events
    micro, n_micro = batch_geometry(cfg.train, info)
    tokenizer = (Tokenizer.load(start.checkpoint.path) if start is not None
                 else main_first(lambda: build_tokenizer(cfg, report), info))
    fit_vocab(cfg, tokenizer)
    check_memory(cfg, micro, device)
    rows = main_first(lambda: rows_for(cfg, tokenizer, report), info)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    if start is not None:
        generator.set_state(start.rng.data)
    t = cfg.train
    return Batches(tokenizer, rows, generator, t.batch_size, micro, n_micro, info.rank,
                   info.world_size, device, validation_sample(rows, t, cfg.run.seed))


def validation_sample(rows: TokenRows | InductionRows, t: TrainConfig, seed: int
                      ) -> torch.Tensor:
    """The offsets every evaluation reads, drawn once: evaluations compare like with like."""
    return rows.sample_offsets("val", t.eval_batches * t.batch_size,
                               torch.Generator().manual_seed(seed + 1))


def batch_geometry(t: TrainConfig, info: DistInfo) -> tuple[int, int]:
    """(sequences per forward pass, forward passes per step on each rank): the global batch of
    train.batch_size is cut into one slice per rank, each into micro-batches."""
    micro = t.micro_batch_size or t.batch_size // info.world_size
    if micro == 0 or t.batch_size % (info.world_size * micro):
        raise ConfigError(
            f"train.batch_size: {t.batch_size} must be a multiple of the world size "
            f"({info.world_size}) x train.micro_batch_size ({micro})")
    return micro, t.batch_size // (info.world_size * micro)


def fit_vocab(cfg: Config, tokenizer: Tokenizer) -> None:
    """model.vocab_size 0 = the tokenizer's size; a size below it is refused."""
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.n_vocab
    elif cfg.model.vocab_size < tokenizer.n_vocab:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the "
                          f"tokenizer's {tokenizer.n_vocab} ids; use 0 (automatic)")
