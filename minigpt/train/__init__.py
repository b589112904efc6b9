"""Training: the loop (`loop.py`) and the four parts it puts together: the batches
(`batches.py`), the run directory and its checkpoints (`saving.py`), the weights, their
optimizer, schedule and step (`weights.py`, with the weight average of `ema.py`) and the
reporting (`reporting.py`: the run files of `outputs.py` and `tensorboard.py`, the clock of
`clock.py`, the copy metrics of `copies.py`); the torchrun / DDP plumbing (`distributed.py`)
and the signal flag and memory check (`safety.py`). `from minigpt.train import train`."""

from minigpt.train.loop import train

__all__ = ["train"]
