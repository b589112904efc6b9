"""The regularisers of issue 25 beyond the model's dropout (tests/test_model.py has the dropout
split and its SDPA kernels; test_train.py resumes a run with all of them on bit for bit):
train.ema's weight average, what a run saves and evaluates with it, and that exporters take
runs trained with dropout or EMA (neither changes the exported model)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import pictures_off
from safetensors.torch import load_file
from test_train import tiny_sets

from minigpt.config import ModelConfig, load_config
from minigpt.core.gpt import GPT
from minigpt.data.rows import rows_for
from minigpt.device import amp_dtype, forward_context
from minigpt.events import EvalEvent
from minigpt.hf import export_hf, load_model
from minigpt.hf.arch import export_kind
from minigpt.run import load_run
from minigpt.run.resume import resume_config
from minigpt.train import train
from minigpt.train.batches import to_device, validation_sample
from minigpt.train.ema import WeightAverage, ema_decay

# Trainings here draw no pictures (conftest.pictures_off: no test here reads curves.png or
# heads.png, and drawing is most of a tiny run's CPU time).
pytestmark = pytest.mark.usefixtures("no_pictures")

MINIGPT = shutil.which("minigpt")


def test_weight_average_follows_its_recurrence_and_keeps_the_tie():
    """a <- a + (1 - d_u)(w - a), d_u = min(ema, 1 - 1/u): the mean of the weights of every
    update until the horizon 1/(1 - ema), then the exponential average; the average's LM head
    stays its own token embedding; it never trains (eval mode, no gradients)."""
    assert ema_decay(0.999, 1) == 0 and ema_decay(0.999, 4) == 0.75
    assert ema_decay(0.9, 10) == 0.9 and ema_decay(0.9, 1000) == 0.9
    model = GPT.from_config(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8,
                                        vocab_size=20), seed=0)
    avg = WeightAverage(model, 0.9)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    history = []
    for u in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen))
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
        avg.update(u)
        d = min(0.9, 1 - 1 / u)
        for n, p in model.named_parameters():
            expected[n] = d * expected[n] + (1 - d) * p.detach()
        if u == 5:  # the plain mean of the weights after updates 1..5
            mean = torch.stack([h["wte.weight"] for h in history[-5:]]).mean(0)
            assert torch.allclose(dict(avg.model.named_parameters())["wte.weight"], mean,
                                  atol=1e-5)
    got = dict(avg.model.named_parameters())
    assert got.keys() == expected.keys()
    for n, want in expected.items():
        assert torch.allclose(got[n], want, atol=1e-5), n
        assert not torch.allclose(got[n], dict(model.named_parameters())[n], atol=1e-2), n
    assert avg.model.lm_head.weight is avg.model.wte.weight
    assert not avg.model.training and not any(p.requires_grad for p in avg.model.parameters())
    assert avg.train_weights is model
    off = WeightAverage(model, 0.0)  # train.ema 0: the live model is what a run evaluates
    before = [p.clone() for p in model.parameters()]
    off.update(1)
    assert off.model is model and off.train_weights is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> tuple[Path, list[EvalEvent]]:
    tmp = tmp_path_factory.mktemp("ema")
    events: list = []
    sets = tiny_sets(tmp, **{"train.ema": 0.9, "model.attn_dropout": 0.1})
    with pictures_off():
        train(load_config(None, sets), tmp / "run", on_event=events.append)
    return tmp / "run", [e for e in events if isinstance(e, EvalEvent)]


def _val_loss(model: GPT, run: Path) -> float:
    """The trainer's validation loss of `model`: the run's fixed evaluation batch (one batch of
    train.batch_size here, train.eval_batches 1)."""
    loaded = load_run(run, "cpu")
    rows = rows_for(loaded.cfg, loaded.tokenizer)
    offsets = validation_sample(rows, loaded.cfg.train, loaded.cfg.run.seed)
    x, y = to_device(rows.rows("val", offsets), torch.device("cpu"))
    cpu = torch.device("cpu")
    with torch.no_grad(), forward_context(cpu, amp_dtype(loaded.cfg.train.precision, cpu))():
        return model.eval()(x, y)[1].item()  # in the precision the trainer evaluated in


def test_an_ema_run_evaluates_and_saves_the_average(ema_run):
    """With train.ema, model.safetensors (what sample, inspect-heads and export load) holds the
    average, the evaluations measured it, and train_weights.safetensors the live weights."""
    run, evals = ema_run
    ckpt = run / "checkpoints" / "latest"
    average = load_file(ckpt / "model.safetensors")
    live = load_file(ckpt / "train_weights.safetensors")
    assert average.keys() == live.keys()
    assert not any(torch.equal(average[k], live[k]) for k in average)
    loaded = load_run(run, "cpu")
    assert all(torch.equal(t, average[k]) for k, t in loaded.model.state_dict().items()
               if k in average)
    assert evals[-1].step == 6
    assert _val_loss(loaded.model, run) == pytest.approx(evals[-1].val_loss, rel=1e-6, abs=0)
    trained = GPT(loaded.cfg.model)
    trained.load_state_dict({**live, "lm_head.weight": live["wte.weight"]})
    assert _val_loss(trained, run) != pytest.approx(evals[-1].val_loss, rel=1e-4)


def test_exporters_take_dropout_and_ema_runs(ema_run, tmp_path):
    """Dropout and weight averaging change nothing at export: the one export rule takes both
    dropouts, and an EMA run exports its averaged weights."""
    for pos, kind in (("rope", "gpt_neox"), ("learned", "gpt2")):
        assert export_kind(ModelConfig(pos_encoding=pos, dropout=0.2, attn_dropout=0.2)) == kind
    run, _ = ema_run
    export_hf(load_run(run, "cpu"), tmp_path / "hf")
    back = load_model(tmp_path / "hf", "cpu").model.state_dict()
    average = load_file(run / "checkpoints" / "latest" / "model.safetensors")
    assert all(torch.equal(back[k], average[k]) for k in average)


def test_train_ema_may_change_on_resume(tmp_path):
    """The checkpoint says what it holds (train_weights.safetensors: model.safetensors is an
    average), so train.ema may be turned on or off by --resume like any train.* setting."""
    run = tmp_path / "run"
    train(load_config(None, tiny_sets(tmp_path)), run, stop_after=2)
    ckpt = run / "checkpoints" / "latest"
    live = load_file(ckpt / "model.safetensors")
    assert not (ckpt / "train_weights.safetensors").exists()
    on = resume_config(run, ["train.ema=0.9"])
    assert on.train.ema == 0.9
    train(on, run, resume=True, stop_after=4)
    assert (ckpt / "train_weights.safetensors").exists()
    average = load_file(ckpt / "model.safetensors")
    live4 = load_file(ckpt / "train_weights.safetensors")
    assert not torch.equal(average["wte.weight"], live4["wte.weight"])
    assert not torch.equal(live4["wte.weight"], live["wte.weight"])  # training went on
    done = train(resume_config(run, ["train.ema=0"]), run, resume=True)
    assert done.step == 6 and not (ckpt / "train_weights.safetensors").exists()


BOUNDS = [("train.ema=1.0", "< 1.0"), ("model.attn_dropout=-0.1", ">= 0.0"),
          ("model.dropout=1", "< 1.0")]


@pytest.mark.parametrize("setting, bound", BOUNDS)
def test_out_of_bounds_regularisers_are_refused_by_name_in_process(setting, bound):
    from minigpt.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, [setting])
    line = str(e.value)
    assert "\n" not in line and setting.split("=")[0] in line and bound in line, line


@pytest.mark.parametrize("setting, bound", [  # one process in the quick tier; all in-process above
    pytest.param(s, b, marks=[] if s.startswith("train.ema") else [pytest.mark.slow])
    for s, b in BOUNDS])
def test_out_of_bounds_regularisers_are_one_line_errors(tmp_path, setting, bound):
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    r = subprocess.run([MINIGPT, "train", "--print-config", "--set", setting], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and setting.split("=")[0] in lines[0] and bound in lines[0], r.stderr
