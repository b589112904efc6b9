"""Training: the loop that puts a session together from four parts, each built once (the
batches; the run directory and its checkpoints; the weights with their optimizer, schedule, step
and weight average; the reporting to the run files, TensorBoard and the caller), the torchrun /
DDP plumbing, and the signal flag and memory check. docs/internals.md lists the modules.
`from minigpt.train import train`.
"""

from minigpt.train.loop import train

__all__ = ["train"]
