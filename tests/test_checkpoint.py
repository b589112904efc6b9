"""Checkpoints: round trip, tied weights stored once, the commit protocol under simulated
crashes, and every way a weights file can be wrong (each a one-line MinigptError)."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from minigpt.config import MinigptError, load_config, to_yaml
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.run import checkpoint as ck
from minigpt.run.load import find_latest_run, load_optimizer_state, load_run
from minigpt.run.safetensors_io import read_header
from minigpt.train.weights import build_optimizer

SETS = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=8",
        "tokenizer.vocab_size=256"]


def _cfg(*extra: str):
    cfg = load_config(None, [*SETS, *extra])
    cfg.model.vocab_size = 257
    return cfg


def _trained(cfg):
    """A model and an AdamW with non-trivial moments after one step."""
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt, names = build_optimizer(model, cfg.train, torch.device("cpu"))
    x = torch.randint(0, 257, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    return model, opt, names


def _save(run: Path, cfg, model, opt, names, step: int) -> Path:
    return ck.save_checkpoint(run, step=step, model=model, cfg=cfg, tokenizer=bytes_tokenizer(),
                              trainer_state={"step": step}, optimizer=opt, param_names=names)


@pytest.fixture()
def saved(tmp_path):
    cfg = _cfg()
    model, opt, names = _trained(cfg)
    run = tmp_path / "run"
    (run).mkdir()
    _save(run, cfg, model, opt, names, 5)
    return run, cfg, model, opt, names


def test_round_trip_and_tied_weights_stored_once(saved):
    run, _, model, _, _ = saved
    from safetensors import safe_open
    with safe_open(run / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    assert "lm_head.weight" not in keys and "wte.weight" in keys
    assert json.loads(meta["tied"]) == {"lm_head.weight": "wte.weight"}
    assert meta["step"] == "5" and meta["minigpt_version"]
    loaded = load_run(run, "cpu")
    assert loaded.step == 5 and loaded.cfg.model.vocab_size == 257
    assert loaded.model.lm_head.weight is loaded.model.wte.weight  # re-tied, not copied
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.model.state_dict()[k]), k
    assert not loaded.model.training


def test_optimizer_state_round_trip(saved):
    run, cfg, model, opt, names = saved
    model2 = GPT(cfg.model)
    opt2, names2 = build_optimizer(model2, cfg.train, torch.device("cpu"))
    assert names2 == names
    load_optimizer_state(opt2, names2, ck.find_checkpoint(run))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key])


def test_muon_and_adamw_states_round_trip_through_one_file(tmp_path):
    """train.optimizer muon: both parts' states go into optimizer.safetensors under the
    parameter names and come back into a fresh chain; the other optimizer's file is refused."""
    cfg = _cfg("train.optimizer=muon", "model.qk_norm=true")
    model, opt, names = _trained(cfg)
    run = tmp_path / "run"
    run.mkdir()
    _save(run, cfg, model, opt, names, 1)
    model2 = GPT(cfg.model)
    opt2, names2 = build_optimizer(model2, cfg.train, torch.device("cpu"))
    assert names2 == names
    load_optimizer_state(opt2, names2, ck.find_checkpoint(run))
    for part, part2 in zip(opt.parts, opt2.parts):
        keys = {"BatchedMuon": ["momentum_buffer"], "AdamW": ["exp_avg", "exp_avg_sq", "step"]}
        params = [p for g in part.param_groups for p in g["params"]]
        params2 = [p for g in part2.param_groups for p in g["params"]]
        for p, p2 in zip(params, params2, strict=True):
            for key in keys[type(part).__name__]:
                assert torch.equal(part.state[p][key], part2.state[p2][key])
                assert part.state[p][key].abs().sum() > 0
    adamw_cfg = _cfg("model.qk_norm=true")  # same model, the other optimizer
    other, other_names = build_optimizer(GPT(adamw_cfg.model), adamw_cfg.train,
                                         torch.device("cpu"))
    with pytest.raises(MinigptError, match=r"exp_avg' is missing.*train.optimizer"):
        load_optimizer_state(other, other_names, ck.find_checkpoint(run))
    run2 = tmp_path / "run2"
    run2.mkdir()
    m3, o3, n3 = _trained(adamw_cfg)
    _save(run2, adamw_cfg, m3, o3, n3, 1)
    with pytest.raises(MinigptError, match=r"momentum_buffer' is missing"):
        load_optimizer_state(opt2, names2, ck.find_checkpoint(run2))


def test_compiled_and_plain_models_save_the_same_names():
    cfg = _cfg()
    model = GPT(cfg.model)
    assert ck.model_tensors(torch.compile(model)).keys() == ck.model_tensors(model).keys()


def test_run_dir_reads_with_plain_libraries(saved):
    """No minigpt needed: safetensors (numpy flavour), yaml and json read everything."""
    run = saved[0]
    code = f"""
import json, sys, yaml
from pathlib import Path
from safetensors.numpy import load_file
run = Path({str(run)!r})
w = load_file(run / "model.safetensors")
assert w["wte.weight"].shape == (257, 16), w["wte.weight"].shape
opt = load_file(run / "optimizer.safetensors")
assert any(k.endswith(".exp_avg") for k in opt)
cfg = yaml.safe_load((run / "checkpoints" / "latest" / "config.yaml").read_text())
assert cfg["model"]["vocab_size"] == 257
state = json.loads((run / "trainer_state.json").read_text())
man = json.loads((run / "manifest.json").read_text())
assert state["step"] == 5 and "model.safetensors" in man["files"]
assert not any(m.startswith("minigpt") for m in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                       cwd="/")
    assert r.returncode == 0, r.stderr


def test_interrupted_save_leaves_previous_checkpoint(saved, monkeypatch):
    run, cfg, model, opt, names = saved
    # What a kill -9 mid-save leaves: a temp dir, and an uncommitted complete step dir.
    root = run / "checkpoints"
    (root / ".tmp-step-000010-999").mkdir()
    (root / ".tmp-step-000010-999" / "model.safetensors").write_bytes(b"\0" * 10)
    (root / "step-000010").mkdir()
    assert load_run(run, "cpu").step == 5
    # A disk full while the manifest, the last file, is written: one-line message, previous
    # checkpoint intact, no leftovers.
    real = ck.write_file_synced

    def full(path, data):
        if Path(path).name == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(ck, "write_file_synced", full)
    with pytest.raises(MinigptError, match="no space left.*step-000005.*intact"):
        _save(run, cfg, model, opt, names, 7)
    assert not any(p.name.startswith(".tmp-step-000007") for p in root.iterdir())
    assert load_run(run, "cpu").step == 5
    monkeypatch.setattr(ck, "write_file_synced", real)
    _save(run, cfg, model, opt, names, 10)  # the next save commits and cleans up
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000010"]
    assert load_run(run, "cpu").step == 10


def _weights(run: Path) -> Path:
    return run / "checkpoints" / "latest" / "model.safetensors"


def _refresh_manifest(run: Path) -> None:
    """Make the manifest agree with tampered files, to reach the checks behind the sha256."""
    import hashlib
    mpath = run / "checkpoints" / "latest" / "manifest.json"
    man = json.loads(mpath.read_text())
    for name in man["files"]:
        data = (mpath.parent / name).read_bytes()
        man["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    mpath.write_text(json.dumps(man))


def test_bit_flip_is_reported_as_corruption(saved):
    run = saved[0]
    data = bytearray(_weights(run).read_bytes())
    data[-3] ^= 0x40
    _weights(run).write_bytes(bytes(data))
    with pytest.raises(MinigptError, match=r"model\.safetensors is corrupted: its sha256"):
        load_run(run, "cpu")


def test_truncated_weights(saved):
    run = saved[0]
    data = _weights(run).read_bytes()
    _weights(run).write_bytes(data[: len(data) // 2])
    with pytest.raises(MinigptError, match="truncated"):
        load_run(run, "cpu")


@pytest.mark.parametrize("kind", ["pickle", "zip"])
def test_pickle_or_zip_in_place_of_weights_is_never_loaded(saved, kind, tmp_path):
    run = saved[0]
    marker = tmp_path / "pwned"
    if kind == "pickle":
        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))
        _weights(run).write_bytes(pickle.dumps(Evil(), protocol=4))
    else:
        with zipfile.ZipFile(_weights(run), "w") as z:
            z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    with pytest.raises(MinigptError, match="pickle" if kind == "pickle" else "zip archive"):
        load_run(run, "cpu")
    assert not marker.exists()


def test_crafted_huge_header_rejected_before_allocation(saved):
    run = saved[0]
    header = json.dumps({"wte.weight": {"dtype": "F32", "shape": [10**9, 10**6],
                                        "data_offsets": [0, 4 * 10**15]}}).encode()
    _weights(run).write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    _refresh_manifest(run)
    with pytest.raises(MinigptError, match="wte.weight.*do not fit"):
        load_run(run, "cpu")


def test_shape_mismatch_names_the_first_tensor(saved):
    run = saved[0]
    other = GPT(_cfg("model.n_embd=32").model)
    tensors = {k: v.contiguous() for k, v in ck.model_tensors(other).items()}
    _weights(run).write_bytes(st_save(tensors, {"tied": "{}"}))
    _refresh_manifest(run)
    with pytest.raises(MinigptError, match=r"tensor 'wte.weight' is F32\[257, 32\] but the config "
                                           r"needs F32\[257, 16\]"):
        load_run(run, "cpu")


def test_other_config_hash_is_rejected(saved):
    run = saved[0]
    cpath = run / "checkpoints" / "latest" / "config.yaml"
    cfg = _cfg("model.n_embd=32")
    cpath.write_text(to_yaml(cfg))
    _refresh_manifest(run)
    with pytest.raises(MinigptError, match="different model config"):
        load_run(run, "cpu")


@pytest.mark.parametrize("name", ["manifest.json", "config.yaml", "model.safetensors",
                                  "tokenizer.json"])
def test_missing_file_is_named(saved, name):
    run = saved[0]
    (run / "checkpoints" / "latest" / name).unlink()
    with pytest.raises(MinigptError, match=name.replace(".", r"\.") + ".*(missing|never)"):
        load_run(run, "cpu")


def test_header_length_insane(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(MinigptError, match="header length"):
        read_header(p, "weights")


def test_find_latest_run(tmp_path, saved):
    with pytest.raises(MinigptError, match="minigpt train"):
        find_latest_run(tmp_path / "nothing")
    run, cfg, model, opt, names = saved
    newer = run.parent / "newer"
    newer.mkdir()
    (run.parent / "not-a-run").mkdir()
    _save(newer, cfg, model, opt, names, 1)
    os.utime(run / "checkpoints" / "latest", (1, 1), follow_symlinks=False)
    assert find_latest_run(run.parent) == newer


def test_run_dirs_without_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MinigptError, match="not a minigpt run directory"):
        load_run(empty, "cpu")
    (empty / "config.yaml").write_text("{}")
    with pytest.raises(MinigptError, match="no saved checkpoint yet.*--resume"):
        load_run(empty, "cpu")
    with pytest.raises(MinigptError, match="does not exist"):
        load_run(tmp_path / "nope", "cpu")


def test_latest_pointer_never_leaves_the_run(saved):
    run = saved[0]
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    os.symlink("/etc", latest)
    with pytest.raises(MinigptError, match="not a step-NNNNNN directory"):
        load_run(run, "cpu")


def test_runs_saved_before_later_model_settings_still_load():
    """The weights' config hash of a model, as minigpt computed it before d_head, d_mlp and
    d_vocab_out existed (commit e2cf70b: these two values), is still its hash: adding those
    settings (and then value_skip and mtp_weight) made every run saved before them refuse to
    load ("saved for a different model config"). A model that sets one of them hashes
    differently."""
    from minigpt.config import ModelConfig, model_hash

    assert model_hash(ModelConfig()) == "9add4edfd0659110"
    induction = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=24, mlp=False, bias=True,
                            vocab_size=257, tie_weights=False)
    assert model_hash(induction) == "f516ae2e63231a03"
    assert model_hash(ModelConfig(d_mlp=256)) != model_hash(ModelConfig())
    assert model_hash(ModelConfig(mtp_weight=0.5)) != model_hash(ModelConfig())
    # and runs saved while a generation was hashed at any value load too: main from 9a96fbc
    # (d_head, d_mlp, d_vocab_out in the hash), and since issue 59 (value_skip, mtp_weight)
    from minigpt.config import model_hashes

    hashes = model_hashes(induction)
    assert {"f516ae2e63231a03", "0a06030bc10c462c"} <= hashes and len(hashes) == 3
