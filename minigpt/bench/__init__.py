"""`minigpt bench`: attention kernels (`attention.py`), the training step and its MFU
(`train.py`), decoding with and without the KV cache (`sample.py`), the timing and memory
harness (`timing.py`), and the run of the chosen suites with its JSON report (`runner.py`).

`from minigpt.bench import BenchOptions, run_bench`."""

from minigpt.bench.runner import BenchOptions, BenchResult, run_bench, write_json

__all__ = ["BenchOptions", "BenchResult", "run_bench", "write_json"]
