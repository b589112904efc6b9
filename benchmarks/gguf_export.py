"""`minigpt export --format gguf`: export time and file size of a run, and how closely the real
llama.cpp (llama-cpp-python) agrees with minigpt:

    python benchmarks/gguf_export.py [--run RUNS/DIR] [--texts 4000] [--dir /tmp/minigpt-gguf-bench]

- Export (needs `--run`): the whole `minigpt export --format gguf` command (a fresh process:
  start-up, loading the run, writing), median of 3, for f32 and f16, and the file sizes.
- Parity (needs llama-cpp-python): for both architectures x both split patterns (the models of
  tests/test_gguf_llamacpp.py: 2 x 64 wide, randomly initialised and perturbed, BPE of 400
  trained on Tiny Shakespeare) and `--run` if given: token ids of `--texts` varied texts equal
  or not (and the same with the other pre-tokenizer name, to show the name matters), the
  largest logit difference over 64 random tokens with llama.cpp's default f16 KV cache and with
  an f32 one, and whether 30 greedy tokens are equal.

The machine may be shared: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_gguf import RUNS, make_run, train_bpe
from test_gguf_llamacpp import CASES, PROMPT, varied_texts

from minigpt.core.generate import generate
from minigpt.hf.gguf import export_gguf
from minigpt.run import load_run


def export_figures(run: Path, work: Path) -> None:
    exe = shutil.which("minigpt")
    for dtype in ("f32", "f16"):
        times, size = [], 0
        for i in range(3):
            out = work / f"export-{dtype}-{i}.gguf"
            t = time.perf_counter()
            subprocess.run([exe, "export", "--run", str(run), "--format", "gguf", "--out",
                            str(out), "--dtype", dtype], check=True, capture_output=True)
            times.append(time.perf_counter() - t)
            size = out.stat().st_size
        print(f"export {dtype}: {statistics.median(times):.2f} s (median of 3: "
              f"{', '.join(f'{x:.2f}' for x in times)}), {size:,} bytes "
              f"({size / 2**20:.2f} MiB)")


def swapped(path: Path, work: Path) -> Path:
    """A copy of the GGUF with the other pre-tokenizer name."""
    import gguf

    r = gguf.GGUFReader(path)
    pre = r.fields["tokenizer.ggml.pre"].contents()
    other = {"llama-bpe": "gpt-2", "gpt-2": "llama-bpe"}[pre]
    w = gguf.GGUFWriter(work / f"swapped-{path.name}", r.fields["general.architecture"]
                        .contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = other if key == "tokenizer.ggml.pre" else field.contents()
        types = field.types
        w.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return work / f"swapped-{path.name}"


def parity(name: str, run_dir: Path, path: Path, texts: list[str], work: Path) -> None:
    import llama_cpp

    run = load_run(run_dir, "cpu")
    tok, block = run.tokenizer, run.cfg.model.block_size

    def llama(p: Path, **kw):
        return llama_cpp.Llama(model_path=str(p), n_ctx=block, n_batch=block, n_ubatch=block,
                               logits_all=True, n_threads=1, verbose=False, **kw)

    llm = llama(path)
    same = sum(llm.tokenize(t.encode(), add_bos=False) == tok.encode(t) for t in texts)
    other = llama(swapped(path, work))
    same_other = sum(other.tokenize(t.encode(), add_bos=False) == tok.encode(t) for t in texts)
    del other
    ids = torch.randint(0, tok.n_vocab - 1, (block,), generator=torch.Generator()
                        .manual_seed(3)).tolist()
    with torch.no_grad():
        ours = run.model(torch.tensor([ids]))[0][0].double().numpy()
    diffs = []
    for model in (llm, llama(path, type_k=0, type_v=0)):  # GGML_TYPE_F32 = 0
        model.reset()
        model.eval(ids)
        diffs.append(np.abs(np.array(model.scores[:len(ids)]) - ours).max())
    prompt = tok.encode(PROMPT)
    want = list(generate(run.model, prompt, 30, temperature=0.0))
    llm.reset()
    llm.eval(prompt)
    got = []
    for _ in range(30):
        got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(got[-1:])
    print(f"{name:22s} tokens equal {same}/{len(texts)} (other pre name: {same_other}/"
          f"{len(texts)}), max |logit diff| {diffs[0]:.2e} (f32 KV cache: {diffs[1]:.2e}), "
          f"greedy 30 equal: {got == want}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, help="a trained run to export and compare too")
    ap.add_argument("--texts", type=int, default=4000)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/minigpt-gguf-bench"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.run:
        export_figures(args.run, args.dir)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python is not installed: no parity figures")
        return
    texts = varied_texts(args.texts)
    for p in ("gpt4", "gpt2"):
        (args.dir / f"bpe-{p}").mkdir()
    bpe = {p: train_bpe(args.dir / f"bpe-{p}", p) for p in ("gpt4", "gpt2")}
    for i, (case, (name, pattern)) in enumerate(CASES.items()):
        run = make_run(args.dir / "runs" / name, bpe[pattern], seed=i, **RUNS[name][0])
        path = export_gguf(load_run(run, "cpu"), args.dir / f"{name}.gguf").out
        parity(f"{case} ({RUNS[name][0].get('activation', 'gelu')})", run, path, texts,
               args.dir)
    if args.run:
        path = export_gguf(load_run(args.run, "cpu"), args.dir / "run.gguf").out
        parity(f"--run {args.run.name}", args.run, path, texts, args.dir)
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
