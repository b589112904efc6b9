"""An SAE directory of `minigpt features`, in SAELens's on-disk layout (`SAE.load_from_disk`
opens it: tests/test_features.py's slow test runs SAELens on one):

- `cfg.json`: SAELens 6's TopK config: architecture "topk", d_in, d_sae, k, dtype, device,
  apply_b_dec_to_input (true), normalize_activations ("none"), reshape_activations ("hook_z":
  SAELens feeds it z as [..., n_head, d_head] and flattens it head by head, our order),
  rescale_acts_by_decoder_norm (false: the decoder rows are unit norm), and `metadata` with
  hook_name `blocks.L.attn.hook_z`, model_name, context_size, prepend_bos, dataset_path.
- `sae_weights.safetensors`: W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in],
  b_dec [d_in], float32.
- `features.json`, written last (it marks a finished SAE): what minigpt needs beyond SAELens
  (the run or model, the layer, n_head and d_head, the settings, the seeds, the held-out
  quality and loss recovered, seconds).
- `train_state.safetensors`, while training only: the whole training state (features.fit),
  for `--resume`; removed once the SAE is finished.

Every file goes through minigpt.files (durable writes); tensors through run.safetensors_io
(headers checked before any tensor is read; nothing unpickles).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minigpt.errors import MinigptError
from minigpt.files import atomic_write_bytes, atomic_write_text, load_json, parse_json
from minigpt.interp.sae import TopKSAE
from minigpt.run.safetensors_io import load_tensors, read_header, tensors_to_bytes

CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
INFO_FILE = "features.json"
STATE_FILE = "train_state.safetensors"
FORMAT = 1  # features.json's format
SAELENS_FORMAT = "6.0.0"  # the SAELens config format cfg.json follows


def hook_name(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_z"


def sae_cfg(sae: TopKSAE, layer: int | None, model_name: str, context_size: int,
            dataset: str) -> dict:
    """SAELens 6's cfg.json for `sae` on layer `layer`'s z (None: activations from a file)."""
    return {
        "architecture": "topk", "d_in": sae.d_in, "d_sae": sae.d_sae, "k": sae.k,
        "dtype": "float32", "device": "cpu", "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "hook_z" if layer is not None else "none",
        "rescale_acts_by_decoder_norm": False,
        "metadata": {"model_name": model_name,
                     "hook_name": hook_name(layer) if layer is not None else "activations",
                     "hook_head_index": None, "context_size": context_size,
                     "prepend_bos": False, "dataset_path": dataset,
                     # the config format written (SAELens reads a config without it as
                     # pre-6.0 and drops the metadata); no SAELens trained it
                     "sae_lens_version": SAELENS_FORMAT, "sae_lens_training_version": None},
    }


def save_weights(sae: TopKSAE, out: Path) -> None:
    tensors = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    atomic_write_bytes(out / WEIGHTS_FILE, tensors_to_bytes(
        {k: v.detach().float() for k, v in tensors.items()}, {"format": "pt"}))


def save_sae(out: Path, sae: TopKSAE, cfg: dict, info: dict) -> None:
    """The finished SAE: weights, cfg.json, then features.json (last: it marks the whole);
    then the training state goes."""
    save_weights(sae, out)
    atomic_write_text(out / CFG_FILE, json.dumps(cfg, indent=2) + "\n")
    atomic_write_text(out / INFO_FILE, json.dumps({"format": FORMAT, **info}, indent=2,
                                                  allow_nan=False) + "\n")
    (out / STATE_FILE).unlink(missing_ok=True)


def save_state(out: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    atomic_write_bytes(out / STATE_FILE, tensors_to_bytes(
        tensors, {"minigpt_features": json.dumps(meta, sort_keys=True)}))


def load_state(out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The training state saved in `out` and its metadata (the settings it was started with)."""
    path = out / STATE_FILE
    _, meta = read_header(path, "an SAE training state")
    try:
        info = parse_json(meta["minigpt_features"].encode())
    except (KeyError, ValueError, MinigptError):
        raise MinigptError(f"{path}: not a minigpt features training state (no "
                           "minigpt_features metadata); delete it or give another --out") from None
    return load_tensors(path), info


def finished(out: Path) -> bool:
    return (out / INFO_FILE).is_file()


def load_sae(directory: Path) -> tuple[TopKSAE, dict, dict]:
    """The SAE saved in `directory` (TopKSAE in eval mode), its cfg.json and features.json;
    one-line MinigptErrors naming the file for anything missing or inconsistent."""
    directory = Path(directory)
    if not (directory / INFO_FILE).is_file():
        what = ("an unfinished training (continue it with features train --resume)"
                if (directory / STATE_FILE).is_file() else "no SAE")
        raise MinigptError(f"{directory}: holds {what} ({INFO_FILE} is missing); give the "
                           "directory `minigpt features train --out` wrote")
    info = load_json(directory / INFO_FILE)
    cfg = load_json(directory / CFG_FILE)
    if not isinstance(cfg, dict) or cfg.get("architecture") != "topk":
        raise MinigptError(f"{directory / CFG_FILE}: not a TopK SAE config (architecture "
                           f"{cfg.get('architecture') if isinstance(cfg, dict) else None!r})")
    try:
        d_in, d_sae, k = int(cfg["d_in"]), int(cfg["d_sae"]), int(cfg["k"])
    except (KeyError, TypeError, ValueError):
        raise MinigptError(f"{directory / CFG_FILE}: d_in, d_sae and k must be integers") \
            from None
    if not 0 < k <= d_sae or d_in <= 0:
        raise MinigptError(f"{directory / CFG_FILE}: need 0 < k <= d_sae and d_in > 0, got "
                           f"k={k}, d_sae={d_sae}, d_in={d_in}")
    tensors = load_tensors(directory / WEIGHTS_FILE)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in),
              "b_dec": (d_in,)}
    for name, shape in shapes.items():
        if name not in tensors or tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape) if name in tensors else "missing"
            raise MinigptError(f"{directory / WEIGHTS_FILE}: {name} should be {list(shape)} "
                               f"for d_in={d_in}, d_sae={d_sae}, got {got}")
    sae = TopKSAE(d_in, d_sae, k)
    sae.load_state_dict({n: tensors[n].float() for n in shapes})
    return sae.eval(), cfg, info
