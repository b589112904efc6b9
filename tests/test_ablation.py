"""Per-head ablation (minigpt.interp.heads) on hand-built models: a head that copies the
previous token carries the prediction, a dead head carries nothing (exactly 0), and the
batched pass equals ablating one head at a time by editing the weights."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import attention_maps_unrendered

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT
from minigpt.errors import ArgumentError
from minigpt.interp.heads import ablate_heads
from minigpt.interp.modes import MODES

V, T, C = 8, 16, 64  # vocabulary, positions, width; two heads of 32


def previous_token_model() -> GPT:
    """One attention-only layer, learned positions, untied head. Head 0 copies the previous
    token: its query at position t and key at t-1 share a direction (W_Q, W_K read the
    position rows), its value is the token (W_V reads the token rows), and W_O writes it to
    a third block of the residual stream, which is all the LM head reads. Head 1 is dead
    (W_V = 0). On a b a b ... the next token is the previous one."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=C, block_size=T, vocab_size=V, mlp=False,
                      pos_encoding="learned", tie_weights=False)
    model = GPT(cfg).eval()
    tok, pos, out = slice(0, V), slice(V, V + T), slice(V + T, V + T + V)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.blocks[0].ln_1, model.ln_f):
            norm.weight.fill_(1.0)
        model.wte.weight[:, tok] = 10 * torch.eye(V)
        model.wpe.weight[:, pos] = 10 * torch.eye(T)
        w = model.blocks[0].attn.c_attn.weight  # rows: W_Q (C) | W_K (C) | W_V (C)
        d = C // 2
        w[0:T, pos] = 8 * torch.eye(T)  # head 0 query: position t -> direction t
        w[C + 1:C + T, pos][:, :T - 1] = 8 * torch.eye(T - 1)  # key: position s -> s + 1
        w[2 * C:2 * C + V, tok] = torch.eye(V)  # head 0 value: the token
        w[C + d:C + d + T, pos] = torch.randn(T, T)  # head 1 looks somewhere; W_V stays 0
        model.blocks[0].attn.c_proj.weight[out, 0:V] = 10 * torch.eye(V)  # W_O of head 0
        model.lm_head.weight[:, out] = 5 * torch.eye(V)
    return model


def alternating(n: int = T) -> list[int]:
    return [3 if i % 2 == 0 else 5 for i in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_the_copying_head_carries_the_prediction_and_a_dead_head_nothing(mode):
    model = previous_token_model()
    positions = list(range(1, T - 1))  # position 0 cannot know the next token
    ab = ablate_heads(model, alternating(), mode, positions=positions)
    assert ab.base_loss < 0.05  # the hand-built head predicts a b a b almost surely
    assert ab.effect.shape == (1, 2)
    assert ab.effect[0, 1].item() == 0.0  # exactly: the dead head's output is already zero
    if mode == "mean":  # the mean of a b a b ... copies is still half a, half b
        assert ab.effect[0, 0].item() > 0.5
    else:
        assert ab.effect[0, 0].item() > 1.0


def test_batched_ablation_equals_editing_the_weights_head_by_head():
    """Zero ablation of head h of layer l = zeroing W_O's columns of that head (the head's
    output reaches the residual stream only through them), measured one model at a time."""
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=40, bias=True)
    model = GPT.from_config(cfg, seed=3).eval()
    ids = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ab = ablate_heads(model, ids, "zero")
    x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    with torch.no_grad():
        base = model(x, y)[1].item()
        for layer in range(2):
            for head in range(4):
                edited = GPT.from_config(cfg, seed=3).eval()
                edited.blocks[layer].attn.c_proj.weight[:, head * 8:(head + 1) * 8] = 0.0
                want = edited(x, y)[1].item() - base
                assert ab.effect[layer, head].item() == pytest.approx(want, abs=1e-5)
    assert math.isclose(ab.base_loss, base, abs_tol=1e-5)
    assert ab.effect.abs().max() > 1e-3  # random heads matter a little


def test_mean_ablation_is_what_the_hook_gives_row_by_row():
    """The batched pass (16 heads in one call) equals mean-ablating each head in its own pass."""
    from minigpt.core.gpt import ForwardSpec

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=40)
    model = GPT.from_config(cfg, seed=4).eval()
    ids = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    ab = ablate_heads(model, ids, "mean")
    x, y = torch.tensor([ids]), torch.tensor(ids[1:])  # the mean is over all 20 positions

    def loss(spec=None) -> float:
        logits = model(x, attn=spec)[0][0, :-1]  # predictions of positions 0..18
        return torch.nn.functional.cross_entropy(logits, y).item()

    with torch.no_grad():
        base = loss()
        for layer, head in [(0, 0), (0, 3), (1, 2)]:
            def hook(i, z, layer=layer, head=head):
                if i == layer:
                    z = z.clone()
                    z[:, head] = z[:, head].mean(dim=1, keepdim=True)
                return z
            got = loss(ForwardSpec(head_hook=hook)) - base
            assert ab.effect[layer, head].item() == pytest.approx(got, abs=1e-5)


def test_scored_positions_and_bad_input():
    model = previous_token_model()
    ab = ablate_heads(model, alternating(6), "zero", positions=[2, 3], scored="the copy")
    assert ab.positions == [2, 3] and ab.to_json()["n_scored"] == 2
    assert ab.to_json()["scored"] == "the copy"
    with pytest.raises(ArgumentError, match="'half' is not an ablation mode"):
        ablate_heads(model, alternating(), "half")
    with pytest.raises(ArgumentError, match="too short to score"):
        ablate_heads(model, [3], "zero")
    assert model.training is False


def test_chunks_give_the_same_effects(monkeypatch):
    """Memory chunking (here one head per pass) changes nothing but the grouping."""
    from minigpt.interp import patching

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=40)
    model = GPT.from_config(cfg, seed=5).eval()
    ids = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = ablate_heads(model, ids, "resample", seed=7)
    monkeypatch.setattr(patching, "CHUNK_FLOATS", 1)
    split = ablate_heads(model, ids, "resample", seed=7)
    assert torch.allclose(whole.effect, split.effect, atol=1e-6)


def test_inspect_passes_its_seed_to_the_resample_ablation():
    """inspect-heads --seed orders the resample reference of a text too (issue 32): the same
    seed gives the same effects, another seed other ones."""
    from minigpt.heads.inspection import inspect
    from minigpt.heads.probes import ProbeInput

    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=24, vocab_size=40)
    model = GPT.from_config(cfg, seed=5).eval()
    ids = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    inp = ProbeInput(ids, [str(i) for i in ids], "text")
    a, b, c = (inspect(model, inp, ablate="resample", seed=s).ablation.effect
               for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.allclose(a, c)


# --------------------------------------------------------------------------------------------
# Through the installed command: the numbers are the library's, bad input is one line.


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    program = shutil.which("minigpt")
    assert program, "the `minigpt` console script is not on PATH: pip install -e ."
    r = subprocess.run([program, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def run_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The same command run by the app in this process."""
    from conftest import in_process

    r = in_process(list(args), cwd=cwd)
    assert "Traceback" not in r.stderr, r.stderr
    return r


# A call that loads the model: in this process in the quick tier (a process adds ~2 CPU-s of
# importing torch), through the installed command in the slow tier.
HOW = [pytest.param(run_here, id="in-process"),
       pytest.param(run_cli, id="installed", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    from conftest import make_run

    return make_run(tmp_path_factory.mktemp("abl") / "run", top_files=True)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("mode", [  # each mode's numbers: the library tests above, in-process
    pytest.param(m, marks=[] if m == "zero" else [pytest.mark.slow]) for m in MODES])
def test_the_command_prints_the_librarys_effects(tiny_run, tmp_path, mode, how):
    from minigpt.heads.probes import prepare_input
    from minigpt.run import load_run

    r = how("inspect-heads", "--run", str(tiny_run), "--probe", "induction", "--ablate",
            mode, "--json", "--device", "cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    loaded = load_run(tiny_run, "cpu")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    want = ablate_heads(loaded.model, inp.tokens, mode, positions=inp.positions)
    assert doc["ablation"]["mode"] == mode and doc["ablation"]["unit"] == "nats/token"
    assert doc["ablation"]["n_scored"] == len(inp.positions) == 16 // 2 - 1  # block 16
    assert "second copy" in doc["ablation"]["scored"] and "second copy" in r.stderr
    assert doc["ablation"]["base_loss"] == pytest.approx(want.base_loss, abs=1e-6)
    for row in doc["heads"]:
        assert row["ablation"] == pytest.approx(float(want.effect[row["layer"], row["index"]]),
                                                abs=1e-6)


@pytest.mark.parametrize("how", HOW)
def test_table_png_html_and_json_files_carry_the_effects(tiny_run, tmp_path, how):
    out = tmp_path / "out"
    with attention_maps_unrendered():  # ablation.png is read here (in this process)
        r = how("inspect-heads", "--run", str(tiny_run), "--text", "To be, or not to be",
                "--ablate", "zero", "--format", "table,png,html,json", "--out", str(out),
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ablate" in r.stdout and "every next-token prediction" in r.stderr
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    scores = json.loads((out / "scores.json").read_text())
    assert all(isinstance(row["ablation"], float) for row in scores["heads"])
    html = (out / "attention.html").read_text()
    data = html.split('id="viewer-data">', 1)[1].split("</script>", 1)[0]
    shown = json.loads(data)  # what the page's script reads
    assert shown["ablation"]["mode"] == "zero"
    assert [row["ablation"] for row in shown["scores"]] == pytest.approx(
        [row["ablation"] for row in scores["heads"]], abs=1e-4)


@pytest.mark.parametrize("args, needle", [
    (["--ablate", "half"],
     "--ablate: 'half' is not an ablation mode; valid: zero, mean, resample"),
    pytest.param(["--text", "a", "--ablate", "zero"],  # (the induction probe refuses < 4)
                 ("--ablate: the input has 1 tokens, too short to score a prediction: it needs "
                  "at least 2 (see --max-tokens)"),
                 marks=pytest.mark.slow),  # in-process: test_scored_positions_and_bad_input
])
def test_bad_ablation_input_is_one_line(tiny_run, tmp_path, args, needle):
    r = run_cli("inspect-heads", "--run", str(tiny_run), *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {needle}"]


# --------------------------------------------------------------------------------------------
# From the residual stream: the rows of layer l start at layer l and equal a full recompute.


@pytest.mark.parametrize("shape", [
    {"pos_encoding": "rope", "qk_norm": True},
    {"pos_encoding": "learned", "bias": True, "activation": "gelu_tanh", "tie_weights": False},
])
def test_from_the_residual_stream_equals_the_whole_pass_per_head(shape):
    """Every head, every mode, scored on a subset of positions: `ablate_heads` (rows started
    from the clean residual stream at their layer, LM head at the scored positions only)
    equals ablating that head alone in a whole forward pass (1e-5)."""
    from minigpt.core.gpt import ForwardSpec
    from minigpt.interp.heads import _resampled_outputs

    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=32, block_size=24, vocab_size=50, **shape)
    model = GPT.from_config(cfg, seed=6).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
                   * 0.05)
    ids = torch.randint(0, 50, (22,), generator=torch.Generator().manual_seed(8)).tolist()
    pos = list(range(9, 21))
    x, y = torch.tensor([ids]), torch.tensor(ids[1:])[pos]

    def loss(spec) -> float:
        return torch.nn.functional.cross_entropy(model(x, attn=spec)[0][0, pos], y).item()

    with torch.no_grad():
        reference = _resampled_outputs(model, x, 2)
        for mode in MODES:
            ab = ablate_heads(model, ids, mode, positions=pos, seed=2)
            base = loss(ForwardSpec())
            assert ab.base_loss == pytest.approx(base, abs=1e-5)
            for layer in range(4):
                for head in range(4):
                    def hook(i, z, layer=layer, head=head, mode=mode):
                        if i != layer:
                            return z
                        z = z.clone()
                        z[:, head] = {"zero": 0.0, "mean": z[:, head].mean(dim=1, keepdim=True),
                                      "resample": reference[i][:, head]}[mode]
                        return z
                    want = loss(ForwardSpec(head_hook=hook)) - base
                    assert ab.effect[layer, head].item() == pytest.approx(want, abs=1e-5)
            assert ab.effect.abs().max() > 1e-3


def test_residual_stream_and_from_layer_are_the_forward_pass():
    """`residual_stream` holds what enters each block and leaves the last; `unembed` of the
    last is the forward's logits; `from_layer(l, stream[l])` gives the last again."""
    cfg = ModelConfig(n_layer=3, n_head=2, n_embd=16, block_size=12, vocab_size=30,
                      logit_softcap=5.0)
    model = GPT.from_config(cfg, seed=1).eval()
    idx = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stream = model.residual_stream(idx)
        assert len(stream) == 4 and all(s.shape == (2, 12, 16) for s in stream)
        assert torch.equal(model.unembed(stream[-1]), model(idx)[0])
        for layer in range(3):
            assert torch.allclose(model.from_layer(layer, stream[layer]), stream[-1], atol=1e-6)
