"""minigpt's circuit numbers against TransformerLens 4.x's own functions, on models exported with
`minigpt export --format hf` and opened offline with `TransformerBridge.boot_transformers(dir)`:
direct logit attribution (`ActivationCache.stack_head_results(apply_ln=True)` read through
W_U), composition scores (`all_composition_scores`) and per-head activation patching
(`patching.get_act_patch_attn_head_out_all_pos`), both directions. Slow (TransformerLens takes
~10 s to import and boot); skipped, saying why, only where TransformerLens is not installed
(CI installs it before the slow tier, pinned: .ci/run).

TransformerLens's compatibility mode is asked for with `center_unembed=False` (it would
subtract the mean over the vocabulary from W_U, moving every single-token logit by a
per-position constant) and `fold_value_biases=False` (it would move each head's value bias into
the layer's output bias, out of the head): with those two, TL's numbers are minigpt's
definitions. `fold_ln` and `center_writing_weights` stay on: they are what minigpt's
composition scores fold in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from minigpt.config import from_dict
from minigpt.core import circuits as c
from minigpt.core.gpt import GPT
from minigpt.hf import export_hf
from minigpt.run import load_run
from minigpt.run.checkpoint import save_checkpoint
from minigpt.tokenizer import bytes_tokenizer

pytestmark = pytest.mark.slow
tl = pytest.importorskip("transformer_lens", reason="TransformerLens is not installed "
                         "(pip install transformer-lens==4.3.0; .ci/run installs it)")

TOL = 1e-4
MODELS = {  # a GPT-2 export with MLPs, and the induction run's shape (GPT-NeoX, no MLP)
    "gpt2": {"pos_encoding": "learned", "bias": True, "n_layer": 3},
    "neox-attention-only": {"pos_encoding": "rope", "bias": True, "tie_weights": False,
                            "mlp": False, "n_layer": 2},
}
CLEAN = [1, 5, 9, 3, 7, 2, 8, 4, 1, 5, 9, 3, 7, 2, 8, 4]  # an induction probe
CORRUPTED = CLEAN[:8] + [11, 15, 19, 13, 17, 12, 18, 14]  # its second copy replaced
SECOND = list(range(8, 15))


def export_pair(name: str, root: Path, spec: dict | None = None):
    """(minigpt model, TransformerBridge) of the model MODELS[name] (or of the model settings
    `spec`), exported under `root`."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"  # never the network
    from transformer_lens.model_bridge import TransformerBridge

    tok = bytes_tokenizer()
    cfg = from_dict({"model": {"n_head": 4, "n_embd": 64, "block_size": 32,
                               "vocab_size": tok.n_vocab, **(spec or MODELS[name])},
                     "tokenizer": {"vocab_size": 256}})
    model = GPT.from_config(cfg, seed=1)
    with torch.no_grad():  # norms and biases away from their init, so folding them matters,
        gen = torch.Generator().manual_seed(2)  # and matrices 8x their init, so heads matter
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(8.0)
    save_checkpoint(root / "run", step=1, model=model, cfg=cfg, tokenizer=tok,
                    trainer_state={"step": 1})
    export_hf(load_run(root / "run", "cpu"), root / "hf")
    bridge = TransformerBridge.boot_transformers(str(root / "hf"), device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True, center_unembed=False,
                                     fold_value_biases=False)
    return load_run(root / "run", "cpu").model.eval(), bridge


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    """(minigpt model, TransformerBridge) of one exported model, in eval mode."""
    return export_pair(request.param, tmp_path_factory.mktemp(request.param))


def test_the_export_runs_the_same_function(pair):
    model, bridge = pair
    with torch.no_grad():
        ours = model(torch.tensor([CLEAN]))[0]
        theirs = bridge(torch.tensor([CLEAN]))
    assert (ours - theirs).abs().max() < TOL


@pytest.mark.parametrize("kind", ["next", "logit_diff"])
def test_direct_logit_attribution(pair, kind):
    model, bridge = pair
    L, H = model.cfg.n_layer, model.cfg.n_head
    if kind == "next":
        metric = c.make_metric(len(CLEAN), SECOND)
        pos, targets = SECOND, torch.tensor([CLEAN[p + 1] for p in SECOND])
        direction = bridge.W_U[:, targets]  # (C, P)
    else:
        metric = c.make_metric(len(CLEAN), answer=1, wrong=7)
        pos = [len(CLEAN) - 1]
        direction = (bridge.W_U[:, 1] - bridge.W_U[:, 7])[:, None]
    ours = c.direct_logit_attribution(model, CLEAN, metric)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(torch.tensor([CLEAN]))
        stack = cache.stack_head_results(layer=-1, apply_ln=True)  # (L*H, batch, T, C)
        theirs = torch.einsum("npc,cp->n", stack[:, 0, pos], direction) / len(pos)
    assert ours.heads.abs().max() > 0.05  # something to compare
    assert (theirs.view(L, H).double() - ours.heads).abs().max() < TOL


def test_composition_scores(pair):
    model, bridge = pair
    ours = c.composition_scores(model)
    for kind in "QKV":
        with torch.no_grad():
            theirs = bridge.all_composition_scores(kind).double()  # (L, H, L, H)
        later = ours.scores[kind.lower()] != 0  # TL leaves 0 where no composition exists
        assert (theirs[~later] == 0).all()
        assert (theirs - ours.scores[kind.lower()]).abs().max() < TOL


@pytest.mark.parametrize("direction", c.DIRECTIONS)
def test_activation_patching(pair, direction):
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    model, bridge = pair
    metric = c.make_metric(len(CLEAN), SECOND)
    ours = c.patch_heads(model, CLEAN, CORRUPTED, metric, direction=direction)
    targets = torch.tensor([CLEAN[p + 1] for p in SECOND])

    def loss(logits):
        return torch.nn.functional.cross_entropy(logits[0, SECOND], targets)

    into, source = (CLEAN, CORRUPTED) if direction == "noising" else (CORRUPTED, CLEAN)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(torch.tensor([source]))
        theirs = get_act_patch_attn_head_out_all_pos(bridge, torch.tensor([into]), cache,
                                                     loss).double()  # (L, H) patched metric
    base = ours.clean if direction == "noising" else ours.corrupted
    assert ours.delta.abs().max() > 0.05  # heads that matter
    assert (theirs - (base + ours.delta)).abs().max() < TOL


def test_detect_head_is_minigpts_score_times_rows_over_T(pair):
    """TransformerLens's `detect_head` divides a pattern's mass by all T query rows; minigpt
    averages over the rows a score applies to: TL = minigpt x rows / T (the previous-token score
    has T - 1 rows; the induction score the queries whose token occurred before)."""
    from transformer_lens.head_detector import detect_head

    from minigpt.core.heads import attention_maps, score_heads

    model, bridge = pair
    text = "abcdefghabcdefgh"  # no token twice in a row: TL's induction pattern would then
    ids = bridge.to_tokens(text)[0].tolist()  # also count the query's own position
    T = len(ids)  # (with or without the BOS TL may put first: minigpt gets the same ids)
    ours = score_heads(attention_maps(model, ids)[0], ids)
    repeated = sum(1 for t in range(T) if ids[t] in ids[:t])
    for name, score, rows in (("previous_token_head", "previous", T - 1),
                              ("induction_head", "induction", repeated)):
        theirs = detect_head(bridge, text, name).double()  # (n_layer, n_head)
        assert (theirs - ours[score].double() * rows / T).abs().max() < TOL
