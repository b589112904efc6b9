"""tracr's compiled weights as a minigpt model: the settings and the state dict, from numpy
arrays in tracr's names (no jax, no tracr: the quick tests convert a stored fixture).

tracr's model (tracr.transformer.model, with the compiler's settings) is a pre-norm
transformer without the norms: x = token_embed[ids] + pos_embed[positions]; per layer
x += attn(x), then x += mlp(x) with mlp = linear_2(relu(linear_1(x))); attention with
`num_heads` heads of width `key_size` (not d_model / heads), scores q.k / sqrt(key_size),
masked causally (-1e30 before the softmax: the same weights as minigpt's -inf), no biases in
use (tracr zeroes them); the output is the residual stream projected onto the output
variable's directions (the argmax of those for a categorical output, the one value for a
numerical one). Position 0 is BOS, whose position embedding is zero.

So a minigpt model with `norm: none`, `activation: relu`, `d_head: key_size`,
`d_mlp: mlp_hidden_size`, learned positions over max_seq_len + 1 positions, no biases and an
untied output read of `d_vocab_out` rows (one per output direction: a one-hot row of the
residual stream) computes the same numbers: the weights are copied, transposed to torch's
(out, in) layout, q|k|v fused into c_attn.
"""

from __future__ import annotations

import numpy as np
import torch

ATTN = ("query", "key", "value")


def model_settings(dims: dict[str, int], n_out: int) -> dict:
    """The `model.*` settings of the compiled model (module docstring); `dims` as
    tracr_compile.Compiled.dims, `n_out` the output directions."""
    return {"n_layer": dims["n_layer"], "n_head": dims["n_head"], "n_embd": dims["n_embd"],
            "d_head": dims["head_dim"], "d_mlp": dims["mlp_hidden"],
            "block_size": dims["block_size"], "vocab_size": dims["vocab_size"],
            "pos_encoding": "learned", "norm": "none", "activation": "relu", "mlp": True,
            "bias": False, "tie_weights": False, "d_vocab_out": n_out, "dropout": 0.0,
            "attn_dropout": 0.0, "qk_norm": False, "logit_softcap": 0.0}


def readout(residual: list[str], directions: list[str]) -> np.ndarray:
    """(n_out, n_embd) float32: row i reads output direction i off the residual stream."""
    index = {label: i for i, label in enumerate(residual)}
    w = np.zeros((len(directions), len(residual)), dtype=np.float32)
    for i, d in enumerate(directions):
        w[i, index[d]] = 1.0
    return w


def state_dict(params: dict[str, np.ndarray], dims: dict[str, int], residual: list[str],
               directions: list[str]) -> dict[str, torch.Tensor]:
    """minigpt's state dict of the compiled model from tracr's `params` ({"module/param":
    array}, e.g. "transformer/layer_0/attn/query/w" (d_model, heads * key_size))."""
    biases = [k for k, v in params.items() if k.endswith("/b") and np.any(v)]
    assert not biases, f"tracr set biases {biases}: the conversion assumes none"

    def t(name: str, transpose: bool = True) -> torch.Tensor:
        a = np.asarray(params[name], dtype=np.float32)
        return torch.from_numpy(np.array(a.T if transpose else a, dtype=np.float32))

    out = {"wte.weight": t("token_embed/embeddings", False),
           "wpe.weight": t("pos_embed/embeddings", False)}
    for layer in range(dims["n_layer"]):
        pre, to = f"transformer/layer_{layer}", f"blocks.{layer}"
        out[f"{to}.attn.c_attn.weight"] = torch.cat([t(f"{pre}/attn/{n}/w") for n in ATTN])
        out[f"{to}.attn.c_proj.weight"] = t(f"{pre}/attn/linear/w")
        out[f"{to}.mlp.c_fc.weight"] = t(f"{pre}/mlp/linear_1/w")
        out[f"{to}.mlp.c_proj.weight"] = t(f"{pre}/mlp/linear_2/w")
    out["lm_head.weight"] = torch.from_numpy(readout(residual, directions))
    return out
