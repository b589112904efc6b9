"""BPE training and corpus-encoding speed and peak memory, on the bundled corpus and on a
synthetic corpus (default 100 MB) built by sampling Shakespeare's words with a seeded RNG.

Every measurement runs in its own subprocess, and peak memory is that subprocess's ru_maxrss
(peak resident set size, whole process, including the Python + torch + numpy import baseline,
which is measured separately as the `import` row). Phases:

- train:  `build_tokenizer` with an empty cache dir = stream the corpus + rustbpe training;
- encode: `prepare_dataset` with the trained tokenizer = stream, tiktoken-encode (all cores),
          write the uint16 token cache, measure bytes/token (this is the whole data pipeline).

    python benchmarks/bpe_bench.py                 # bundled + 100 MB synthetic, vocab 1024
    python benchmarks/bpe_bench.py --synthetic-mb 10 --vocab-size 4096

Timings on a shared machine are noisy; run once, compare orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def make_synthetic(path: Path, size_mb: int, source: Path, seed: int = 0) -> None:
    """Lines of 4-14 words drawn from the source's word list (seeded): ~size_mb MB of text
    whose statistics resemble English-ish verse but which is not one repeated string."""
    words = re.findall(r"[A-Za-z']+[,.;:!?]?", source.read_text(encoding="utf-8"))
    rng = random.Random(seed)
    target = size_mb * 1_000_000
    written = 0
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            lines = [" ".join(rng.choices(words, k=rng.randint(4, 14))) for _ in range(2000)]
            block = "\n".join(lines) + "\n\n"
            fh.write(block)
            written += len(block.encode("utf-8"))


def worker(phase: str, corpus: str, vocab_size: int, cache: str) -> dict:
    """Run one phase in this (fresh) process; return timings and ru_maxrss."""
    from minigpt.config import from_dict

    out: dict = {"phase": phase}
    if phase != "import":
        from minigpt.data.cache import prepare_dataset
        from minigpt.data.tokenizer import build_tokenizer

        cfg = from_dict({"tokenizer": {"vocab_size": vocab_size},
                         "data": {"corpus": corpus, "cache_dir": cache}})
        t0 = time.perf_counter()
        tok = build_tokenizer(cfg)
        t1 = time.perf_counter()
        out["tokenizer_seconds"] = t1 - t0
        if phase == "encode":
            ds = prepare_dataset(cfg, tok)
            out["encode_seconds"] = time.perf_counter() - t1
            out["tokens"] = len(ds.train) + len(ds.val)
            out["bytes_per_token"] = ds.bytes_per_token
        out["n_vocab"] = tok.n_vocab
    else:
        import minigpt.data.cache  # noqa: F401 - the import baseline (torch, numpy, tiktoken)
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return out


def run_phase(phase: str, corpus: Path, vocab_size: int, cache: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", phase, "--corpus", str(corpus),
           "--vocab-size", str(vocab_size), "--cache", str(cache)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{phase} on {corpus} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_corpus(label: str, corpus: Path, vocab_size: int, tmp: Path) -> dict:
    cache = tmp / f"cache-{label}"
    train = run_phase("train", corpus, vocab_size, cache)          # empty cache: trains
    encode = run_phase("encode", corpus, vocab_size, cache)        # tokenizer from the cache
    size = corpus.stat().st_size
    return {"corpus": label, "mb": size / 1e6, "train_s": train["tokenizer_seconds"],
            "train_rss_mb": train["maxrss_mb"], "encode_s": encode["encode_seconds"],
            "tokens": encode["tokens"], "tok_per_s": encode["tokens"] / encode["encode_seconds"],
            "mb_per_s": size / 1e6 / encode["encode_seconds"],
            "encode_rss_mb": encode["maxrss_mb"], "bytes_per_token": encode["bytes_per_token"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic-mb", type=int, default=100, help="0 = skip the synthetic case")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.corpus, args.vocab_size, args.cache)))
        return

    from minigpt.paths import DATA_DIR

    bundled = DATA_DIR / "tinyshakespeare.txt"
    print(f"cpus: {os.cpu_count()}  vocab_size: {args.vocab_size}  (shared machine: noisy)")
    with tempfile.TemporaryDirectory(prefix="bpe_bench_") as tmp_name:
        tmp = Path(tmp_name)
        base = run_phase("import", bundled, args.vocab_size, tmp / "unused")
        print(f"import baseline ru_maxrss: {base['maxrss_mb']:.0f} MB")
        rows = [bench_corpus("tinyshakespeare", bundled, args.vocab_size, tmp)]
        if args.synthetic_mb:
            synth = tmp / "synthetic.txt"
            t0 = time.perf_counter()
            make_synthetic(synth, args.synthetic_mb, bundled)
            print(f"generated {synth.stat().st_size / 1e6:.0f} MB synthetic corpus in "
                  f"{time.perf_counter() - t0:.1f} s")
            rows.append(bench_corpus(f"synthetic-{args.synthetic_mb}MB", synth,
                                     args.vocab_size, tmp))
    head = (f"{'corpus':<20} {'MB':>7} {'train s':>8} {'train RSS':>10} {'encode s':>9} "
            f"{'tokens':>11} {'tok/s':>11} {'MB/s':>6} {'enc RSS':>8} {'B/tok':>6}")
    print(head)
    for r in rows:
        print(f"{r['corpus']:<20} {r['mb']:>7.1f} {r['train_s']:>8.2f} "
              f"{r['train_rss_mb']:>7.0f} MB {r['encode_s']:>9.2f} {r['tokens']:>11,} "
              f"{r['tok_per_s']:>11,.0f} {r['mb_per_s']:>6.1f} {r['encode_rss_mb']:>5.0f} MB "
              f"{r['bytes_per_token']:>6.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
