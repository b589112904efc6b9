"""Loading a run: weights and optimizer state into live objects (validated before any tensor is
read), and `load_run` for inference. Nothing here unpickles.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from minigpt.config import Config, model_hash, model_hashes
from minigpt.core.gpt import GPT, device_of
from minigpt.data.tokenizer import Tokenizer
from minigpt.device import resolve_device
from minigpt.errors import MinigptError
from minigpt.files import permission_denied_as_error
from minigpt.run.checkpoint import Checkpoint, find_checkpoint, raw_module, tied_aliases
from minigpt.run.layout import (
    CKPT_DIR,
    CONFIG_FILE,
    DEFAULT_RUNS,
    LATEST,
    MODEL_FILE,
    OPTIM_FILE,
)
from minigpt.run.listing import named_run
from minigpt.run.safetensors_io import check_against, load_tensors, read_header


@dataclasses.dataclass
class LoadedRun:
    """A model ready for inference: a trained run (`load_run`) or an imported model
    (`minigpt.hf.load_model`); `sample`, `inspect-heads` and `bench` take either."""

    model: GPT          # on the requested device, eval mode
    cfg: Config         # the run's resolved config (model.vocab_size filled in)
    tokenizer: Tokenizer
    step: int           # optimizer steps completed when the checkpoint was written
    run_dir: Path | None  # None: not a minigpt run (an imported model has no run directory)
    source: str = ""    # what was loaded, for messages and files: the run dir or the model spec
    eot_first: bool = False  # trained on documents that follow <|endoftext|> (or a compiled
    #                          program's BOS): inputs start so
    weights_sha256: str | None = None  # a run's: its checkpoint's model.safetensors, as listed

    def __post_init__(self) -> None:
        if not self.source:
            self.source = str(self.run_dir)

    @property
    def label(self) -> str:
        """One phrase for messages: `<run dir> (step N)`, or the model spec."""
        return self.source if self.run_dir is None else f"{self.source} (step {self.step})"

    @property
    def device(self) -> torch.device:
        """The device the model is on."""
        return device_of(self.model)


def load_model_weights(model: torch.nn.Module, ckpt: Checkpoint, name: str = MODEL_FILE) -> None:
    """Validate the checkpoint's weights file `name` (model.safetensors; with train.ema,
    train_weights.safetensors holds the live weights) against `model` (names, dtypes, shapes,
    config hash) before reading any tensor data, then load it and re-tie aliased weights."""
    raw = raw_module(model)
    path = ckpt.path / name
    if not path.is_file():
        raise MinigptError(f"{path} is missing from the checkpoint; the run directory is "
                           "incomplete")
    header, meta = read_header(path, "weights")
    hint = "the weights do not belong to this config (different model shape?)"
    if meta.get("config_hash") and meta["config_hash"] not in model_hashes(ckpt.cfg.model):
        raise MinigptError(f"{path} was saved for a different model config "
                           f"(hash {meta['config_hash']} != {model_hash(ckpt.cfg.model)}); "
                           "the weights and config.yaml do not match")
    aliases = tied_aliases(raw)
    expected = {k: v for k, v in raw.state_dict().items() if k not in aliases}
    check_against(header, expected, path, hint)
    tensors = load_tensors(path)
    state = dict(tensors)
    for alias, canonical in aliases.items():
        state[alias] = tensors[canonical]
    raw.load_state_dict(state, strict=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str],
                         ckpt: Checkpoint) -> None:
    """Restore the state saved by optimizer_tensors (validated against the params first).

    `optimizer` is one torch optimizer or a chain with `.parts` (train.weights.OptimizerChain);
    `names` spans the parts in order. AdamW and Muon parts expect exactly their own keys
    (`_STATE_KEYS`), so a file from the other train.optimizer fails naming the first missing
    tensor instead of resuming with a silently reset state; another optimizer gets the keys
    saved for its parameters. A file saved before the first step restores nothing."""
    path = ckpt.path / OPTIM_FILE
    header, _ = read_header(path, "optimizer state")
    if not header:  # saved before the first step: nothing to restore
        return
    saved_keys: dict[str, set[str]] = {}
    for k in header:
        stem, key = k.rsplit(".", 1)
        saved_keys.setdefault(stem, set()).add(key)
    plan, expected, start = [], {}, 0
    for opt in getattr(optimizer, "parts", [optimizer]):
        params = [p for g in opt.param_groups for p in g["params"]]
        part = names[start:start + len(params)]
        start += len(params)
        keys = _STATE_KEYS.get(type(opt).__name__) \
            or sorted(set().union(*(saved_keys.get(n, set()) for n in part)))
        for name, p in zip(part, params):
            for key in keys:
                expected[f"{name}.{key}"] = (
                    torch.empty((), dtype=torch.float32) if key == "step"
                    else torch.empty(p.shape, dtype=p.dtype, device="meta"))
        plan.append((opt, part, keys))
    check_against(header, expected, path, "the optimizer state does not match the model and "
                  "train.optimizer")
    tensors = load_tensors(path)
    for opt, part, keys in plan:
        sd = opt.state_dict()
        sd["state"] = {i: {key: tensors[f"{name}.{key}"] for key in keys}
                       for i, name in enumerate(part)}
        opt.load_state_dict(sd)


# The state each optimizer keeps per parameter, by class name.
_STATE_KEYS = {"AdamW": ("exp_avg", "exp_avg_sq", "step"), "Muon": ("momentum_buffer",),
               "BatchedMuon": ("momentum_buffer",)}  # train/muon.py: Muon's state


@permission_denied_as_error()
def load_run(run_dir: Path | None, device: str | torch.device = "cpu",
             step: int | None = None) -> LoadedRun:
    """Load a trained run for inference: the verified latest checkpoint's config, tokenizer and
    weights, model on `device` in eval mode. `run_dir=None` = the latest run under runs/.
    Every failure is a one-line MinigptError naming the file; nothing is unpickled."""
    run_dir = find_latest_run() if run_dir is None else named_run(run_dir)
    dev = device if isinstance(device, torch.device) else resolve_device(str(device))
    ckpt = find_checkpoint(run_dir, step=step)  # None: the latest; else a kept checkpoint
    cfg = ckpt.cfg
    if cfg.model.vocab_size <= 0:
        raise MinigptError(f"{ckpt.path / CONFIG_FILE}: model.vocab_size is {cfg.model.vocab_size}"
                           "; a trained run's config must record the real vocabulary size")
    tokenizer = Tokenizer.load(ckpt.path)
    if tokenizer.n_vocab > cfg.model.vocab_size:
        raise MinigptError(f"{ckpt.path}: the tokenizer has {tokenizer.n_vocab} tokens but "
                           f"model.vocab_size is {cfg.model.vocab_size}; files from different "
                           "runs?")
    model = GPT(cfg.model)
    load_model_weights(model, ckpt)
    model.to(dev).eval()
    listed = ckpt.files.get(MODEL_FILE)
    sha = listed.get("sha256") if isinstance(listed, dict) else None
    # a compiled program reads every input after its beginning token, as tracr adds it
    return LoadedRun(model=model, cfg=cfg, tokenizer=tokenizer, step=ckpt.step, run_dir=run_dir,
                     eot_first=cfg.data.source == "program",
                     weights_sha256=sha if isinstance(sha, str) else None)


@permission_denied_as_error()
def trained_runs(root: Path = DEFAULT_RUNS) -> list[Path]:
    """The runs under `root` with a committed checkpoint, the most recently committed first.
    MinigptError when there is none."""
    root = Path(root)
    found: list[tuple[float, Path]] = []
    if root.is_dir():
        for d in root.iterdir():
            try:
                found.append(((d / CKPT_DIR / LATEST).lstat().st_mtime, d))
            except OSError:
                continue
    if not found:
        raise MinigptError(f"no trained run found under {root}/ (looked for "
                           f"{root}/*/{CKPT_DIR}/{LATEST}); train one with `minigpt train`, or "
                           "pass --run DIR")
    return [d for _, d in sorted(found, key=lambda x: x[0], reverse=True)]


def find_latest_run(root: Path = DEFAULT_RUNS) -> Path:
    """The run under `root` with the most recently committed checkpoint."""
    return trained_runs(root)[0]
