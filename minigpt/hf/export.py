"""`export_hf`: a minigpt model as a Hugging Face model directory that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load with
no custom code.

learned positions -> GPT2LMHeadModel; rope -> GPTNeoXForCausalLM (full rotary, sequential
residual, q/k rows permuted to NeoX's rotate-half layout); sinusoidal / none, RMSNorm, ReLU^2,
QK-norm, logit soft-capping and value skips are refused, naming the setting
(`arch.export_kind`).
config.json also carries a "minigpt" section (`arch.export_inputs`): whether inputs to inspect
start with <|endoftext|> and the run's data source and induction ids, so that
`inspect-heads --model DIR` probes the export with the run's inputs. Biases a
bias-free minigpt model lacks are written as zeros, and an attention-only model (model.mlp
false, as configs/induction.yaml trains) gets MLPs whose weights are all zero: the same
function, in the blocks GPT-2 and GPT-NeoX always have.

The directory is written whole or not at all (`files.new_output`): every file goes into a
temporary sibling directory `.NAME.PID-XXXXXXXX.tmp` (each fsynced), which is then renamed to
`out`. An existing non-empty `out` is never touched; an existing empty one keeps its mode. A
temporary directory left by a killed export is deleted by the next export to the same `out`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from minigpt import __version__
from minigpt.errors import ArgumentError
from minigpt.files import check_new_path, new_output, read_only_dir, write_file_synced
from minigpt.hf.arch import (
    ARCHITECTURES,
    MINIGPT_KEY,
    export_config,
    export_inputs,
    export_kind,
)
from minigpt.hf.tokenizer import tokenizer_files
from minigpt.hf.weights import WEIGHTS, from_minigpt
from minigpt.run.checkpoint import model_tensors
from minigpt.run.load import LoadedRun
from minigpt.run.safetensors_io import tensors_to_bytes


@dataclass
class Exported:
    out: Path
    architecture: str  # GPT2LMHeadModel | GPTNeoXForCausalLM
    files: list[str]
    n_params: int


def check_export_dir(out: Path) -> Path:
    """`out` must be missing or an empty directory this process may write: an export never
    overwrites anything, and never fills a directory made read-only."""
    out = check_new_path(out, "out")
    if out.exists() and not out.is_dir():
        raise ArgumentError("out", "exists and is not a directory; give a new directory",
                            subject=out)
    try:
        full = out.is_dir() and any(out.iterdir())
    except OSError as e:
        raise ArgumentError("out", f"cannot read it ({e.strerror})", subject=out) from None
    if full:
        raise ArgumentError("out", "is not empty; an export never overwrites files: give a new "
                            "or empty directory", subject=out)
    # Made read-only (no write bit), or not writable by this process: the rename that commits
    # the export needs only the parent's permission, so it would fill it anyway (root too).
    if out.is_dir() and (why := read_only_dir(out)) is not None:
        raise ArgumentError("out", f"{why}; an export fills the directory it is given: make it "
                            "writable (chmod u+w) or give another", subject=out)
    return out


def export_files(loaded: LoadedRun) -> tuple[str, dict[str, bytes], int]:
    """(architecture, {file name: bytes}, parameter count) of the Hugging Face directory."""
    m, tok = loaded.cfg.model, loaded.tokenizer
    kind = export_kind(m)
    tensors = from_minigpt(kind, m, model_tensors(loaded.model))
    meta = {"format": "pt", "minigpt_version": __version__, "source": loaded.label}
    generation = {"bos_token_id": tok.eot_id, "eos_token_id": tok.eot_id}
    config = {**export_config(m, tok.eot_id),
              MINIGPT_KEY: export_inputs(loaded.cfg, loaded.eot_first)}
    files = {"config.json": _json(config),
             "generation_config.json": _json(generation),
             WEIGHTS: tensors_to_bytes(tensors, meta), **tokenizer_files(tok, m.block_size)}
    return ARCHITECTURES[kind], files, loaded.model.num_params()["total"]


def export_hf(loaded: LoadedRun, out: str | Path) -> Exported:
    """Write `loaded` (a run, or any LoadedRun) as a Hugging Face model directory at `out`."""
    out = check_export_dir(Path(out))
    architecture, files, n_params = export_files(loaded)
    with new_output(out, directory=True) as tmp:
        for name, data in files.items():
            write_file_synced(tmp / name, data)
    return Exported(out, architecture, sorted(files), n_params)


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()
