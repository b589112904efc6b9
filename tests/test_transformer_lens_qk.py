"""minigpt's QK attribution (minigpt.interp.qk) against TransformerLens 4.x, on models exported
with `minigpt export --format hf` and opened offline with `TransformerBridge.boot_transformers`
(the set-up of tests/test_transformer_lens.py): every score `inspect-heads --qk` reports is
TransformerLens's `blocks.{l}.attn.hook_attn_scores` (scaled by 1/sqrt(d_head)) within 1e-4,
on every exported architecture; and on a GPT-2 export with MLPs and learned positions the
per-pair grid [query writer, key writer] is, within 1e-4, the one computed from
TransformerLens's cache alone: each writer's output (`hook_embed`, `hook_pos_embed`, each
head's `hook_z` through its W_O, `hook_mlp_out`, the W_O biases) centred, divided by the
layer's frozen `ln1.hook_scale`, through its W_Q and W_K (compatibility mode folds the norm's
gain and bias into them: the same linear map), the q/k biases with the constants. Slow;
skipped, saying why, where TransformerLens is not installed."""

from __future__ import annotations

import math

import pytest
import torch
from test_transformer_lens import CLEAN, MODELS, export_pair

from minigpt.interp.qk import induction_pairs, qk_attribution

pytestmark = pytest.mark.slow
TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def transformer_lens():
    return pytest.importorskip("transformer_lens", reason="TransformerLens is not installed "
                               "(pip install transformer-lens==4.3.0; .ci/run installs it)")


@pytest.fixture(scope="module", params=sorted(MODELS))
def exported(request, tmp_path_factory):
    model, bridge = export_pair(request.param, tmp_path_factory.mktemp(request.param))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(torch.tensor([CLEAN]))
    return request.param, model, bridge, cache


def every_head(model):
    return [(la, h) for la in range(model.cfg.n_layer) for h in range(model.cfg.n_head)]


@pytest.mark.parametrize("pairs", ["most-attended", "induction"])
def test_every_reported_score_is_transformer_lens(exported, pairs):
    _, model, _, cache = exported
    chosen = None if pairs == "most-attended" else induction_pairs(CLEAN, len(CLEAN) // 2)
    res = qk_attribution(model, torch.tensor([CLEAN]), every_head(model), chosen)
    for h in res:
        theirs = cache[f"blocks.{h.layer}.attn.hook_attn_scores"][0, h.head].double()
        for p, (_, t, s) in enumerate(h.pairs):
            assert abs(float(h.scores[p]) - float(theirs[t, s])) < TOL
            assert abs(float(h.grid[p].sum()) - float(theirs[t, s])) < TOL
            allowed = theirs[t, :t + 1]
            assert abs(float(h.margins[p]) - float(theirs[t, s] - allowed.mean())) < TOL


def tl_writers(bridge, cache, layer: int) -> list[torch.Tensor]:
    """Each writer of the stream entering `layer`, from TransformerLens's cache alone, in
    minigpt's order (embed.tok, embed.pos, per layer its heads and MLP), and last the
    constant: the W_O biases of the earlier layers. Each (T, C) float64."""
    out = [cache["hook_embed"][0].double(), cache["hook_pos_embed"][0].double()]
    const = torch.zeros_like(out[0])
    for la in range(layer):
        z = cache[f"blocks.{la}.attn.hook_z"][0].double()  # (T, H, D)
        w_o = bridge.W_O[la].double()  # (H, D, C)
        out += [z[:, h] @ w_o[h] for h in range(w_o.shape[0])]
        out.append(cache[f"blocks.{la}.hook_mlp_out"][0].double())
        const = const + bridge.b_O[la].double()
    return [*out, const]


def test_the_grid_is_transformer_lens_cache_through_the_frozen_norm(exported):
    name, model, bridge, cache = exported
    if name != "gpt2":
        pytest.skip("the grid from the cache is checked on the GPT-2 export (learned "
                    "positions, MLPs, no rotation between W_Q and W_K)")
    pairs = induction_pairs(CLEAN, len(CLEAN) // 2)
    D = model.cfg.head_dim
    for la, h in every_head(model):
        (ours,) = qk_attribution(model, torch.tensor([CLEAN]), [(la, h)], pairs)
        writers = tl_writers(bridge, cache, la)
        scale = cache[f"blocks.{la}.ln1.hook_scale"][0].double()  # (T, 1), frozen
        normed = [(x - x.mean(-1, keepdim=True)) / scale for x in writers]
        q = [x @ bridge.W_Q[la, h].double() for x in normed]
        k = [x @ bridge.W_K[la, h].double() for x in normed]
        q[-1] = q[-1] + bridge.b_Q[la, h].double()  # the constants: the bias writer
        k[-1] = k[-1] + bridge.b_K[la, h].double()
        assert len(writers) == len(ours.writers)
        for p, (_, t, s) in enumerate(pairs):
            grid = torch.stack([torch.stack([qi[t] @ kj[s] for kj in k]) for qi in q])
            assert (grid / math.sqrt(D) - ours.grid[p]).abs().max() < TOL, (la, h, t, s)
