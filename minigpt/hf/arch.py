"""Hugging Face config.json <-> minigpt's ModelConfig, for the two architectures minigpt runs.

- `gpt2` (GPT2LMHeadModel: gpt2, distilgpt2, gpt2-medium/large/xl and their fine-tunes):
  learned positions (n_positions), LayerNorm with bias (layer_norm_epsilon), biases
  everywhere, GELU (`gelu_new` = tanh approximation -> model.activation gelu_tanh), tied head.
- `gpt_neox` (GPTNeoXForCausalLM) in minigpt's shape: full rotary (partial_rotary_factor 1),
  sequential residual (use_parallel_residual false), MLP of 4 x hidden_size.

A config option minigpt does not implement is refused, naming the field: minigpt would
otherwise compute something else than the model was trained with.
"""

from __future__ import annotations

import json
import math

from minigpt.config import Config, ModelConfig, from_dict
from minigpt.errors import MinigptError

GPT2, NEOX = "gpt2", "gpt_neox"
ARCHITECTURES = {GPT2: "GPT2LMHeadModel", NEOX: "GPTNeoXForCausalLM"}
# config.json activation names -> model.activation
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# GPT-NeoX's context length is the one size no tensor holds: its RoPE tables (positions x
# head_dim) are capped instead. Pythia: 2048 x 128 = 2^18; a 128k-token context at 128: 2^24.
MAX_ROPE_TABLE = 1 << 25


def brief(value: object) -> str:
    """repr of a value from a file for an error line, cut short (a crafted file may hold a
    megabyte where one word belongs)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def brief_json(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _finite(v: object) -> float | None:
    """A JSON number as a finite float, else None (true/false, strings, 1e999, 10**400)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


class _Fields:
    """Typed reads of a config.json mapping; every failure names the field."""

    def __init__(self, raw: dict, where: str) -> None:
        self.raw, self.where = raw, where

    def refuse(self, key: str, problem: str) -> MinigptError:
        return MinigptError(f"{self.where}: {key} {problem}")

    def count(self, key: str, default: int | None = None) -> int:
        v = self.raw.get(key, default)
        if type(v) is not int or v < 1:
            raise self.refuse(key, f"must be a positive integer, got {brief(v)}")
        return v

    def number(self, key: str, default: float) -> float:
        v = _finite(self.raw.get(key, default))
        if v is None or v <= 0:
            raise self.refuse(key, f"must be a positive number, got {brief(self.raw.get(key))}")
        return v

    def flag(self, key: str, default: bool) -> bool:
        v = self.raw.get(key, default)
        if not isinstance(v, bool):
            raise self.refuse(key, f"must be true or false, got {brief(v)}")
        return v

    def unsupported_if(self, key: str, bad: bool, value: object, why: str) -> None:
        if bad:
            raise self.refuse(key, f"is {brief_json(value)}: {why}; minigpt does not "
                              "implement it")

    def activation(self, key: str, default: str) -> str:
        v = self.raw.get(key, default)
        if not isinstance(v, str) or v not in ACTIVATIONS:
            raise self.refuse(key, f"{brief(v)} is not supported; minigpt implements "
                              f"{', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[v]


def kind_of(raw: object, where: str) -> str:
    """`gpt2` or `gpt_neox` from config.json's model_type (and architectures, when given)."""
    if not isinstance(raw, dict):
        raise MinigptError(f"{where}: not a JSON object")
    kind = raw.get("model_type")
    if not isinstance(kind, str) or kind not in ARCHITECTURES:
        raise MinigptError(
            f"{where}: model_type {brief(kind)} is not supported; minigpt imports "
            + ", ".join(f"{k} ({a})" for k, a in ARCHITECTURES.items()))
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[kind]]:
        raise MinigptError(f"{where}: architectures {brief(archs)}: minigpt imports "
                           f"{ARCHITECTURES[kind]} (a language-model head) for {kind}")
    return kind


def import_config(raw: dict, where: str, name: str = "") -> Config:
    """The minigpt Config of a Hugging Face config.json (already parsed): model section from
    the file, everything else at its defaults. MinigptError naming the field it refuses."""
    kind = kind_of(raw, where)
    c = _Fields(raw, where)
    model = _gpt2(c) if kind == GPT2 else _neox(c)
    if model["n_embd"] % model["n_head"]:
        raise c.refuse("n_head" if kind == GPT2 else "num_attention_heads",
                       f"{model['n_head']} does not divide the width {model['n_embd']}")
    cfg = from_dict({"model": {**model, "dropout": 0.0, "mlp": True, "norm": "layernorm",
                               "attn_impl": "sdpa"}}, where)
    cfg.run.name = name
    return cfg


def _gpt2(c: _Fields) -> dict:
    n_embd = c.count("n_embd")
    inner = c.raw.get("n_inner")
    c.unsupported_if("n_inner", inner is not None and inner != 4 * n_embd, inner,
                     f"an MLP width other than 4 * n_embd = {4 * n_embd}")
    for key, why in (("scale_attn_by_inverse_layer_idx", "scores scaled by 1/layer index"),
                     ("reorder_and_upcast_attn", "a reordered, upcast attention"),
                     ("add_cross_attention", "cross-attention to an encoder")):
        c.unsupported_if(key, c.flag(key, False), True, why)
    c.unsupported_if("scale_attn_weights", not c.flag("scale_attn_weights", True), False,
                     "attention scores not divided by sqrt(head_dim)")
    return {"n_layer": c.count("n_layer"), "n_head": c.count("n_head"), "n_embd": n_embd,
            "block_size": c.count("n_positions", 1024), "vocab_size": c.count("vocab_size"),
            "pos_encoding": "learned", "norm_eps": c.number("layer_norm_epsilon", 1e-5),
            "activation": c.activation("activation_function", "gelu_new"), "bias": True,
            "tie_weights": c.flag("tie_word_embeddings", True)}


def _neox(c: _Fields) -> dict:
    hidden = c.count("hidden_size")
    c.unsupported_if("use_parallel_residual", c.flag("use_parallel_residual", True), True,
                     "attention and MLP side by side (Pythia)")
    rope = c.raw.get("rope_parameters") or c.raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise c.refuse("rope_parameters", f"must be an object, got {brief(rope)}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    c.unsupported_if("rope_parameters.rope_type", kind != "default", kind,
                     "a scaled RoPE")
    pct = rope.get("partial_rotary_factor", c.raw.get("rotary_pct", 0.25))
    c.unsupported_if("partial_rotary_factor", pct != 1, pct,
                     "rotary on part of each head (Pythia)")
    base = rope.get("rope_theta", c.raw.get("rotary_emb_base", 10000))
    if _finite(base) is None or not base > 1:
        raise c.refuse("rope_theta", f"must be a number > 1, got {brief(base)}")
    inner = c.count("intermediate_size", 4 * hidden)
    c.unsupported_if("intermediate_size", inner != 4 * hidden, inner,
                     f"an MLP width other than 4 * hidden_size = {4 * hidden}")
    heads, positions = c.count("num_attention_heads"), c.count("max_position_embeddings", 2048)
    if positions * max(1, hidden // heads) > MAX_ROPE_TABLE:
        raise c.refuse("max_position_embeddings", f"{positions} x head_dim "
                       f"{hidden // heads} is more than the {MAX_ROPE_TABLE:,} entries of "
                       "RoPE table minigpt builds (no weight holds this size, so it is bounded "
                       "here); lower it in config.json")
    return {"n_layer": c.count("num_hidden_layers"), "n_head": heads,
            "n_embd": hidden, "block_size": positions,
            "vocab_size": c.count("vocab_size"), "pos_encoding": "rope",
            "rope_base": float(base), "norm_eps": c.number("layer_norm_eps", 1e-5),
            "activation": c.activation("hidden_act", "gelu"), "bias": True,
            "tie_weights": c.flag("tie_word_embeddings", False)}


# --------------------------------------------------------------------------------------------
# Export.


def export_kind(m: ModelConfig) -> str:
    """The architecture a minigpt model exports as (learned -> gpt2, rope -> gpt_neox), or a
    MinigptError naming the setting that GPT-2 and GPT-NeoX cannot express: the one rule of
    both export formats (transformers and llama.cpp)."""
    if m.pos_encoding not in ("learned", "rope"):
        raise MinigptError(f"model.pos_encoding is {m.pos_encoding!r}: only learned (-> GPT-2) "
                           "and rope (-> GPT-NeoX) positions export")
    if m.norm != "layernorm":
        raise MinigptError(f"model.norm is {m.norm!r}: GPT-2 and GPT-NeoX use LayerNorm")
    if m.activation not in ("gelu", "gelu_tanh"):
        raise MinigptError(f"model.activation is {m.activation!r}: GPT-2 and GPT-NeoX export "
                           "gelu and gelu_tanh only")
    if m.qk_norm:
        raise MinigptError("model.qk_norm is true: GPT-2 and GPT-NeoX do not normalise queries "
                           "and keys")
    if m.logit_softcap:
        raise MinigptError(f"model.logit_softcap is {m.logit_softcap:g}: GPT-2 and GPT-NeoX do "
                           "not soft-cap their logits")
    if m.value_skip:
        raise MinigptError("model.value_skip is true: GPT-2 and GPT-NeoX layers read no other "
                           "layer's values")
    for name, default in (("d_head", "n_embd / n_head"), ("d_mlp", "4 * n_embd"),
                          ("d_vocab_out", "vocab_size")):
        if getattr(m, name):
            raise MinigptError(f"model.{name} is {getattr(m, name)}: the export writes "
                               f"{default} (what GPT-2 and GPT-NeoX derive it from)")
    return GPT2 if m.pos_encoding == "learned" else NEOX


def export_config(m: ModelConfig, eot_id: int) -> dict:
    """config.json of the exported model (transformers' own keys, no custom code; GPT-2's
    `n_ctx` too, which transformers 5 no longer writes and llama.cpp's converter reads).
    GPT-NeoX always has `attention_bias` true: a bias-free model's attention biases are
    written as zeros (`weights.from_minigpt`), because TransformerLens's GPT-NeoX adapter
    splits a query_key_value bias that must exist."""
    kind = export_kind(m)
    act = "gelu_new" if m.activation == "gelu_tanh" else "gelu"
    common = {"architectures": [ARCHITECTURES[kind]], "model_type": kind,
              "vocab_size": m.vocab_size, "bos_token_id": eot_id, "eos_token_id": eot_id,
              "tie_word_embeddings": m.tie_weights, "initializer_range": 0.02,
              "use_cache": True, "dtype": "float32"}
    if kind == GPT2:
        return {**common, "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd,
                "n_positions": m.block_size, "n_ctx": m.block_size, "n_inner": None,
                "activation_function": act, "layer_norm_epsilon": m.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    return {**common, "num_hidden_layers": m.n_layer, "num_attention_heads": m.n_head,
            "hidden_size": m.n_embd, "intermediate_size": 4 * m.n_embd,
            "max_position_embeddings": m.block_size, "hidden_act": act,
            "layer_norm_eps": m.norm_eps, "use_parallel_residual": False,
            "attention_bias": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_base,
                                "partial_rotary_factor": 1.0},
            "rotary_pct": 1.0, "rotary_emb_base": m.rope_base}  # the keys of transformers 4


# config.json's "minigpt" section: what inspect-heads needs to give an export the inputs it
# gives the run (transformers keeps keys it does not know, and the other readers skip them).
MINIGPT_KEY = "minigpt"


def export_inputs(cfg: Config, eot_first: bool) -> dict:
    """The "minigpt" section of an export of a model with config `cfg`: `eot_first` (whether
    inputs to inspect start with <|endoftext|>; false for a minigpt run) and `data` (its
    data.source and, for the induction source, data.induction_vocab: the ids the probes use)."""
    data = {"source": cfg.data.source}
    if cfg.data.source == "induction":
        data["induction_vocab"] = cfg.data.induction_vocab
    return {"eot_first": eot_first, "data": data}


def import_inputs(raw: dict, cfg: Config, where: str) -> bool | None:
    """Apply config.json's "minigpt" section (`export_inputs`) to `cfg.data`; returns its
    `eot_first` (None: no section, a model minigpt did not export). MinigptError naming the
    field when it is malformed."""
    section = raw.get(MINIGPT_KEY)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise _Fields({}, where).refuse(MINIGPT_KEY, f"must be an object, got {brief(section)}")
    eot_first = _Fields(section, f"{where}: {MINIGPT_KEY}").flag("eot_first", True)
    data = section.get("data", {})
    if not isinstance(data, dict):
        raise _Fields({}, f"{where}: {MINIGPT_KEY}").refuse("data", f"must be an object, got "
                                                          f"{brief(data)}")
    d = _Fields(data, f"{where}: {MINIGPT_KEY}.data")
    source = data.get("source", "text")
    if source not in ("text", "induction"):
        raise d.refuse("source", f"{brief(source)} is not text or induction")
    cfg.data.source = source
    if source == "induction":
        vocab = d.count("induction_vocab")
        if vocab < 2 or vocab > cfg.model.vocab_size:
            raise d.refuse("induction_vocab", f"{vocab} is outside 2..{cfg.model.vocab_size} "
                           "(vocab_size)")
        cfg.data.induction_vocab = vocab
    return eot_first
