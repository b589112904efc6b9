"""Hardening: every bad input through the real CLI gets exit code 2, one `error:` line naming
the file/field/flag (and what would fix it), no traceback, and leaves every existing run
byte-for-byte unchanged.

The table below (CASES) drives one test per case through `typer.testing.CliRunner` on
`minigpt.cli.app`; a few cases are repeated in a real `python -m minigpt` subprocess to prove
the process exit code and stderr. Inputs that are NOT errors (empty / huge / special-token
prompts, an empty config) have their behaviour asserted separately. Property tests feed random
`--set` strings and random config files to `minigpt train --print-config`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import Config, from_dict, to_yaml
from minigpt.model import GPT
from minigpt.run.checkpoint import save_checkpoint
from minigpt.run.lock import LOCK_NAME
from minigpt.tokenizer import bytes_tokenizer
from minigpt.train.optim import build_optimizer

BLOCK = 16
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": BLOCK}


# --------------------------------------------------------------------------------------------
# The world every case runs against: one good run, damaged copies of it, bad corpora, bad
# config files. Built once per module (no training: a random-init model saved as a committed
# checkpoint through the real save path).


def make_run(run_dir: Path, weights_model: dict | None = None, **model) -> Path:
    """A committed step-7 checkpoint of a random-init model (+ the top-level files train
    writes). `weights_model` saves weights of a different shape than config.yaml records."""
    tok = bytes_tokenizer()
    sec = {**MODEL, **model, "vocab_size": tok.n_vocab}
    cfg = from_dict({"model": sec, "tokenizer": {"vocab_size": 256}})
    wcfg = from_dict({"model": {**sec, **weights_model}}) if weights_model else cfg
    model = GPT.from_config(wcfg, seed=0)
    optimizer, names = build_optimizer(model, cfg.train, torch.device("cpu"))
    ckpt = save_checkpoint(run_dir, step=7, model=model, cfg=cfg, tokenizer=tok,
                           trainer_state={"step": 7}, optimizer=optimizer, param_names=names)
    for name in ("config.yaml", "tokenizer.tiktoken", "tokenizer.json"):  # as train leaves them
        shutil.copy(ckpt / name, run_dir / name)
    return run_dir


def tree_hash(root: Path) -> dict[str, str]:
    """{relative path: sha256 or '-> target'} for every file, directory and symlink under root."""
    out: dict[str, str] = {}
    if not root.exists() and not root.is_symlink():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel == LOCK_NAME:  # the run lock (holder's pid), not run data
                continue
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def weights_of(run: Path) -> Path:
    return (run / "checkpoints" / "latest").resolve() / "model.safetensors"


@dataclass
class World:
    root: Path
    good: Path          # a complete run that no case may change
    runs: dict[str, Path]
    files: dict[str, Path]
    corpus: Path        # a good tiny corpus
    models: dict[str, Path] = field(default_factory=dict)  # Hugging Face model directories

    def tiny(self, **over) -> list[str]:
        """--set flags of a 1-layer byte model on the good corpus (train fails fast or works)."""
        base = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32,
                "model.block_size": BLOCK, "tokenizer.vocab_size": 256,
                "train.batch_size": 2, "train.max_steps": 2, "train.warmup_steps": 1,
                "train.eval_interval": 2, "train.eval_batches": 1, "train.sample_tokens": 0,
                "data.corpus": str(self.corpus), "data.cache_dir": str(self.root / "cache")}
        base.update(over)
        return [x for k, v in base.items() for x in ("--set", f"{k}={v}")]


def build_world(root: Path) -> World:
    root.mkdir(parents=True, exist_ok=True)
    good = make_run(root / "good")
    runs: dict[str, Path] = {"good": good}

    def copy(name: str) -> Path:
        dst = root / "runs" / name
        shutil.copytree(good, dst, symlinks=True)
        runs[name] = dst
        return dst

    (root / "runs").mkdir()
    empty = root / "runs" / "empty"
    empty.mkdir()
    runs["empty"] = empty
    other = root / "runs" / "not-a-run"  # someone's directory: never taken for a run
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    runs["not-a-run"] = other
    # As left by kill -9 during the first save: config + tokenizer, a torn temp checkpoint
    # holding weights, no manifest, no `latest` commit pointer.
    half = root / "runs" / "half"
    (half / "checkpoints" / ".tmp-step-000003-4242").mkdir(parents=True)
    for name in ("config.yaml", "tokenizer.tiktoken", "tokenizer.json"):
        shutil.copy(good / name, half / name)
    shutil.copy(weights_of(good), half / "checkpoints" / ".tmp-step-000003-4242" /
                "model.safetensors")
    runs["half"] = half
    # Weights present but the manifest gone (a checkpoint nobody finished).
    nomani = copy("no-manifest")
    (weights_of(nomani).parent / "manifest.json").unlink()
    (weights_of(copy("garbage-manifest")).parent / "manifest.json").write_text("garbage{")
    os.symlink("step-999999", copy("dangling-latest") / "checkpoints" / ".latest-new")
    os.replace(runs["dangling-latest"] / "checkpoints" / ".latest-new",
               runs["dangling-latest"] / "checkpoints" / "latest")
    runs["shape"] = make_run(root / "runs" / "shape", weights_model={"n_embd": 64})
    trunc = copy("truncated")
    w = weights_of(trunc)
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    flip = copy("bitflip")
    w = weights_of(flip)
    data = bytearray(w.read_bytes())
    data[-5] ^= 0x10  # inside the last tensor's data: only the sha256 can catch it
    w.write_bytes(bytes(data))
    log = copy("with-metrics") / "metrics.jsonl"  # a run with a few logged steps
    log.write_text("".join(json.dumps({"kind": "train", "step": i, "loss": 5.0 - i / 10,
                                       "lr": 1e-3, "elapsed": i / 2}) + "\n" for i in (1, 2, 3))
                   + json.dumps({"kind": "eval", "step": 3, "val_loss": 4.8, "val_bpb": 6.9,
                                 "elapsed": 1.6}) + "\n")
    pk = copy("pickle")
    weights_of(pk).write_bytes(pickle.dumps({"wte": [0.0] * 8}, protocol=4))
    zp = copy("zip")
    with zipfile.ZipFile(weights_of(zp), "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"a": 1}))

    d = root / "inputs"
    d.mkdir()
    files: dict[str, Path] = {}

    def put(name: str, data: bytes) -> Path:
        p = d / name
        p.write_bytes(data)
        files[name] = p
        return p

    put("garbage.yaml", bytes(range(256)) * 4)
    put("list.yaml", b"- model\n- train\n")
    put("deep.yaml", b"[" * 5000 + b"]" * 5000)
    put("nested.yaml", b"model:\n  n_layer:\n    a:\n      b: [1, {c: d}]\n")
    put("badindent.yaml", b"model:\n  n_layer: 2\n   n_head: 2\n")
    put("unknown-section.yaml", b"modle:\n  n_layer: 2\n")
    put("dupkey.yaml", b"model:\n  n_layer: 2\n  n_layer: 3\n")
    put("tab.yaml", b"model:\n\tn_layer: 2\n")
    put("empty.txt", b"")
    put("spaces.txt", b" \n\t\r\n   \n" * 100)
    put("binary.txt", bytes(range(256)) * 40)
    put("latin1.txt", ("The caf\u00e9 is open. " * 200).encode("latin-1"))
    put("short.txt", b"hello")
    put("empty-prompt.txt", b"")
    put("latin1-prompt.txt", "caf\u00e9".encode("latin-1"))
    nodir = d / "no-txt"
    nodir.mkdir()
    (nodir / "notes.md").write_text("not a txt file\n" * 50)
    files["no-txt"] = nodir
    dangling = d / "dangling.txt"
    os.symlink(d / "does-not-exist.txt", dangling)
    files["dangling"] = dangling
    regular = put("regular-file", b"I am a file, not a directory\n")
    files["under-file"] = regular / "run"
    corpus = d / "good-corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    build_records(d, files)
    runs["sinusoidal"] = make_run(root / "runs" / "sinusoidal", pos_encoding="sinusoidal")
    nonempty = root / "runs" / "nonempty-out"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("mine\n")
    runs["nonempty-out"] = nonempty
    return World(root, good, runs, files, corpus, build_models(root / "models"))


def build_records(d: Path, files: dict[str, Path]) -> None:
    """JSON Lines and Parquet corpora (one document per record), good and bad."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"record {i}: the quick brown fox jumps over the lazy dog\n" * 3 for i in range(40)]
    good = [json.dumps({"id": i, "text": t}) for i, t in enumerate(docs)]

    def jsonl(name: str, lines: list[str]) -> None:
        files[name] = d / name
        files[name].write_text("\n".join(lines) + "\n")

    def parquet(name: str, **columns) -> Path:
        files[name] = d / name
        pq.write_table(pa.table(columns), files[name], row_group_size=4)
        return files[name]

    jsonl("good.jsonl", good)
    jsonl("bad-line.jsonl", good[:2] + ["{not json"] + good[2:])
    jsonl("no-field.jsonl", good[:1] + ['{"id": 1, "body": "the text"}'] + good[1:])
    jsonl("not-string.jsonl", good[:1] + ['{"text": 42}'] + good[1:])
    jsonl("blank.jsonl", ['{"text": ""}', "", '{"text": "   "}'])
    files["prose.jsonl"] = d / "prose.jsonl"
    files["prose.jsonl"].write_text("the quick brown fox jumps over the lazy dog\n" * 60)
    parquet("no-column.parquet", id=list(range(40)), body=docs)
    parquet("null.parquet", text=docs[:5] + [None] + docs[6:])
    files["corrupt.parquet"] = d / "corrupt.parquet"
    files["corrupt.parquet"].write_bytes(b"PAR1" + bytes(range(256)) * 8)
    damaged = parquet("damaged.parquet", text=docs)
    at = pq.ParquetFile(damaged).metadata.row_group(1).column(0).data_page_offset + 2
    data = bytearray(damaged.read_bytes())
    data[at: at + 8] = bytes(b ^ 0xFF for b in data[at: at + 8])
    damaged.write_bytes(bytes(data))


def build_models(root: Path) -> dict[str, Path]:
    """Hugging Face model directories (minigpt's own export: no transformers needed), a good
    GPT-2 and a good GPT-NeoX, and damaged copies of them."""
    from safetensors.torch import load_file, save_file

    from minigpt.hf import export_hf
    from minigpt.run import load_run

    learned = make_run(root / "learned-run", pos_encoding="learned", bias=True)
    models = {"gpt2": export_hf(load_run(learned, "cpu"), root / "gpt2").out}
    rope = make_run(root / "rope-run")
    models["neox"] = export_hf(load_run(rope, "cpu"), root / "neox").out

    def copy(name: str, src: str = "gpt2") -> Path:
        models[name] = dst = root / name
        shutil.copytree(models[src], dst)
        return dst

    def edit_config(d: Path, **changes) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))

    (copy("no-config") / "config.json").unlink()
    sharded = copy("sharded")
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, sharded / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: sh for sh, part in shards.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    shard2 = copy("truncated-shard", "sharded") / "model-00002-of-00002.safetensors"
    shard2.write_bytes(shard2.read_bytes()[: shard2.stat().st_size // 2])
    (copy("missing-shard", "sharded") / "model-00002-of-00002.safetensors").unlink()
    edit_config(copy("shape"), vocab_size=300)
    edit_config(copy("llama"), model_type="llama", architectures=["LlamaForCausalLM"])
    edit_config(copy("inverse-layer"), scale_attn_by_inverse_layer_idx=True)
    edit_config(copy("parallel", "neox"), use_parallel_residual=True)
    pk = copy("pickle-only")
    (pk / "model.safetensors").unlink()
    (pk / "pytorch_model.bin").write_bytes(pickle.dumps({"wte": [0.0] * 8}, protocol=4))
    (copy("renamed-pickle") / "model.safetensors").write_bytes(pickle.dumps([1], protocol=4))
    (copy("no-tokenizer") / "tokenizer.json").unlink()
    (copy("no-weights") / "model.safetensors").unlink()  # what hf: leaves of a pickle-only repo
    return models


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return build_world(tmp_path_factory.mktemp("hardening"))


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """cwd (so a default `runs/` lands in tmp) and the token cache both under tmp."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------
# The table. args(world, tmp) -> argv; needles: substrings the error line must contain (they
# name the file/field/flag and, where the message has one, the fix). usage=True: click itself
# rejects the value (its own `Error:` line under a usage line, still exit 2).


@dataclass
class Case:
    id: str
    args: Callable[[World, Path], list[str]]
    needles: tuple[str, ...]
    usage: bool = False
    target: str | None = None    # a run in world.runs that must stay unchanged too


def _sub(w: World, arg: str) -> str:
    """'@name' -> the path of world file `name`."""
    return str(w.files[arg[1:]]) if arg.startswith("@") else arg


def _fresh(w: World, tmp: Path) -> str:
    return str(tmp / "new-run")


def train(*extra: str, **over) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(**over), *extra]


def print_config(*sets: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["train", "--print-config", *[x for s in sets for x in ("--set", s)]]


def config_file(name: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["train", "--print-config", "--config", str(w.files[name])]


def corpus(name: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(**{"data.corpus":
                                                                    str(w.files[name])})]


def records(name: str, **over) -> Callable[[World, Path], list[str]]:
    """train on a record corpus, with a BPE and the cache under the case's own directory (the
    test checks that nothing was cached)."""
    return lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(**{
        "data.corpus": str(w.files[name]), "data.cache_dir": str(t / "cache"),
        "tokenizer.vocab_size": 260, **over})]


def sample(run: str | None, *extra: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["sample", *(["--run", str(w.runs[run])] if run else []), "-n", "2",
                         *[_sub(w, x) for x in extra]]


def inspect(run: str, *extra: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["inspect-heads", "--run", str(w.runs[run]),
                         *[_sub(w, x) for x in extra]]


def resume(run: str, *extra: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["train", "--out", str(w.runs[run]), "--resume", *extra]


def bench(*extra: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["bench", "--quick", *[_sub(w, x) for x in extra]]


def with_model(command: str, name: str, *extra: str) -> Callable[[World, Path], list[str]]:
    """`command --model <world model name>`; `name` may also be a literal spec (hf:...)."""
    return lambda w, t: [command, "--model", str(w.models.get(name) or _sub(w, name)),
                         *[_sub(w, x) for x in extra]]


def export(run: str, *extra: str) -> Callable[[World, Path], list[str]]:
    return lambda w, t: ["export", "--run", str(w.runs[run]), *extra]


CASES = [
    # ---- config validation through `train --print-config` (tests/test_config.py: full table)
    Case("set-unknown-key", print_config("model.n_layr=2"), ("n_layr", "did you mean 'n_layer'")),
    Case("set-unknown-section", print_config("modle.n_layer=2"), ("modle", "did you mean")),
    Case("set-no-equals", print_config("model.n_layer"), ("--set", "section.key=value")),
    Case("set-wrong-type", print_config("model.n_layer=abc"), ("model.n_layer", "integer")),
    Case("set-negative-size", print_config("model.n_embd=-8"), ("model.n_embd", ">= 1")),
    Case("set-dropout-1", print_config("model.dropout=1.0"), ("model.dropout", "< 1.0")),
    Case("set-lr-zero", print_config("train.learning_rate=0"), ("train.learning_rate", "> 0")),
    Case("set-lr-nan", print_config("train.learning_rate=nan"), ("train.learning_rate",
                                                                  "finite")),
    Case("set-lr-inf", print_config("train.learning_rate=.inf"), ("train.learning_rate",
                                                                   "finite")),
    Case("set-steps-huge-float", print_config("train.max_steps=1e400"), ("train.max_steps",)),
    Case("set-steps-negative", print_config("train.max_steps=-1"), ("train.max_steps", ">= 1")),
    Case("set-n-head-divides", print_config("model.n_embd=30", "model.n_head=4"),
         ("model.n_head", "does not divide", "use one of")),
    Case("set-odd-rope-head", print_config("model.n_embd=12", "model.n_head=4"),
         ("odd", "RoPE")),
    Case("set-choice", print_config("model.pos_encoding=rop"), ("model.pos_encoding",
                                                                 "did you mean 'rope'")),
    Case("set-min-lr-above-peak", print_config("train.min_lr=1", "train.learning_rate=0.1"),
         ("train.min_lr", "<= the peak")),
    Case("config-missing", lambda w, t: ["train", "--print-config", "--config",
                                         str(t / "nope.yaml")],
         ("config file not found", "nope.yaml")),
    Case("config-is-dir", lambda w, t: ["train", "--print-config", "--config", str(t) + "/"],
         ("is a directory",)),
    Case("config-binary-garbage", config_file("garbage.yaml"), ("garbage.yaml", "not a UTF-8")),
    Case("config-yaml-list", config_file("list.yaml"), ("list.yaml", "mapping")),
    Case("config-deeply-nested", config_file("deep.yaml"), ("deep.yaml",)),
    Case("config-nested-nonsense", config_file("nested.yaml"), ("nested.yaml", "model.n_layer",
                                                                 "integer")),
    Case("config-bad-indent", config_file("badindent.yaml"), ("badindent.yaml", "line 3")),
    Case("config-tab", config_file("tab.yaml"), ("tab.yaml", "line")),
    Case("config-unknown-section", config_file("unknown-section.yaml"),
         ("unknown-section.yaml", "modle", "did you mean 'model'")),
    Case("config-duplicate-key", config_file("dupkey.yaml"), ("dupkey.yaml", "duplicate key",
                                                               "n_layer")),
    Case("train-config-with-resume", lambda w, t: ["train", "--out", str(w.good), "--resume",
                                                   "--config", "bytes"],
         ("--config bytes: model.n_layer cannot change on --resume", "model.n_layer=2",
          "gives 4"), target="good"),
    Case("resume-changes-model", resume("good", "--set", "model.n_embd=64"),
         ("model.n_embd cannot change on --resume",), target="good"),
    # ---- corpora
    Case("corpus-empty", corpus("empty.txt"), ("data.corpus", "empty.txt", "empty")),
    Case("corpus-whitespace", corpus("spaces.txt"), ("data.corpus", "spaces.txt", "whitespace")),
    Case("corpus-binary", corpus("binary.txt"), ("binary.txt", "binary file", "UTF-8 text")),
    Case("corpus-latin1", corpus("latin1.txt"), ("latin1.txt", "offset", "data.invalid_utf8")),
    Case("corpus-too-short", corpus("short.txt"), ("block_size",)),
    Case("corpus-dir-without-txt", corpus("no-txt"), ("data.corpus", "no corpus files", ".txt")),
    Case("corpus-dangling-symlink", corpus("dangling"), ("data.corpus", "dangling symlink")),
    Case("corpus-device", lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(
        **{"data.corpus": "/dev/zero"})], ("data.corpus", "/dev/zero", "not a regular file")),
    Case("corpus-missing", lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(
        **{"data.corpus": str(t / "missing.txt")})], ("data.corpus", "missing.txt", "not found")),
    Case("corpus-glob-matches-nothing", lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(
        **{"data.corpus": str(t / "nothing-*.txt")})], ("data.corpus", "matches no files")),
    # ---- record corpora: JSON Lines and Parquet (the file and the line or row)
    Case("records-line-not-json", records("bad-line.jsonl"),
         ("bad-line.jsonl: line 3 is not JSON",)),
    Case("records-jsonl-holding-prose", records("prose.jsonl"), ("prose.jsonl: line 1 is not JSON",)),
    Case("records-no-text-field", records("no-field.jsonl"),
         ('no-field.jsonl: line 2 has no "text" field', "data.text_field")),
    Case("records-text-not-a-string", records("not-string.jsonl"),
         ('not-string.jsonl: line 2: "text" is number, not a string',)),
    Case("records-text-field-elsewhere", records("good.jsonl", **{"data.text_field": "body"}),
         ('good.jsonl: line 1 has no "body" field', "data.text_field")),
    Case("records-no-text", records("blank.jsonl"), ("data.corpus", "blank.jsonl holds no text")),
    Case("records-parquet-no-column", records("no-column.parquet"),
         ('no-column.parquet: no column "text"', "data.text_field")),
    Case("records-parquet-null", records("null.parquet"), ('null.parquet: row 5: "text" is null',)),
    Case("records-parquet-corrupt", records("corrupt.parquet"),
         ("corrupt.parquet: not a readable Parquet file",)),
    Case("records-parquet-damaged-page", records("damaged.parquet"),
         ("damaged.parquet: row group 1 (rows 4-7) cannot be read",)),
    Case("set-text-field-empty", print_config("data.text_field="),
         ("data.text_field", "must not be empty")),
    # ---- run directories
    Case("train-existing-run-no-resume", lambda w, t: ["train", "--out", str(w.good),
                                                       *w.tiny()],
         ("already exists", "--resume"), target="good"),
    Case("train-out-under-a-file", lambda w, t: ["train", "--out", str(w.files["under-file"]),
                                                 *w.tiny()], ("regular-file", "--out")),
    Case("train-out-in-proc", lambda w, t: ["train", "--out", "/proc/minigpt-run", *w.tiny()],
         ("/proc/minigpt-run", "--out")),
    Case("resume-missing-dir", lambda w, t: ["train", "--out", str(t / "nowhere"), "--resume"],
         ("nowhere", "does not exist")),
    Case("resume-not-a-run", resume("not-a-run"), ("not-a-run", "config.yaml",
                                                    "not a minigpt run"), target="not-a-run"),
    Case("resume-bitflip", resume("bitflip"), ("model.safetensors", "sha256"), target="bitflip"),
    Case("resume-truncated", resume("truncated"), ("model.safetensors", "truncated"),
         target="truncated"),
    Case("resume-pickle", resume("pickle"), ("model.safetensors", "pickle"), target="pickle"),
    Case("resume-shape", resume("shape"), ("model.safetensors", "wte.weight", "different model"),
         target="shape"),
    Case("sample-empty-dir", sample("empty"), ("empty", "minigpt train"), target="empty"),
    Case("sample-half-written", sample("half"), ("no saved checkpoint", "--resume"),
         target="half"),
    Case("sample-garbage-manifest", sample("garbage-manifest"), ("manifest.json", "corrupted"),
         target="garbage-manifest"),
    Case("resume-dangling-latest", resume("dangling-latest"), ("step-999999", "missing"),
         target="dangling-latest"),
    Case("sample-no-manifest", sample("no-manifest"), ("manifest.json", "never completed"),
         target="no-manifest"),
    Case("sample-shape-mismatch", sample("shape"), ("model.safetensors", "config"),
         target="shape"),
    Case("sample-truncated", sample("truncated"), ("model.safetensors", "truncated"),
         target="truncated"),
    Case("sample-bitflip", sample("bitflip"), ("model.safetensors", "sha256"), target="bitflip"),
    Case("sample-pickle", sample("pickle"), ("model.safetensors", "pickle", "never"),
         target="pickle"),
    Case("sample-zip", sample("zip"), ("model.safetensors", "zip", "never"), target="zip"),
    Case("sample-no-run-anywhere", sample(None), ("no trained run found", "minigpt train")),
    Case("sample-run-missing", lambda w, t: ["sample", "--run", str(t / "nowhere")],
         ("nowhere", "does not exist")),
    Case("inspect-empty-dir", inspect("empty"), ("empty", "minigpt train"), target="empty"),
    Case("inspect-half-written", inspect("half"), ("no saved checkpoint",), target="half"),
    Case("inspect-shape-mismatch", inspect("shape"), ("model.safetensors",), target="shape"),
    Case("inspect-truncated", inspect("truncated"), ("model.safetensors", "truncated"),
         target="truncated"),
    Case("inspect-bitflip", inspect("bitflip"), ("sha256",), target="bitflip"),
    Case("inspect-pickle", inspect("pickle"), ("pickle",), target="pickle"),
    Case("inspect-zip", inspect("zip"), ("zip",), target="zip"),
    # ---- prompts / texts
    Case("sample-empty-prompt-file", sample("good", "--prompt-file", "@empty-prompt.txt"),
         ("--prompt-file", "empty"), target="good"),
    Case("sample-prompt-file-not-utf8", sample("good", "--prompt-file", "@latin1-prompt.txt"),
         ("--prompt-file", "UTF-8"), target="good"),
    Case("sample-prompt-and-file", sample("good", "-p", "x", "--prompt-file", "@short.txt"),
         ("--prompt", "--prompt-file"), target="good"),
    Case("inspect-empty-text", inspect("good", "--text", ""), ("empty",), target="good"),
    # ---- numeric flags
    Case("sample-n-negative", sample("good", "-n", "-1"), ("--max-new-tokens", ">= 1"),
         target="good"),
    Case("sample-n-huge", sample("good", "-n", str(10**15)), ("--max-new-tokens", "at most"),
         target="good"),
    Case("sample-temp-nan", sample("good", "-t", "nan"), ("--temperature", "finite"),
         target="good"),
    Case("sample-temp-inf", sample("good", "-t", "inf"), ("--temperature", "finite"),
         target="good"),
    Case("sample-temp-negative", sample("good", "-t", "-1"), ("--temperature", ">= 0"),
         target="good"),
    Case("sample-top-p-nan", sample("good", "--top-p", "nan"), ("--top-p", "(0, 1]"),
         target="good"),
    Case("sample-top-p-zero", sample("good", "--top-p", "0"), ("--top-p", "(0, 1]"),
         target="good"),
    Case("sample-top-p-huge", sample("good", "--top-p", "1e308"), ("--top-p",), target="good"),
    Case("sample-top-k-negative", sample("good", "-k", "-1"), ("--top-k", ">= 0"),
         target="good"),
    Case("sample-num-samples-zero", sample("good", "--num-samples", "0"), ("--num-samples",),
         target="good"),
    Case("sample-n-not-a-number", sample("good", "-n", "lots"), ("--max-new-tokens",),
         usage=True, target="good"),
    Case("sample-device-cuda", sample("good", "--device", "cuda"), ("--device cuda",
                                                                    "--device cpu"),
         target="good"),
    Case("inspect-max-tokens-negative", inspect("good", "--max-tokens", "-5"),
         ("--max-tokens", "valid: 2..16"), target="good"),
    Case("inspect-max-tokens-huge", inspect("good", "--max-tokens", str(10**12)),
         ("--max-tokens", "valid: 2..16"), target="good"),
    Case("inspect-layer-negative", inspect("good", "--layer", "-1"), ("--layer", "valid: 0..1"),
         target="good"),
    Case("inspect-head-huge", inspect("good", "--head", str(10**9)), ("--head", "valid: 0..1"),
         target="good"),
    Case("inspect-format", inspect("good", "--format", "gif"), ("--format", "gif", "valid:"),
         target="good"),
    Case("inspect-probe", inspect("good", "--probe", "nope"), ("--probe", "nope", "valid:"),
         target="good"),
    Case("inspect-out-under-a-file", inspect("good", "--format", "json", "--out",
                                             "@under-file"), ("--out", "regular-file"),
         target="good"),
    Case("bench-seq-lens-negative", bench("--seq-lens", "-5"), ("--seq-lens",)),
    Case("bench-seq-lens-nan", bench("--seq-lens", "nan"), ("--seq-lens",)),
    Case("bench-seq-lens-huge", bench("--seq-lens", str(10**12)), ("--seq-lens",)),
    Case("bench-peak-nan", bench("--peak-tflops", "nan"), ("--peak-tflops", "positive")),
    Case("bench-peak-inf", bench("--peak-tflops", "inf"), ("--peak-tflops", "positive")),
    Case("bench-peak-negative", bench("--peak-tflops", "-1"), ("--peak-tflops", "positive")),
    Case("bench-device-cuda", bench("--device", "cuda"), ("--device cuda",)),
    Case("bench-suite", bench("--suite", "nope"), ("--suite", "nope")),
    Case("bench-dtype", bench("--dtype", "int8"), ("--dtype", "int8")),
    Case("bench-json-under-a-file", bench("--json", "@under-file"), ("--json", "regular-file")),
    Case("train-device-tpu", train("--device", "tpu"), ("--device", "tpu")),
    Case("train-device-cuda", train("--device", "cuda"), ("--device cuda",)),
    Case("train-stop-after-zero", train("--stop-after", "0"), ("--stop-after",), usage=True),
    Case("train-vocab-smaller-than-tokenizer", train(**{"model.vocab_size": 100}),
         ("model.vocab_size", "0")),
    Case("set-seed-huge", print_config(f"run.seed={2**70}"), ("run.seed", "<=")),
    Case("cache-dir-in-proc", train(**{"data.cache_dir": "/proc/minigpt-cache"}),
         ("/proc/minigpt-cache", "data.cache_dir")),
    Case("cache-dir-under-a-file", lambda w, t: ["train", "--out", _fresh(w, t), *w.tiny(
        **{"data.cache_dir": str(w.files["under-file"])})], ("regular-file", "data.cache_dir")),
    Case("bpe-cache-unwritable", train(**{"data.cache_dir": "/proc/minigpt-cache",
                                          "tokenizer.vocab_size": 260}),
         ("/proc/minigpt-cache/tokenizers", "data.cache_dir")),
    # A model or batch too big for memory: torch's allocator error, not a traceback.
    Case("train-model-too-big", train(**{"model.vocab_size": 10**12}), ("model.vocab_size",)),
    Case("train-batch-too-big", train(**{"train.batch_size": 10**12}), ("train.batch_size",)),
    Case("sample-seed-huge", sample("good", "--seed", str(2**70)), ("--seed",), target="good"),
    # ---- Hugging Face models (--model) and export
    Case("model-and-run", with_model("sample", "gpt2", "--run", "good"),
         ("--run and --model",), target="good"),
    Case("model-missing-dir", lambda w, t: ["sample", "--model", str(t / "nowhere")],
         ("--model", "nowhere", "no such directory")),
    Case("model-is-a-file", with_model("sample", "@short.txt"), ("--model", "is a file")),
    Case("model-bad-hub-spec", with_model("sample", "hf:a b@"), ("--model", "hf:REPO_ID")),
    Case("model-no-config", with_model("sample", "no-config"), ("no-config", "config.json")),
    Case("model-truncated-shard", with_model("inspect-heads", "truncated-shard"),
         ("model-00002-of-00002.safetensors", "truncated")),
    Case("model-missing-shard", with_model("sample", "missing-shard"),
         ("model-00002-of-00002.safetensors", "missing")),
    Case("model-shape-mismatch", with_model("sample", "shape"),
         ("transformer.wte.weight", "config.json")),
    Case("model-unsupported-type", with_model("inspect-heads", "llama"),
         ("model_type", "llama", "gpt2")),
    Case("model-unsupported-option", with_model("sample", "inverse-layer"),
         ("scale_attn_by_inverse_layer_idx",)),
    Case("model-parallel-residual", with_model("sample", "parallel"),
         ("use_parallel_residual",)),
    Case("model-pickle-only", with_model("sample", "pickle-only"),
         ("pytorch_model.bin", "never unpickles")),
    Case("model-renamed-pickle", with_model("inspect-heads", "renamed-pickle"),
         ("model.safetensors", "pickle")),
    Case("model-no-tokenizer", with_model("sample", "no-tokenizer"), ("tokenizer.json",)),
    Case("model-no-weights", with_model("sample", "no-weights"),
         ("no safetensors weights", "pytorch_model.bin")),
    Case("model-files-need-out", with_model("inspect-heads", "gpt2", "--format", "png"),
         ("--out",)),
    Case("model-bench-other-suite", with_model("bench", "gpt2", "--suite", "attention"),
         ("--model", "sample")),
    Case("export-sinusoidal", export("sinusoidal", "--out", "new-run"),
         ("model.pos_encoding", "sinusoidal"), target="sinusoidal"),
    Case("export-nonempty-out", lambda w, t: ["export", "--run", str(w.good), "--out",
                                              str(w.runs["nonempty-out"])],
         ("--out", "not empty"), target="nonempty-out"),
    Case("export-format", export("good", "--format", "onnx", "--out", "new-run"),
         ("--format", "onnx"), target="good"),
    # ---- runs and curves (issue #15): read-only listing, pictures written only to --out
    Case("runs-no-runs", lambda w, t: ["runs", str(w.files["no-txt"])],
         ("no runs under", "no-txt", "config.yaml")),
    Case("runs-missing-dir", lambda w, t: ["runs", str(t / "nowhere")], ("nowhere",)),
    Case("curves-unknown-run", lambda w, t: ["curves", str(w.runs["with-metrics"]), "nope",
                                             "--out", str(t / "c.png")],
         ("unknown run 'nope'", "minigpt runs"), target="with-metrics"),
    Case("curves-no-metrics", lambda w, t: ["curves", str(w.good), "--out", str(t / "c.png")],
         ("good", "no metrics yet"), target="good"),
    Case("curves-out-unwritable", lambda w, t: ["curves", str(w.runs["with-metrics"]), "--out",
                                                "/proc/minigpt-curves.png"],
         ("--out /proc/minigpt-curves.png", "cannot write"), target="with-metrics"),
    Case("curves-out-under-a-file", lambda w, t: ["curves", str(w.runs["with-metrics"]),
                                                  "--out", str(w.files["under-file"]) + ".png"],
         ("--out", "regular-file"), target="with-metrics"),
    Case("curves-out-into-a-run", lambda w, t: ["curves", str(w.runs["with-metrics"]), "--out",
                                                str(w.runs["with-metrics"] / "model.safetensors")],
         ("--out", ".png"), target="with-metrics"),
]

# Cases that reveal a bug in a module whose owner is still at work: {id: reason}.
XFAIL: dict[str, str] = {
}


def check_error(result, case: Case) -> str:
    """Exit 2, exactly one error line, no traceback; returns the error line."""
    out = (result.stderr or "") + (result.stdout or "")
    assert "Traceback" not in out, out
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"uncaught {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code == 2, f"exit {result.exit_code}: {out}"
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    if lines and lines[0].startswith(("data: ", "training the BPE")):
        # train reports its data progress before it can find an --out problem: the error is
        # still exactly one line, and the last one.
        assert not any(x.lower().startswith("error") for x in lines[:-1]), result.stderr
        lines = lines[-1:]
    if case.usage:  # click's own usage error: a usage line, a hint, one `Error:` line
        errs = [x for x in lines if x.lower().startswith("error")]
        assert len(errs) == 1, result.stderr
        return errs[0]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=XFAIL[c.id])]
                 if c.id in XFAIL else []) for c in CASES])
def test_bad_input(case: Case, world: World, tmp_path: Path):
    before_good = tree_hash(world.good)
    target = world.runs[case.target] if case.target else None
    before_target = tree_hash(target) if target else None
    args = case.args(world, tmp_path)
    result = CliRunner().invoke(app, args)
    line = check_error(result, case)
    for needle in case.needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert tree_hash(world.good) == before_good  # nothing in an existing run changed
    if target is not None:
        assert tree_hash(target) == before_target
    fresh = tmp_path / "new-run"
    assert not fresh.exists(), f"a failed command left {sorted(tree_hash(fresh))}"
    assert not (tmp_path / "runs").exists()
    if case.id.startswith("records-"):  # a bad corpus: neither tokens nor a BPE are cached
        cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
        assert not cached, f"a failed command cached {cached}"


def test_table_is_big_enough_and_covers_every_command(world, tmp_path):
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
    commands = {c.args(world, tmp_path)[0] for c in CASES}
    assert commands == {"train", "sample", "inspect-heads", "bench", "export", "runs", "curves"}


# --------------------------------------------------------------------------------------------
# The real process: exit code and stderr of `python -m minigpt` (what a shell script sees).


@pytest.mark.parametrize("name,args,needle", [
    ("sample-pickle", lambda w, t: ["sample", "--run", str(w.runs["pickle"])], "pickle"),
    ("model-pickle-only", lambda w, t: ["sample", "--model", str(w.models["pickle-only"])],
     "never unpickles"),
    pytest.param("model-missing-shard", lambda w, t: ["inspect-heads", "--model",
                                                      str(w.models["missing-shard"])],
                 "model-00002-of-00002", marks=pytest.mark.slow),
    pytest.param("config-garbage", lambda w, t: ["train", "--print-config", "--config",
                                                 str(w.files["garbage.yaml"])], "not a UTF-8",
                 marks=pytest.mark.slow),
    pytest.param("bench-usage", lambda w, t: ["bench", "--seq-lens", "x"], "--seq-lens",
                 marks=pytest.mark.slow),
])
def test_real_process_exit_code_and_stderr(world, tmp_path, name, args, needle):
    before = tree_hash(world.good)
    r = subprocess.run([sys.executable, "-m", "minigpt", *args(world, tmp_path)], check=False,
                       cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert tree_hash(world.good) == before


MINIGPT = shutil.which("minigpt")
QUICK_RECORD_CASES = {"records-line-not-json", "records-parquet-corrupt"}


@pytest.mark.skipif(MINIGPT is None, reason="the minigpt console script is not installed")
@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=[] if c.id in QUICK_RECORD_CASES else [pytest.mark.slow])
    for c in CASES if c.id.startswith("records-")])
def test_record_corpora_through_the_installed_command(case, world, tmp_path):
    """The record-corpus cases as a user types them: the installed `minigpt` console script,
    exit 2, the error as the last stderr line (after data progress lines), no traceback, no
    run directory, nothing cached."""
    r = subprocess.run([MINIGPT, *case.args(world, tmp_path)], check=False, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == "", r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines and lines[-1].startswith("error: "), r.stderr
    assert all(x.startswith(("data: ", "training the BPE")) for x in lines[:-1]), r.stderr
    assert all(n in lines[-1] for n in case.needles), lines[-1]
    assert not (tmp_path / "new-run").exists()
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


# --------------------------------------------------------------------------------------------
# Inputs that look odd but are not errors: their behaviour is part of the contract.


def test_empty_prompt_starts_from_endoftext(world):
    r = CliRunner().invoke(app, ["sample", "--run", str(world.good), "-p", "", "-n", "3",
                                 "--seed", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["prompt"] == "" and doc["prompt_tokens"] == 1  # just <|endoftext|>


def test_huge_prompt_is_left_truncated_not_an_error(world, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("all the world's a stage " * 20000)  # ~480 KB
    r = CliRunner().invoke(app, ["sample", "--run", str(world.good), "--prompt-file", str(big),
                                 "-n", "2", "--seed", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    assert "longer than the model's context" in r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == BLOCK


def test_special_token_text_in_prompt_is_ordinary_text(world):
    text = "<|endoftext|>"
    r = CliRunner().invoke(app, ["sample", "--run", str(world.good), "-p", text, "-n", "1",
                                 "-t", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == len(text.encode())  # bytes, not 1 special
    r = CliRunner().invoke(app, ["inspect-heads", "--run", str(world.good), "--text", text,
                                 "--json"])
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == len(text.encode())


def test_empty_config_file_means_all_defaults(world, tmp_path):
    """A config file with nothing in it is valid (documented: missing keys keep defaults)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = CliRunner().invoke(app, ["train", "--print-config", "--config", str(empty)])
    assert r.exit_code == 0, r.stderr
    defaults = Config()
    defaults.run.name = "empty"  # the run name comes from the file name
    assert r.stdout == to_yaml(defaults)


# --------------------------------------------------------------------------------------------
# Property tests at the CLI level: any --set text or config file either loads (exit 0, YAML
# on stdout) or fails with exactly one `error:` line and exit 2. Never a traceback.

_keys = st.sampled_from(["model.n_layer", "model.dropout", "model.pos_encoding", "train.lr",
                         "train.learning_rate", "train.sample_prompts", "train.compile",
                         "run.seed", "data.corpus", "tokenizer.vocab_size", "model", "x.y.z",
                         ""])
_values = st.one_of(st.text(max_size=20), st.integers().map(str),
                    st.floats(allow_nan=True).map(str),
                    st.sampled_from(["", "[", "{a: 1}", "- 1", "!!python/object:os.system",
                                     "&a [*a]", "1e999", "0x10", "yes", "~", "'x", "\x00"]))


def _loads_or_one_line(result) -> None:
    out = (result.stderr or "") + (result.stdout or "")
    assert "Traceback" not in out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception)
    if result.exit_code == 0:
        assert result.stdout.startswith("model:")
    else:
        assert result.exit_code == 2, out
        lines = [x for x in result.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=st.lists(st.one_of(st.builds(lambda k, v: f"{k}={v}", _keys, _values),
                               st.text(max_size=30)), min_size=1, max_size=3))
def test_any_set_loads_or_fails_in_one_line(sets):
    args = ["train", "--print-config"]
    for s in sets:
        args += ["--set", s]
    _loads_or_one_line(CliRunner().invoke(app, args))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                           st.text(max_size=8)),
                 lambda kids: st.one_of(st.lists(kids, max_size=3),
                                        st.dictionaries(st.sampled_from(
                                            ["model", "train", "n_layer", "dropout", "x"]),
                                            kids, max_size=3)), max_leaves=12)
    .map(lambda v: __import__("yaml").safe_dump(v).encode())))
def test_any_config_file_loads_or_fails_in_one_line(tmp_path, body):
    p = tmp_path / "cfg.yaml"
    p.write_bytes(body)
    _loads_or_one_line(CliRunner().invoke(app, ["train", "--print-config", "--config", str(p)]))
