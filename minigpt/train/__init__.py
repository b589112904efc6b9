"""Training: the loop (`loop.py`), the optimizer and its learning-rate schedule (`optim.py`),
the weight average it evaluates (`ema.py`), its clock (`clock.py`) and the torchrun / DDP
plumbing (`distributed.py`). `from minigpt.train import train`."""

from minigpt.train.loop import train

__all__ = ["train"]
