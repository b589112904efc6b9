"""A compiled program on disk: `write_compiled_run` makes an ordinary run directory (config,
safetensors checkpoint at step 0, the program's tokenizer, metrics.jsonl) plus `truth.json`,
all in a hidden temp directory beside `--out` that is renamed into place once complete, so a
failure leaves nothing half-written; `read_truth` reads truth.json back, checked (no tracr
needed: every command opens a compiled run without it).

truth.json (format `minigpt-truth-1`): `program` (name, summary, source, vocab, max_seq_len,
bos), `output` (kind categorical | numerical, variable, directions: the residual directions
the output read takes, values: a categorical output's value per direction), `directions`
(every residual direction: label, variable, whether it changes with the input tokens), `nodes`
(what each head and MLP computes), `edges` (from, to, input as `minigpt circuit --json` names
them, the variables each carries, `tokens`) and `compiled` (how it was made and checked). The
meaning of each is tracr_compile.py's docstring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from minigpt.config import Config, from_dict, to_yaml
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import WordTokenizer
from minigpt.errors import ArgumentError, MinigptError
from minigpt.files import (
    ReadError,
    atomic_write_bytes,
    check_new_path,
    disk_error,
    fsync_dir,
    load_json,
)
from minigpt.run.checkpoint import save_checkpoint
from minigpt.run.layout import CONFIG_FILE, METRICS_FILE, OPTIM_FILE, SUMMARY_FILE, TRUTH_FILE
from minigpt.run.state import TrainerState, rng_state
from minigpt.truth.convert import model_settings, state_dict

FORMAT = "minigpt-truth-1"
INPUTS = ("q", "k", "v", "mlp", "logits")


@dataclass
class Truth:
    """truth.json of a compiled run, read and checked (module docstring)."""

    program: dict
    output: dict
    directions: list[dict]
    nodes: list[dict]
    edges: list[dict]
    compiled: dict

    @property
    def categorical(self) -> bool:
        return self.output["kind"] == "categorical"

    def output_str(self, i: int) -> str:
        """The name of the model's output i: a categorical output's value, the numerical
        output's variable."""
        if not self.categorical:
            return self.output["name"]
        values = self.output["values"]
        return str(values[i]) if 0 <= i < len(values) else "?"

    def to_json(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}


def compiled_config(program: dict, dims: dict[str, int], n_out: int) -> Config:
    """The run config of a compiled program: its model settings (convert.model_settings),
    `data.source: program`, the run named for the program, no head scores while training
    (there is no training)."""
    return from_dict({"model": model_settings(dims, n_out), "data": {"source": "program"},
                      "train": {"head_scores_interval": "off", "max_steps": 1},
                      "run": {"name": program["name"]}}, "<compiled program>")


def compiled_tokenizer(program: dict, input_ids: dict[str, int]) -> WordTokenizer:
    """The program's vocabulary as a tokenizer: its tokens at the compiled model's ids, BOS
    its special token (the padding token's id stays unused)."""
    ranks = {t.encode("utf-8"): input_ids[t] for t in program["vocab"]}
    return WordTokenizer(ranks, {program["bos"]: input_ids[program["bos"]]},
                         f"program-{program['name']}")


def build_model(cfg: Config, params: dict, dims: dict, residual: list[str],
                directions: list[str]) -> GPT:
    """The compiled model as a minigpt GPT in eval mode (convert.state_dict's weights)."""
    model = GPT(cfg.model)
    model.load_state_dict(state_dict(params, dims, residual, directions), strict=True)
    return model.eval()


def check_out(out: Path) -> Path:
    """`out` as an absolute path where a new run may go: missing, or an empty directory;
    ArgumentError naming --out otherwise (a compile never overwrites anything)."""
    path = check_new_path(out, "out")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ArgumentError("out", "already exists and is not an empty directory; minigpt "
                            "compile never overwrites anything: choose another {name}",
                            subject=path)
    return path


def write_compiled_run(out: Path, cfg: Config, model: GPT, tokenizer: WordTokenizer,
                       truth: Truth, metrics: dict) -> Path:
    """The run directory `out` (checked by `check_out`) holding the compiled model as a
    step-0 checkpoint, its config and tokenizer beside it, metrics.jsonl (one record,
    `metrics`) and truth.json; made in a temp sibling and renamed into place (module
    docstring). MinigptError (nothing left behind) when the disk refuses."""
    out = check_out(out)
    tmp = out.parent / f".{out.name}.compile-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_checkpoint(tmp, step=0, model=model, cfg=cfg, tokenizer=tokenizer,
                        trainer_state=TrainerState().as_json(rng_state(torch.Generator())))
        (tmp / OPTIM_FILE).unlink(missing_ok=True)  # nothing was trained: no optimizer state
        atomic_write_bytes(tmp / CONFIG_FILE, to_yaml(cfg).encode())
        tokenizer.save(tmp)
        atomic_write_bytes(tmp / METRICS_FILE, (json.dumps(metrics) + "\n").encode())
        atomic_write_bytes(tmp / SUMMARY_FILE, summary(truth, metrics).encode())
        text = json.dumps(truth.to_json(), indent=1, ensure_ascii=False, allow_nan=False)
        atomic_write_bytes(tmp / TRUTH_FILE, (text + "\n").encode())
        if out.is_dir():  # an empty directory (check_out): the rename replaces it
            out.rmdir()
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:
        raise MinigptError(f"writing {out} failed: {disk_error(e, Path(e.filename or tmp))}; "
                           "nothing was written") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def summary(truth: Truth, metrics: dict) -> str:
    """summary.md of a compiled run: what it is, how it was checked (`minigpt runs` reads its
    status line: `compiled`)."""
    p = truth.program
    return (f"# {p['name']}: a compiled program\n\n| | |\n|---|---|\n"
            f"| status | compiled at step 0/1 |\n| program | {p['summary']} |\n"
            f"| tokens | {' '.join(p['vocab'])} (BOS first; up to {p['max_seq_len']}) |\n"
            f"| output | {truth.output['kind']} |\n| truth | {len(truth.nodes)} heads and "
            f"MLPs, {len(truth.edges)} edges (truth.json) |\n| checked | {metrics['inputs']} "
            f"random inputs against tracr: outputs equal {metrics['outputs_equal']}, residual "
            f"streams within {metrics['max_residual_diff']:.1g} |\n")


# --------------------------------------------------------------------------------------------
# Reading truth.json back.


def read_truth(run_dir: Path | None) -> Truth | None:
    """The truth of a compiled run (None: `run_dir` is None or holds no truth.json); a
    MinigptError naming the file when it is not a truth this version wrote."""
    if run_dir is None:
        return None
    path = Path(run_dir) / TRUTH_FILE
    if not os.path.lexists(path):
        return None
    try:
        raw = load_json(path)
    except ReadError as e:
        raise MinigptError(f"{path}: cannot be read ({e.problem}); compile the program again "
                           "(minigpt compile)") from None
    try:
        return _checked(raw)
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise MinigptError(f"{path}: not a truth file minigpt wrote ({type(e).__name__}: "
                           f"{str(e)[:80]}); compile the program again (minigpt compile)"
                           ) from None


def _checked(raw: dict) -> Truth:
    """truth.json's object with every field the readers use checked (raises otherwise)."""
    if raw.get("format") != FORMAT:
        raise ValueError(f"format is {raw.get('format')!r}, not {FORMAT}")
    prog, out = raw["program"], raw["output"]
    assert isinstance(prog["name"], str) and isinstance(prog["bos"], str)
    assert all(isinstance(t, str) for t in prog["vocab"]) and prog["vocab"]
    assert out["kind"] in ("categorical", "numerical")
    assert all(isinstance(d, str) for d in out["directions"]) and out["directions"]
    assert out["kind"] == "numerical" or len(out["values"]) == len(out["directions"])
    dirs = raw["directions"]
    assert all(isinstance(d["label"], str) and isinstance(d["tokens"], bool) for d in dirs)
    labels = {d["label"] for d in dirs}
    for e in raw["edges"]:
        assert isinstance(e["from"], str) and isinstance(e["to"], str), "an edge's from/to"
        assert e["input"] in INPUTS, f"input {e['input']!r}"
        for c in e["carries"]:
            assert all(f"{c['variable']}:{v}" in labels for v in c["values"]) or \
                (not c["values"] and c["variable"] in labels), f"variable {c['variable']!r}"
    assert all(isinstance(n["node"], str) for n in raw["nodes"])
    return Truth(prog, out, dirs, raw["nodes"], raw["edges"], raw.get("compiled", {}))
