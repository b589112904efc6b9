"""Every file another tool or a user can hand minigpt's newest surfaces, and every number it
takes there, answered (issue 57's fuzz, causes 1-7): an SAE directory someone else wrote
(cfg.json, features.json, weights), activation files, a damaged training state, QK pairs,
a cut config.yaml, huge `--set` values. Each case ends in one `error:` line and exit 2, or
in a bounded run, with nothing a user wrote lost and nothing half-made left behind.

The table drives each case twice: in this process (the quick tier: the same app and error path,
without a process's start-up) and through the installed `minigpt` (the slow tier), under a
2 GiB address-space limit (`ulimit -v`) so that a case that tries to allocate what a crafted
header declares fails the test instead of the machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import error_line, in_process, make_run, shakespeare

from minigpt.run.safetensors_io import tensors_to_bytes

MINIGPT = shutil.which("minigpt")
SMALL = ["--tokens", "2048", "--held-out", "512", "--steps", "30", "--width", "32", "--k", "4",
         "--batch-size", "256"]
MEMORY_LIMIT = 3 << 30  # bytes of address space for the installed command
TIMEOUT_S = 300


@dataclass
class World:
    root: Path
    run: Path
    text: Path
    sae: Path        # a finished SAE of run's layer 1, trained on text
    acts: Path       # a good activations file
    state: Path      # an unfinished training's --out (train_state.safetensors only)
    wide: Path       # a 4 x 8-head model of block 256 (QK pairs by the thousand)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("hostile57")
    run = make_run(root / "run", top_files=True)
    text = root / "text.txt"
    text.write_text(shakespeare()[:6000])
    sae = root / "sae"
    r = in_process(["features", "train", "--run", run, "--layer", "1", "--text-file", text,
                    "--out", sae, *SMALL])
    assert r.returncode == 0, r.stderr
    acts = root / "acts.safetensors"
    acts.write_bytes(tensors_to_bytes({"x": torch.randn(400, 8,
                                                        generator=torch.Generator().manual_seed(0))},
                                      {}))
    state = root / "state"
    stop = {"n": 0}

    def interrupt(*a, **k):  # the first save of a 30-step training, then a "signal"
        stop["n"] += 1
        return stop["n"] >= 10

    from minigpt.features import train_features as tf
    from minigpt.features.fit import SaeSettings

    src = tf.Source(activations=acts)
    res = tf.train_features(src, SaeSettings(16, 4, 30, 64, 0.0, 0), state, stop=interrupt)
    assert res.interrupted and (state / "train_state.safetensors").is_file()
    wide = make_run(root / "wide", top_files=True, n_layer=4, n_head=8, n_embd=64,
                    block_size=256)
    return World(root, run, text, sae, acts, state, wide)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _json_edit(path: Path, edit: Callable[[object], object]) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text())), allow_nan=True))


def _sae_with(field: str, edit: Callable[[object], object]) -> Callable:
    """An SAE directory whose file `field` (cfg or info) is edited: edit(parsed) -> written."""
    def make(w: World, d: Path) -> list[str]:
        sae = _copy(w.sae, d / "sae")
        _json_edit(sae / ("cfg.json" if field == "cfg" else "features.json"), edit)
        return ["features", "show", "--sae", sae, "--run", w.run, "--text-file", w.text,
                "--tokens", "256"]
    return make


def _features_of(field: str, edit: Callable[[object], object]) -> Callable:
    """inspect-heads --features on an SAE directory whose cfg or info is edited."""
    def make(w: World, d: Path) -> list[str]:
        args = _sae_with(field, edit)(w, d)
        return ["inspect-heads", "--run", w.run, "--text", "abcdefgh", "--features",
                args[args.index("--sae") + 1]]
    return make


def _set(key: str, value) -> Callable[[object], object]:
    def edit(d):
        d[key] = value
        return d
    return edit


def _drop(*keys: str) -> Callable[[object], object]:
    def edit(d):
        for k in keys:
            d.pop(k, None)
        return d
    return edit


def _huge_weights(w: World, d: Path) -> list[str]:
    """cfg.json and the weights' header agree on 2**24 features (2 GiB a matrix), in a sparse
    file: everything is consistent, and reading it would take 4 GiB."""
    sae = _copy(w.sae, d / "sae")
    _json_edit(sae / "cfg.json", _set("d_sae", 1 << 24))
    _sparse_safetensors(sae / "sae_weights.safetensors", {
        "W_enc": [32, 1 << 24], "b_enc": [1 << 24], "W_dec": [1 << 24, 32], "b_dec": [32]})
    return ["features", "show", "--sae", sae, "--run", w.run, "--text-file", w.text,
            "--tokens", "256"]


def _sparse_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A valid safetensors header declaring float32 tensors of `shapes`, its data a hole."""
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 4
        for s in shape:
            n *= s
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + off)


def _acts(make: Callable[[], torch.Tensor] | None = None, raw: bytes | None = None) -> Callable:
    def case(w: World, d: Path) -> list[str]:
        path = d / "acts.safetensors"
        if raw is not None:
            path.write_bytes(raw)
        else:
            path.write_bytes(tensors_to_bytes({"x": make()}, {}))
        return ["features", "train", "--activations", path, "--out", d / "out", "--width", "16",
                "--k", "4", "--steps", "20", "--batch-size", "64"]
    return case


def _huge_acts(w: World, d: Path) -> list[str]:
    path = d / "acts.safetensors"
    _sparse_safetensors(path, {"x": [1 << 26, 64]})  # 16 GiB of float32, a hole
    return ["features", "train", "--activations", path, "--out", d / "out"]


def _state_with(edit: Callable[[dict], dict]) -> Callable:
    """A --resume of the unfinished training whose train_state.safetensors is edited."""
    def make(w: World, d: Path) -> list[str]:
        from minigpt.features import store
        from minigpt.run.safetensors_io import load_tensors, read_header

        out = _copy(w.state, d / "state")
        path = out / store.STATE_FILE
        _, meta = read_header(path, "state")
        path.write_bytes(tensors_to_bytes(edit(dict(load_tensors(path))), meta))
        return ["features", "train", "--activations", w.acts, "--out", out, "--width", "16",
                "--k", "4", "--steps", "30", "--batch-size", "64", "--resume"]
    return make


def _t(tensors: dict, name: str, value: torch.Tensor) -> dict:
    tensors[name] = value
    return tensors


def _relative_run_elsewhere(w: World, d: Path) -> list[str]:
    """An SAE trained on runs/x from one directory, shown from another whose runs/x is another
    run (another seed): features.json found its run by a path relative to the working
    directory, and showed the other one (exit 0). Now found from the SAE's own directory."""
    for where, seed in (("a", 0), ("b", 1)):
        make_run(d / where / "runs" / "x", seed=seed, top_files=True)
    sae = d / "a" / "sae"
    r = in_process(["features", "train", "--run", "runs/x", "--layer", "1", "--text-file",
                    w.text, "--out", sae, *SMALL], cwd=d / "a")
    assert r.returncode == 0, r.stderr
    return ["features", "show", "--sae", sae, "--text-file", w.text, "--tokens", "256"]


def _shows_run_a(r: subprocess.CompletedProcess, d: Path) -> None:
    assert r.returncode == 0, r.stderr
    assert f"of {os.path.normpath(d / 'a' / 'runs' / 'x')} (step 7)" in r.stderr, r.stderr


def _old_relative_run(w: World, d: Path) -> list[str]:
    """A features.json of before (no run_from_sae, a relative run path), shown from a directory
    where that path is another run: refused, not shown on the wrong run."""
    args = _relative_run_elsewhere(w, d)
    _json_edit(d / "a" / "sae" / "features.json",
               lambda i: {**_drop("run_from_sae", "weights_sha256")(i), "run": "runs/x"})
    return args


def _other_weights(w: World, d: Path) -> list[str]:
    """The recorded run's weights replaced by another run's of the same shape."""
    args = _relative_run_elsewhere(w, d)
    ckpt = d / "a" / "runs" / "x" / "checkpoints"
    shutil.rmtree(ckpt)
    shutil.copytree(d / "b" / "runs" / "x" / "checkpoints", ckpt, symlinks=True)
    return args


def _step_gone(w: World, d: Path) -> list[str]:
    args = _relative_run_elsewhere(w, d)
    _json_edit(d / "a" / "sae" / "features.json", _set("step", 999))
    return args


def _qk(*extra: str) -> Callable:
    return lambda w, d: ["inspect-heads", "--run", w.run, "--text", "abcdefghabcdefgh",
                         "--qk", "L1.H1", *extra]


def _cut_config(command: str) -> Callable:
    def make(w: World, d: Path) -> list[str]:
        run = _copy(w.run, d / "runs" / "cut")
        path = run / "config.yaml"
        text = path.read_text()
        path.write_text(text[:len(text) // 2])
        return ["runs", d / "runs"] if command == "runs" else \
            ["curves", "--run", run, "--out", d / "c.png"]
    return make


def _cut_config_at_a_line(w: World, d: Path) -> list[str]:
    run = _copy(w.run, d / "runs" / "cut")
    path = run / "config.yaml"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:len(lines) - 1]))  # the run section's last setting lost
    return ["runs", d / "runs", "--json"]


def _runs_says(status: str, needle: str) -> Callable:
    def check(r: subprocess.CompletedProcess, d: Path) -> None:
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout) if r.stdout.lstrip().startswith("{") else None
        if doc is not None:
            (row,) = doc["runs"]
            assert row["status"] == status and needle in row["problem"], row
        else:
            assert status in r.stdout and needle in r.stderr, (r.stdout, r.stderr)
    return check


@dataclass
class Case:
    id: str
    make: Callable[[World, Path], list[str]]
    needles: tuple[str, ...] = ()    # the error line's; empty: `check` decides
    check: Callable[[subprocess.CompletedProcess, Path], None] | None = None
    left: str | None = None          # a path (relative to the case dir) that must not exist


CASES = [
    # 1. SAE directories someone else wrote
    Case("cfg-d_in-inf", _sae_with("cfg", _set("d_in", float("inf"))),
         ("cfg.json", "d_in must be an integer")),
    Case("cfg-d_sae-minus-inf", _sae_with("cfg", _set("d_sae", float("-inf"))),
         ("cfg.json", "d_sae must be an integer")),
    Case("cfg-k-float", _sae_with("cfg", _set("k", 4.5)), ("cfg.json", "k must be an integer")),
    Case("cfg-a-list", _sae_with("cfg", lambda c: [c]), ("cfg.json", "not a TopK SAE config")),
    Case("info-a-list", _sae_with("info", lambda i: [i]), ("features.json", "not a JSON object")),
    Case("info-null", _sae_with("info", lambda i: None), ("features.json", "not a JSON object")),
    Case("info-a-string", _sae_with("info", lambda i: "sae"), ("features.json", "JSON object")),
    Case("info-layer-a-string", _sae_with("info", _set("layer", "one")),
         ("features.json", "layer must be an integer or null")),
    Case("info-n_head-a-list", _sae_with("info", _set("n_head", [2])),
         ("features.json", "n_head must be")),
    Case("info-quality-a-string", _sae_with("info", _set("quality", "good")),
         ("features.json", "quality must be")),
    Case("info-quality-of-strings", _sae_with("info", _set("quality", {"l0": "4"})),
         ("features.json", "quality must be an object of numbers")),
    Case("info-run-a-number", _sae_with("info", _set("run", 5)),
         ("features.json", "run must be a string or null")),
    Case("info-without-quality-and-seconds", _sae_with("info", _drop("quality", "seconds")),
         check=lambda r, d: (r.returncode == 0 and "quality: not recorded" in r.stderr)
         or pytest.fail(r.stderr)),
    Case("inspect-features-k-inf", _features_of("cfg", _set("k", float("inf"))),
         ("cfg.json", "k must be an integer")),
    Case("inspect-features-info-a-list", _features_of("info", lambda i: [i]),
         ("features.json", "not a JSON object")),
    Case("weights-declaring-4-gib", _huge_weights,
         ("sae_weights.safetensors", "more than the", "of memory free")),
    # 2. the run an SAE names, from another directory
    Case("relative-run-from-elsewhere", _relative_run_elsewhere, check=_shows_run_a),
    Case("old-relative-run-elsewhere", _old_relative_run,
         ("features.json", "names its run by a path relative to where it was trained")),
    Case("run-holds-other-weights", _other_weights,
         ("features.json", "holds other weights than the SAE was trained on")),
    Case("step-no-longer-kept", _step_gone,
         ("features.json", "step 999", "no longer keeps", "--checkpoint STEP")),
    # 3. features train's numbers and files
    Case("lr-inf", lambda w, d: ["features", "train", "--activations", w.acts, "--out",
                                 d / "out", "--lr", "inf"], ("--lr", "must be from 0"), left="out"),
    Case("lr-1e30", lambda w, d: ["features", "train", "--activations", w.acts, "--out",
                                  d / "out", "--lr", "1e30"], ("--lr",), left="out"),
    Case("seed-2-64", lambda w, d: ["features", "train", "--activations", w.acts, "--out",
                                    d / "out", "--seed", str(2**64)], ("--seed",), left="out"),
    Case("seed-1e30", lambda w, d: ["features", "train", "--activations", w.acts, "--out",
                                    d / "out", "--seed", "1" + "0" * 30], ("--seed",), left="out"),
    Case("acts-huge-values", _acts(lambda: torch.randn(100, 8) * 1e30),
         ("--activations", "overflow"), left="out"),
    Case("acts-one-row-repeated", _acts(lambda: torch.ones(100, 8) * 3),
         ("--activations", "same row"), left="out"),
    Case("acts-all-zeros", _acts(lambda: torch.zeros(100, 8)),
         ("--activations", "same row"), left="out"),
    Case("acts-a-pickle", _acts(raw=b"\x80\x04\x95" + b"\x00" * 64),
         ("pickle", "never loads pickles"), left="out"),
    Case("acts-declaring-16-gib", _huge_acts, ("acts.safetensors", "of memory free"), left="out"),
    Case("out-a-symlink-loop", lambda w, d: (os.symlink("loop", d / "loop"),
                                             ["features", "train", "--activations", w.acts,
                                              "--out", d / "loop" / "sae"])[1],
         ("--out",), left="loop/sae"),
    Case("out-under-a-file", lambda w, d: ((d / "file").write_text("x"),
                                           ["features", "train", "--activations", w.acts,
                                            "--out", d / "file" / "sae"])[1],
         ("--out", "is a file")),
    Case("show-seed-minus-1", lambda w, d: ["features", "show", "--sae", w.sae, "--seed", "-1"],
         ("--seed",)),
    # 4. a damaged training state
    Case("state-generator-garbage", _state_with(lambda t: _t(
        t, "generator", torch.randint(0, 256, t["generator"].shape, dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(3)))),
         ("train_state.safetensors",)),
    Case("state-generator-floats", _state_with(lambda t: _t(
        t, "generator", t["generator"].float())), ("train_state.safetensors",)),
    Case("state-nan-weights", _state_with(lambda t: _t(
        t, "sae.W_dec", torch.full_like(t["sae.W_dec"], float("nan")))),
         ("train_state.safetensors", "NaN")),
    Case("state-step-1e15", _state_with(lambda t: _t(
        t, "step", torch.tensor([10**15]))), ("train_state.safetensors", "step 1000000000000000")),
    # 5. QK pairs
    Case("qk-pairs-5000-digits", _qk("--qk-pairs", "1" * 5000 + ":0"), ("--qk-pairs",)),
    Case("qk-empty-item", lambda w, d: ["inspect-heads", "--run", w.run, "--text",
                                        "abcdefgh", "--qk", "L0.H0,,L1.H1"],
         check=lambda r, d: r.returncode == 0 or pytest.fail(r.stderr)),
    Case("qk-duplicate-pairs", _qk("--qk-pairs", ",".join(["5:2"] * 30000)),
         check=lambda r, d: (r.returncode == 0 and "1 pair (5:2)" in " ".join(r.stdout.split())
                             and len(max(r.stderr.splitlines(), key=len)) < 2000)
         or pytest.fail(r.stderr[-2000:])),
    Case("qk-every-pair-of-a-wide-model", lambda w, d: [
        "inspect-heads", "--run", w.wide, "--text", "ab" * 200, "--qk", "all",
        *(x for t in range(256) for x in ("--qk-pairs", ",".join(f"{t}:{s}"
                                                                 for s in range(t + 1))))],
         ("--max-tokens", "of memory free")),
    # 6. a cut config.yaml
    Case("runs-config-cut-in-half", _cut_config("runs"),
         check=_runs_says("damaged", "cut short")),
    Case("runs-config-cut-at-a-line", _cut_config_at_a_line,
         check=_runs_says("damaged", "cut short")),
    Case("curves-config-cut-in-half", _cut_config("curves"), ("no metrics",), left="c.png"),
    # 7. huge --set values
    Case("set-induction-groups-2-63", lambda w, d: [
        "train", "--config", "induction", "--set", f"data.induction_groups={2**63}", "--out",
        d / "r"], ("data.induction_groups", "with --set"), left="r"),
    Case("set-vocab-size-2-63", lambda w, d: [
        "train", "--set", f"tokenizer.vocab_size={2**63}", "--out", d / "r"],
         ("tokenizer.vocab_size", "must be <="), left="r"),
]
# Too big for this process (the quick tier): what the crafted header declares would be
# allocated if a check failed, so these run only under the installed command's memory limit.
UNDER_A_LIMIT = {"weights-declaring-4-gib", "acts-declaring-16-gib",
                 "qk-every-pair-of-a-wide-model"}


def judge(case: Case, r: subprocess.CompletedProcess, d: Path) -> None:
    assert "Traceback" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    if case.check is not None:
        case.check(r, d)
    else:
        line = error_line(r, after_progress=True)
        for needle in case.needles:
            assert needle in line, line
    if case.left is not None:
        assert not (d / case.left).exists(), f"{case.left} was left behind"


@pytest.mark.parametrize("case", [c for c in CASES if c.id not in UNDER_A_LIMIT],
                         ids=lambda c: c.id)
def test_in_process(case: Case, world: World, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))
    args = case.make(world, tmp_path)
    judge(case, in_process(args, cwd=tmp_path), tmp_path)


def test_the_memory_cases_in_process_with_little_memory_free(world: World, tmp_path: Path,
                                                             monkeypatch):
    """The quick twins of UNDER_A_LIMIT: the same checks with the memory available said to be
    1 GiB (device.available_bytes, the one reader), so nothing is allocated if one fails."""
    import sys

    from minigpt import device

    real = device.available_bytes
    for mod in list(sys.modules.values()):  # wherever it was imported
        if getattr(mod, "available_bytes", None) is real:
            monkeypatch.setattr(mod, "available_bytes", lambda dev: 1 << 30)
    for case in CASES:
        if case.id in UNDER_A_LIMIT:
            d = tmp_path / case.id
            d.mkdir()
            judge(case, in_process(case.make(world, d), cwd=d), d)


def _limited() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_installed(case: Case, world: World, tmp_path: Path):
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    args = [str(a) for a in case.make(world, tmp_path)]
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([MINIGPT, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S, preexec_fn=_limited, check=False)
    judge(case, r, tmp_path)


def test_a_resume_removes_what_a_killed_save_left_in_out(world: World, tmp_path: Path):
    """kill -9 in the middle of a state save leaves the durable write's temp beside the state
    (`.train_state.safetensors.PID-XXXXXXXX.tmp`); `--resume` deletes it once its process is
    gone (it was left in --out after a resume), and never a live process's or another name."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = subprocess.Popen(["sleep", "120"])
    try:
        out = _copy(world.state, tmp_path / "state")
        left = out / f".train_state.safetensors.{dead.pid}-0123abcd.tmp"
        live = out / f".train_state.safetensors.{alive.pid}-0123abcd.tmp"
        other = out / "notes.txt"
        for p in (left, live, other):
            p.write_bytes(b"x")
        r = in_process(["features", "train", "--activations", world.acts, "--out", out,
                        "--width", "16", "--k", "4", "--steps", "30", "--batch-size", "64",
                        "--resume"])
        assert r.returncode == 0, r.stderr
        assert not left.exists() and live.exists() and other.exists()
    finally:
        alive.kill()
        alive.wait()
