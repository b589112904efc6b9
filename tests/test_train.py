"""The training loop through the library API: schedule, optimizer groups, exact resume,
the NaN stop, the run lock, resume rules, and DDP == single process (slow)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import error_line, in_process
from safetensors.torch import load_file

from minigpt.config import ConfigError, MinigptError, ModelConfig, from_dict, load_config, to_dict
from minigpt.core.gpt import GPT
from minigpt.errors import TrainingDiverged
from minigpt.events import CheckpointEvent, DoneEvent, EvalEvent, StepEvent
from minigpt.run import load_run
from minigpt.run.lock import RunLock
from minigpt.run.resume import resume_config
from minigpt.train import train
from minigpt.train.weights import OptimizerChain, build_optimizer, lr_at, set_lr

# Trainings here draw no pictures (conftest.pictures_off: no test here reads curves.png or
# heads.png, and drawing is most of a tiny run's CPU time).
pytestmark = pytest.mark.usefixtures("no_pictures")


def write_corpus(path: Path) -> Path:
    rng = random.Random(0)
    words = ["the", "king", "spoke", "to", "his", "son", "and", "the", "queen", "sat", "by",
             "a", "fire", "while", "rain", "fell"]
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(500))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny_sets(tmp: Path, **over) -> list[str]:
    """A 1-layer, 32-wide byte model that trains a step in a few ms."""
    base = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
            "model.dropout": 0.1, "tokenizer.vocab_size": 256, "train.batch_size": 4,
            "train.max_steps": 6, "train.warmup_steps": 2, "train.learning_rate": 1e-2,
            "train.min_lr": 1e-3, "train.eval_interval": 3, "train.eval_batches": 1,
            "train.log_interval": 1, "train.checkpoint_interval": 3, "train.sample_tokens": 2,
            "data.corpus": str(write_corpus(tmp / "corpus.txt")),
            "data.cache_dir": str(tmp / "cache")}
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


LATEST = Path("checkpoints/latest")


def losses(run: Path) -> list[tuple]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in recs]


def test_lr_schedule_shape():
    t = load_config(None, ["train.max_steps=100", "train.warmup_steps=10",
                           "train.learning_rate=1e-3", "train.min_lr=1e-4"]).train
    lrs = [lr_at(i, t) for i in range(100)]
    assert all(a < b for a, b in itertools.pairwise(lrs[:11]))  # warm-up rises to the peak
    assert lrs[10] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))  # then only decays
    assert lrs[99] == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)
    assert lrs[55] == pytest.approx((1e-3 + 1e-4) / 2, rel=0.02)  # cosine midpoint


def test_wsd_schedule_shape():
    """Warm-up 10, stable at the peak, then the last 20% (20 updates) step down linearly to
    min_lr at the last update; still a pure function of the step."""
    t = load_config(None, ["train.max_steps=100", "train.warmup_steps=10", "train.schedule=wsd",
                           "train.decay_fraction=0.2", "train.learning_rate=1e-3",
                           "train.min_lr=1e-4"]).train
    lrs = [lr_at(i, t) for i in range(100)]
    assert all(a < b for a, b in itertools.pairwise(lrs[:11]))  # warm-up, as cosine
    assert lrs[:10] == [lr_at(i, dataclasses.replace(t, schedule="cosine")) for i in range(10)]
    assert lrs[10:80] == [1e-3] * 70  # warm-up end .. decay start: the peak exactly
    assert lrs[80] == pytest.approx(1e-3 - 0.9e-3 / 20)  # the first of 20 decay updates
    assert all(a > b for a, b in itertools.pairwise(lrs[79:]))
    steps = [a - b for a, b in itertools.pairwise(lrs[79:])]
    assert max(steps) == pytest.approx(min(steps))  # linear
    assert lrs[99] == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)
    assert [lr_at(i, t) for i in range(100)] == lrs  # pure
    # decay_fraction 0: the peak to the end; 1: the decay starts right after warm-up
    assert lr_at(99, dataclasses.replace(t, decay_fraction=0.0)) == 1e-3
    whole = dataclasses.replace(t, decay_fraction=1.0)
    assert lr_at(9, whole) < lr_at(10, whole) == pytest.approx(1e-3 - 0.9e-3 / 90)
    assert lr_at(99, whole) == pytest.approx(1e-4)


MUON = {"train.optimizer": "muon", "train.muon_lr": 0.05, "model.qk_norm": True,
        "model.activation": "relu2", "model.logit_softcap": 30.0, "model.tie_weights": False,
        "model.head_init": "zero", "train.schedule": "wsd", "train.decay_fraction": 0.5}


def test_muon_takes_the_block_matrices_and_adamw_the_rest(tmp_path):
    cfg = load_config(None, [*tiny_sets(tmp_path, **MUON), "model.bias=true",
                             "model.pos_encoding=learned", "model.n_layer=2"])
    cfg.model.vocab_size = 50
    model = GPT(cfg.model)
    opt, names = build_optimizer(model, cfg.train, torch.device("cpu"))
    assert isinstance(opt, OptimizerChain)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    by_id = {id(p): n for n, p in model.named_parameters()}
    in_muon = {by_id[id(p)] for g in muon.param_groups for p in g["params"]}
    assert in_muon == {f"blocks.{i}.{m}.weight" for i in range(2)
                       for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    in_adamw = {by_id[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "blocks.0.attn.qk_norm.q_weight",
            "blocks.1.ln_2.bias", "blocks.0.attn.c_attn.bias"} <= in_adamw
    assert not in_muon & in_adamw and len(names) == len(set(names)) == len(by_id)
    assert names == [by_id[id(p)] for g in opt.param_groups for p in g["params"]]
    # The schedule scales both optimizers: each keeps its ratio to its own peak.
    for it in (0, 3, 4, 5):
        set_lr(opt, lr_at(it, cfg.train))
        assert adamw.param_groups[0]["lr"] == lr_at(it, cfg.train)
        assert muon.param_groups[0]["lr"] / 0.05 == pytest.approx(lr_at(it, cfg.train) / 1e-2)
    # Two steps move every parameter of both parts (the first only the zero head: nothing
    # flows back through a zero matrix).
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randint(0, 50, (2, 16))
    for _ in range(2):
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    assert [n for n, p in model.named_parameters() if torch.equal(before[n], p)] == []
    assert all(p.grad is None for p in model.parameters())
    assert {k for s in opt.state.values() for k in s} == {"momentum_buffer", "exp_avg",
                                                          "exp_avg_sq", "step"}


def test_optimizer_groups_decay_only_matrices():
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=16", "model.n_head=2",
                             "model.bias=true"])
    cfg.model.vocab_size = 50
    model = GPT(cfg.model)
    opt, names = build_optimizer(model, cfg.train, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2
                                                             for p in no_decay["params"])
    assert len(names) == len(set(names)) == len(list(model.parameters()))  # tied weight once
    assert "lm_head.weight" not in names


# The regularisers of issue 25 on top of the speedrun's options (tiny_sets has model.dropout).
REGULARISED = {**MUON, "model.attn_dropout": 0.1, "train.ema": 0.9}


@pytest.mark.parametrize("options", [{}, MUON, REGULARISED, {"train.precision": "fp32"},
                                     {**MUON, "train.precision": "bf16"},
                                     {"train.data_order": "epochs"}],
                         ids=["adamw", "muon", "regularised", "fp32", "muon-bf16", "epochs"])
def test_exact_resume_is_bit_identical(tmp_path, options):
    """6 steps straight == 4 steps (stop) + resume to 6: same weights, same optimizer state
    (AdamW moments; Muon momentum buffers too), same logged losses; with train.ema the
    average (model.safetensors) and the live weights (train_weights.safetensors) both. The
    default precision is auto (bf16 autocast on a CPU with bf16 instructions, fp32 on one
    without), so fp32 and bf16 are each named once too."""
    sets = tiny_sets(tmp_path, **options)
    straight, split = tmp_path / "straight", tmp_path / "split"
    events = []
    train(load_config(None, sets), straight, on_event=events.append)
    first = train(load_config(None, sets), split, stop_after=4)
    assert first.reason == "stopped" and first.step == 4
    done = train(resume_config(split, []), split, resume=True)
    assert done.step == 6 and done.reason == "finished"
    ema = "train.ema" in options
    assert (split / LATEST / "train_weights.safetensors").exists() == ema
    for name in ("model.safetensors", "train_weights.safetensors")[:1 + ema]:
        a, b = load_file(straight / LATEST / name), load_file(split / LATEST / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = load_file(straight / "optimizer.safetensors")
    ob = load_file(split / "optimizer.safetensors")
    assert oa.keys() == ob.keys() and all(torch.equal(oa[k], ob[k]) for k in oa)
    buffers = {k for k in oa if k.endswith(".momentum_buffer")}
    muon = options.get("train.optimizer") == "muon"
    assert len(buffers) == (4 if muon else 0)  # the block's 4 matrices under Muon
    assert losses(straight) == losses(split)
    kinds = {type(e) for e in events}
    assert {StepEvent, EvalEvent, CheckpointEvent, DoneEvent} <= kinds
    ev = [e for e in events if isinstance(e, EvalEvent)][-1]
    assert ev.val_bpb == pytest.approx(ev.val_loss / math.log(2))  # bytes: 1 byte per token
    assert ev.samples and ev.samples[0][0] == ""
    state = json.loads((split / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["tokens_seen"] == 6 * 4 * 16
    assert load_run(split, "cpu").step == 6


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory) -> Path:
    """The tiny run stopped after step 4 (a committed checkpoint), trained once for the tests
    that damage a copy of it."""
    from conftest import pictures_off

    tmp = tmp_path_factory.mktemp("stopped")
    with pictures_off():
        train(load_config(None, tiny_sets(tmp)), tmp / "run", stop_after=4)
    return tmp / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, tmp_path / "run", symlinks=True))


def _rewrite_state(run: Path, edit) -> None:
    """Edit the committed checkpoint's trainer_state.json and re-sign it in the manifest, as a
    checkpoint written that way would be."""
    import hashlib

    ckpt = (run / "checkpoints" / "latest").resolve()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    data = (json.dumps(state, indent=1) + "\n").encode()
    (ckpt / "trainer_state.json").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                               "bytes": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def test_a_run_from_before_the_byte_split_is_refused_in_one_line(stopped_run, tmp_path):
    """A checkpoint whose trainer state records no `data_split` was made by a development
    version before the byte split (no release wrote one): --resume says to retrain, and
    changes nothing."""
    from cli_world import tree_hash

    run = copy_of(stopped_run, tmp_path)
    _rewrite_state(run, lambda state: state.pop("data_split"))
    before = tree_hash(run)
    with pytest.raises(MinigptError, match=r"trainer_state.json records no byte split .* "
                                           r"cannot be resumed; start a new run"):
        train(resume_config(run, []), run, resume=True)
    assert tree_hash(run) == before


@pytest.mark.parametrize("damage", ["rng-torch", "rng-numpy", "tokens_seen", "step"])
def test_a_damaged_trainer_state_is_one_line_naming_the_file(stopped_run, tmp_path, damage):
    """What the trainer state's parser refuses is a one-line MinigptError naming the file,
    before anything is restored (a bug in restoring keeps its traceback)."""
    run = copy_of(stopped_run, tmp_path)

    def edit(state):
        if damage == "rng-torch":
            state["rng"]["torch"] = state["rng"]["torch"][:40]
        elif damage == "rng-numpy":
            state["rng"]["numpy"][1] = state["rng"]["numpy"][1][:10]
        elif damage == "tokens_seen":
            state["tokens_seen"] = "many"
        else:
            state["step"] = -3

    _rewrite_state(run, edit)
    with pytest.raises(MinigptError, match=r"trainer_state.json[: ]") as err:
        train(resume_config(run, []), run, resume=True)
    assert type(err.value) is MinigptError and "\n" not in str(err.value)
    assert load_run(run, "cpu").step == 4


def test_nan_stops_with_knobs_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    sets = tiny_sets(tmp_path, **{"train.max_steps": 8, "train.checkpoint_interval": 2})
    real = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, kv_cache=None):
        logits, loss = real(self, idx, targets, kv_cache)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == 3:  # the third training step
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"step 3.*train\.learning_rate.*train\.precision"
                                               r".*step-000002"):
        train(load_config(None, sets), run)
    assert load_run(run, "cpu").step == 2
    # The lock was released: the run can be resumed (the poison is gone by now).
    monkeypatch.setattr(GPT, "forward", real)
    assert train(resume_config(run, []), run, resume=True).step == 8


def test_lock_refuses_a_second_trainer(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run), pytest.raises(MinigptError, match=f"in use by process {os.getpid()}"):
        train(load_config(None, tiny_sets(tmp_path)), run, resume=True)


def test_fresh_run_never_overwrites(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "precious.txt").write_text("keep")
    with pytest.raises(MinigptError, match="already exists.*--resume"):
        train(load_config(None, tiny_sets(tmp_path)), run)
    assert sorted(p.name for p in run.iterdir()) == ["precious.txt"]


def test_train_leaves_the_callers_config_alone(tmp_path):
    cfg = load_config(None, [*tiny_sets(tmp_path), "train.max_steps=2", "model.vocab_size=0"])
    before = to_dict(cfg)
    train(cfg, tmp_path / "run")
    assert to_dict(cfg) == before and cfg.model.vocab_size == 0  # the run's copy got filled in
    assert load_run(tmp_path / "run", "cpu").cfg.model.vocab_size > 0


def test_resume_rules(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(MinigptError, match="does not exist"):
        resume_config(run, [])
    run.mkdir()
    (run / "config.yaml").write_text("train:\n  max_steps: 10\n")
    with pytest.raises(ConfigError, match="model.n_layer cannot change on --resume"):
        resume_config(run, ["model.n_layer=3"])
    with pytest.raises(ConfigError, match="train.batch_size cannot change"):
        resume_config(run, ["train.batch_size=3"])
    with pytest.raises(ConfigError, match="train.optimizer cannot change.*except "
                                          "train.batch_size and train.optimizer"):
        resume_config(run, ["train.optimizer=muon"])  # the saved state is AdamW's
    cfg = resume_config(run, ["train.schedule=wsd", "train.muon_lr=0.01"])
    assert (cfg.train.schedule, cfg.train.muon_lr) == ("wsd", 0.01)
    cfg = resume_config(run, ["train.max_steps=20", "train.eval_interval=5"], device="cpu")
    assert (cfg.train.max_steps, cfg.train.eval_interval, cfg.run.device) == (20, 5, "cpu")


def test_resume_accepts_stored_values_and_names_a_changed_one(tmp_path):
    """Issue #15 finding 4: the command that started a run, with --resume appended, continues
    it; a value that differs is refused naming the setting, the stored and the given value."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  n_layer: 2\n  vocab_size: 300\n"
                                     "train:\n  max_steps: 10\n")
    cfg = resume_config(run, ["model.n_layer=2", "model.vocab_size=0", "model.n_head=4",
                              "train.max_steps=10", "train.max_steps=12"])
    assert (cfg.model.n_layer, cfg.model.vocab_size, cfg.train.max_steps) == (2, 300, 12)
    with pytest.raises(ConfigError) as err:
        resume_config(run, ["model.n_layer=2", "model.n_layer=3"])
    msg = str(err.value)
    assert msg.startswith("--set: model.n_layer cannot change on --resume")
    assert "model.n_layer=2" in msg and "gives 3" in msg and str(run / "config.yaml") in msg
    conf = tmp_path / "mine.yaml"  # --config: the keys the file names are checked the same way
    conf.write_text("model:\n  n_layer: 2\ntrain:\n  max_steps: 11\n")
    assert resume_config(run, [], config=str(conf)).train.max_steps == 11
    assert resume_config(run, ["train.max_steps=13"], config=str(conf)).train.max_steps == 13
    conf.write_text("model:\n  n_layer: 5\n")
    with pytest.raises(ConfigError, match=r"^--config \S+mine.yaml: model.n_layer cannot change"
                                          r".*n_layer=2 .*gives 5"):
        resume_config(run, [], config=str(conf))


def test_resume_where_nothing_was_saved_uses_the_commands_config(tmp_path):
    """Issue #15 finding 5: a run killed during start-up leaves only train.lock (or nothing):
    --resume takes the config the same command without --resume would use."""
    run = tmp_path / "run"
    run.mkdir()
    assert resume_config(run, ["model.n_layer=3"]).model.n_layer == 3  # empty
    RunLock(run).acquire().release()
    assert [p.name for p in run.iterdir()] == ["train.lock"]
    cfg = resume_config(run, ["model.n_layer=3"], config="bytes")
    assert (cfg.model.n_layer, cfg.model.block_size, cfg.run.name) == (3, 64, "bytes")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(MinigptError, match="config.yaml is missing.*not a minigpt run"):
        resume_config(run, [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, MUON], ids=["adamw", "muon"])
def test_ddp_two_processes_equal_one(tmp_path, options):
    """torchrun, 2 CPU processes on gloo, global batch 4 (2 per rank, micro 1 = accumulation)
    gives the loss curve of one process with the same global batch."""
    # fp32 pinned: the test is about the gradient average, and auto's precision depends on
    # the CPU (bf16 autocast where it has bf16 instructions)
    sets = tiny_sets(tmp_path, **{"model.dropout": 0.0, "train.max_steps": 5,
                                  "train.precision": "fp32", **options})
    single = tmp_path / "single"
    train(load_config(None, sets), single)
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", "-m", "minigpt", "train",
           "--out", str(ddp), "--device", "cpu", "--set", "train.micro_batch_size=1"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")}
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(single), losses(ddp)
    # Muon orthogonalises in bf16 (torch's Newton-Schulz): the ~1e-7 summation-order
    # differences of the averaged gradient flip some bf16 roundings (2^-8 relative), and the
    # iteration stretches the directions of small singular values to ~1, so the block matrices
    # of two equally correct runs drift apart (measured: up to 3.3e-3 on one machine, 2.0e-2 on
    # another, after 5 steps of muon_lr 0.05, i.e. a fraction of the 0.25 a matrix entry can
    # move); the losses still agree to ~1e-5 relative, which is what catches a wrong average.
    # AdamW's weights agree to 1e-5.
    rel = 1e-5 if not options else 1e-4
    assert [x[0] for x in a] == [x[0] for x in b]
    for (_, la, va), (_, lb, vb) in zip(a, b):
        assert (la is None) == (lb is None) and (va is None) == (vb is None)
        if la is not None:
            assert la == pytest.approx(lb, rel=rel, abs=1e-6)
        if va is not None:
            assert va == pytest.approx(vb, rel=rel, abs=1e-6)
    wa, wb = load_file(single / "model.safetensors"), load_file(ddp / "model.safetensors")
    muon = {n for n in wa if n.startswith("blocks.") and wa[n].ndim == 2} if options else set()
    for k in wa:
        atol = 0.06 if k in muon else (1e-5 if not options else 1e-3)
        assert torch.allclose(wa[k], wb[k], atol=atol), (k, (wa[k] - wb[k]).abs().max())
    assert "x 2 processes" in r.stderr


def test_resume_without_rng_state_is_a_clear_error(tmp_path):
    """A checkpoint written without trainer RNG state (e.g. by another tool) cannot be
    resumed exactly: one-line error, no traceback, nothing changed."""
    from minigpt.config import to_yaml
    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.run.checkpoint import save_checkpoint

    cfg = load_config(None, tiny_sets(tmp_path))
    cfg.model.vocab_size = 257
    model = GPT(cfg.model)
    opt, names = build_optimizer(model, cfg.train, torch.device("cpu"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    save_checkpoint(run, step=2, model=model, cfg=cfg, tokenizer=bytes_tokenizer(),
                    trainer_state={"step": 2}, optimizer=opt, param_names=names)
    with pytest.raises(MinigptError, match="trainer_state.json: the RNG .* cannot be resumed"):
        train(resume_config(run, []), run, resume=True)


def test_adamw_groups_cover_each_parameter_once():
    from minigpt.train.weights import adamw_groups

    m = GPT.from_config(ModelConfig(n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16,
                                    bias=True), seed=0)
    groups, names = adamw_groups(list(m.named_parameters()), 0.1)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(m.parameters())) == len(names)
    assert all(p.dim() >= 2 for p in groups[0]["params"]) and groups[1]["weight_decay"] == 0.0


def test_a_step_runs_through_a_forward_module_that_has_no_truth_value():
    """train_step's `fwd` may be a torch.compile wrapper, whose truth value raises (it has a
    __len__ that refuses): the step must not ask `fwd or model`, which crashed every CUDA run
    (train.compile auto = on for CUDA) at its first step."""
    from minigpt.core.step import train_step

    class NoTruth(torch.nn.Module):  # what torch.compile returns behaves like this
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def __len__(self):
            raise TypeError("no len()")

        def forward(self, x, y):
            return self.inner(x, y)

    cfg = from_dict({"model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8,
                               "vocab_size": 32}})
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(32, (2, 8))
    result = train_step(model, opt, [(x, x)], n_micro=1, grad_clip=1.0, fwd=NoTruth(model))
    assert result.stepped


@pytest.mark.slow
def test_a_compiled_run_trains_on_the_cpu(tmp_path):
    """train.compile=true through the real loop on the CPU (torch.compile's inductor): the run
    finishes and its checkpoint holds the plain parameter names."""
    from minigpt.train import train

    run = tmp_path / "run"
    done = train(load_config(None, tiny_sets(tmp_path, **{"train.compile": "true",
                                                          "train.max_steps": 4})), run)
    assert done.reason == "finished" and done.step == 4
    weights = load_file(run / "model.safetensors")
    assert weights and not any("_orig_mod" in n for n in weights)


def test_batched_muon_is_torch_muon_step_for_step():
    """train/muon.py's BatchedMuon (Newton-Schulz batched by shape, foreach momentum) gives
    torch.optim.Muon's weights (to one bf16 rounding of an update: a batched matmul may sum
    in another order) and its momentum buffers exactly, over matrices of several shapes (tall
    ones transposed), with and without weight decay and Nesterov, and keeps the same state
    dict."""
    from minigpt.train.muon import BatchedMuon

    g = torch.Generator().manual_seed(0)
    shapes = [(48, 16), (16, 16), (16, 64), (48, 16), (64, 16), (16, 64)]
    for wd, nesterov in ((0.05, True), (0.0, False)):
        ref = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
        mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
        first = [p.detach().clone() for p in ref]
        kw = {"lr": 0.02, "weight_decay": wd, "momentum": 0.95, "nesterov": nesterov}
        o_ref, o_mine = torch.optim.Muon(ref, **kw), BatchedMuon(mine, **kw)
        for _ in range(3):
            for a, b in zip(ref, mine):
                a.grad = torch.randn(a.shape, generator=g)
                b.grad = a.grad.clone()
            o_ref.step()
            o_mine.step()
        assert all(torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(ref, mine))
        assert all((a - f).abs().max() > 1e-2 for a, f in zip(ref, first))  # they moved
        s_ref, s_mine = o_ref.state_dict(), o_mine.state_dict()
        assert s_ref["param_groups"] == s_mine["param_groups"]
        assert all(torch.equal(s_ref["state"][i]["momentum_buffer"],
                               s_mine["state"][i]["momentum_buffer"]) for i in s_ref["state"])


def test_the_compile_cache_lives_under_the_minigpt_cache(tmp_path, monkeypatch):
    from minigpt.device import use_compile_cache
    from minigpt.train.weights import compiles

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_compile_cache(str(tmp_path / "c"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "torch-compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_compile_cache(str(tmp_path / "c"))  # the user's choice stays
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [compiles(s, cpu) for s in ("auto", "true", "false")] == [False, True, False]
    assert [compiles(s, cuda) for s in ("auto", "true", "false")] == [True, True, False]


@pytest.mark.slow
def test_a_compiled_run_resumes_into_an_eager_one(tmp_path, monkeypatch):
    """4 steps with train.compile true (RoPE, QK-norm, soft-cap), then --resume with compile
    false to 6: the run continues from the compiled run's checkpoint (plain parameter names, its
    optimizer state and data position) and ends where 6 eager steps end, to the float
    tolerance of compiled kernels; inductor's cache is written under data.cache_dir. AdamW:
    Muon's bf16 orthogonalisation turns float-tolerance differences into bf16 roundings."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # fp32 pinned: under bf16 autocast (auto on a CPU with bf16 instructions) the compiled and
    # eager kernels round differently to bf16, and 6 steps at lr 1e-2 carry that to ~1e-2
    sets = tiny_sets(tmp_path, **{**MUON, "model.dropout": 0.0,  # no RNG the compiler redraws
                                  "train.optimizer": "adamw", "train.precision": "fp32"})
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(load_config(None, [*sets, "train.compile=false"]), straight)
    first = train(load_config(None, [*sets, "train.compile=true"]), split, stop_after=4)
    assert first.reason == "stopped" and first.step == 4
    assert any((tmp_path / "cache" / "torch-compile").rglob("*"))
    done = train(resume_config(split, ["train.compile=false"]), split, resume=True)
    assert done.step == 6 and done.reason == "finished"
    a, b = load_file(straight / LATEST / "model.safetensors"), load_file(
        split / LATEST / "model.safetensors")
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff < 1e-4, diff
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the compiled steps did run
    la, lb = losses(straight), losses(split)
    assert [r[0] for r in la] == [r[0] for r in lb]
    assert all(x[1] == pytest.approx(y[1], abs=1e-4) for x, y in zip(la, lb) if x[1] is not None)
    state = json.loads((split / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["tokens_seen"] == 6 * 4 * 16


def test_a_cut_checkpoint_config_is_blamed_not_the_users_set(trained_runs, tmp_path):
    run = Path(shutil.copytree(trained_runs["stopped"]["dir"], tmp_path / "run", symlinks=True))
    cfg = (run / "checkpoints" / "latest").resolve() / "config.yaml"
    data = cfg.read_bytes()
    cfg.write_bytes(data[: len(data) // 2])
    line = error_line(in_process(["train", "--out", run, "--resume", "--set",
                                "train.batch_size=8"]))
    assert f"{cfg}" in line and "corrupted" in line, line
    assert "cannot change on --resume" not in line
