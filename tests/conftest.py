"""Fixtures shared by several test modules."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

# The tests run torch on ONE intra-op thread, here and in every process they start (the
# environment is inherited), unless OMP_NUM_THREADS says otherwise: their models are tiny, and
# on a busy machine a second OpenMP thread spin-waits (the developers' guide), which multiplied
# the quick tier's CPU seconds (tests/test_stop_when_formed.py at load 11: 64 CPU-s on the
# default two threads, 17 on one). Tests about thread counts set their own.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def _share_the_click_command() -> None:
    """typer's CliRunner rebuilds the click command tree from the app's functions at every
    invoke (resolving every parameter's annotation: ~10 ms, ~600 times in the quick tier); the
    tree depends only on the app (no test replaces a command), so the in-process runs of one
    app share the one built first. A typer without this private name builds it each time."""
    import typer.main
    import typer.testing

    if getattr(typer.testing, "_get_command", None) is not typer.main.get_command:
        return
    built: dict[int, object] = {}

    def get_command(app):
        if id(app) not in built:
            built[id(app)] = (app, typer.main.get_command(app))
        return built[id(app)][1]

    typer.testing._get_command = get_command


_share_the_click_command()


@contextlib.contextmanager
def pictures_off(curves: bool = True, heads: bool = True):
    """Trainings inside draw neither curves.png nor heads.png (or only the one not turned off);
    their records, metrics.jsonl and every other file are written as always. Drawing is most
    of a tiny run's CPU time (matplotlib lays a figure out at each evaluation: ~0.2 CPU-s for
    curves.png, ~1.5 for heads.png, against milliseconds a step), so tests that read neither
    picture train without them. The pictures a training draws are checked in
    tests/test_curves.py, tests/test_timeline.py and on the installed command's run in
    tests/test_cli_real.py."""
    from minigpt.train import outputs

    with pytest.MonkeyPatch.context() as m:
        if curves:
            m.setattr(outputs, "write_curves", lambda series: None)
        if heads:
            m.setattr(outputs, "draw_timeline", lambda *a, **k: None)
        yield


@pytest.fixture
def no_pictures():
    """pictures_off() for the test."""
    with pictures_off():
        yield


@pytest.fixture
def unrendered_pictures(monkeypatch):
    """Every picture's bytes (minigpt.display.figure_png, wherever it was imported) are a few
    placeholder bytes: the figure is built but not rendered, most of a picture's CPU time. For
    tests that check which files are written, not what they show."""
    from minigpt import display

    real = display.figure_png

    def placeholder(fig) -> bytes:
        return b"unrendered"

    monkeypatch.setattr(display, "figure_png", placeholder)
    for mod in list(sys.modules.values()):
        if getattr(mod, "figure_png", None) is real:
            monkeypatch.setattr(mod, "figure_png", placeholder)
    yield
    for mod in list(sys.modules.values()):  # imported during the test: bound the placeholder
        if getattr(mod, "figure_png", None) is placeholder:
            mod.figure_png = real


@contextlib.contextmanager
def attention_maps_unrendered():
    """inspect-heads' attention maps (attention_grid.png, attention_L*_H*.png) are placeholder
    bytes; its other pictures are drawn as always. For tests that read those others: the maps
    are drawn and checked in tests/test_inspection.py."""
    from minigpt.heads import attention_png

    with pytest.MonkeyPatch.context() as m:
        m.setattr(attention_png, "grid_png", lambda *a: b"unrendered")
        m.setattr(attention_png, "head_png", lambda *a: b"unrendered")
        yield


@pytest.fixture
def one_thread():
    """Tiny models decode fastest on one thread (and the CLI sets one): restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def in_process(args: list[str], *, cwd: Path | None = None, **env: str | None):
    """`minigpt ARGS` run by the app in this process (typer's CliRunner), in `cwd` when given,
    with `env` set for the call (None unsets), as a finished process would report it: exit
    code, stdout, stderr. What the quick tier runs where a real process would add only its
    start-up (~2 CPU-s, most of it importing torch); an exception that escaped the error path (a
    traceback in a real process) fails the test with its own traceback."""
    import subprocess

    from typer.testing import CliRunner

    from minigpt.cli import app

    before = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, [str(a) for a in args], env=env)
    finally:
        os.chdir(before)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}

# `minigpt circuit` and inspect-heads' circuits on a model they can tell heads apart in: 3 heads
# of width 8, no MLP, induction data, the matrices sharpened (x 10) so that patching moves the
# loss visibly. `make_run(path, **SHARP_INDUCTION)`.
SHARP_INDUCTION = {"n_head": 3, "n_embd": 24, "block_size": 24, "mlp": False, "step": 5,
                   "sharpen": 10.0, "sections": {"data": {"source": "induction",
                                                          "induction_vocab": 50}}}


# What the export tests (Hugging Face, GGUF) export: a model whose every weight is in play
# (perturbed: no norm at 1, no bias at 0). `make_run(path, tokenizer=tok, **EXPORT_RUN)`.
EXPORT_MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}
EXPORT_RUN = {**EXPORT_MODEL, "perturbed": True, "step": 3}

# A run as training leaves it: the complete trainer state and the top-level files.
AS_TRAINED = {"optimizer": True, "top_files": True}


def make_run(run_dir: Path, *, tokenizer=None, seed: int = 0, step: int = 7,
             sections: dict | None = None, weights_model: dict | None = None,
             perturbed: bool = False, sharpen: float = 1.0, says: int | None = None,
             nan: str | None = None, optimizer: bool = False, top_files: bool = False,
             **model) -> Path:
    """The one maker of a run directory without training: a committed checkpoint at `step` of
    a random-init model (weights from `seed`) of TINY_MODEL with `model`'s settings, its
    `tokenizer` (default: bytes; model.vocab_size its ids unless given), the config's other
    `sections` ({"data": {...}, "train": {...}}).

    What the weights are: `weights_model` saves weights of another shape than config.yaml
    records; `perturbed` adds noise to every parameter (`perturb`: norms and biases no longer
    1 and 0); `sharpen` multiplies every matrix; `says=b` makes the model write byte b, b, b,
    ... (the final norm ignores its input: weight 0, bias e_0, and b's embedding is 50 e_0, so
    every next-token distribution puts all but ~e^-50 of its mass on b); `nan` makes the first
    parameter of that module NaN ("ln_f": the logits are not finite, the attention is;
    "blocks.1": layer 1's attention is not finite). `optimizer`: a complete trainer
    state (AdamW's, the data generator's) as training saves it, else the step alone;
    `top_files`: the top-level files `minigpt train` leaves beside the checkpoints."""
    from minigpt.config import from_dict
    from minigpt.core.gpt import GPT
    from minigpt.data.tokenizer import bytes_tokenizer
    from minigpt.run.checkpoint import save_checkpoint

    tok = tokenizer or bytes_tokenizer()
    sec = {**TINY_MODEL, "vocab_size": tok.n_vocab, **model, "bias": model.get(
        "bias", says is not None)}
    cfg = from_dict({"model": sec, "tokenizer": {"vocab_size": tok.n_vocab - 1},
                     **(sections or {})})
    wcfg = from_dict({"model": {**sec, **weights_model}}) if weights_model else cfg
    net = GPT.from_config(wcfg, seed=seed)
    if perturbed:
        perturb(net, seed)
    _edit_weights(net, sharpen, says, nan)
    state, extra = {"step": step}, {}
    if optimizer:
        from minigpt.run.state import TrainerState, rng_state
        from minigpt.train.weights import build_optimizer

        opt, names = build_optimizer(net, cfg.train, torch.device("cpu"))
        state = TrainerState(step=step).as_json(rng_state(torch.Generator().manual_seed(0)))
        extra = {"optimizer": opt, "param_names": names}
    ckpt = save_checkpoint(run_dir, step=step, model=net, cfg=cfg, tokenizer=tok,
                           trainer_state=state, **extra)
    if top_files:
        for name in ("config.yaml", "tokenizer.tiktoken", "tokenizer.json"):
            shutil.copy(ckpt / name, run_dir / name)
    return run_dir


def _edit_weights(net: torch.nn.Module, sharpen: float, says: int | None,
                  nan: str | None) -> None:
    """make_run's `sharpen`, `says` and `nan`."""
    with torch.no_grad():
        if sharpen != 1.0:
            for p in net.parameters():
                if p.ndim == 2:
                    p.mul_(sharpen)
        if says is not None:
            net.ln_f.weight.zero_()
            net.ln_f.bias.zero_()
            net.ln_f.bias[0] = 1.0
            net.wte.weight[:, 0] = 0.0
            net.wte.weight[says, 0] = 50.0
        if nan is not None:
            next(net.get_submodule(nan).parameters()).fill_(math.nan)


def error_line(result, *, after_progress: bool = False) -> str:
    """The one line a refused command prints, checked: exit code 2, no traceback and no
    exception escaped, nothing on stdout, and on stderr exactly one line, `error: ...` (with
    `after_progress`: the last line, after progress lines none of which is an error). `result`
    is a finished process (`returncode`) or a CliRunner result (`exit_code`). Returns the
    line."""
    code = getattr(result, "returncode", None)
    code = result.exit_code if code is None else code
    exc = getattr(result, "exception", None)
    assert exc is None or isinstance(exc, SystemExit), f"uncaught {type(exc).__name__}: {exc}"
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    assert code == 2, (code, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stdout == "", result.stdout[-2000:]
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    if after_progress:
        assert lines and not any(x.lower().startswith("error") for x in lines[:-1]), \
            result.stderr[-2000:]
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """The world the tests of bad input run against (tests/cli_world.py), built once."""
    from cli_world import build_world

    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """cwd (so a default `runs/` lands in tmp) and the token cache both under tmp."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))


# Settings neither export format (a Hugging Face GPT-2 / GPT-NeoX directory, a GGUF file) can
# hold, and the setting each refusal names (tests/test_hf_export.py, tests/test_gguf.py).
UNEXPORTABLE = [
    ({"pos_encoding": "sinusoidal"}, "model.pos_encoding"),
    ({"pos_encoding": "none"}, "model.pos_encoding"),
    ({"norm": "rmsnorm"}, "model.norm"),
    ({"activation": "relu2"}, "model.activation"),
    ({"qk_norm": True}, "model.qk_norm"),
    ({"logit_softcap": 30.0}, "model.logit_softcap"),
    ({"norm": "none"}, "model.norm"),
    ({"activation": "relu"}, "model.activation"),
    ({"d_head": 8}, "model.d_head"),
    ({"d_mlp": 64}, "model.d_mlp"),
    ({"d_vocab_out": 5, "tie_weights": False}, "model.d_vocab_out"),
]


def half_matrices_logits(model: torch.nn.Module, ids: list[int]):
    """The model's logits (float64 numpy, [T, vocab]) of `ids` after its matrices are rounded
    to float16 in place: what an export with float16 matrices holds (--dtype f16)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
        return model(torch.tensor([ids]))[0][0].double().numpy()


def kill_trials():
    """benchmarks/kill_trials.py as a module (its trial runner and `minigpt_command`, which
    starts a `minigpt` process that kills itself in the middle of a checkpoint save)."""
    import importlib.util
    import sys

    if "kill_trials" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "kill_trials", Path(__file__).resolve().parents[1] / "benchmarks" / "kill_trials.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["kill_trials"] = mod  # dataclasses look their module up here
        spec.loader.exec_module(mod)
    return sys.modules["kill_trials"]


def shakespeare() -> str:
    """The first 60,000 characters of the bundled Shakespeare: text for the small BPEs the
    export and import tests train."""
    from minigpt.paths import DATA_DIR

    return (DATA_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")[:60_000]


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Noise on every parameter: norms and biases are no longer 1 and 0, so a weight put in the
    wrong place shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def killed_mid_write(target: str, partial: str, argv: list[str]):
    """`minigpt ARGV` in a child process whose writer `target` ("module:attribute.path")
    first runs `partial` (Python on its arguments `a`: the bytes written before the kill), then
    SIGKILLs the process: what kill -9 in the middle of an export leaves. Returns the finished
    process, checked to have died of the SIGKILL."""
    import signal
    import subprocess
    import sys

    module, attr = target.split(":")
    *owner, name = attr.split(".")
    code = ("import functools, importlib, os, signal, sys\n"
            f"obj = importlib.import_module({module!r})\n"
            f"obj = functools.reduce(getattr, {owner!r}, obj)\n"
            "def die(*a, **k):\n"
            f"    {partial}\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"setattr(obj, {name!r}, die)\n"
            "from minigpt.cli import main\n"
            f"sys.argv = ['minigpt', *{list(argv)!r}]\n"
            "main()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    return r


def tiny_train_sets(tmp: Path, **over) -> list[str]:
    """`--set` values of a 1-layer, 32-wide byte model on a small generated corpus: a step
    takes milliseconds; evaluations (and so curves.png) at steps 3 and 6."""
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        words = ["the", "king", "spoke", "to", "his", "son", "and", "the", "queen", "sat", "by",
                 "a", "fire", "while", "rain", "fell"]
        corpus.write_text("\n".join(" ".join(words[(i * 7 + j * 3) % len(words)]
                                             for j in range(4 + i % 9)) for i in range(500))
                          + "\n")
    base = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
            "tokenizer.vocab_size": 256, "train.batch_size": 4, "train.max_steps": 6,
            "train.warmup_steps": 2, "train.learning_rate": 1e-2, "train.min_lr": 1e-3,
            "train.eval_interval": 3, "train.eval_batches": 1, "train.log_interval": 1,
            "train.checkpoint_interval": 3, "train.sample_tokens": 0,
            "data.corpus": str(corpus), "data.cache_dir": str(tmp / "cache")}
    base.update(over)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory) -> dict:
    """Two tiny runs trained through the library, shared by the tests that read runs:
    `finished` (6 of 6 steps) and `stopped` (--stop-after 4 of 6: one log step after its
    last evaluation). Each entry: {"dir", "done" (DoneEvent), "evals" (EvalEvents),
    "pictures" ((inode, sha256) of curves.png seen at each EvalEvent), "sets" (the `--set`
    values it was trained with, without --stop-after)}."""
    import hashlib

    from minigpt.config import load_config
    from minigpt.events import EvalEvent
    from minigpt.train import train

    root = tmp_path_factory.mktemp("trained")
    out = {}
    for name, stop in (("finished", None), ("stopped", 4)):
        run = root / "runs" / name
        info = {"dir": run, "evals": [], "pictures": [], "sets": tiny_train_sets(root)}

        def on_event(e, info=info, run=run):
            if isinstance(e, EvalEvent):
                png = run / "curves.png"
                info["evals"].append(e)
                info["pictures"].append((png.stat().st_ino,
                                         hashlib.sha256(png.read_bytes()).hexdigest()))

        with pictures_off(curves=False):  # curves.png only: no test reads their heads.png
            info["done"] = train(load_config(None, tiny_train_sets(root)), run,
                                 on_event=on_event, stop_after=stop)
        out[name] = info
    return out


def induction_inspection(half: int = 16, base: int = 100, strs: list[str] | None = None):
    """A hand-built `Inspection` of an induction probe of 2 x `half` ids from `base`: head
    (0, 0) attends to the previous token, head (1, 1) is an induction head (query half + i ->
    key i + 1), the others are attention sinks. `strs`: the first copy's token strings
    (default `t<id>`)."""
    from minigpt.heads.inspection import Inspection
    from minigpt.interp.heads import score_heads

    T = 2 * half
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    sink = torch.zeros(T, T)
    sink[:, 0] = 1
    ind = sink.clone()
    for t in range(half, T - 1):
        ind[t] = 0
        ind[t, t - half + 1] = 1
    attn = torch.stack([torch.stack([prev, sink]), torch.stack([sink, ind])])
    tokens = list(range(base, base + half)) * 2
    token_strs = (strs or [f"t{i}" for i in tokens[:half]]) * 2
    return Inspection(tokens=tokens, token_strs=token_strs, attention=attn,
                      scores=score_heads(attn, tokens), parity_max_diff=0.0, parity_tol=1e-4,
                      source="probe:induction", copy_start=half)


# A 2-layer, 4-head, 32-wide byte model: every documented command can read it (inspect-heads
# --layer 1 --head 2), and 3 steps train in a few seconds.
REAL_TINY = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 32,
             "tokenizer.vocab_size": 256, "train.batch_size": 4, "train.max_steps": 3,
             "train.warmup_steps": 1, "train.eval_interval": 3, "train.eval_batches": 1,
             "train.checkpoint_interval": 3, "train.log_interval": 1, "train.sample_tokens": 0}


@pytest.fixture(scope="session")
def real_env(tmp_path_factory) -> dict[str, str]:
    """The environment of the installed `minigpt` processes: the token cache in tmp."""
    return {**os.environ, "MINIGPT_CACHE": str(tmp_path_factory.mktemp("real-cache"))}


@pytest.fixture(scope="session")
def place(real_env, tmp_path_factory) -> Path:
    """A working directory outside the checkout whose runs/ holds `default` (the default
    config with REAL_TINY's `--set`s, 3 steps, trained by the installed `minigpt train`),
    `bytes` and `induction` (copies), as the documented commands expect (tests/test_cli_real.py);
    tests/test_cli_train.py trains the same in this process and compares the files."""
    import subprocess

    from minigpt.paths import PROJECT_ROOT

    program = shutil.which("minigpt")
    assert program is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    cwd = tmp_path_factory.mktemp("real-cwd")
    assert not cwd.resolve().is_relative_to(PROJECT_ROOT), "run outside the checkout"
    sets = [x for k, v in REAL_TINY.items() for x in ("--set", f"{k}={v}")]
    r = subprocess.run([program, "train", "--out", "runs/default", *sets], cwd=cwd,
                       env=real_env, capture_output=True, text=True, timeout=300, check=False)
    assert "Traceback" not in r.stderr + r.stdout and r.returncode == 0, r.stderr
    for name in ("bytes", "induction"):
        shutil.copytree(cwd / "runs" / "default", cwd / "runs" / name, symlinks=True)
    return cwd

