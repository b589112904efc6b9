"""What `minigpt circuit` costs (minigpt.interp.edge_graph) on GPT-2 small's shape (12 layers x 12
heads, 768 wide, vocabulary 50257, random weights: the cost does not depend on them), 64
tokens, 8 (clean, corrupted) pairs (an induction probe and its second copy replaced), the
metric logit[a] - logit[b] at the last position:

- EAP over all 32,491 edges (`attribute_edges`, 1 step), EAP-IG with 5 steps, and the
  10-point faithfulness curve (the ten circuits of the EAP ranking run with every other edge
  patched, `recovered`), each against one forward pass of the 8 pairs;
- side by side with TransformerLens 4.3 (`--tl`) on the same model exported with
  `minigpt export --format hf` and opened with `TransformerBridge.boot_transformers`:
  `attribution_patch(..., EdgeAttributionConfig(granularity="edge"))` on the same pairs and
  metric, the two engines alternated in one process (`--rounds`) so a busy machine slows both
  alike; the largest difference of their edge scores (summed over positions) is printed too.

    python benchmarks/circuit_bench.py [--threads 2] [--tokens 64] [--pairs 8] [--tl]
        [--tl-pairs N] [--rounds 2]

Wall and CPU seconds (process time, every thread) per measurement and the load average around
it; the last lines are a markdown table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from minigpt.config import from_dict
from minigpt.core.gpt import GPT
from minigpt.interp import edge_graph as G
from minigpt.interp.patching import make_metric

SHAPE = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "vocab_size": 50257,
         "pos_encoding": "learned", "bias": True, "activation": "gelu_tanh", "tie_weights": True}


def timed(fn, *args, **kwargs):
    """(wall s, CPU s, load average before, result)."""
    load = os.getloadavg()[0]
    t, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, time.process_time() - c, load, out


def make_pairs(T: int, n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    clean, bad = [], []
    for _ in range(n):
        half = torch.randperm(vocab, generator=gen)[:T // 2]
        clean.append(torch.cat([half, half]))
        bad.append(torch.cat([half, torch.randperm(vocab, generator=gen)[:T // 2]]))
    return torch.stack(clean), torch.stack(bad)


def curve(model, clean, bad, metric, ranking):
    patcher = G.Patcher(model, clean, bad, metric, None)
    return G.recovered(patcher, G.curve_circuits(patcher.graph, ranking)[1])


def tl_bridge(model: GPT, cfg, root: Path):
    """The model exported for TransformerLens and booted offline, in eval mode."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformer_lens.model_bridge import TransformerBridge

    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.hf import export_hf
    from minigpt.run import load_run
    from minigpt.run.checkpoint import save_checkpoint

    save_checkpoint(root / "run", step=1, model=model, cfg=cfg, tokenizer=bytes_tokenizer(),
                    trainer_state={"step": 1})
    export_hf(load_run(root / "run", "cpu"), root / "hf")
    bridge = TransformerBridge.boot_transformers(str(root / "hf"), device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True, center_unembed=False,
                                     fold_value_biases=False)
    return bridge.eval()


def tl_eap(bridge, clean, bad, answer: int, wrong: int):
    from transformer_lens.tools.analysis.attribution_patching import (
        EdgeAttributionConfig,
        attribution_patch,
    )

    return attribution_patch(bridge, clean, bad,  # TL's sign: denoising
                             lambda lg: lg[0, -1, answer] - lg[0, -1, wrong],
                             EdgeAttributionConfig(granularity="edge"))


def tl_matrix(graph: G.Graph, edge_scores: dict) -> torch.Tensor:
    """TL's per-position edge scores summed over positions, in minigpt's (U, R) layout (as
    tests/test_transformer_lens_graph.py maps them)."""
    def name(node) -> tuple[str, str | None]:
        if node.kind in ("embed", "logits"):
            return node.kind, node.kind if node.kind == "logits" else None
        base = f"L{node.layer}." + ("MLP" if node.head is None else f"H{node.head}")
        inp = {"mlp_in": "mlp"}.get(node.kind, node.kind[0] if node.kind.endswith("input")
                                    else None)
        return base, inp

    writers = {graph.writer_name(u): u for u in range(graph.n_writers)}
    readers = {graph.reader_name(v): v for v in range(graph.n_readers)}
    out = torch.zeros(graph.n_writers, graph.n_readers, dtype=torch.float64)
    for (w, r), score in edge_scores.items():
        out[writers[name(w)[0]], readers[name(r)]] += score
    return out


def row(name: str, m: tuple, note: str = "") -> str:
    wall, cpu, load = m[0], m[1], m[2]
    return f"| {name} | {wall:.2f} s | {cpu:.2f} s | {load:.1f} | {note} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--tl", action="store_true", help="also TransformerLens 4.3, alternated")
    ap.add_argument("--tl-pairs", type=int, default=0, help="pairs for the TL comparison "
                    "(default: --pairs)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = from_dict({"model": SHAPE, "tokenizer": {"vocab_size": 256}})
    model = GPT.from_config(cfg, seed=0).eval()
    T = args.tokens
    clean, bad = make_pairs(T, args.pairs, SHAPE["vocab_size"])
    answer, wrong = int(clean[0, T // 2 + 1]), int(bad[0, T // 2 + 1])
    metric = make_metric(T, answer=answer, wrong=wrong)
    print(f"torch {torch.__version__}, {args.threads} threads, GPT-2 small shape, {T} tokens, "
          f"{args.pairs} pairs, {int(G.graph_of(model.cfg).valid().sum())} edges")
    rows = []
    with torch.no_grad():
        rows.append(row("one forward pass of the pairs", timed(model, clean)))
    eap = timed(G.attribute_edges, model, clean, bad, metric, None, 1)
    rows.append(row("EAP, every edge", eap, "goal <= 5 s"))
    rows.append(row("EAP-IG, 5 steps", timed(G.attribute_edges, model, clean, bad, metric,
                                                  None, 5), "goal <= 30 s"))
    rows.append(row("faithfulness curve, 10 circuits",
                    timed(curve, model, clean, bad, metric, eap[3][0]), "goal <= 60 s"))
    for r in rows:
        print(r, flush=True)
    if args.tl:
        rows += compare_tl(model, cfg, clean, bad, metric, answer, wrong, args)
    print("\n| GPT-2 small shape, random weights | wall | CPU (all threads) | load | |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


def compare_tl(model, cfg, clean, bad, metric, answer, wrong, args) -> list[str]:
    """minigpt's EAP and TL's, alternated `args.rounds` times on the same pairs."""
    n = args.tl_pairs or args.pairs
    c, b = clean[:n], bad[:n]
    with tempfile.TemporaryDirectory() as tmp:
        bridge = tl_bridge(model, cfg, Path(tmp))
        ours, theirs = [], []
        for r in range(args.rounds):
            pair = [lambda: timed(G.attribute_edges, model, b, c, metric, None, 1),
                    lambda: timed(tl_eap, bridge, c, b, answer, wrong)]
            first, second = (0, 1) if r % 2 == 0 else (1, 0)
            got = {first: pair[first](), second: pair[second]()}
            ours.append(got[0])
            theirs.append(got[1])
            print(f"round {r + 1}: minigpt {got[0][0]:.2f} s ({got[0][1]:.2f} CPU-s), "
                  f"TL {got[1][0]:.2f} s ({got[1][1]:.2f} CPU-s)", flush=True)
    graph = G.graph_of(model.cfg)
    diff = (ours[0][3][0] - tl_matrix(graph, theirs[0][3].edge_scores))[graph.valid()]
    med = [tuple(statistics.median(x[i] for x in runs) for i in range(3))
           for runs in (ours, theirs)]
    note = f"{n} pairs, denoising, median of {args.rounds} alternated rounds"
    return [row("minigpt EAP (as TL: denoising)", med[0], note),
            row("TransformerLens 4.3 attribution_patch (edge)", med[1],
                f"{note}; max edge-score difference {float(diff.abs().max()):.1e} (largest "
                f"|score| {float(ours[0][3][0][graph.valid()].abs().max()):.2f})")]


if __name__ == "__main__":
    main()
