"""N one-token KV-cache decode steps of the default model's shape (4 layers x 128, vocabulary
1024, random weights) on one thread, for instruction counts: run it under
`valgrind --tool=callgrind` with N and with 0 and subtract, which leaves the decode steps alone
(start-up, imports and the prefill cancel). Load-independent, so two versions of the code
compare on a busy machine:

    valgrind --tool=callgrind python benchmarks/decode_steps.py 100
    valgrind --tool=callgrind python benchmarks/decode_steps.py 0

(with PYTHONPATH pointing at the checkout to measure).
"""

from __future__ import annotations

import sys

import torch

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    torch.set_num_threads(1)
    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=1024)
    model = GPT.from_config(cfg, seed=0).eval()
    cache = model.new_kv_cache(1)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)  # the prefill
        token = torch.tensor([[5]])
        for _ in range(n):
            model(token, kv_cache=cache)


if __name__ == "__main__":
    main()
