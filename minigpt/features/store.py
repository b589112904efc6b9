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
from minigpt.files import atomic_write_bytes, atomic_write_text, load_json, parse_json, shown
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


def load_state_header(out: Path) -> tuple[dict[str, dict], dict]:
    """The header of the training state saved in `out` (no tensor read) and its metadata (the
    settings it was started with)."""
    path = out / STATE_FILE
    header, meta = read_header(path, "an SAE training state")
    try:
        info = parse_json(meta["minigpt_features"].encode())
    except (KeyError, ValueError, MinigptError):
        raise MinigptError(f"{path}: not a minigpt features training state (no "
                           "minigpt_features metadata); delete it or give another --out") from None
    return header, info


def finished(out: Path) -> bool:
    return (out / INFO_FILE).is_file()


MAX_WIDTH = 1 << 24  # d_in and d_sae: a bound on what a cfg.json may declare, far above any SAE


def _count(cfg: dict, name: str, path: Path) -> int:
    """cfg.json's `name`: a JSON integer in 1..MAX_WIDTH (no float, no inf, no bool)."""
    v = cfg.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_WIDTH:
        raise MinigptError(f"{path}: {name} must be an integer from 1 to {MAX_WIDTH:,}, got "
                           f"{shown(v)}; not an SAE minigpt or SAELens wrote")
    return v


def read_cfg(directory: Path) -> tuple[dict, int, int, int]:
    """cfg.json of the SAE in `directory`, checked: (cfg, d_in, d_sae, k)."""
    path = Path(directory) / CFG_FILE
    cfg = load_json(path)
    if not isinstance(cfg, dict) or cfg.get("architecture") != "topk":
        raise MinigptError(f"{path}: not a TopK SAE config (architecture "
                           f"{shown(cfg.get('architecture')) if isinstance(cfg, dict) else None})")
    d_in, d_sae, k = (_count(cfg, n, path) for n in ("d_in", "d_sae", "k"))
    if k > d_sae:
        raise MinigptError(f"{path}: need k <= d_sae, got k={k}, d_sae={d_sae}")
    return cfg, d_in, d_sae, k


# features.json: each field minigpt reads, the JSON types it may have (None: null), and whether
# a file without it is still an SAE (the numbers of its training are shown when present).
_NUMBER = (int, float)
INFO_FIELDS: dict[str, tuple[tuple, bool]] = {
    "layer": ((int, type(None)), False), "n_head": ((int, type(None)), False),
    "d_head": ((int, type(None)), False), "run": ((str, type(None)), False),
    "model": ((str, type(None)), False), "step": ((int, type(None)), False),
    "text_file": ((str, type(None)), False), "activations": ((str, type(None)), False),
    "run_from_sae": ((str, type(None)), False), "weights_sha256": ((str, type(None)), False),
    "quality": ((dict, type(None)), False), "ce": ((dict, type(None)), False),
    "seconds": ((*_NUMBER, type(None)), False), "settings": ((dict, type(None)), False),
    "density": ((list, type(None)), False),
}
QUALITY_FIELDS = ("l0", "variance_explained", "dead_fraction", "mse")
CE_FIELDS = ("clean", "zero_ablated", "sae", "recovered")


def read_info(directory: Path) -> dict:
    """features.json of the SAE in `directory`, every field minigpt reads checked for its type
    (INFO_FIELDS): one MinigptError naming the file and the field otherwise."""
    path = Path(directory) / INFO_FILE
    info = load_json(path)
    if not isinstance(info, dict):
        raise MinigptError(f"{path}: not a JSON object but {type(info).__name__}; give the "
                           "directory `minigpt features train --out` wrote")

    def bad(name: str, want: str) -> MinigptError:
        return MinigptError(f"{path}: {name} must be {want}, got {shown(info.get(name), 60)}; "
                            "the file was not written by `minigpt features train` (or was "
                            "edited)")

    for name, (kinds, _) in INFO_FIELDS.items():
        v = info.get(name)
        if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds):
            words = {int: "an integer", float: "a number", str: "a string", dict: "an object",
                     list: "a list", type(None): "null"}
            raise bad(name, " or ".join(dict.fromkeys(words[k] for k in kinds)))
    for name in ("layer", "step"):
        if info.get(name) is not None and info[name] < 0:
            raise bad(name, "0 or more")
    for name in ("n_head", "d_head"):
        if info.get(name) is not None and not 1 <= info[name] <= MAX_WIDTH:
            raise bad(name, f"from 1 to {MAX_WIDTH:,}")
    if info.get("layer") is not None and info.get("n_head") is None:
        raise bad("n_head", "an integer (the heads of the layer the SAE reads)")
    for name, fields in (("quality", QUALITY_FIELDS), ("ce", CE_FIELDS)):
        sub = info.get(name)
        if sub is not None and not all(isinstance(sub.get(f), (*_NUMBER, type(None)))
                                       and not isinstance(sub.get(f), bool) for f in fields):
            raise bad(name, f"an object of numbers ({', '.join(fields)})")
    return info


def load_weights(directory: Path, d_in: int, d_sae: int, k: int) -> TopKSAE:
    """sae_weights.safetensors of `directory`, its header checked against cfg.json's sizes
    before any tensor is read (a file declaring other shapes, or a huge one, is refused
    unread): the TopKSAE in eval mode."""
    path = Path(directory) / WEIGHTS_FILE
    header, _ = read_header(path, "SAE weights")
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in),
              "b_dec": (d_in,)}
    for name, shape in shapes.items():
        got = header.get(name)
        if got is None or tuple(got["shape"]) != shape or got["dtype"] not in ("F32", "F16",
                                                                                "BF16", "F64"):
            what = "missing" if got is None else f"{got['dtype']}{got['shape']}"
            raise MinigptError(f"{path}: {name} should be a float tensor {list(shape)} for "
                               f"d_in={d_in}, d_sae={d_sae}, got {what}")
    check_fits_memory(path, sum(t["data_offsets"][1] - t["data_offsets"][0]
                                for t in header.values()), "SAE weights")
    tensors = load_tensors(path)
    sae = TopKSAE(d_in, d_sae, k)
    sae.load_state_dict({n: tensors[n].float() for n in shapes})
    return sae.eval()


def check_fits_memory(path: Path, nbytes: int, what: str, copies: float = 2.0) -> None:
    """A file of `nbytes` tensor bytes (read whole, then `copies` - 1 more in float32) fits in
    MEMORY_SHARE of the free memory; a MinigptError naming it otherwise, before it is read."""
    from minigpt.cost import memory_limit
    from minigpt.display import size

    need, free = copies * nbytes, memory_limit("cpu")
    if need > free:
        raise MinigptError(f"{path}: its {what} declare {size(nbytes)} of tensors; reading them "
                           f"needs about {size(need)}, more than the {size(free)} of memory "
                           "free for it")


def check_sae_dir(directory: Path) -> None:
    """`directory` holds a finished SAE (features.json present); a one-line MinigptError saying
    what it holds otherwise."""
    directory = Path(directory)
    if not (directory / INFO_FILE).is_file():
        what = ("an unfinished training (continue it with features train --resume)"
                if (directory / STATE_FILE).is_file() else "no SAE")
        raise MinigptError(f"{directory}: holds {what} ({INFO_FILE} is missing); give the "
                           "directory `minigpt features train --out` wrote")


def sae_memory(d_in: int, d_sae: int) -> float:
    """Bytes an SAE of these sizes holds once loaded (its two matrices, float32, and the file
    read whole)."""
    return 3 * 4.0 * d_in * d_sae


def load_sae(directory: Path) -> tuple[TopKSAE, dict, dict]:
    """The SAE saved in `directory` (TopKSAE in eval mode), its cfg.json and features.json;
    one-line MinigptErrors naming the file for anything missing or inconsistent."""
    check_sae_dir(directory)
    info = read_info(directory)
    cfg, d_in, d_sae, k = read_cfg(directory)
    return load_weights(directory, d_in, d_sae, k), cfg, info
