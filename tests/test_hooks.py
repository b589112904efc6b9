"""Hooks a user registers on any module of the model fire, as in any torch model (the leaf
layers' fast path is taken only when no hook is there), and the forward pass's one
intervention point (`core.gpt.Intervention`) changes nothing when it changes nothing: with
every head's query, key and value input apart, the logits are the plain pass's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT, ForwardSpec, Intervention


def model_of(**over) -> GPT:
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 12,
                         "vocab_size": 30, "bias": True, **over})
    return GPT.from_config(cfg, seed=0).eval()


IDX = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(0))


def leaves(model: GPT) -> dict[str, nn.Module]:
    b = model.blocks[1]
    named = {"lm_head": model.lm_head, "ln_f": model.ln_f, "c_attn": b.attn.c_attn,
             "ln_1": b.ln_1, "wte": model.wte}
    if b.mlp is not None:
        named["mlp.c_fc"] = b.mlp.c_fc
    if model.wpe is not None:
        named["wpe"] = model.wpe
    return named


@pytest.mark.parametrize("over", [{}, {"norm": "rmsnorm", "pos_encoding": "learned"}])
def test_forward_and_pre_hooks_fire_on_every_leaf(over):
    model = model_of(**over)
    with torch.no_grad():
        plain = model(IDX)[0]
    seen: list[str] = []
    handles = []
    for name, m in leaves(model).items():
        handles.append(m.register_forward_pre_hook(lambda mod, a, n=name: seen.append("pre " + n)))
        handles.append(m.register_forward_hook(lambda mod, a, out, n=name: seen.append(n)))
    with torch.no_grad():
        hooked = model(IDX)[0]
    for h in handles:
        h.remove()
    for name in leaves(model):
        assert "pre " + name in seen and name in seen, name
    assert torch.equal(hooked, plain)  # calling the module is the same op


def test_a_forward_hook_can_change_the_output():
    model = model_of()
    handle = model.ln_f.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    with torch.no_grad():
        logits = model(IDX)[0]
    handle.remove()
    assert torch.equal(logits, torch.zeros_like(logits))  # the LM head has no bias
    with torch.no_grad():
        assert model(IDX)[0].abs().max() > 0  # removed: the fast path again


def test_backward_hooks_fire():
    model = model_of()
    grads: dict[str, torch.Tensor] = {}
    h1 = model.lm_head.register_full_backward_hook(
        lambda m, gin, gout: grads.__setitem__("lm_head", gout[0]))
    h2 = model.blocks[0].attn.c_attn.register_full_backward_pre_hook(
        lambda m, gout: grads.__setitem__("c_attn", gout[0]))
    logits, loss = model(IDX[:, :-1], targets=IDX[:, 1:])
    loss.backward()
    h1.remove()
    h2.remove()
    assert grads["lm_head"].shape == logits.shape and grads["lm_head"].abs().sum() > 0
    assert grads["c_attn"].shape == (2, 11, 48)


def test_global_hooks_fire():
    from torch.nn.modules.module import register_module_forward_hook

    model = model_of()
    seen = []
    handle = register_module_forward_hook(lambda m, a, out: seen.append(type(m).__name__))
    with torch.no_grad():
        model(IDX)
    handle.remove()
    assert {"Linear", "LayerNorm", "Embedding"} <= set(seen)


class SplitEveryReader(Intervention):
    """Each head's q, k and v its own copy of the stream; MLP and final inputs as copies."""

    def attn_in(self, layer, x):
        return x.expand(3, 2, *x.shape).clone()  # (3, H, B, T, C)

    def mlp_in(self, layer, x):
        return x.clone()

    def final_in(self, x):
        return x.clone()


@pytest.mark.parametrize("over", [{}, {"pos_encoding": "learned", "mlp": False},
                                  {"qk_norm": True, "norm": "rmsnorm", "bias": False}])
def test_split_reader_inputs_give_the_plain_logits(over):
    model = model_of(**over)
    with torch.no_grad():
        plain = model(IDX)[0]
        split = model(IDX, attn=ForwardSpec(intervention=SplitEveryReader()))[0]
        seen = []
        h = model.blocks[0].attn.c_attn.register_forward_hook(lambda m, a, o: seen.append(o))
        hooked = model(IDX, attn=ForwardSpec(intervention=SplitEveryReader()))[0]
        h.remove()
    assert (split - plain).abs().max() < 1e-5
    assert (hooked - plain).abs().max() < 1e-5  # the module called on every reader's input
    assert seen and seen[0].shape == (3, 2, 2, 12, 48)


def test_head_hook_is_the_intervention_at_the_heads():
    model = model_of()
    hook = lambda layer, z: torch.zeros_like(z) if layer == 1 else z
    with torch.no_grad():
        a = model(IDX, attn=ForwardSpec(head_hook=hook))[0]

        class Zero(Intervention):
            def heads(self, layer, z):
                return hook(layer, z)

        b = model(IDX, attn=ForwardSpec(intervention=Zero()))[0]
    assert torch.equal(a, b) and not torch.allclose(a, model(IDX)[0])
    with pytest.raises(ValueError, match="not both"):
        ForwardSpec(head_hook=hook, intervention=Zero())
