"""Naive attention vs SDPA on this machine: a thin wrapper over `minigpt bench --suite attention`.

    python benchmarks/attention_bench.py                       # T = 256, 512, 1024, 2048
    python benchmarks/attention_bench.py --seq-lens 512,4096 --out attn.json

Any other `minigpt bench` flag passes through (--device, --dtype, --quick, ...). Timings on a
shared machine are noisy: read the q1-q3 spread next to each median.
"""

import sys

from minigpt.cli import main

if __name__ == "__main__":
    sys.argv = ["minigpt", "bench", "--suite", "attention", *sys.argv[1:]]
    main()
