"""`minigpt export --format gguf`, checked without llama.cpp (tests/test_gguf_llamacpp.py runs
the real one): the file read back with the `gguf` package's own reader holds every key and
tensor llama.cpp's loader requires for its architecture, in the shapes it requires; a forward
pass written in numpy from the file's tensors and keys alone (llama.cpp's gpt2 / gptneox
graphs: NeoX rotate-half RoPE with the file's base) equals minigpt's logits within 1e-4, for
both architectures, tied and untied heads, with and without biases, f32 and f16; the file's
tokens and merges, applied as llama.cpp applies them, give minigpt's token ids for both split
patterns; and what cannot be exported or written fails through the installed command in one
line, leaving nothing behind."""

from __future__ import annotations

import errno
import itertools
import math
import os
import re
import resource
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    EXPORT_RUN,
    UNEXPORTABLE,
    error_line,
    half_matrices_logits,
    killed_mid_write,
    make_run,
    shakespeare,
)

from minigpt.config import from_dict
from minigpt.data.tokenizer import EOT, Tokenizer, build_tokenizer, bytes_tokenizer
from minigpt.errors import WriteError
from minigpt.hf.gguf import export_gguf
from minigpt.run import load_run

gguf = pytest.importorskip("gguf", reason="the gguf extra: pip install 'minigpt-lab[gguf]'")
regex = pytest.importorskip("regex", reason="installed with transformers (the dev extra)")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MINIGPT = shutil.which("minigpt")
# name -> (model settings, split pattern): both architectures with both patterns, tied and
# untied heads, with and without biases, exact and tanh GELU
RUNS = {
    "learned": ({"pos_encoding": "learned", "bias": True, "activation": "gelu_tanh",
                 "norm_eps": 1e-3}, "gpt4"),
    "learned-nobias-untied": ({"pos_encoding": "learned", "bias": False,
                               "tie_weights": False}, "gpt2"),
    "rope": ({"pos_encoding": "rope", "bias": False, "tie_weights": False,
              "rope_base": 500.0}, "gpt2"),
    "rope-bias-tied": ({"pos_encoding": "rope", "bias": True, "activation": "gelu_tanh"},
                       "gpt4"),
    # attention-only (configs/induction.yaml): written with zero MLPs
    "rope-attention-only": ({"pos_encoding": "rope", "bias": True, "tie_weights": False,
                             "mlp": False}, "gpt2"),
    # configs/default.yaml's (and bytes.yaml's) architecture
    "rope-nobias-tied": ({"pos_encoding": "rope", "bias": False}, "gpt4"),
}
TEXTS = {
    "ascii": "Hello world! It's a test, isn't it? You'll see: we've WON; they'd (ok) [x] {y}.",
    "cjk": "日本語のテキストと中文文本，还有한국어。 Ελληνικά, кириллица.",
    "emoji": "emoji 😀🎉 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "combining": "combining: e\u0301 a\u0308 n\u0303 A\u030a \u0915\u094d\u0937 ﬁ",
    "digits": "12345 apples, 3.14159 pies, 1000000 years, 20240101, x1y22z333 4 56 789",
    "whitespace": "   spaces\ttabs\nnewlines\r\n  trailing   \n\n\n x \t\t\n  \n y",
    "special": f"a {EOT} typed in the text",
}


def train_bpe(root: Path, pattern: str) -> Tokenizer:
    """A BPE trained by minigpt (rustbpe) with `pattern` on Shakespeare and the texts above."""
    (root / "corpus.txt").write_text(shakespeare() + "\n".join(list(TEXTS.values()) * 5),
                                     encoding="utf-8")
    cfg = from_dict({"tokenizer": {"vocab_size": 400, "pattern": pattern},
                     "data": {"corpus": str(root / "corpus.txt"), "cache_dir": str(root)}})
    return build_tokenizer(cfg)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> dict[str, Tokenizer]:
    return {p: train_bpe(tmp_path_factory.mktemp(f"bpe-{p}"), p) for p in ("gpt4", "gpt2")}


@pytest.fixture(scope="module")
def exported(bpe, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (run dir, GGUF file), exported by the library."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for i, (name, (model, pattern)) in enumerate(RUNS.items()):
        run = make_run(root / "runs" / name, tokenizer=bpe[pattern], **EXPORT_RUN, seed=i,
                       **model)
        done = export_gguf(load_run(run, "cpu"), root / f"{name}.gguf")
        assert done.out == root / f"{name}.gguf" and done.n_bytes == done.out.stat().st_size
        out[name] = (run, done.out)
    return out


# --------------------------------------------------------------------------------------------
# Reading a GGUF file with nothing but the gguf package.


def read_gguf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """({key: value}, {tensor name: array in numpy's shape}) through gguf's reader."""
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in r.tensors:
        assert tuple(t.data.shape) == tuple(int(d) for d in reversed(t.shape)), t.name
        tensors[t.name] = np.asarray(t.data)
    return meta, tensors


def value_types(path: Path) -> dict[str, list[str]]:
    return {k: [v.name for v in f.types] for k, f in gguf.GGUFReader(path).fields.items()}


# What llama.cpp's loader reads for these architectures (src/llama-model.cpp: load_hparams;
# src/models/gpt2.cpp, gptneox.cpp: load_arch_hparams; src/llama-vocab.cpp), with the GGUF
# type it reads: {key: type}. {a} is the architecture.
REQUIRED_KEYS = {
    "general.architecture": ["STRING"], "{a}.context_length": ["UINT32"],
    "{a}.embedding_length": ["UINT32"], "{a}.block_count": ["UINT32"],
    "{a}.feed_forward_length": ["UINT32"], "{a}.attention.head_count": ["UINT32"],
    "{a}.attention.layer_norm_epsilon": ["FLOAT32"], "tokenizer.ggml.model": ["STRING"],
    "tokenizer.ggml.pre": ["STRING"], "tokenizer.ggml.tokens": ["ARRAY", "STRING"],
    "tokenizer.ggml.token_type": ["ARRAY", "INT32"],
    "tokenizer.ggml.merges": ["ARRAY", "STRING"], "tokenizer.ggml.bos_token_id": ["UINT32"],
    "tokenizer.ggml.eos_token_id": ["UINT32"], "tokenizer.ggml.add_bos_token": ["BOOL"],
}
NEOX_KEYS = {"{a}.use_parallel_residual": ["BOOL"], "{a}.rope.freq_base": ["FLOAT32"],
             "{a}.rope.dimension_count": ["UINT32"]}


def required_tensors(arch: str, m) -> dict[str, tuple[int, ...]]:
    """The tensors llama.cpp's load_arch_tensors creates as required, numpy shapes (ggml's
    {n_embd, n_vocab} is numpy's (n_vocab, n_embd))."""
    C, V, F = m.n_embd, m.vocab_size, 4 * m.n_embd
    out = {"token_embd.weight": (V, C), "output_norm.weight": (C,), "output_norm.bias": (C,)}
    if arch == "gpt2":
        out["position_embd.weight"] = (m.block_size, C)
    else:
        out["output.weight"] = (V, C)  # gptneox: required even for a tied model
    for i in range(m.n_layer):
        for name, shape in (("attn_norm", (C,)), ("ffn_norm", (C,)), ("attn_qkv", (3 * C, C)),
                            ("attn_output", (C, C)), ("ffn_up", (F, C)), ("ffn_down", (C, F))):
            out[f"blk.{i}.{name}.weight"] = shape
            out[f"blk.{i}.{name}.bias"] = (shape[0],)
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_key_and_tensor_llama_cpp_requires_is_there(exported, name):
    run_dir, path = exported[name]
    run = load_run(run_dir, "cpu")
    m, tok = run.cfg.model, run.tokenizer
    meta, tensors = read_gguf(path)
    arch = "gpt2" if m.pos_encoding == "learned" else "gptneox"
    assert meta["general.architecture"] == arch
    types = value_types(path)
    for key, want in {**REQUIRED_KEYS, **(NEOX_KEYS if arch == "gptneox" else {})}.items():
        assert types.get(key.format(a=arch)) == want, key
    assert (meta[f"{arch}.context_length"], meta[f"{arch}.embedding_length"],
            meta[f"{arch}.block_count"], meta[f"{arch}.feed_forward_length"],
            meta[f"{arch}.attention.head_count"]) == (64, 64, 2, 256, 4)
    assert meta[f"{arch}.attention.layer_norm_epsilon"] == pytest.approx(m.norm_eps)
    if arch == "gptneox":
        assert meta["gptneox.use_parallel_residual"] is False
        assert meta["gptneox.rope.dimension_count"] == m.head_dim
        assert meta["gptneox.rope.freq_base"] == m.rope_base
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == {"gpt4": "llama-bpe", "gpt2": "gpt-2"}[RUNS[name][1]]
    assert meta["tokenizer.ggml.bos_token_id"] == meta["tokenizer.ggml.eos_token_id"] \
        == tok.eot_id
    assert meta["tokenizer.ggml.tokens"][tok.eot_id] == EOT
    assert meta["tokenizer.ggml.token_type"][tok.eot_id] == gguf.TokenType.CONTROL
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.token_type"]) \
        == m.vocab_size

    required = required_tensors(arch, m)
    optional = {"output.weight": (m.vocab_size, m.n_embd)} if arch == "gpt2" else {}
    assert set(required) <= set(tensors) <= set(required) | set(optional)
    assert ("output.weight" in tensors) == (arch == "gptneox" or not m.tie_weights)
    for t, shape in {**required, **optional}.items():
        if t in tensors:
            assert tensors[t].shape == shape and tensors[t].dtype == np.float32, t
    # and every name is one gguf-py's own table gives this architecture
    model_arch = {"gpt2": gguf.MODEL_ARCH.GPT2, "gptneox": gguf.MODEL_ARCH.GPTNEOX}[arch]
    names = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]}
    for t in tensors:
        base = t.rsplit(".", 1)[0]
        assert base in names or re.sub(r"blk\.\d+\.", "blk.{bid}.", base) in names, t


# --------------------------------------------------------------------------------------------
# llama.cpp's forward pass, in numpy, from the file alone.


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x, tanh: bool):
    if tanh:
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def rope_neox(x, base: float, n_rot: int):
    """llama.cpp's NEOX rotation: dims (i, i + n_rot/2) rotate by pos * base^(-2i/n_rot).
    x (T, H, D)."""
    T, half = x.shape[0], n_rot // 2
    theta = np.arange(T)[:, None] * base ** (-2 * np.arange(half) / n_rot)  # (T, half)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., :half], x[..., half:n_rot]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos, x[..., n_rot:]], axis=-1)


def gguf_forward(meta: dict, W: dict[str, np.ndarray], ids: list[int], tanh: bool, act=None):
    """Logits (T, V) of llama.cpp's gpt2 / gptneox graph (src/models/*.cpp) in float64, with
    GELU exact or tanh-approximated (or `act`)."""
    a = meta["general.architecture"]
    H, L = meta[f"{a}.attention.head_count"], meta[f"{a}.block_count"]
    eps = meta[f"{a}.attention.layer_norm_epsilon"]
    W = {k: v.astype(np.float64) for k, v in W.items()}
    T = len(ids)
    x = W["token_embd.weight"][ids]  # (T, C)
    if a == "gpt2":
        x = x + W["position_embd.weight"][:T]
    C = x.shape[1]
    D = C // H
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        p = f"blk.{i}."
        h = layer_norm(x, W[p + "attn_norm.weight"], W[p + "attn_norm.bias"], eps)
        qkv = h @ W[p + "attn_qkv.weight"].T + W[p + "attn_qkv.bias"]  # (T, 3C)
        q, k, v = (qkv[:, j * C:(j + 1) * C].reshape(T, H, D) for j in range(3))
        if a == "gptneox":
            base, n_rot = meta["gptneox.rope.freq_base"], meta["gptneox.rope.dimension_count"]
            q, k = rope_neox(q, base, n_rot), rope_neox(k, base, n_rot)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(D) + mask  # (H, T, T)
        s = np.exp(s - s.max(-1, keepdims=True))
        y = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(T, C)
        x = x + y @ W[p + "attn_output.weight"].T + W[p + "attn_output.bias"]
        h = layer_norm(x, W[p + "ffn_norm.weight"], W[p + "ffn_norm.bias"], eps)
        h = h @ W[p + "ffn_up.weight"].T + W[p + "ffn_up.bias"]
        h = act(h) if act is not None else gelu(h, tanh)
        x = x + h @ W[p + "ffn_down.weight"].T + W[p + "ffn_down.bias"]
    x = layer_norm(x, W["output_norm.weight"], W["output_norm.bias"], eps)
    return x @ W.get("output.weight", W["token_embd.weight"]).T


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_numpy_forward_from_the_file_alone_gives_minigpts_logits(exported, name):
    run_dir, path = exported[name]
    run = load_run(run_dir, "cpu")
    ids = torch.randint(0, run.tokenizer.n_vocab, (64,), generator=torch.Generator()
                        .manual_seed(5)).tolist()
    with torch.no_grad():
        ours = run.model(torch.tensor([ids]))[0][0].double().numpy()
    theirs = gguf_forward(*read_gguf(path), ids, tanh=run.cfg.model.activation == "gelu_tanh")
    assert np.abs(ours - theirs).max() <= 1e-4


def test_f16_holds_the_weights_rounded_to_half(exported, tmp_path):
    """--dtype f16: matrices float16, vectors float32; the file's model is minigpt's with
    its matrices rounded to float16 (same logits within 1e-4)."""
    run_dir, _ = exported["rope-bias-tied"]
    run = load_run(run_dir, "cpu")
    done = export_gguf(run, tmp_path / "half.gguf", dtype="f16")
    meta, W = read_gguf(done.out)
    assert meta["general.file_type"] == 1
    assert {n for n, t in W.items() if t.dtype == np.float16} == {n for n, t in W.items()
                                                                    if t.ndim == 2}
    f32 = export_gguf(run, tmp_path / "full.gguf").n_bytes
    assert 0.45 < done.n_bytes / f32 < 0.55
    ids = list(range(0, 400, 7))
    ours = half_matrices_logits(run.model, ids)
    assert np.abs(ours - gguf_forward(meta, W, ids, tanh=True)).max() <= 1e-4


def test_without_the_rope_permutation_the_file_computes_something_else(exported, tmp_path,
                                                                         monkeypatch):
    """The gptneox parity above needs the q/k row permutation: with the identity instead,
    the logits differ."""
    import minigpt.hf.gguf as lc

    monkeypatch.setattr(lc, "rope_interleaved_to_halves", torch.arange)
    run_dir, _ = exported["rope"]
    run = load_run(run_dir, "cpu")
    path = export_gguf(run, tmp_path / "unpermuted.gguf").out
    ids = list(range(0, 400, 7))
    with torch.no_grad():
        ours = run.model(torch.tensor([ids]))[0][0].double().numpy()
    assert np.abs(ours - gguf_forward(*read_gguf(path), ids, tanh=False)).max() > 1e-2


# --------------------------------------------------------------------------------------------
# The tokenizer: tokens and merges, applied as llama.cpp applies them.


def byte_text(data: bytes) -> str:
    """GPT-2's byte alphabet (bytes_to_unicode), written out independently of minigpt's."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        table[b] = chr(b) if b in keep else chr(256 + extra)
        extra += b not in keep
    return "".join(table[b] for b in data)


def gguf_encode(meta: dict, pattern: str, text: str) -> list[int]:
    """Token ids from the file's tokens and merges, as llama.cpp's BPE session computes them:
    each pre-token in the byte alphabet is one token when it is in the vocabulary and the
    pre-tokenizer ignores merges (llama-bpe), else its characters merged pair by pair, the
    pair whose merge comes first in the list first (leftmost on ties). The split itself is
    minigpt's pattern (llama.cpp's own split is checked by tests/test_gguf_llamacpp.py)."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == gguf.TokenType.NORMAL}
    rank = {tuple(m.split(" ", 1)): i for i, m in enumerate(meta["tokenizer.ggml.merges"])}
    ignore_merges = meta["tokenizer.ggml.pre"] == "llama-bpe"
    ids = []
    for piece in regex.findall(pattern, text):
        word = byte_text(piece.encode("utf-8"))
        if ignore_merges and word in vocab:
            ids.append(vocab[word])
            continue
        parts = list(word)
        while len(parts) > 1:
            ranks = [rank.get((a, b), math.inf) for a, b in itertools.pairwise(parts)]
            best = min(ranks)
            if best == math.inf:
                break
            at = ranks.index(best)
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        ids += [vocab[p] for p in parts]
    return ids


@pytest.mark.parametrize("pattern", ["gpt4", "gpt2"])
def test_the_files_tokens_and_merges_give_minigpts_ids(bpe, pattern, tmp_path):
    tok = bpe[pattern]
    run = make_run(tmp_path / "run", tokenizer=tok, **EXPORT_RUN, pos_encoding="learned")
    meta, _ = read_gguf(export_gguf(load_run(run, "cpu"), tmp_path / "m.gguf").out)
    texts = [*TEXTS.values(), shakespeare()[-3000:], " ".join(TEXTS.values()) * 2]
    for text in texts:
        assert gguf_encode(meta, tok.pattern, text) == tok.encode(text), text
    assert len(meta["tokenizer.ggml.merges"]) == len(tok.ranks) - 256


def test_a_bytes_tokenizer_exports_with_an_inert_merge(tmp_path):
    """A bytes tokenizer has no merges; llama.cpp needs the list and the gguf writer refuses
    an empty one: one merge no text can ever use. A model.vocab_size above the tokenizer's
    gets one placeholder token per unused id."""
    tok = bytes_tokenizer()
    run = make_run(tmp_path / "run", tokenizer=tok, **EXPORT_RUN, pos_encoding="rope",
                   vocab_size=300)
    meta, W = read_gguf(export_gguf(load_run(run, "cpu"), tmp_path / "b.gguf").out)
    assert len(meta["tokenizer.ggml.merges"]) == 1
    assert W["token_embd.weight"].shape == (300, 64) == W["output.weight"].shape
    assert len(meta["tokenizer.ggml.tokens"]) == len(set(meta["tokenizer.ggml.tokens"])) == 300
    assert meta["tokenizer.ggml.token_type"][257:] == [gguf.TokenType.UNUSED] * 43
    for text in TEXTS.values():
        assert gguf_encode(meta, tok.pattern, text) == tok.encode(text) \
            == list(text.encode("utf-8"))


# --------------------------------------------------------------------------------------------
# Bad input through the installed command.


def minigpt(*args: str, **kw) -> subprocess.CompletedProcess:
    assert MINIGPT, "the minigpt command is not installed (pip install -e .)"
    return subprocess.run([MINIGPT, "export", *args], capture_output=True, text=True,
                          timeout=300, check=False, **kw)


def export_cmd(run: Path, out: Path, *more: str) -> list[str]:
    return ["--run", str(run), "--format", "gguf", "--out", str(out), *more]


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("small") / "run", tokenizer=bytes_tokenizer(),
                    **EXPORT_RUN, pos_encoding="learned")


def unwritable_dir(tmp_path: Path) -> Path | None:
    """A directory this process cannot create files in: mode 0500, or for root (whom modes do
    not stop) /sys, where even root cannot; None if there is none."""
    d = tmp_path / "locked"
    d.mkdir(mode=0o500)
    for candidate in (d, Path("/sys")):
        try:
            (candidate / ".probe").touch()
        except OSError:
            return candidate
        (candidate / ".probe").unlink()
    return None


def bad_export_cases(small_run: Path, tmp_path: Path) -> list[tuple[list[str], list[str]]]:
    """(export arguments, what the error line must say) for every way an export is refused."""
    cases = []  # (args, what the line must say)
    for i, (change, needle) in enumerate(UNEXPORTABLE):  # what llama.cpp cannot represent
        run = make_run(tmp_path / "runs" / str(i), tokenizer=bytes_tokenizer(), **EXPORT_RUN,
                       **{"pos_encoding": "rope", **change})
        cases.append((export_cmd(run, tmp_path / "o" / f"{i}.gguf"), [needle]))
    words = Tokenizer({bytes([b]): b for b in range(256)}, r"\S+|\s+", {EOT: 256}, "words")
    run = make_run(tmp_path / "runs" / "words", tokenizer=words, **EXPORT_RUN,
                   pos_encoding="learned")
    cases.append((export_cmd(run, tmp_path / "o" / "w.gguf"), ["tokenizer.pattern", "words"]))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "m.gguf").write_bytes(b"mine")
    (tmp_path / "o" / "d").mkdir()
    (tmp_path / "o" / "afile").write_text("x")
    cases += [
        (export_cmd(small_run, tmp_path / "o" / "m.gguf"), ["--out", "exists",
                                                             "never overwrites"]),
        (export_cmd(small_run, tmp_path / "o" / "d"), ["--out", "is a directory"]),
        (export_cmd(small_run, tmp_path / "o" / "afile" / "sub" / "m.gguf"),
         [f"{tmp_path / 'o' / 'afile'} is a file, not a directory"]),
        (export_cmd(small_run, tmp_path / "o" / ("x" * 300 + ".gguf")),
         ["--out", "longer than the file system allows"]),
        (export_cmd(small_run, tmp_path / "o" / "x.gguf", "--dtype", "bf16"),
         ["--dtype", "float32, float16"]),
        (["--run", str(small_run), "--out", str(tmp_path / "o" / "hf"), "--dtype", "f16"],
         ["--dtype", "--format gguf"]),
    ]
    locked = unwritable_dir(tmp_path)
    if locked is not None:
        cases.append((export_cmd(small_run, locked / "m.gguf"),
                      [f"{locked} is a read-only directory"]))  # before any work
    return cases


def test_bad_input_is_one_line_and_leaves_nothing(small_run, tmp_path):
    """Every case through the command in this process (the one error path, `_Group.invoke`):
    one `error:` line naming the setting, flag or path, exit 2, and the directory as it was."""
    from typer.testing import CliRunner

    from minigpt.cli import app

    cases = bad_export_cases(small_run, tmp_path)
    before = tree(tmp_path)
    for args, needles in cases:
        r = CliRunner().invoke(app, ["export", *args])
        line = error_line(r)
        assert all(n in line for n in needles), (args, line)
    assert tree(tmp_path) == before
    assert (tmp_path / "o" / "m.gguf").read_bytes() == b"mine"


@pytest.mark.slow
def test_bad_input_through_the_installed_command(small_run, tmp_path):
    """The same table, every case through its own `minigpt export` process (side by side)."""
    cases = bad_export_cases(small_run, tmp_path)
    before = tree(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda case: minigpt(*case[0]), cases))
    for (args, needles), r in zip(cases, done):
        line = error_line(r)
        assert all(n in line for n in needles), (args, line)
    assert tree(tmp_path) == before
    assert (tmp_path / "o" / "m.gguf").read_bytes() == b"mine"


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "locked" not in p.parts)


@pytest.mark.slow  # a process under RLIMIT_FSIZE (~2 CPU-s); quick: test_a_full_disk_leaves_nothing
def test_a_write_that_fails_mid_file_leaves_nothing(small_run, tmp_path):
    """The file-size limit (RLIMIT_FSIZE, 64 KiB) makes the kernel refuse the write part way
    through the tensors, as a full disk does: one line, no file, no temporary file."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "out"
    out.mkdir()
    r = minigpt(*export_cmd(small_run, out / "m.gguf"), preexec_fn=limit)
    assert "cannot write" in error_line(r) and "File too large" in r.stderr
    assert names(out) == []


def test_a_really_full_disk_leaves_nothing(small_run, tmp_path):
    """A 256 KiB tmpfs (needs root and mount rights; skipped otherwise) cannot hold the
    ~0.5 MB file: the kernel's ENOSPC, one line, nothing left on the file system. (The command
    runs in this process: the one error line of a real process is the file-size-limit test's
    above.)"""
    from typer.testing import CliRunner

    from minigpt.cli import app

    def export(*args: str) -> subprocess.CompletedProcess:
        r = CliRunner().invoke(app, ["export", *args])
        return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
            capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission)")
    try:
        line = error_line(export(*export_cmd(small_run, mnt / "m.gguf")))
        assert "no space left on device" in line and str(mnt / "m.gguf") in line
        assert names(mnt) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def test_a_full_disk_leaves_nothing(small_run, tmp_path, monkeypatch):
    """ENOSPC part way through the tensors (the writer's file object fails as a full disk
    makes it fail): the library says so in one line and leaves no file behind."""
    written = []

    class Full:
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            written.append(len(data))
            if sum(written) > 100_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    real = gguf.GGUFWriter.open_output_file

    def open_full(self, path=None):
        real(self, path)
        self.fout = [Full(f) for f in self.fout]

    monkeypatch.setattr(gguf.GGUFWriter, "open_output_file", open_full)
    big = make_run(tmp_path / "run", tokenizer=bytes_tokenizer(), **EXPORT_RUN, pos_encoding="rope")
    (tmp_path / "out").mkdir()
    with pytest.raises(WriteError, match="no space left on device") as err:
        export_gguf(load_run(big, "cpu"), tmp_path / "out" / "m.gguf")
    assert "\n" not in str(err.value) and sum(written) > 100_000
    assert names(tmp_path / "out") == []


@pytest.mark.slow  # two processes (~1.5 CPU-s), kill -9 needs one
def test_a_killed_export_leaves_a_temp_file_the_next_export_deletes(small_run, tmp_path):
    """kill -9 in the middle of writing: the hidden temporary sibling stays (nothing can run
    at a SIGKILL); the next export to the same name deletes it and writes the file."""
    out = tmp_path / "m.gguf"
    killed_mid_write("gguf:GGUFWriter.write_tensors_to_file",
                     "a[0].fout[0].write(b'partial'); a[0].fout[0].flush()",
                     ["export", *export_cmd(small_run, out)])
    left = names(tmp_path)
    assert len(left) == 1 and re.fullmatch(r"\.m\.gguf\.\d+-[0-9a-f]{8}\.tmp", left[0]), left
    from typer.testing import CliRunner

    from minigpt.cli import app

    r = CliRunner().invoke(app, ["export", *export_cmd(small_run, out)])  # the next export
    assert r.exit_code == 0, r.stderr
    assert names(tmp_path) == ["m.gguf"]
    assert read_gguf(out)[0]["general.architecture"] == "gpt2"


def test_without_the_gguf_package_one_line_says_what_to_install(small_run, tmp_path,
                                                                  monkeypatch):
    """The command's one error line when `import gguf` fails (in-process: the exit code and
    stderr of a real process are checked by the other one-line errors of the installed
    command)."""
    from typer.testing import CliRunner

    from minigpt.cli import app

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    r = CliRunner().invoke(app, ["export", *export_cmd(small_run, tmp_path / "m.gguf")])
    line = error_line(subprocess.CompletedProcess([], r.exit_code, r.stdout, r.stderr))
    assert "--format" in line and "pip install 'minigpt-lab[gguf]'" in line
    assert names(tmp_path) == []


def export_here(*args: str) -> subprocess.CompletedProcess:
    """`minigpt export ARGS` run by the app in this process."""
    from conftest import in_process

    return in_process(["export", *args])


# In this process in the quick tier (a process adds ~2 CPU-s of importing torch; the quick
# tier's installed `minigpt export` processes: the file-size-limit test above, the killed
# export, tests/test_cli_real.py), through the installed command in the slow tier.
@pytest.mark.parametrize("export", [pytest.param(export_here, id="in-process"),
                                    pytest.param(minigpt, id="installed",
                                                 marks=pytest.mark.slow)])
def test_the_installed_command_writes_the_file_and_says_where(small_run, tmp_path, export):
    out = tmp_path / "sub" / "m.gguf"
    r = export(*export_cmd(small_run, out, "--dtype", "f16"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert "gpt2" in r.stderr and "float16" in r.stderr and "llama-bpe" in r.stderr
    assert read_gguf(out)[0]["general.file_type"] == 1
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
