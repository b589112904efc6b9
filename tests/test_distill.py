"""Distillation (train.distill_from, train/distill.py): the loss it trains on, that the
student stays a plain run whose directory names its teachers, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from test_train import LATEST, tiny_sets

from minigpt.config import ConfigError, load_config
from minigpt.core.gpt import GPT
from minigpt.run import load_run
from minigpt.train import train
from minigpt.train.distill import Teachers


def test_the_loss_mixes_the_teachers_mean_probabilities():
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                             "model.vocab_size=20", "model.logit_softcap=10"])
    teachers = [GPT.from_config(cfg, seed=s).eval() for s in (1, 2)]
    student = GPT.from_config(cfg, seed=3)
    x = torch.randint(0, 20, (2, 8))
    y = torch.randint(0, 20, (2, 8))
    y[1, 5] = -1
    logits, ce = student(x, y)
    got = Teachers(teachers, 0.3).loss(x, y, logits, ce)
    p = (teachers[0](x)[0].softmax(-1) + teachers[1](x)[0].softmax(-1)) / 2
    per_pos = -(p * F.log_softmax(logits, -1)).sum(-1)  # (2, 8)
    soft = per_pos[y != -1].mean()
    assert torch.allclose(got, 0.7 * ce + 0.3 * soft)
    got.backward()  # differentiable through the student only
    assert student.wte.weight.grad is not None and teachers[0].wte.weight.grad is None


def test_a_distilled_run_names_its_teachers_and_stays_a_plain_model(tmp_path, monkeypatch):
    teacher = tmp_path / "teacher"
    train(load_config(None, tiny_sets(tmp_path)), teacher)
    monkeypatch.chdir(tmp_path)  # a relative path is saved absolute
    plain, none, some = tmp_path / "plain", tmp_path / "w0", tmp_path / "w1"
    train(load_config(None, tiny_sets(tmp_path)), plain)
    for run, w in ((none, 0.0), (some, 1.0)):
        sets = [*tiny_sets(tmp_path), "train.distill_from=[teacher]",
                f"train.distill_weight={w}"]
        train(load_config(None, sets), run)
    saved = yaml.safe_load((some / "config.yaml").read_text())["train"]["distill_from"]
    assert saved == [str(teacher.resolve())]
    a, b, c = (load_file(r / LATEST / "model.safetensors") for r in (plain, none, some))
    assert all(torch.equal(a[k], b[k]) for k in a)  # weight 0: the plain run exactly
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert load_run(some).model.num_params() == load_run(plain).model.num_params()


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    teacher = tmp_path / "teacher"
    train(load_config(None, tiny_sets(tmp_path)), teacher)
    sets = [*tiny_sets(tmp_path, **{"tokenizer.vocab_size": 260}),
            f"train.distill_from=[{teacher}]"]
    with pytest.raises(ConfigError, match="train.distill_from: .* reads text with another "
                                          "tokenizer"):
        train(load_config(None, sets), tmp_path / "student")
    assert not (tmp_path / "student").exists()  # refused before the run directory is made
