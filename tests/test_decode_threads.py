"""The decoding thread policy (`minigpt.device.decode_threads`): one function picks the
intra-op threads from the model's width, and `minigpt sample` and `minigpt bench --suite
sample` both decode under it (so the bench times what sample runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from minigpt.bench.sample import SampleSettings, run_sample_suite
from minigpt.cli import app
from minigpt.config import ModelConfig, from_dict
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.device import DECODE_WEIGHTS_PER_THREAD, decode_threads, decoding_threads
from minigpt.run.checkpoint import save_checkpoint


@pytest.fixture(autouse=True)
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def model_of(n_embd: int, n_layer: int = 1, block_size: int = 16, vocab: int = 64) -> GPT:
    cfg = ModelConfig(n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd,
                      block_size=block_size, vocab_size=vocab)
    return GPT.from_config(cfg, seed=0).eval()


def test_small_models_decode_on_one_thread_and_wide_ones_use_the_cores():
    """One thread per DECODE_WEIGHTS_PER_THREAD weights of the MLP matrix (4 n_embd^2): the
    default 4 x 128 model, 6 x 384 and 768 wide on 1, 1024 wide on both of 2 cores; never
    more than available."""
    assert decode_threads(model_of(128, 4), available=2) == 1
    assert decode_threads(model_of(384, 6), available=2) == 1
    assert decode_threads(model_of(768, 1), available=2) == 1
    assert decode_threads(model_of(1024, 1), available=2) == 2
    assert decode_threads(model_of(1024, 1), available=1) == 1
    assert decode_threads(model_of(1600, 1), available=16) == \
        4 * 1600 * 1600 // DECODE_WEIGHTS_PER_THREAD
    assert decode_threads(model_of(32), available=16) == 1
    torch.set_num_threads(1)
    assert decode_threads(model_of(1024, 1)) == 1  # `available` defaults to torch's setting


def test_decoding_threads_sets_the_policy_and_restores_the_callers_setting():
    torch.set_num_threads(2)
    with decoding_threads(model_of(128, 4)) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), decoding_threads(model_of(32)):
        raise RuntimeError("decoding failed")
    assert torch.get_num_threads() == 2


def forward_threads(monkeypatch) -> list[int]:
    """torch's intra-op thread count at every forward pass of any GPT from now on."""
    seen: list[int] = []
    forward = GPT.forward

    def spy(self, *args, **kw):
        seen.append(torch.get_num_threads())
        return forward(self, *args, **kw)

    monkeypatch.setattr(GPT, "forward", spy)
    return seen


@pytest.mark.parametrize("n_embd", [32, 1024])
def test_sample_and_the_sample_bench_decode_on_the_same_threads(tmp_path: Path, monkeypatch,
                                                                n_embd: int):
    """The same model decodes on decode_threads(model) threads in `minigpt sample` and in
    the bench's sample suite, which records the count; the caller's setting is back after."""
    torch.set_num_threads(2)
    tok = bytes_tokenizer()
    cfg = from_dict({"model": {"n_layer": 1, "n_head": max(1, n_embd // 64), "n_embd": n_embd,
                               "block_size": 16, "vocab_size": tok.n_vocab},
                     "tokenizer": {"vocab_size": 256}})
    model = GPT.from_config(cfg, seed=0)
    save_checkpoint(tmp_path / "run", step=1, model=model, cfg=cfg, tokenizer=tok,
                    trainer_state={"step": 1})
    want = decode_threads(model, 2)
    assert want == (1 if n_embd == 32 else 2)  # 1024 wide: two threads
    seen = forward_threads(monkeypatch)
    r = CliRunner().invoke(app, ["sample", "--run", str(tmp_path / "run"), "-n", "5",
                                 "--seed", "0", "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    assert seen and set(seen) == {want}
    seen.clear()
    s = SampleSettings(n_layer=1, n_embd=n_embd, n_head=max(1, n_embd // 64), block_size=16,
                       vocab_size=tok.n_vocab, prompt_len=4, new_tokens=4, warmup=0, repeats=1)
    rows, same = run_sample_suite(torch.device("cpu"), torch.float32, s, model=model.eval())
    assert same and [r.threads for r in rows] == [want, want] and set(seen) == {want}
    assert torch.get_num_threads() == 2
