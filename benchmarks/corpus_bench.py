"""Corpus preparation: time and peak memory of BPE training + tokenization for the same text
kept as one .txt file, as JSON Lines and as Parquet (docs/data.md).

The data is the bundled corpus repeated to the size asked for (default 200 MB), cut into
documents of consecutive speeches of at least 1 KB (about TinyStories' size; a document
boundary costs the most when documents are small). The .txt file holds the same texts
back to back, so all three formats carry the same bytes of text; the JSON Lines file is
`{"id": i, "text": ...}` per line, the Parquet file the same two columns in row groups of
10,000 rows (snappy, pyarrow's default). The files go to --dir (default: a temporary
directory) and are deleted afterwards unless --keep.

Every measurement runs in a fresh subprocess with an empty cache directory: `build_tokenizer`
(read, split, train the BPE) then `prepare_dataset` (tokenize into the token cache), as
`minigpt train` does before its first step. Peak memory is that subprocess's ru_maxrss
(whole process, the import of torch, numpy and tiktoken included), its CPU time the user +
system seconds of all its threads. A second subprocess with the warm caches times the cached
start (reading, hashing and splitting only).

    python benchmarks/corpus_bench.py                      # 200 MB, vocab 1024
    python benchmarks/corpus_bench.py --mb 2000 --dir /tmp/corpus-bench
    python benchmarks/corpus_bench.py --mb 20 --formats jsonl,parquet

Timings on a shared machine are noisy: compare the formats with each other (same run, same
load), and say what the load was (`uptime` is printed before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMATS = {"txt": "corpus.txt", "jsonl": "corpus.jsonl", "parquet": "corpus.parquet"}


def documents(min_bytes: int = 1000) -> list[str]:
    """The bundled corpus cut into documents: consecutive speeches, at least min_bytes each."""
    text = (ROOT / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")
    docs, current = [], ""
    for speech in text.split("\n\n"):
        current += speech + "\n\n"
        if len(current) >= min_bytes:
            docs.append(current)
            current = ""
    return docs + ([current] if current else [])


def make_corpora(directory: Path, mb: float, formats: list[str]) -> dict[str, Path]:
    """The same documents, repeated to about `mb` MB of text, in each format; streamed."""
    docs = documents()
    paths = {f: directory / FORMATS[f] for f in formats}
    with contextlib.ExitStack() as stack:
        txt, jsonl = (stack.enter_context(open(paths[f], "w", encoding="utf-8"))
                      if f in paths else None for f in ("txt", "jsonl"))
        parquet = _ParquetRows(paths["parquet"]) if "parquet" in paths else None
        if parquet:
            stack.callback(parquet.close)
        written, i = 0, 0
        while written < mb * 1e6:
            doc = docs[i % len(docs)]
            if txt:
                txt.write(doc)
            if jsonl:
                jsonl.write(json.dumps({"id": i, "text": doc}) + "\n")
            if parquet:
                parquet.add(i, doc)
            written += len(doc.encode("utf-8"))
            i += 1
    return paths


class _ParquetRows:
    """Rows (id, text) written in row groups of 10,000."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.pa, self.rows = pa, {"id": [], "text": []}
        self.schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
        self.writer = pq.ParquetWriter(path, self.schema)

    def add(self, i: int, text: str) -> None:
        self.rows["id"].append(i)
        self.rows["text"].append(text)
        if len(self.rows["id"]) == 10_000:
            self.flush()

    def flush(self) -> None:
        if self.rows["id"]:
            self.writer.write_table(self.pa.table(self.rows, schema=self.schema))
        self.rows = {"id": [], "text": []}

    def close(self) -> None:
        self.flush()
        self.writer.close()


def worker(corpus: str, vocab_size: int, cache: str) -> dict:
    """Prepare the corpus in this (fresh) process; timings and ru_maxrss."""
    from minigpt.config import from_dict
    from minigpt.data.cache import prepare_dataset
    from minigpt.data.tokenizer import build_tokenizer

    cfg = from_dict({"tokenizer": {"vocab_size": vocab_size},
                     "data": {"corpus": corpus, "cache_dir": cache}})
    t0, c0 = time.perf_counter(), _cpu()
    tok = build_tokenizer(cfg)
    t1 = time.perf_counter()
    ds = prepare_dataset(cfg, tok)
    t2 = time.perf_counter()
    return {"tokenizer_s": t1 - t0, "tokenize_s": t2 - t1, "total_s": t2 - t0,
            "cpu_s": _cpu() - c0, "tokens": len(ds.train) + len(ds.val),
            "bytes_per_token": ds.bytes_per_token,
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _cpu() -> float:
    """CPU seconds of this process, all its threads (tiktoken's, rustbpe's) included: less
    sensitive than wall time to other jobs on a shared machine."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(corpus: Path, vocab_size: int, cache: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(corpus), "--vocab-size", str(vocab_size),
           "--cache", str(cache)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode:
        raise SystemExit(f"{corpus} failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200, help="MB of text per format")
    ap.add_argument("--formats", default="txt,jsonl,parquet")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--dir", type=Path, default=None, help="where the corpora go (deleted)")
    ap.add_argument("--keep", action="store_true", help="keep the corpora and caches")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.vocab_size, args.cache)))
        return
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    directory = args.dir or Path(tempfile.mkdtemp(prefix="corpus-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    print(f"load before: {uptime()}")
    print(f"cpus: {os.cpu_count()}, {args.mb:g} MB of text per format, vocab {args.vocab_size}")
    try:
        t0 = time.perf_counter()
        paths = make_corpora(directory, args.mb, formats)
        print(f"made the corpora in {time.perf_counter() - t0:.0f} s: " + ", ".join(
            f"{f} {p.stat().st_size / 1e6:,.0f} MB on disk" for f, p in paths.items()))
        print("| format | on disk | first preparation: wall (BPE + tokenize) | CPU | peak RSS | "
              "cached start | tokens |")
        print("|---|---|---|---|---|---|---|")
        for f, path in paths.items():
            cache = directory / f"cache-{f}"
            first = measure(path, args.vocab_size, cache)
            again = measure(path, args.vocab_size, cache)
            print(f"| {f} | {path.stat().st_size / 1e6:,.0f} MB | {first['total_s']:.0f} s "
                  f"({first['tokenizer_s']:.0f} + {first['tokenize_s']:.0f}) | "
                  f"{first['cpu_s']:.0f} s | {first['maxrss_mb']:,.0f} MB | "
                  f"{again['total_s']:.1f} s "
                  f"({again['maxrss_mb']:,.0f} MB) | {first['tokens']:,} |", flush=True)
            if not args.keep:
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"load after: {uptime()}")


if __name__ == "__main__":
    main()
