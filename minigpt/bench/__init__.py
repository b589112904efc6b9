"""`minigpt bench`: what this machine does with minigpt's own code paths, measured: the attention
kernels, one training step and its MFU, decoding with and without the KV cache, each suite
timed by one harness and reported as one JSON document. docs/internals.md lists the modules.

`from minigpt.bench import BenchOptions, run_bench`.
"""

from minigpt.bench.runner import BenchOptions, BenchResult, run_bench, write_json

__all__ = ["BenchOptions", "BenchResult", "run_bench", "write_json"]
