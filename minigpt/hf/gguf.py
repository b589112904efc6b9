"""`export_gguf`: a minigpt model as one GGUF file that llama.cpp (and what is built on it:
llama-cpp-python, ollama, LM Studio) loads and runs as minigpt does.

learned positions -> llama.cpp's `gpt2` architecture; rope -> `gptneox` (full rotary,
sequential residual, the RoPE base written). What GPT-2 / GPT-NeoX cannot express is refused
by the rule the transformers export uses (`hf.arch.export_kind`): one line naming the setting.

Tensors, in numpy's shapes (ggml lists dimensions the other way round, so nn.Linear's
(out, in) weight is ggml's {in, out}, what llama.cpp's loader asks for: nothing is transposed):

    token_embd.weight           (V, C)   wte
    position_embd.weight        (P, C)   wpe (gpt2 only)
    blk.N.attn_norm.weight|bias (C,)     blocks.N.ln_1
    blk.N.attn_qkv.weight|bias  (3C, C)  blocks.N.attn.c_attn: rows [Q | K | V], heads
                                         contiguous; gptneox: each head's q and k rows in the
                                         rotate-half order (`attention.rope_interleaved_to_halves`)
    blk.N.attn_output.*         (C, C)   blocks.N.attn.c_proj
    blk.N.ffn_norm.*            (C,)     blocks.N.ln_2
    blk.N.ffn_up.*              (4C, C)  blocks.N.mlp.c_fc
    blk.N.ffn_down.*            (C, 4C)  blocks.N.mlp.c_proj
    output_norm.weight|bias     (C,)     ln_f
    output.weight               (V, C)   lm_head: gpt2 writes it only when untied (llama.cpp
                                         reuses token_embd otherwise); gptneox always needs it

llama.cpp requires every bias: those a `model.bias: false` model lacks are zeros (the same
function). `--dtype float16` stores the matrices as float16; vectors stay float32.

Tokenizer: llama.cpp's `gpt2` model (byte-level BPE): the tokens in id order in GPT-2's byte
alphabet and the merges recovered from the ranks (`hf.tokenizer.bpe_vocab`, as the
transformers export writes them), `<|endoftext|>` as a control token and as BOS and EOS,
`add_bos_token` false, and the pre-tokenizer named for the run's split pattern (llama.cpp picks
its split regex by that name): `llama-bpe` for minigpt's gpt4 pattern, `gpt-2` for its gpt2
pattern; another pattern is refused. llama.cpp then gives minigpt's token ids
(tests/test_gguf_llamacpp.py runs it).

The file is written by the `gguf` package (the format's reference writer, the optional extra
`minigpt-lab[gguf]`) into a temporary sibling, fsynced, and linked into place: whole or not at
all, never over an existing file (`files.new_output`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minigpt.config import ModelConfig
from minigpt.core.gpt import rope_interleaved_to_halves
from minigpt.data.tokenizer import EOT, PATTERNS, Tokenizer
from minigpt.errors import ArgumentError, MinigptError
from minigpt.files import check_new_path, new_output, read_only_dir
from minigpt.hf.arch import GPT2, export_kind
from minigpt.hf.tokenizer import bpe_vocab
from minigpt.hf.weights import zero_mlp
from minigpt.run.checkpoint import model_tensors
from minigpt.run.load import LoadedRun

ARCHITECTURES = {GPT2: "gpt2", "gpt_neox": "gptneox"}  # hf.arch kind -> llama.cpp name
# minigpt's split patterns -> the llama.cpp pre-tokenizer whose regex splits text the same way
PRE_TOKENIZERS = {PATTERNS["gpt4"]: "llama-bpe", PATTERNS["gpt2"]: "gpt-2"}
DTYPES = {"float32": (np.float32, 0), "float16": (np.float16, 1)}  # numpy dtype, general.file_type
DTYPE_ALIASES = {"f32": "float32", "f16": "float16"}  # the spellings before bench's were adopted
# llama.cpp's token types (gguf-py's TokenType)
NORMAL, CONTROL, UNUSED = 1, 3, 5
# llama.cpp needs a merge list and the gguf writer refuses an empty one: a bytes tokenizer (no
# merges) gets this one, two characters outside GPT-2's byte alphabet that no text ever has
INERT_MERGE = "\u2205 \u2205"


@dataclass
class GGUFExport:
    out: Path
    architecture: str  # gpt2 | gptneox
    pre_tokenizer: str  # llama-bpe | gpt-2
    dtype: str  # float32 | float16
    n_params: int
    n_bytes: int


def check_gguf_out(out: str | Path) -> Path:
    """`out` must be a new file name: an export never replaces anything."""
    out = check_new_path(out, "out")
    if os.path.lexists(out):
        what = "is a directory" if out.is_dir() else "exists"
        raise ArgumentError("out", f"{what}; an export never overwrites anything: give a new "
                            "file name (e.g. model.gguf)", subject=out)
    if out.parent.is_dir() and (why := read_only_dir(out.parent)) is not None:
        raise ArgumentError("out", f"{out.parent} {why}, so the export cannot be written there "
                            "(as the hf export refuses it): make it writable (chmod u+w) or give "
                            "another place", subject=out)
    return out


def require_gguf():
    """The `gguf` package, or a one-line error saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise ArgumentError("format", "gguf needs the gguf package, the optional extra: pip "
                            "install 'minigpt-lab[gguf]'") from None
    return gguf


def pre_tokenizer(tok: Tokenizer) -> str:
    """The llama.cpp pre-tokenizer that splits text as `tok` does, or a one-line refusal."""
    if tok.pattern not in PRE_TOKENIZERS:
        known = ", ".join(f"{name} (-> {PRE_TOKENIZERS[p]})" for name, p in PATTERNS.items())
        raise MinigptError(f"tokenizer.pattern: tokenizer {tok.name} splits text with a pattern "
                           f"llama.cpp has no pre-tokenizer for; llama.cpp reproduces minigpt's "
                           f"patterns {known}")
    return PRE_TOKENIZERS[tok.pattern]


# --------------------------------------------------------------------------------------------
# What the file holds: metadata and tensors as plain data.


def gguf_dtype(dtype: str) -> str:
    """The matrices' dtype by its one spelling (float32 | float16, as `minigpt bench --dtype`
    spells them; f32 and f16 still read), else an ArgumentError naming `--dtype`."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ArgumentError("dtype", f"'{dtype}' is not a GGUF dtype here; valid: "
                            f"{', '.join(DTYPES)}")
    return name


def gguf_metadata(loaded: LoadedRun, dtype: str = "float32") -> tuple[str, dict[str, object]]:
    """(llama.cpp architecture, {key: value}) of the GGUF file. Value types: bool, int (written
    as uint32), float (float32), str, list[str], list[int] (int32)."""
    m, tok = loaded.cfg.model, loaded.tokenizer
    arch = ARCHITECTURES[export_kind(m)]
    meta: dict[str, object] = {
        "general.name": Path(loaded.source).name or loaded.source,
        "general.file_type": DTYPES[gguf_dtype(dtype)][1],
        f"{arch}.context_length": m.block_size,
        f"{arch}.embedding_length": m.n_embd,
        f"{arch}.block_count": m.n_layer,
        f"{arch}.feed_forward_length": 4 * m.n_embd,
        f"{arch}.attention.head_count": m.n_head,
        f"{arch}.attention.layer_norm_epsilon": float(m.norm_eps),
    }
    if arch == "gptneox":
        meta |= {f"{arch}.use_parallel_residual": False,
                 f"{arch}.rope.dimension_count": m.head_dim,
                 f"{arch}.rope.freq_base": float(m.rope_base)}
    return arch, meta | tokenizer_metadata(tok, m.vocab_size)


def tokenizer_metadata(tok: Tokenizer, vocab_size: int) -> dict[str, object]:
    """The `tokenizer.ggml.*` keys: one token per id up to the model's vocab_size (ids the
    tokenizer does not use, if any, are unused placeholders that no text can produce)."""
    pre = pre_tokenizer(tok)
    vocab, merges = bpe_vocab(tok)
    tokens: list[str | None] = [None] * vocab_size
    types = [UNUSED] * vocab_size
    for text, i in vocab.items():
        tokens[i], types[i] = text, NORMAL
    for text, i in tok.special_tokens.items():
        tokens[i], types[i] = text, CONTROL
    tokens = [t if t is not None else f"<unused {i}>" for i, t in enumerate(tokens)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges] or [INERT_MERGE],
            "tokenizer.ggml.bos_token_id": tok.special_tokens[EOT],
            "tokenizer.ggml.eos_token_id": tok.special_tokens[EOT],
            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": False}


def gguf_tensors(loaded: LoadedRun, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{GGUF name: array} in llama.cpp's order and shapes (the table in the module docstring);
    matrices in `dtype`, vectors float32."""
    m = loaded.cfg.model
    kind = export_kind(m)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in
             model_tensors(loaded.model).items()}
    if not m.mlp:  # attention-only: zero MLPs, the same function (hf.weights.zero_mlp)
        state = {**zero_mlp(m), **state}

    def get(name: str, rows: int) -> torch.Tensor:
        return state[name] if name in state else torch.zeros(rows)  # bias=False: zeros

    out = {"token_embd.weight": state["wte.weight"]}
    if kind == GPT2:
        out["position_embd.weight"] = state["wpe.weight"]
    qkv_rows = _qkv_rows(m) if kind != GPT2 else None
    C = m.n_embd
    for i in range(m.n_layer):
        b, blk = f"blocks.{i}.", f"blk.{i}."
        for ours, theirs, n in (("ln_1", "attn_norm", C), ("attn.c_attn", "attn_qkv", 3 * C),
                                ("attn.c_proj", "attn_output", C), ("ln_2", "ffn_norm", C),
                                ("mlp.c_fc", "ffn_up", 4 * C), ("mlp.c_proj", "ffn_down", C)):
            w, bias = state[f"{b}{ours}.weight"], get(f"{b}{ours}.bias", n)
            if qkv_rows is not None and theirs == "attn_qkv":
                w, bias = w[qkv_rows], bias[qkv_rows]
            out[f"{blk}{theirs}.weight"], out[f"{blk}{theirs}.bias"] = w, bias
    out["output_norm.weight"], out["output_norm.bias"] = state["ln_f.weight"], get("ln_f.bias", C)
    if not m.tie_weights:
        out["output.weight"] = state["lm_head.weight"]
    elif kind != GPT2:  # llama.cpp's gptneox has no tied head: the embedding again
        out["output.weight"] = state["wte.weight"]
    matrix = DTYPES[gguf_dtype(dtype)][0]
    return {name: np.ascontiguousarray(t.numpy(), dtype=matrix if t.ndim == 2 else np.float32)
            for name, t in out.items()}


def _qkv_rows(m: ModelConfig) -> torch.Tensor:
    """Row order of c_attn for gptneox: every head's q and k rows go from minigpt's
    interleaved pairs (2i, 2i+1) to NeoX's halves (i, i + D/2); v rows stay."""
    H, D = m.n_head, m.head_dim
    head = rope_interleaved_to_halves(D)  # (D,)
    qk = (torch.arange(2 * H)[:, None] * D + head[None, :]).reshape(-1)  # (2C,) q then k
    return torch.cat([qk, torch.arange(2 * H * D, 3 * H * D)])  # (3C,)


# --------------------------------------------------------------------------------------------
# Writing.


def export_gguf(loaded: LoadedRun, out: str | Path, dtype: str = "float32") -> GGUFExport:
    """Write `loaded` (a run, or any LoadedRun) as one GGUF file at `out` (a new file)."""
    dtype = gguf_dtype(dtype)
    gguf = require_gguf()
    out = check_gguf_out(out)
    arch, meta = gguf_metadata(loaded, dtype)
    tensors = gguf_tensors(loaded, dtype)
    with new_output(out) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for key, value in meta.items():
                _add(gguf, writer, key, value)
            for name, array in tensors.items():
                writer.add_tensor(name, array.view(_Through))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    n_params = loaded.model.num_params()["total"]
    return GGUFExport(out, arch, meta["tokenizer.ggml.pre"], dtype, n_params,
                      out.stat().st_size)


class _Through(np.ndarray):
    """An array the gguf writer writes through the file object (numpy's own tofile reports a
    failed write as "N requested and M written", without the errno that says "no space left
    on device")."""

    def tofile(self, fh, *args) -> None:
        fh.write(memoryview(np.ascontiguousarray(self)).cast("B"))


def _add(gguf, writer, key: str, value: object) -> None:
    """One metadata entry, typed as llama.cpp reads it."""
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        writer.add_key_value(key, value, T.ARRAY, sub_type=T.STRING)
    elif isinstance(value, list) and all(type(v) is int for v in value):
        writer.add_key_value(key, value, T.ARRAY, sub_type=T.INT32)
    else:
        raise TypeError(f"{key}: no GGUF type for {type(value).__name__}")
