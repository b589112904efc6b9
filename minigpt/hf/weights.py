"""Weights of a Hugging Face model directory in minigpt's names, and minigpt's weights in theirs.

Reading: safetensors only -- `model.safetensors`, or shards listed by
`model.safetensors.index.json`. A directory with only pickled weights (`pytorch_model.bin`,
`*.pt`) is refused: unpickling runs code. Every file is sniffed and its header checked
(`run.safetensors_io.read_header`: a pickle, a zip or a truncated file fails there), then every
tensor name and shape against what config.json implies, before any tensor data is read.
Tensors are memory-mapped (`safetensors.safe_open`): pages come from the file as they are
used, and nothing is copied where the layouts agree.

Layouts (C = width, H heads of D = C/H, V vocabulary):
- GPT-2's Conv1D stores W as (in, out), minigpt's nn.Linear as (out, in): the transposed VIEW
  is handed to the model (F.linear reads either layout; no copy).
- GPT-NeoX's query_key_value rows are grouped per head, [q_h | k_h | v_h] for h = 0..H-1, each
  in the rotate-half layout; minigpt's c_attn rows are [Q | K | V] with heads contiguous inside
  each and RoPE on interleaved pairs. The rows are regrouped and the q and k rows of each head
  permuted (`attention.rope_interleaved_to_halves`): one copy of those matrices only.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from minigpt.config import ModelConfig
from minigpt.core.gpt import rope_interleaved_to_halves
from minigpt.errors import MinigptError
from minigpt.hf.arch import GPT2, brief
from minigpt.hf.hub import model_file, read_model_json
from minigpt.run.safetensors_io import read_header

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # a 100B-parameter model's index is a few hundred KiB
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.bin")
FLOATS = ("F32", "F16", "BF16", "F64")
# Buffers older checkpoints saved along with the weights (causal masks, RoPE frequencies).
IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|attention\.bias|attention\.masked_bias"
                     r"|rotary_emb\.inv_freq)$")


def weight_files(directory: Path) -> dict[str, tuple[Path, dict]]:
    """{tensor name: (file, header entry)} of a model directory's safetensors, every header
    checked (and, with an index, every shard present and holding what the index says). Every
    file goes through `hub.model_file`: inside the model directory, a regular file."""
    index = model_file(directory, INDEX)
    if index is not None:
        wmap = read_model_json(index, MAX_INDEX_BYTES)
        wmap = wmap.get("weight_map") if isinstance(wmap, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(s, str) for s in wmap.values()):
            raise MinigptError(f"{index}: not a safetensors index (a JSON object with a "
                               "weight_map of tensor name -> shard file)")
        shards = {}
        for shard in sorted(set(wmap.values())):
            if Path(shard).name != shard or shard in ("", ".", "..") or "\0" in shard:
                raise MinigptError(f"{index}: shard {brief(shard)} is not a file name in the "
                                   "model directory")
            path = model_file(directory, shard)
            if path is None:
                raise MinigptError(f"{index}: shard {shard} is missing from {directory}; "
                                   "download the model again")
            shards[shard] = _header(path)
        for name, shard in wmap.items():
            if name not in shards[shard]:
                raise MinigptError(f"{index}: tensor '{name}' should be in {shard}, which does "
                                   "not hold it; the shards and the index do not match")
        return {name: (directory / shard, shards[shard][name]) for name, shard in wmap.items()}
    path = model_file(directory, WEIGHTS)
    if path is not None:
        return {name: (path, info) for name, info in _header(path).items()}
    pickles = sorted({p.name for pat in PICKLE_PATTERNS for p in directory.glob(pat)})
    if pickles:
        raise MinigptError(f"{directory}: only pickled weights ({', '.join(pickles)}); minigpt "
                           "never unpickles (it can run code): use a model with "
                           f"{WEIGHTS}, or convert the weights to safetensors")
    raise MinigptError(f"{directory}: no safetensors weights ({WEIGHTS} or {INDEX}); minigpt "
                       "loads only safetensors (a model with only pytorch_model.bin / *.pt "
                       "weights is refused: unpickling runs code)")


def _header(path: Path) -> dict[str, dict]:
    """A shard's checked header (`read_header`); one whose JSON nests thousands deep is
    damaged, not a crash."""
    try:
        return read_header(path, "weights")[0]
    except RecursionError:
        raise MinigptError(f"{path} is not a valid safetensors file (its header is nested "
                           "too deeply); the weights are damaged") from None


def expected_shapes(kind: str, m: ModelConfig, attention_bias: bool,
                    prefix: str) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors (names, shapes) that config.json implies."""
    C, V = m.n_embd, m.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    if kind == GPT2:
        out[f"{prefix}wte.weight"] = (V, C)
        out[f"{prefix}wpe.weight"] = (m.block_size, C)
        for i in range(m.n_layer):
            h = f"{prefix}h.{i}."
            for ln in ("ln_1", "ln_2"):
                out[f"{h}{ln}.weight"] = out[f"{h}{ln}.bias"] = (C,)
            for name, (n_in, n_out) in (("attn.c_attn", (C, 3 * C)), ("attn.c_proj", (C, C)),
                                        ("mlp.c_fc", (C, 4 * C)), ("mlp.c_proj", (4 * C, C))):
                out[f"{h}{name}.weight"], out[f"{h}{name}.bias"] = (n_in, n_out), (n_out,)
        out[f"{prefix}ln_f.weight"] = out[f"{prefix}ln_f.bias"] = (C,)
    else:
        out["gpt_neox.embed_in.weight"] = (V, C)
        for i in range(m.n_layer):
            h = f"gpt_neox.layers.{i}."
            for ln in ("input_layernorm", "post_attention_layernorm"):
                out[f"{h}{ln}.weight"] = out[f"{h}{ln}.bias"] = (C,)
            for name, (n_out, n_in), bias in (
                    ("attention.query_key_value", (3 * C, C), attention_bias),
                    ("attention.dense", (C, C), attention_bias),
                    ("mlp.dense_h_to_4h", (4 * C, C), True),
                    ("mlp.dense_4h_to_h", (C, 4 * C), True)):
                out[f"{h}{name}.weight"] = (n_out, n_in)
                if bias:
                    out[f"{h}{name}.bias"] = (n_out,)
        out["gpt_neox.final_layer_norm.weight"] = out["gpt_neox.final_layer_norm.bias"] = (C,)
    if not m.tie_weights:
        out["lm_head.weight" if kind == GPT2 else "embed_out.weight"] = (V, C)
    return out


def check_weights(directory: Path, kind: str, m: ModelConfig,
                  attention_bias: bool = True) -> dict[str, tuple[Path, str]]:
    """{Hugging Face name (without `transformer.`): (file, name stored in it)} of the tensors
    config.json implies, every name, shape and dtype checked against the headers before any
    tensor data is read. Every size in `m` is held by a tensor's shape (n_layer: the layers'
    tensors; vocab_size, n_embd: the embedding; block_size: GPT-2's wpe; GPT-NeoX's is bounded
    in `arch`), so a config.json claiming more than the weights hold fails here, before
    anything of that size is built."""
    files = weight_files(directory)
    prefix = "transformer." if any(k.startswith("transformer.") for k in files) else ""
    per_layer = (len(expected_shapes(kind, replace(m, n_layer=1), attention_bias, prefix))
                 - len(expected_shapes(kind, replace(m, n_layer=0), attention_bias, prefix)))
    if m.n_layer * per_layer > len(files):
        what = "n_layer" if kind == GPT2 else "num_hidden_layers"
        raise MinigptError(f"{directory}: config.json's {what} is {m.n_layer} but the weights "
                           f"hold {len(files)} tensors, fewer than {m.n_layer} layers of "
                           f"{per_layer}; the weights do not match config.json")
    expected = expected_shapes(kind, m, attention_bias, prefix)
    for name, shape in expected.items():
        if name not in files:
            raise MinigptError(f"{directory}: tensor '{name}' is missing; the weights do not "
                               "match config.json")
        path, info = files[name]
        if info["dtype"] not in FLOATS or tuple(info["shape"]) != shape:
            raise MinigptError(f"{path}: tensor '{name}' is {info['dtype']}"
                               f"{list(info['shape'])} but config.json needs a float tensor of "
                               f"shape {list(shape)}; the weights do not match config.json")
    tied_head = {"lm_head.weight", "embed_out.weight"} if m.tie_weights else set()
    extra = sorted(k for k in files if k not in expected and not IGNORED.search(k)
                   and k not in tied_head)
    if extra:
        raise MinigptError(f"{files[extra[0]][0]}: unexpected tensor '{extra[0]}'; the weights "
                           "do not match config.json")
    return {name.removeprefix(prefix): (files[name][0], name) for name in expected}


def map_weights(checked: dict[str, tuple[Path, str]]) -> dict[str, Tensor]:
    """The tensors `check_weights` checked, memory-mapped: {Hugging Face name: tensor}
    (float32; other float dtypes are converted)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for path in dict.fromkeys(p for p, _ in checked.values()):
        try:
            with safe_open(str(path), framework="pt") as fh:
                for name, (where, stored) in checked.items():
                    if where == path:
                        t = fh.get_tensor(stored)  # a view of the memory-mapped file
                        out[name] = t if t.dtype == torch.float32 else t.float()
        except (SafetensorError, OSError) as e:
            raise MinigptError(f"{path}: cannot read the weights ({e})") from None
    return out


def read_weights(directory: Path, kind: str, m: ModelConfig,
                 attention_bias: bool = True) -> dict[str, Tensor]:
    """`check_weights` then `map_weights`: {Hugging Face name: tensor}, checked and mapped."""
    return map_weights(check_weights(directory, kind, m, attention_bias))


# --------------------------------------------------------------------------------------------
# Renaming: Hugging Face <-> minigpt.


def _neox_qkv_to_minigpt(w: Tensor, m: ModelConfig) -> Tensor:
    """query_key_value rows (H x [q_h | k_h | v_h], rotate-half) -> c_attn rows [Q | K | V]
    (interleaved pairs). w is (3C, C) or the bias (3C,)."""
    H, D = m.n_head, m.head_dim
    per_head = w.view(H, 3, D, *w.shape[1:])  # (H, 3, D[, C])
    back = torch.argsort(rope_interleaved_to_halves(D))  # halves -> interleaved
    q, k, v = per_head[:, 0, back], per_head[:, 1, back], per_head[:, 2]
    return torch.cat([q.reshape(H * D, *w.shape[1:]), k.reshape(H * D, *w.shape[1:]),
                      v.reshape(H * D, *w.shape[1:])])


def _minigpt_qkv_to_neox(w: Tensor, m: ModelConfig) -> Tensor:
    """The inverse of `_neox_qkv_to_minigpt`."""
    H, D = m.n_head, m.head_dim
    q, k, v = (t.reshape(H, D, *w.shape[1:]) for t in w.chunk(3))  # each (H, D[, C])
    perm = rope_interleaved_to_halves(D)
    return torch.stack([q[:, perm], k[:, perm], v], dim=1).reshape(w.shape).contiguous()


def _pairs(kind: str, m: ModelConfig) -> list[tuple[str, str, bool]]:
    """(minigpt name, Hugging Face name, transposed) of every weight the two share."""
    if kind == GPT2:
        rows = [("wte.weight", "wte.weight", False), ("wpe.weight", "wpe.weight", False),
                ("ln_f.weight", "ln_f.weight", False), ("ln_f.bias", "ln_f.bias", False)]
        for i in range(m.n_layer):
            for ours, theirs, t in (("ln_1", "ln_1", False), ("ln_2", "ln_2", False),
                                    ("attn.c_attn", "attn.c_attn", True),
                                    ("attn.c_proj", "attn.c_proj", True),
                                    ("mlp.c_fc", "mlp.c_fc", True),
                                    ("mlp.c_proj", "mlp.c_proj", True)):
                rows.append((f"blocks.{i}.{ours}.weight", f"h.{i}.{theirs}.weight", t))
                rows.append((f"blocks.{i}.{ours}.bias", f"h.{i}.{theirs}.bias", False))
        head = "lm_head.weight"
    else:
        rows = [("wte.weight", "gpt_neox.embed_in.weight", False),
                ("ln_f.weight", "gpt_neox.final_layer_norm.weight", False),
                ("ln_f.bias", "gpt_neox.final_layer_norm.bias", False)]
        for i in range(m.n_layer):
            for ours, theirs in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm"),
                                 ("attn.c_attn", "attention.query_key_value"),
                                 ("attn.c_proj", "attention.dense"),
                                 ("mlp.c_fc", "mlp.dense_h_to_4h"),
                                 ("mlp.c_proj", "mlp.dense_4h_to_h")):
                for p in ("weight", "bias"):
                    rows.append((f"blocks.{i}.{ours}.{p}", f"gpt_neox.layers.{i}.{theirs}.{p}",
                                 False))
        head = "embed_out.weight"
    if not m.tie_weights:
        rows.append(("lm_head.weight", head, False))
    return rows


def to_minigpt(kind: str, m: ModelConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """minigpt's state dict (tied head left out) from `read_weights`' tensors. GPT-2: views,
    no copy. Biases a GPT-NeoX without attention_bias lacks are zeros."""
    out = {}
    for ours, theirs, transposed in _pairs(kind, m):
        t = hf.get(theirs)
        if t is None and kind != GPT2 and ".attention." in theirs and ours.endswith(".bias"):
            n = 3 * m.n_embd if ours.endswith("c_attn.bias") else m.n_embd
            t = torch.zeros(n)  # attention_bias false: a zero bias is the same function
        elif t is None:
            raise KeyError(theirs)  # read_weights checked every name: a minigpt bug
        elif kind != GPT2 and ".attn.c_attn." in ours:
            t = _neox_qkv_to_minigpt(t, m)
        out[ours] = t.t() if transposed else t
    return out


def zero_mlp(m: ModelConfig) -> dict[str, Tensor]:
    """The MLP an attention-only model (model.mlp false) exports with: both matrices and
    biases zero, so each block adds exactly 0 where GPT-2 and GPT-NeoX run an MLP (GELU(0) =
    0), and a unit LayerNorm in front of it (its output is multiplied by zeros)."""
    C = m.n_embd
    out = {}
    for i in range(m.n_layer):
        b = f"blocks.{i}."
        out.update({f"{b}ln_2.weight": torch.ones(C), f"{b}ln_2.bias": torch.zeros(C),
                    f"{b}mlp.c_fc.weight": torch.zeros(4 * C, C),
                    f"{b}mlp.c_fc.bias": torch.zeros(4 * C),
                    f"{b}mlp.c_proj.weight": torch.zeros(C, 4 * C),
                    f"{b}mlp.c_proj.bias": torch.zeros(C)})
    return out


def from_minigpt(kind: str, m: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face tensors (contiguous, CPU, float32) from minigpt's state dict; biases a
    bias-free minigpt model lacks are written as zeros (GPT-NeoX's attention biases too:
    `export_config` says attention_bias true, which TransformerLens needs), and an
    attention-only model's MLPs as zero MLPs (`zero_mlp`): the same function."""
    out = {}
    prefix = "transformer." if kind == GPT2 else ""
    state = {**zero_mlp(m), **state} if not m.mlp else state
    for ours, theirs, transposed in _pairs(kind, m):
        t = state.get(ours)
        if t is None:  # bias=False: a zero bias is the same function
            t = torch.zeros(state[ours.replace(".bias", ".weight")].shape[0])
        t = t.detach().to("cpu", torch.float32)
        if kind != GPT2 and ".attn.c_attn." in ours:
            t = _minigpt_qkv_to_neox(t, m)
        name = theirs if theirs in ("lm_head.weight", "embed_out.weight") else prefix + theirs
        out[name] = (t.t() if transposed else t).contiguous()
    return out
