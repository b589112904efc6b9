"""The decode step (core/decode.py): a static KV cache gives the logits of the usual one, its
one-token steps run compiled only where nothing watches the pass (a hook on any module, an
Intervention), the compiled step's logits equal the eager pass's (slow: it compiles), and the
arithmetic `minigpt bench` prints beside the tokens/s."""

from __future__ import annotations

import pytest
import torch

from minigpt.bench.sample import decode_arithmetic
from minigpt.config import ModelConfig
from minigpt.core.decode import decode_steps
from minigpt.core.generate import generate
from minigpt.core.gpt import GPT
from minigpt.errors import ArgumentError
from minigpt.infer.sample import decode_compiles

SPEEDRUN_LIKE = {"activation": "relu2", "qk_norm": True, "tie_weights": False,
                 "logit_softcap": 30.0}


def model_of(**over) -> GPT:
    cfg = ModelConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 24,
                         "vocab_size": 50, **over})
    m = GPT.from_config(cfg, seed=0).eval()
    with torch.no_grad():  # weights far enough from the init that the logits vary
        for p in m.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return m


def logits_of(model: GPT, n: int, compiled: bool) -> list[torch.Tensor]:
    """Every step's next-token logits of a greedy decode of n tokens (the context window
    jumps forward at block_size, so the cache is re-prefilled on the way)."""
    seen: list[torch.Tensor] = []
    list(generate(model, [3, 1, 4], n, temperature=0.0, on_logits=lambda z: seen.append(z),
                  compile_step=compiled))
    return seen


@pytest.mark.parametrize("over", [{}, SPEEDRUN_LIKE, {"pos_encoding": "learned"}],
                         ids=["default", "speedrun-like", "learned"])
def test_a_static_cache_gives_the_usual_logits_and_a_hook_keeps_the_step_eager(over):
    """With a hook on a module the static cache's steps run eagerly (so the hook fires on
    every forward pass) and give the dynamic cache's logits."""
    m = model_of(**over)
    calls = []
    m.blocks[1].mlp.register_forward_hook(lambda mod, args, out: calls.append(1))
    static, usual = logits_of(m, 40, True), logits_of(m, 40, False)
    assert "_decode_steps" not in m.__dict__  # nothing was compiled
    assert len(calls) == 2 * len(usual)  # one forward per token, in both decodes
    assert max(float((a - b).abs().max()) for a, b in zip(static, usual)) < 1e-5


def test_only_plain_one_token_steps_on_a_static_cache_run_compiled():
    """torch.compile wraps the blocks lazily (nothing compiles until a step runs): the wrappers
    exist only for a plain one-token step on a static cache, without hooks."""
    m = model_of()
    static, usual = m.new_kv_cache(1, static=True), m.new_kv_cache(1)
    assert decode_steps(m, usual, 1, True) is None and decode_steps(m, None, 1, True) is None
    assert decode_steps(m, static, 2, True) is None  # a prefill
    assert decode_steps(m, static, 1, False) is None  # an Intervention or probabilities
    steps = decode_steps(m, static, 1, True)
    assert [s._orig_mod for s in steps] == list(m.blocks)
    assert decode_steps(m, static, 1, True) is steps  # kept on the model, made once
    assert "_decode_steps" not in dict(m.named_modules())  # not a submodule
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:  # torch's global hooks count too
        assert decode_steps(m, static, 1, True) is None
    finally:
        handle.remove()


def test_compile_is_the_kv_caches_and_opt_in():
    assert decode_compiles(True, True) and not decode_compiles(True, False)
    with pytest.raises(ArgumentError, match="--compile compiles the KV-cache decode step"):
        decode_compiles(False, True)


def test_the_arithmetic_of_a_decoded_token():
    m = model_of(tie_weights=False)
    C, L, mat = 32, 2, m.num_params()["matmul"]
    flops, bytes_ = decode_arithmetic(m, 4, 3, kv_cache=True)  # contexts 5 and 6
    assert flops == pytest.approx(2 * mat + 4 * L * C * 5.5)
    assert bytes_ == pytest.approx(4 * (m.num_params()["total"] + 2 * L * C * 5.5))
    flops, bytes_ = decode_arithmetic(m, 4, 3, kv_cache=False)
    assert flops == pytest.approx((5 * 2 * mat + 2 * L * C * 25 + 6 * 2 * mat
                                   + 2 * L * C * 36) / 2)
    assert bytes_ == 4 * m.num_params()["total"]


@pytest.mark.slow
@pytest.mark.parametrize("over", [{}, SPEEDRUN_LIKE, {"pos_encoding": "learned", "bias": True}],
                         ids=["default", "speedrun-like", "learned-bias"])
def test_the_compiled_step_gives_the_eager_logits(over):
    """Each block compiled for a one-token step (the weight streamed through inductor's
    multiply-reduce): every step's logits within 1e-4 of the eager pass's, across window jumps
    (re-prefilled eagerly), and one compiled step serves every layer."""
    m = model_of(**over)
    compiled, usual = logits_of(m, 60, True), logits_of(m, 60, False)
    assert "_decode_steps" in m.__dict__
    assert max(float((a - b).abs().max()) for a, b in zip(compiled, usual)) < 1e-4
