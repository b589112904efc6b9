"""What keeps a training session safe: Ctrl-C / SIGTERM only raise a flag that the loop reads
after each step (so it can save a checkpoint first), and a model or batch too big for the
machine is refused before anything is allocated."""

from __future__ import annotations

import signal
import threading

import torch

from minigpt.config import Config
from minigpt.device import available_bytes
from minigpt.errors import MinigptError


class StopFlag:
    """SIGINT/SIGTERM handlers that only set a flag; the loop checks it after each step. A
    second signal stops at once (KeyboardInterrupt; the last committed checkpoint stays)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def check_memory(cfg: Config, micro: int, device: torch.device) -> None:
    """Refuse, before allocating anything, a model or micro-batch that cannot fit in memory
    (instead of an allocator crash mid-set-up). A rough fp32 estimate: weights, gradients and
    two AdamW moments (4 copies of the parameters); per micro-batch token, ~16 n_embd floats
    of activations per layer plus ~3 vocab-sized rows (logits, softmax, gradient)."""
    m = cfg.model
    params = (m.vocab_size * m.n_embd * (1 if m.tie_weights else 2)
              + m.n_layer * 12 * m.n_embd ** 2 + m.block_size * m.n_embd)
    weights = 16 * params
    acts = 4 * micro * m.block_size * (m.n_layer * 16 * m.n_embd + 3 * m.vocab_size)
    avail = available_bytes(device)
    if avail is None:
        return
    gb = lambda b: f"{b / 2**30:,.1f} GB"
    if weights > avail:
        raise MinigptError(
            f"the model is too big for this machine: {params:,} parameters need ~{gb(weights)} "
            f"for weights, gradients and AdamW state, {gb(avail)} available; shrink "
            f"model.vocab_size ({m.vocab_size:,}), model.n_embd ({m.n_embd:,}) or "
            f"model.n_layer ({m.n_layer})")
    if weights + acts > avail:
        raise MinigptError(
            f"train.batch_size: a micro-batch of {micro:,} sequences x {m.block_size} tokens "
            f"needs ~{gb(acts)} of activations, {gb(avail - weights)} available; lower "
            "train.micro_batch_size (gradient accumulation keeps train.batch_size) or "
            "train.batch_size, or model.block_size")
    t = cfg.train
    offsets = 8 * t.eval_batches * t.batch_size  # every evaluation's offsets, drawn at once
    if weights + offsets > avail:
        raise MinigptError(
            f"train.eval_batches: {t.eval_batches:,} batches of {t.batch_size:,} sequences "
            f"need ~{gb(offsets)} for their offsets alone, {gb(avail - weights)} available; "
            "lower train.eval_batches (20 is the default)")
