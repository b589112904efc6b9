"""The real llama.cpp (through llama-cpp-python, which .ci/run installs before the slow tier)
runs `minigpt export --format gguf` files as minigpt runs the run: for both architectures
(learned positions -> gpt2, RoPE -> gptneox) and both split patterns (gpt4 -> llama-bpe,
gpt2 -> gpt-2), llama.cpp's tokenizer gives minigpt's token ids on varied texts (and adds no
BOS), its logits equal minigpt's within 2e-3 (the rest is llama.cpp's tanh GELU and its f16
KV cache), and greedy decoding gives the same 30 tokens. Also what docs/export.md says about
context length: llama.cpp pads the context to 256, a learned-position model aborts the process
past its position table, a RoPE model runs on past block_size."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import EXPORT_RUN, half_matrices_logits, make_run, shakespeare
from test_gguf import RUNS, TEXTS, gelu, gguf_forward, read_gguf, train_bpe

from minigpt.core.generate import generate
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.hf.gguf import export_gguf
from minigpt.run import load_run

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (.ci/run installs it before the "
    "slow tier: pip install llama-cpp-python, which compiles llama.cpp)")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PROMPT = "ROMEO: 日本語 😀 e\u0301"
LOGITS_TOL = 2e-3


def varied_texts(n: int, seed: int = 0) -> list[str]:
    """`n` texts: the test texts, slices of Shakespeare, and random mixes of letters, digits,
    spaces, tabs, newlines, punctuation, apostrophes, CJK, emoji and combining marks."""
    rng = random.Random(seed)
    text = shakespeare()
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " ", "  ",
             "\t", "\n", "\r\n", "\n\n", ".,;:!?-()[]{}\"'/", "'s 've 're 'll 'd 'm 't",
             "日本語中文한국어", "😀🎉👍🏽👨‍👩‍👧🇫🇷", "e\u0301a\u0308n\u0303", "ÀéîõüßçÑ",
             "кириллица",
             "Ελληνικά", "\u00a0\u2003"]
    out = [*TEXTS.values()]
    while len(out) < n:
        if rng.random() < 0.4:
            start = rng.randrange(len(text) - 400)
            out.append(text[start:start + rng.randrange(1, 400)])
        else:
            out.append("".join(rng.choice(rng.choice(pools)) if rng.random() < 0.7
                               else rng.choice(pools) for _ in range(rng.randrange(1, 60))))
    return out


# (model run name from test_gguf.RUNS, split pattern): both architectures x both patterns,
# and the default and induction configs' architectures
CASES = {
    "gpt2/llama-bpe": ("learned", "gpt4"),
    "gpt2/gpt-2": ("learned-nobias-untied", "gpt2"),
    "gptneox/gpt-2": ("rope", "gpt2"),
    "gptneox/llama-bpe": ("rope-bias-tied", "gpt4"),
    "gptneox/default": ("rope-nobias-tied", "gpt4"),  # configs/default.yaml's architecture
    "gptneox/attention-only": ("rope-attention-only", "gpt2"),  # configs/induction.yaml's
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """case -> (run dir, GGUF file); plus a bytes-tokenizer RoPE run with unused ids
    ('bytes')."""
    root = tmp_path_factory.mktemp("llamacpp")
    bpe = {p: train_bpe(tmp_path_factory.mktemp(f"bpe-{p}"), p) for p in ("gpt4", "gpt2")}
    out = {}
    for i, (case, (name, pattern)) in enumerate(CASES.items()):
        run = make_run(root / "runs" / name, tokenizer=bpe[pattern], **EXPORT_RUN, seed=i,
                       **RUNS[name][0])
        out[case] = (run, export_gguf(load_run(run, "cpu"), root / f"{name}.gguf").out)
    run = make_run(root / "runs" / "bytes", tokenizer=bytes_tokenizer(), **EXPORT_RUN, seed=9,
                   pos_encoding="rope", vocab_size=320)  # 63 unused ids: placeholder tokens
    out["bytes"] = (run, export_gguf(load_run(run, "cpu"), root / "bytes.gguf").out)
    return out


def llama(path: Path, n_ctx: int = 64):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           logits_all=True, n_threads=1, seed=0, verbose=False)


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    """(len(ids), V) logits of llama.cpp for the sequence, every position."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)


@pytest.mark.parametrize("case", [*CASES, "bytes"])
def test_llama_cpp_tokenizes_as_minigpt_does(files, case):
    run_dir, path = files[case]
    tok = load_run(run_dir, "cpu").tokenizer
    llm = llama(path)
    texts = varied_texts(1500)
    differ = [t for t in texts if llm.tokenize(t.encode("utf-8"), add_bos=False,
                                               special=False) != tok.encode(t)]
    assert differ == [], f"{len(differ)} of {len(texts)} texts differ, e.g. {differ[:3]!r}"
    # add_bos_token is false: llama.cpp's default add_bos=True adds nothing
    assert llm.tokenize(PROMPT.encode("utf-8")) == tok.encode(PROMPT)
    assert llm.token_bos() == llm.token_eos() == tok.eot_id
    for text in TEXTS.values():
        assert llm.detokenize(tok.encode(text)).decode("utf-8") == text


@pytest.mark.parametrize("case", [*CASES, "bytes"])
def test_llama_cpp_logits_and_greedy_tokens_equal_minigpts(files, case):
    run_dir, path = files[case]
    run = load_run(run_dir, "cpu")
    llm = llama(path)
    ids = torch.randint(0, run.tokenizer.n_vocab - 1, (64,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ours = run.model(torch.tensor([ids]))[0][0].double().numpy()
    assert np.abs(llama_logits(llm, ids) - ours).max() <= LOGITS_TOL

    prompt = run.tokenizer.encode(PROMPT)
    want = list(generate(run.model, prompt, 30, temperature=0.0))
    llm.reset()
    llm.eval(prompt)
    got = []
    for _ in range(30):
        got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(got[-1:])
    assert got == want


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU GELU (ggml-cpu/vec.h, GGML_GELU_FP16): the input rounded to float16,
    the tanh approximation looked up in a float16 table; 0 below -10, x above 10."""
    x16 = x.astype(np.float16).astype(np.float64)
    y = gelu(x16, tanh=True).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, y))


@pytest.mark.parametrize("case", ["gpt2/gpt-2", "gptneox/gpt-2", "gptneox/llama-bpe"])
def test_the_logit_difference_is_llama_cpps_gelu_table(files, case):
    """Where the ~1e-3 comes from: the numpy forward of tests/test_gguf.py with llama.cpp's
    float16 GELU table in place of the model's GELU agrees with llama.cpp (f32 KV cache)
    within 3e-4, for exact- and tanh-GELU models alike."""
    run_dir, path = files[case]
    run = load_run(run_dir, "cpu")
    ids = torch.randint(0, run.tokenizer.n_vocab - 1, (64,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64,
                          logits_all=True, n_threads=1, seed=0, verbose=False, type_k=0,
                          type_v=0)  # GGML_TYPE_F32
    emulated = gguf_forward(*read_gguf(path), ids, tanh=True, act=gelu_fp16_table)
    assert np.abs(llama_logits(llm, ids) - emulated).max() <= 3e-4


def test_f16_files_run_too(files, tmp_path):
    """--dtype f16: llama.cpp's logits equal those of minigpt's model with its matrices
    rounded to float16, within the same tolerance."""
    run_dir, _ = files["gptneox/llama-bpe"]
    run = load_run(run_dir, "cpu")
    path = export_gguf(run, tmp_path / "half.gguf", dtype="f16").out
    ids = list(range(0, 400, 7))
    ours = half_matrices_logits(run.model, ids)
    assert np.abs(llama_logits(llama(path), ids) - ours).max() <= LOGITS_TOL


def test_context_length_in_llama_cpp(files):
    """llama.cpp pads the context to 256 positions; a learned-position model must not go past
    its table (64 here): llama.cpp aborts the whole process (so: in a subprocess); a RoPE model
    runs on past block_size (minigpt's sampler slides its window instead)."""
    _, learned = files["gpt2/llama-bpe"]
    _, rope = files["gptneox/gpt-2"]
    assert llama(learned).n_ctx() == 256
    code = ("import sys, llama_cpp\n"
            "llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_batch=256, "
            "n_threads=1, verbose=False)\n"
            "llm.eval(list(range(int(sys.argv[2]))))\nprint('ok')\n")
    ok = subprocess.run([sys.executable, "-c", code, str(learned), "64"], capture_output=True,
                        text=True, timeout=300, check=False)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok", ok.stderr[-2000:]
    assert "n_ctx_seq (256) > n_ctx_train (64)" in ok.stderr  # even with verbose=False
    past = subprocess.run([sys.executable, "-c", code, str(learned), "100"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert past.returncode == -signal.SIGABRT and "ok" not in past.stdout.splitlines()
    fine = subprocess.run([sys.executable, "-c", code, str(rope), "200"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert fine.returncode == 0 and fine.stdout.strip() == "ok", fine.stderr[-2000:]


def test_llama_cpps_whole_text_detokenizer_cleans_spaces(files):
    """What docs/export.md warns of: llama.cpp's `llama_detokenize` applies the GPT-2-era
    clean-up to every BPE model (a space before ? ! . , and before 's 'm 're 've is dropped; no
    GGUF key turns it off), while the per-token pieces, which llama-cpp-python's detokenize and
    streamed generation use, give minigpt's text back exactly."""
    import ctypes

    run_dir, path = files["gptneox/llama-bpe"]
    tok = load_run(run_dir, "cpu").tokenizer
    llm = llama(path)
    text = "Hello , world . Isn 't it ? I 'm here !"
    ids = tok.encode(text)
    buf = ctypes.create_string_buffer(1000)
    n = llama_cpp.llama_detokenize(llm._model.vocab, (llama_cpp.llama_token * len(ids))(*ids),
                                   len(ids), buf, len(buf), False, False)
    assert buf.raw[:n].decode("utf-8") == "Hello, world. Isn 't it? I'm here!"
    assert llm.detokenize(ids).decode("utf-8") == text == tok.decode(ids)
