"""The batches a training session reads: its tokenizer, its rows of token ids
(`minigpt.data.rows`: the corpus's token cache, or synthetic induction rows), which rows each
optimizer step takes, and their copy to the device. `open_batches` builds them in set-up;
`Batches.train` and `Batches.val` are what a step and an evaluation read.

Which rows. Every optimizer step draws the GLOBAL batch of `train.batch_size` offsets from one
torch.Generator seeded by run.seed (identical on every rank; its state is saved with every
checkpoint, so a resumed run draws what an uninterrupted one would), or, with train.data_order
epochs, reads the next `train.batch_size` rows of the epochs (`TokenRows.epoch_offsets`: a
function of the step and run.seed, so a resumed run reads them too); rank r takes the r-th
contiguous slice and splits it into micro-batches of `micro_batch_size`. Each micro-loss is
divided by the number of micro-batches per rank and DDP averages over ranks, so the gradient is
the mean over the global batch: a DDP run equals a single-process run up to float summation
order. Every evaluation reads the same validation offsets, drawn once from run.seed + 1.

A row is block_size + 1 ids; its batch is x, y = rows[:, :-1], rows[:, 1:], each (n,
block_size) int64 (y[:, t] is the token after x[:, t]), copied to the device: through pinned
memory, without waiting, to CUDA; contiguous copies elsewhere.

The rows themselves (windows of the corpus's token cache, or synthetic induction sequences)
are the data's design: `minigpt.data.rows` (`rows_for`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from minigpt.config import Config, TrainConfig
from minigpt.data.rows import InductionRows, TokenRows, rows_for
from minigpt.data.tokenizer import Tokenizer, build_tokenizer
from minigpt.errors import ConfigError
from minigpt.events import OnEvent, no_events
from minigpt.run.resume import Resumed
from minigpt.train.distributed import DistInfo, main_first
from minigpt.train.safety import Session, check_training

Batch = tuple[torch.Tensor, torch.Tensor]  # x, y: (n, block_size) int64 on the device


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
    epochs_seed: int | None = None  # train.data_order epochs: run.seed; None: random offsets

    def train(self, step: int) -> Iterator[Batch]:
        """This rank's micro-batches of global batch `step` (0-based; its offsets drawn now, the
        rows read as the step consumes them)."""
        if self.epochs_seed is not None:  # rows step * batch_size onwards of the epochs
            offsets = self.rows.epoch_offsets(step * self.batch_size, self.batch_size,
                                              self.epochs_seed)
        else:
            offsets = self.rows.sample_offsets("train", self.batch_size, self.generator)
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
                 on_event: OnEvent, session: Session) -> Batches:
    """The batches of a session: the batch geometry, the tokenizer (the checkpoint's on resume,
    else built, rank 0 first), model.vocab_size fitted to it, the memory and time check of
    `session` (safety.check_training; rank 0 decides), the rows (rank 0
    prepares the token cache first) and the data-order generator (seeded, or where the run left
    it). Rank 0 reports the tokenizer's and the data's preparation."""
    report = on_event if info.is_main else no_events
    if cfg.data.source == "program":
        raise ConfigError("data.source: program is the run of a compiled program (minigpt "
                          "compile), whose weights are its program: it is not trained; train "
                          "on text or induction data")
    micro, n_micro = batch_geometry(cfg.train, info)
    tokenizer = (Tokenizer.load(start.checkpoint.path) if start is not None
                 else main_first(lambda: build_tokenizer(cfg, report), info))
    fit_vocab(cfg, tokenizer)
    main_first(lambda: check_training(cfg, session, device) if info.is_main else None, info)
    rows = main_first(lambda: rows_for(cfg, tokenizer, report), info)
    generator = torch.Generator().manual_seed(cfg.run.seed)
    if start is not None:
        generator.set_state(start.rng.data)
    t = cfg.train
    return Batches(tokenizer, rows, generator, t.batch_size, micro, n_micro, info.rank,
                   info.world_size, device, validation_sample(rows, t, cfg.run.seed),
                   cfg.run.seed if t.data_order == "epochs" else None)


def validation_sample(rows: TokenRows | InductionRows, t: TrainConfig, seed: int
                      ) -> torch.Tensor:
    """The offsets every evaluation reads, drawn once: evaluations compare like with like."""
    return rows.sample_offsets("val", t.eval_batches * t.batch_size,
                               torch.Generator().manual_seed(seed + 1))


def batch_geometry(t: TrainConfig, info: DistInfo) -> tuple[int, int]:
    """(sequences per forward pass, forward passes per step on each rank): the global batch of
    train.batch_size is cut into one slice per rank, each into micro-batches."""
    micro = t.micro(info.world_size)
    if t.batch_size % (info.world_size * micro):
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
