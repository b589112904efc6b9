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

from minigpt.config import from_dict, load_config, to_dict
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.errors import MinigptError
from minigpt.hf import export_hf
from minigpt.interp import head_circuits as c
from minigpt.interp.edge_args import DIRECTIONS
from minigpt.interp.patching import make_metric
from minigpt.run import load_run
from minigpt.run.checkpoint import save_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def transformer_lens():
    """Skip where TransformerLens is absent; imported when a test here runs, not when the
    quick tier collects this file (the import alone takes ~1 CPU-s)."""
    return pytest.importorskip("transformer_lens", reason="TransformerLens is not installed "
                               "(pip install transformer-lens==4.3.0; .ci/run installs it)")

TOL = 1e-4
SMALL = {"n_head": 4, "n_embd": 64, "block_size": 32}  # each shipped config's shape, narrower
MODELS = {  # a GPT-2 export with MLPs, and the architecture of every shipped config that exports
    "gpt2": {"pos_encoding": "learned", "bias": True, "n_layer": 3},
    # GPT-NeoX without biases (written as zeros: TL's adapter needs a qkv bias), tied, MLPs;
    # configs/bytes.yaml has the same architecture with a 256-token vocabulary
    "config-default": "default",
    "config-induction": "induction",  # GPT-NeoX with biases, untied, no MLP
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
    model = spec or MODELS[name]
    if isinstance(model, str):  # a shipped config's model section, at SMALL's widths
        model = {k: v for k, v in to_dict(load_config(model))["model"].items()
                 if k not in ("vocab_size", "dropout")}
    cfg = from_dict({"model": {**model, **SMALL, "vocab_size": tok.n_vocab},
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
def exported(request, tmp_path_factory):
    """(minigpt model, TransformerBridge, the export's directory) of one exported model."""
    root = tmp_path_factory.mktemp(request.param)
    return (*export_pair(request.param, root), root / "hf")


@pytest.fixture(scope="module")
def pair(exported):
    """(minigpt model, TransformerBridge) of one exported model, in eval mode."""
    return exported[:2]


def boot(path: Path, raw: bool = False, **compatibility):
    """The export at `path` as a TransformerBridge in eval mode: `raw` (no weight processing),
    or in compatibility mode with these arguments (none: TransformerLens's defaults)."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(path), device="cpu")
    if not raw:
        bridge.enable_compatibility_mode(disable_warnings=True, **compatibility)
    return bridge.eval()


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
        metric = make_metric(len(CLEAN), SECOND)
        pos, targets = SECOND, torch.tensor([CLEAN[p + 1] for p in SECOND])
        direction = bridge.W_U[:, targets]  # (C, P)
    else:
        metric = make_metric(len(CLEAN), answer=1, wrong=7)
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


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_activation_patching(pair, direction):
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    model, bridge = pair
    metric = make_metric(len(CLEAN), SECOND)
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

    from minigpt.interp.heads import attention_maps, score_heads

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


def test_the_native_models_of_transformer_lens_cannot_hold_the_speedrun_config():
    """docs/export.md: configs/speedrun.yaml goes nowhere. minigpt's exports refuse it (GPT-2
    and GPT-NeoX have no ReLU^2, QK-norm or soft-capping), and TransformerLens 4.3's own
    models (`boot_native`, what `convert_tl_checkpoint` loads into) hold its soft-capped,
    untied head but not its MLP or attention: `act_fn` relu2 is refused, and `use_qk_norm`
    is accepted and ignored (no norm on queries or keys, the same function as without)."""
    from transformer_lens.model_bridge import TransformerBridge

    from minigpt.hf.arch import export_kind

    m = load_config("speedrun").model
    assert (m.activation, m.qk_norm, m.logit_softcap > 0) == ("relu2", True, True)
    with pytest.raises(MinigptError, match="model.activation is 'relu2'"):
        export_kind(m)
    native = {"d_model": 64, "d_head": 16, "n_heads": 4, "n_layers": 1, "n_ctx": 32,
              "d_vocab": 256, "positional_embedding_type": "rotary", "seed": 0,
              "output_logits_soft_cap": m.logit_softcap}
    with pytest.raises(ValueError, match="relu2"):
        TransformerBridge.boot_native({**native, "act_fn": "relu2"})
    ids = torch.tensor([CLEAN])
    logits = []
    for qk_norm in (False, True):
        bridge = TransformerBridge.boot_native({**native, "act_fn": "relu",
                                                "use_qk_norm": qk_norm})
        names = [n for n, _ in bridge.named_parameters() if ".attn." in n]
        assert names and not any("norm" in n for n in names)
        with torch.no_grad():
            logits.append(bridge(ids))
    assert torch.equal(logits[0], logits[1])


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits[0, SECOND], targets)


def test_value_bias_folding_moves_ablation_and_dla_but_not_patching(exported):
    """TransformerLens's default compatibility mode folds each head's value bias into the
    layer's output bias: a head's zero ablation and DLA lose that part (measured: zero ablation
    moves by up to 0.17 nats/token on the GPT-2 export, 0.19 on the GPT-NeoX one), while patching
    is unchanged (the bias's contribution b_V W_O is the same on both inputs, every attention
    row summing to 1): it agrees to ~1e-6. With fold_value_biases=False the ablation agrees; a
    model without biases (the default config) has nothing to fold and agrees both ways."""
    from transformer_lens.patching import get_act_patch_attn_head_out_all_pos

    from minigpt.interp.heads import ablate_heads

    model, folded_off, path = exported
    folded = boot(path)  # TransformerLens's defaults: fold_value_biases=True
    L, H = model.cfg.n_layer, model.cfg.n_head
    targets = torch.tensor([CLEAN[p + 1] for p in SECOND])
    ours = c.patch_heads(model, CLEAN, CORRUPTED, make_metric(len(CLEAN), SECOND))
    with torch.no_grad():
        _, cache = folded.run_with_cache(torch.tensor([CORRUPTED]))
        theirs = get_act_patch_attn_head_out_all_pos(
            folded, torch.tensor([CLEAN]), cache, lambda lg: _loss(lg, targets)).double()
    assert (theirs - (ours.clean + ours.delta)).abs().max() < TOL

    ablation = ablate_heads(model, CLEAN, "zero", positions=SECOND).effect
    moved = {}
    for name, bridge in (("folded", folded), ("not folded", folded_off)):
        with torch.no_grad():
            base = float(_loss(bridge(torch.tensor([CLEAN])), targets))
        effect = torch.zeros(L, H, dtype=torch.float64)
        for la in range(L):
            for h in range(H):
                def zero(z, hook, h=h):
                    z = z.clone()
                    z[:, :, h] = 0.0
                    return z

                with torch.no_grad():
                    lg = bridge.run_with_hooks(torch.tensor([CLEAN]),
                                               fwd_hooks=[(f"blocks.{la}.attn.hook_z", zero)])
                effect[la, h] = float(_loss(lg, targets)) - base
        moved[name] = float((effect - ablation).abs().max())
    assert moved["not folded"] < TOL
    if not model.cfg.bias:  # the default config: its exported value biases are zeros
        assert moved["folded"] < TOL
        return
    assert moved["folded"] > 0.1  # 0.166 (GPT-2 export) and 0.193 (GPT-NeoX) measured

    dla = c.direct_logit_attribution(model, CLEAN, make_metric(len(CLEAN), answer=1, wrong=7))
    with torch.no_grad():
        _, cache = folded.run_with_cache(torch.tensor([CLEAN]))
        stack = cache.stack_head_results(layer=-1, apply_ln=True)[:, 0, -1]  # (L*H, C)
        theirs = (stack @ (folded.W_U[:, 1] - folded.W_U[:, 7])).view(L, H).double()
    assert (theirs - dla.heads).abs().max() > 0.1  # 0.22 and 0.45 measured


def test_logit_lens(exported):
    """minigpt's logit lens is TransformerLens's `logit_lens` (every residual point, its own
    final-norm statistics, W_U and b_U): on the raw bridge the target's logits, probabilities,
    ranks and the top tokens agree; in the default compatibility mode (which centres the
    unembedding, shifting every logit at a position by one constant) the log-probabilities do."""
    from transformer_lens.tools.analysis import logit_lens as tl_lens

    from minigpt.interp.lens import logit_lens

    model, _, path = exported
    ours = logit_lens(model, CLEAN)  # every position, the next token as the target
    raw = boot(path, raw=True)
    inputs, targets = torch.tensor([CLEAN[:-1]]), torch.tensor([CLEAN[1:]])
    res = tl_lens(raw, inputs, positions=None, targets=targets)
    assert len(res.labels) == model.cfg.n_layer + 1 == len(ours.points)
    assert (res.values[:, 0, :, 0].double() - ours.logit.double()).abs().max() < TOL
    assert torch.equal(res.readout.target_ranks[:, 0, :, 0], ours.rank)
    probs = tl_lens(raw, inputs, positions=None, targets=targets, return_type="probs")
    assert (probs.values[:, 0, :, 0].double() - ours.prob.double()).abs().max() < TOL
    top = tl_lens(raw, inputs, positions=None, top_k=1).readout.top_ids[:, 0, :, 0]
    assert torch.equal(top, ours.top)
    logp = tl_lens(boot(path), inputs, positions=None, targets=targets, return_type="log_probs")
    assert (logp.values[:, 0, :, 0].double() - ours.prob.double().log()).abs().max() < TOL
    assert (ours.logit[0] - ours.logit[-1]).abs().max() > 0.1  # the points differ
