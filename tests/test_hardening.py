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

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import AS_TRAINED, TINY_MODEL, error_line, make_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import Config, from_dict, to_yaml
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.run.checkpoint import save_checkpoint
from minigpt.run.lock import LOCK_NAME

BLOCK = TINY_MODEL["block_size"]


# --------------------------------------------------------------------------------------------
# The world every case runs against: one good run, damaged copies of it, bad corpora, bad
# config files. Built once per module (no training: a random-init model saved as a committed
# checkpoint through the real save path).


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
            elif not p.is_file():  # a FIFO or a device: never read
                out[rel] = "special"
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
        base = {**TINY_SETS, "data.corpus": str(self.corpus),
                "data.cache_dir": str(self.root / "cache"), **over}
        return [x for k, v in base.items() for x in ("--set", f"{k}={v}")]


# A 1-layer byte model that trains a step in milliseconds.
TINY_SETS = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": BLOCK,
             "tokenizer.vocab_size": 256, "train.batch_size": 2, "train.max_steps": 2,
             "train.warmup_steps": 1, "train.eval_interval": 2, "train.eval_batches": 1,
             "train.sample_tokens": 0}


def build_world(root: Path) -> World:
    root.mkdir(parents=True, exist_ok=True)
    good = make_run(root / "good", **AS_TRAINED)
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
    runs["shape"] = make_run(root / "runs" / "shape", weights_model={"n_embd": 64}, **AS_TRAINED)
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
    runs["sinusoidal"] = make_run(root / "runs" / "sinusoidal", pos_encoding="sinusoidal",
                                  **AS_TRAINED)
    build_resumable(root, runs, corpus)
    nonempty = root / "runs" / "nonempty-out"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("mine\n")
    runs["nonempty-out"] = nonempty
    return World(root, good, runs, files, corpus, build_models(root / "models"))


def build_resumable(root: Path, runs: dict[str, Path], corpus: Path) -> None:
    """A really trained run (step 2 of 4, resumable) and copies of it that a resume must
    refuse without changing them (issue 26): its first save blocked by a file where the step-4
    directory goes; a trainer state from before the byte split; `latest` a copy, not a link
    (a zip round trip); no `latest` and the newest step bit-flipped."""
    from minigpt.config import load_config
    from minigpt.train import train as train_run

    trained = root / "runs" / "trained"
    sets = {**TINY_SETS, "train.max_steps": 4, "train.checkpoint_interval": 2,
            "data.corpus": corpus, "data.cache_dir": root / "cache"}
    train_run(load_config(None, [f"{k}={v}" for k, v in sets.items()]), trained, stop_after=2)

    def copy(name: str) -> Path:
        runs[name] = dst = root / "runs" / name
        shutil.copytree(trained, dst, symlinks=True)
        return dst

    (copy("save-blocked") / "checkpoints" / "step-000004").write_text("in the way\n")
    state = weights_of(copy("before-byte-split")).parent / "trainer_state.json"
    data = json.loads(state.read_text())
    del data["data_split"]
    state.write_text(json.dumps(data, indent=1) + "\n")
    manifest = state.parent / "manifest.json"
    signed = json.loads(manifest.read_text())
    signed["files"][state.name] = {"sha256": hashlib.sha256(state.read_bytes()).hexdigest(),
                                   "bytes": state.stat().st_size}
    manifest.write_text(json.dumps(signed))
    latest = copy("latest-copied") / "checkpoints" / "latest"
    latest.unlink()
    shutil.copytree(trained / "checkpoints" / "step-000002", latest)
    unlinked = copy("unlinked-bitflip") / "checkpoints"
    (unlinked / "latest").unlink()
    w = unlinked / "step-000002" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-5] + bytes([w.read_bytes()[-5] ^ 0x10]) + w.read_bytes()[-4:])


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

    learned = make_run(root / "learned-run", pos_encoding="learned", bias=True, **AS_TRAINED)
    models = {"gpt2": export_hf(load_run(learned, "cpu"), root / "gpt2").out}
    rope = make_run(root / "rope-run", **AS_TRAINED)
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
    # ---- a resume never changes or loses a run (issue 26)
    Case("resume-first-save-blocked", resume("save-blocked", "--set", "train.eval_interval=1"),
         ("saving checkpoint step 4 failed", "(step-000002) is intact"), target="save-blocked"),
    Case("resume-before-byte-split", resume("before-byte-split"),
         ("trainer_state.json records no byte split", "start a new run"),
         target="before-byte-split"),
    Case("resume-latest-copied", resume("latest-copied"),
         ("checkpoints/latest is a directory, not the symbolic link", "ln -s step-000002"),
         target="latest-copied"),
    Case("resume-no-latest-newest-bitflip", resume("unlinked-bitflip"),
         ("step-000002/model.safetensors", "sha256"), target="unlinked-bitflip"),
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
    Case("records-jsonl-holding-prose", records("prose.jsonl"),
         ("prose.jsonl: line 1 is not JSON",)),
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
    Case("sample-prompt-file-not-utf8", sample("good", "--prompt-file", "@latin1-prompt.txt"),
         ("--prompt-file", "UTF-8"), target="good"),
    Case("sample-prompt-and-file", sample("good", "-p", "x", "--prompt-file", "@short.txt"),
         ("--prompt", "--prompt-file"), target="good"),
    Case("inspect-empty-text", inspect("good", "--text", ""), ("empty",), target="good"),
    Case("sample-prompt-file-directory", sample("good", "--prompt-file", "@no-txt"),
         ("--prompt-file", "no-txt", "not a regular file (a directory)"), target="good"),
    Case("inspect-text-file-directory", inspect("good", "--text-file", "@no-txt"),
         ("--text-file", "no-txt", "not a regular file (a directory)"), target="good"),
    Case("inspect-text-file-dangling-link", inspect("good", "--text-file", "@dangling"),
         ("--text-file", "dangling.txt", "no such file"), target="good"),
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
    Case("model-and-checkpoint", with_model("inspect-heads", "gpt2", "--checkpoint", "7"),
         ("--model and --checkpoint exclude each other",)),
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
    """Exit 2, exactly one error line, no traceback (conftest.error_line); returns the error
    line. train reports its data progress before it can find an --out problem: the error is
    then still exactly one line, and the last one. A usage error (`case.usage`) is the
    parser's message, one line as well."""
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    return error_line(result, after_progress=bool(lines) and lines[0].startswith(
        ("data: ", "training the BPE")))


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


@pytest.mark.parametrize("name,args,needle", [  # every case in-process: test_bad_input
    pytest.param("sample-pickle", lambda w, t: ["sample", "--run", str(w.runs["pickle"])],
                 "pickle", marks=pytest.mark.slow),
    pytest.param("model-pickle-only", lambda w, t: ["sample", "--model",
                                                   str(w.models["pickle-only"])],
                 "never unpickles", marks=pytest.mark.slow),
    pytest.param("model-missing-shard", lambda w, t: ["inspect-heads", "--model",
                                                      str(w.models["missing-shard"])],
                 "model-00002-of-00002", marks=pytest.mark.slow),
    # the quick one: refused before torch loads (~0.3 CPU-s; the others ~2.5)
    ("config-garbage", lambda w, t: ["train", "--print-config", "--config",
                                     str(w.files["garbage.yaml"])], "not a UTF-8"),
    pytest.param("bench-usage", lambda w, t: ["bench", "--seq-lens", "x"], "--seq-lens",
                 marks=pytest.mark.slow),
])
def test_real_process_exit_code_and_stderr(world, tmp_path, name, args, needle):
    before = tree_hash(world.good)
    r = subprocess.run([sys.executable, "-m", "minigpt", *args(world, tmp_path)], check=False,
                       cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")})
    assert needle in error_line(r), r.stderr
    assert tree_hash(world.good) == before


MINIGPT = shutil.which("minigpt")
# Every record case runs in-process in test_bad_input (quick tier); every one through the
# installed command here (slow tier).
@pytest.mark.slow
@pytest.mark.skipif(MINIGPT is None, reason="the minigpt console script is not installed")
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES
                                  if c.id.startswith("records-")])
def test_record_corpora_through_the_installed_command(case, world, tmp_path):
    """The record-corpus cases as a user types them: the installed `minigpt` console script,
    exit 2, the error as the last stderr line (after data progress lines), no traceback, no
    run directory, nothing cached."""
    r = subprocess.run([MINIGPT, *case.args(world, tmp_path)], check=False, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache")})
    line = error_line(r, after_progress=True)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert all(x.startswith(("data: ", "training the BPE")) for x in lines[:-1]), r.stderr
    assert all(n in line for n in case.needles), line
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
    """The config printed, or one clean error line (conftest.error_line)."""
    if result.exit_code == 0 and result.exception is None:
        assert result.stdout.startswith("model:") and "Traceback" not in result.stderr
    else:
        error_line(result)


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


# --------------------------------------------------------------------------------------------
# Files from elsewhere (issue 26): hostile Hugging Face model directories, special files and
# permissions in runs, run names that leave runs/, an empty HOME. Every case runs the
# installed `minigpt` console script in a subprocess, under a time limit and an address-space
# cap: a hang or a runaway allocation fails the case instead of the machine. Each must end in
# one `error:` line naming the file and exit 2. One case of each class runs in the quick tier;
# the rest are `slow` (each process imports torch: ~2 s of CPU).

MINIGPT = shutil.which("minigpt")
CASE_TIMEOUT_S = 120
CASE_MEMORY_CAP = 6 << 30


def unprivileged_prefix() -> list[str] | None:
    """A command prefix under which file permissions apply: none needed when not root; as root,
    `setpriv` dropping the capabilities that bypass them (CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH; still uid 0, so the interpreter under /root stays reachable). None
    when neither works here (the permission cases are then skipped, saying so)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search",
              "--inh-caps=-dac_override,-dac_read_search"]
    with __import__("tempfile").TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        probe.write_text("x")
        probe.chmod(0)
        r = subprocess.run([*prefix, "cat", str(probe)], check=False, capture_output=True)
    return prefix if r.returncode != 0 else None


def _capped() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (CASE_MEMORY_CAP, CASE_MEMORY_CAP))


def run_minigpt(args: list[str], cwd: Path, prefix: tuple[str, ...] = (),
                **env: str | None) -> subprocess.CompletedProcess:
    """The installed `minigpt ARGS` (time and memory capped); env values of None unset."""
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    environ = {**os.environ, "MINIGPT_CACHE": str(cwd / "cache"), **env}
    environ = {k: v for k, v in environ.items() if v is not None}
    return subprocess.run([*prefix, MINIGPT, *args], check=False, cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
                          preexec_fn=_capped)


# Quick cases of the process tables below that the quick tier runs in this process, through the
# same app and error path (`in_process`): a process adds only its start-up (~2 CPU-s, most of it
# importing torch), and the process tests that stay quick check the real exit code and stderr.
# The slow tier runs these through the installed command as well.
QUICK_IN_PROCESS = {"model-type-list", "eot-id-billion", "regex-invalid",
                    "runs-deep-metrics-line", "eval-batches-trillion",
                    "resume-tensorboard-a-file", "empty-prompt-file-like-empty-prompt",
                    "inspect-nan-attention", "runs-escape-codes-in-a-name",
                    "error-naming-a-run-with-escape-codes", "resume-tensorboard-a-note",
                    "tiktoken-missing-single-bytes", "n-layer-million", "sample-prompt-file-fifo"}


def in_process(args: list[str], **env: str | None) -> subprocess.CompletedProcess:
    """`minigpt ARGS` run by the app in this process (the working directory and the token cache
    are the test's: `_isolated`), as a finished process would report it: exit code, stdout,
    stderr. An exception that escaped the error path (a traceback in a real process) fails the
    test with its own traceback."""
    r = CliRunner().invoke(app, args, env=env)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(args, r.exit_code, r.stdout, r.stderr)


def where_run(cases) -> list:
    """pytest params (case, how) of a process table: every case through the installed command
    ("process": quick for the table's quick cases not in QUICK_IN_PROCESS), and the cases in
    QUICK_IN_PROCESS in this process too ("in-process", quick)."""
    params = []
    for c in cases:
        quick = c.quick if hasattr(c, "quick") else not c.slow
        params.append(pytest.param(c, "process", id=c.id, marks=[] if quick and c.id not in
                                   QUICK_IN_PROCESS else [pytest.mark.slow]))
        if c.id in QUICK_IN_PROCESS:
            params.append(pytest.param(c, "in-process", id=f"{c.id}-in-process"))
    return params


def build_hostile(root: Path, models: dict[str, Path]) -> dict[str, Path]:
    """Model directories made from the good exports, each with one hostile file."""
    out: dict[str, Path] = {}
    deep = b"[" * 100_000 + b"]" * 100_000

    def copy(name: str, src: str = "gpt2") -> Path:
        out[name] = dst = root / name
        shutil.copytree(models[src], dst, symlinks=True)
        return dst

    def edit(d: Path, file: str, change: Callable[[dict], None]) -> None:
        doc = json.loads((d / file).read_text())
        change(doc)
        (d / file).write_text(json.dumps(doc))

    def config(name: str, src: str = "gpt2", **changes) -> None:
        edit(copy(name, src), "config.json", lambda c: c.update(changes))

    def tokenizer(name: str, change: Callable[[dict], None]) -> None:
        edit(copy(name), "tokenizer.json", change)

    def split_regex(regex: str) -> Callable[[dict], None]:
        return lambda t: t["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=regex)

    def eot_id(i: int) -> Callable[[dict], None]:
        return lambda t: t["added_tokens"][0].update(id=i)

    (copy("deep-config") / "config.json").write_bytes(deep)
    (copy("deep-tokenizer") / "tokenizer.json").write_bytes(deep)
    (copy("deep-index", "sharded") / "model.safetensors.index.json").write_bytes(deep)
    config("type-list", model_type=["gpt2"])
    config("activation-list", activation_function=["gelu"])
    config("epsilon-huge-int", layer_norm_epsilon=10**400)
    config("n-layer-million", n_layer=10**6)
    config("vocab-huge", vocab_size=10**12)
    config("neox-positions-billion", "neox", max_position_embeddings=10**9)
    tokenizer("merges-int", lambda t: t["model"].update(merges=5))
    tokenizer("merges-nested", lambda t: t["model"].update(merges=[[["a"], ["b"]]]))
    tokenizer("merges-nulls", lambda t: t["model"].update(merges=[[None, None]]))
    tokenizer("added-int", lambda t: t.update(added_tokens=5))
    tokenizer("vocab-list", lambda t: t["model"].update(vocab=[["a", 1]]))
    tokenizer("eot-id-billion", eot_id(10**9))
    tokenizer("eot-id-negative", eot_id(-5))
    tokenizer("vocab-id-negative", lambda t: t["model"]["vocab"].update({"!": -1}))
    tokenizer("regex-invalid", split_regex("(unclosed"))
    tokenizer("regex-empty", split_regex(""))
    tokenizer("regex-enormous", split_regex("a|" * 500_000 + "b"))
    tokenizer("regex-backtracking", split_regex("(a+)+$"))
    edit(copy("index-lists", "sharded"), "model.safetensors.index.json",
         lambda i: i.update(weight_map={k: [v] for k, v in i["weight_map"].items()}))
    vm = copy("vocab-merges-huge-id")  # vocab.json + merges.txt, an id far past vocab_size
    vocab = json.loads((vm / "tokenizer.json").read_text())["model"]["vocab"]
    (vm / "tokenizer.json").unlink()
    (vm / "vocab.json").write_text(json.dumps({**vocab, "<|endoftext|>": 2**40}))
    (vm / "merges.txt").write_text("#version: 0.2\n")
    # Symlinks and special files.
    secret = root / "outside-secret.json"
    secret.write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    link = copy("config-link-out")
    (link / "config.json").unlink()
    os.symlink(secret, link / "config.json")
    shard = copy("shard-link-out")
    os.replace(shard / "model.safetensors", root / "outside-weights.safetensors")
    os.symlink(root / "outside-weights.safetensors", shard / "model.safetensors")
    zero = copy("tokenizer-dev-zero")
    (zero / "tokenizer.json").unlink()
    os.symlink("/dev/zero", zero / "tokenizer.json")
    fifo = copy("config-fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    # Permissions (read by an unprivileged process).
    copy("unreadable-dir").chmod(0)
    (copy("unreadable-config") / "config.json").chmod(0)
    return out


def build_hostile_runs(root: Path, good: Path) -> dict[str, Path]:
    """Runs whose metrics.jsonl or train.lock is not a regular file, or cannot be read."""
    out: dict[str, Path] = {}
    log = json.dumps({"kind": "train", "step": 1, "loss": 3.0, "lr": 1e-3, "elapsed": 0.5})

    def copy(name: str) -> Path:
        out[name] = dst = root / name
        shutil.copytree(good, dst, symlinks=True)
        (dst / "metrics.jsonl").write_text(log + "\n")
        return dst

    os.unlink(copy("metrics-fifo") / "metrics.jsonl")
    os.mkfifo(out["metrics-fifo"] / "metrics.jsonl")
    os.unlink(copy("metrics-dev-zero") / "metrics.jsonl")
    os.symlink("/dev/zero", out["metrics-dev-zero"] / "metrics.jsonl")
    os.unlink(copy("metrics-dir") / "metrics.jsonl")
    (out["metrics-dir"] / "metrics.jsonl").mkdir()
    os.mkfifo(copy("lock-fifo") / LOCK_NAME)
    (copy("metrics-unreadable") / "metrics.jsonl").chmod(0)
    return out


@dataclass
class Hostile:
    root: Path
    models: dict[str, Path]
    runs: dict[str, Path]
    unprivileged: list[str] | None


@pytest.fixture(scope="module")
def hostile(world, tmp_path_factory) -> Hostile:
    root = tmp_path_factory.mktemp("hostile")
    models = build_hostile(root / "models", {**world.models})
    runs = build_hostile_runs(root / "runs", world.good)
    return Hostile(root, models, runs, unprivileged_prefix())


@dataclass
class HostileCase:
    id: str
    args: Callable[[Hostile, Path], list[str]]
    needles: tuple[str, ...]
    quick: bool = False          # in the default tier (one case per class)
    unprivileged: bool = False   # run where file permissions apply
    env: dict[str, str | None] = field(default_factory=dict)


def hmodel(command: str, name: str, *extra: str) -> Callable[[Hostile, Path], list[str]]:
    return lambda h, t: [command, "--model", str(h.models[name]), *extra]


def hcurves(name: str) -> Callable[[Hostile, Path], list[str]]:
    return lambda h, t: ["curves", str(h.runs[name]), "--out", str(t / "c.png")]


HOSTILE = [
    # JSON nested 100,000 deep: a parse with a depth limit, never a RecursionError.
    HostileCase("deep-config", hmodel("sample", "deep-config"), ("config.json", "nested")),
    HostileCase("deep-tokenizer", hmodel("inspect-heads", "deep-tokenizer"),
                ("tokenizer.json", "nested")),
    HostileCase("deep-index", hmodel("sample", "deep-index"),
                ("model.safetensors.index.json", "nested")),
    # A list or a number where a string or a list of pairs belongs.
    HostileCase("model-type-list", hmodel("sample", "type-list"), ("config.json", "model_type"),
                quick=True),
    HostileCase("activation-list", hmodel("sample", "activation-list"),
                ("activation_function",)),
    HostileCase("epsilon-huge-int", hmodel("sample", "epsilon-huge-int"),
                ("config.json", "integer of 401 digits")),  # the JSON door's digit cap
    HostileCase("merges-int", hmodel("sample", "merges-int"), ("tokenizer.json", "merges")),
    HostileCase("merges-nested-lists", hmodel("sample", "merges-nested"),
                ("tokenizer.json", "merge 1", "not a pair")),
    HostileCase("merges-nulls", hmodel("inspect-heads", "merges-nulls"),
                ("tokenizer.json", "merge 1")),
    HostileCase("added-tokens-int", hmodel("sample", "added-int"), ("added_tokens",)),
    HostileCase("vocab-list", hmodel("sample", "vocab-list"), ("tokenizer.json", "vocabulary")),
    HostileCase("index-lists", hmodel("sample", "index-lists"),
                ("model.safetensors.index.json", "weight_map")),
    # Token ids outside the model's vocabulary: checked before the tokenizer is built.
    HostileCase("eot-id-billion", hmodel("sample", "eot-id-billion"),
                ("tokenizer.json", "<|endoftext|>", "1000000000", "outside"), quick=True),
    HostileCase("eot-id-negative", hmodel("inspect-heads", "eot-id-negative"),
                ("tokenizer.json", "-5", "outside")),
    HostileCase("vocab-id-negative", hmodel("sample", "vocab-id-negative"),
                ("tokenizer.json", "'!'", "id -1", "outside")),
    HostileCase("vocab-json-huge-id", hmodel("sample", "vocab-merges-huge-id"),
                ("vocab.json", "outside")),
    # Split regexes: only the patterns minigpt knows run.
    HostileCase("regex-invalid", hmodel("sample", "regex-invalid"), ("Split regex",),
                quick=True),
    HostileCase("regex-empty", hmodel("sample", "regex-empty"), ("Split regex",)),
    HostileCase("regex-enormous", hmodel("inspect-heads", "regex-enormous"), ("Split regex",)),
    HostileCase("regex-backtracking", hmodel("sample", "regex-backtracking"),
                ("Split regex", "(a+)+$")),
    # Sizes the weights do not hold: refused before anything of that size is built.
    HostileCase("n-layer-million", hmodel("sample", "n-layer-million"),
                ("n_layer is 1000000", "weights"), quick=True),
    HostileCase("bench-n-layer-million", hmodel("bench", "n-layer-million", "--suite",
                                                "sample", "--quick"), ("n_layer is 1000000",)),
    HostileCase("vocab-size-huge", hmodel("sample", "vocab-huge"), ("wte.weight",)),
    HostileCase("neox-positions-billion", hmodel("sample", "neox-positions-billion"),
                ("max_position_embeddings", "1000000000")),
    # Symlinks out of the model directory, special files in it.
    HostileCase("config-link-out", hmodel("sample", "config-link-out"),
                ("config.json", "outside the model directory")),
    HostileCase("shard-link-out", hmodel("inspect-heads", "shard-link-out"),
                ("model.safetensors", "outside the model directory")),
    HostileCase("tokenizer-dev-zero", hmodel("sample", "tokenizer-dev-zero"),
                ("tokenizer.json", "/dev/zero", "outside")),
    HostileCase("config-fifo", hmodel("sample", "config-fifo"),
                ("config.json", "not a regular file")),
    # Permissions.
    HostileCase("model-dir-unreadable", hmodel("sample", "unreadable-dir"),
                ("--model", "unreadable-dir", "permission denied"),
                unprivileged=True),
    HostileCase("config-unreadable", hmodel("inspect-heads", "unreadable-config"),
                ("config.json", "permission denied"), unprivileged=True),
    # Runs: metrics.jsonl that is not a regular file, or cannot be read.
    HostileCase("curves-metrics-fifo", hcurves("metrics-fifo"),
                ("metrics.jsonl", "not a regular file (a FIFO)")),
    HostileCase("curves-metrics-dev-zero", hcurves("metrics-dev-zero"),
                ("metrics.jsonl", "character device")),
    HostileCase("curves-metrics-dir", hcurves("metrics-dir"),
                ("metrics.jsonl", "a directory")),
    HostileCase("curves-metrics-unreadable", hcurves("metrics-unreadable"),
                ("metrics-unreadable/metrics.jsonl", "permission denied"), unprivileged=True),
    # Run names that leave runs/, and a cache with no home.
    HostileCase("run-name-dotdot", lambda h, t: ["train", "--print-config", "--set",
                                                 "run.name=../../elsewhere"],
                ("run.name", "'../../elsewhere'", "one directory name")),
    HostileCase("run-name-absolute", lambda h, t: ["train", "--print-config", "--set",
                                                   "run.name=/tmp/x"], ("run.name", "'/tmp/x'")),
    HostileCase("home-empty", lambda h, t: ["train", "--config", "bytes", "--out",
                                            str(t / "new-run"), "--set",
                                            "train.max_steps=1"],
                ("HOME", "MINIGPT_CACHE"),
                env={"HOME": "", "MINIGPT_CACHE": None, "XDG_CACHE_HOME": None}),
]


@pytest.mark.parametrize("case, how", where_run(HOSTILE))
def test_files_from_elsewhere(case: HostileCase, how: str, hostile: Hostile, tmp_path: Path):
    prefix: list[str] = []
    if case.unprivileged:
        if hostile.unprivileged is None:
            pytest.skip("running as root without a way to drop CAP_DAC_OVERRIDE (setpriv): "
                        "file permissions do not apply here; tests/test_security.py checks "
                        "the message in-process")
        prefix = hostile.unprivileged
    before = tree_hash(hostile.root / "models"), tree_hash(hostile.root / "runs")
    r = (run_minigpt(case.args(hostile, tmp_path), tmp_path, tuple(prefix), **case.env)
         if how == "process" else in_process(case.args(hostile, tmp_path), **case.env))
    line = error_line(r)
    for needle in case.needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert len(line) < 600, line
    assert (tree_hash(hostile.root / "models"), tree_hash(hostile.root / "runs")) == before
    assert not (tmp_path / "new-run").exists() and not (tmp_path / "runs").exists()


# Classes whose rule a quick in-process test checks: their process cases are all slow.
HOSTILE_IN_PROCESS = {
    "deep-config": "test_security.py::test_json_nested_too_deeply_is_an_error_not_a_crash",
    "config-link-out":
        "test_security.py::test_links_inside_a_model_directory_are_followed_and_links_out_refused",
    "model-dir-unreadable":
        "test_security.py::test_permission_denied_is_reported_with_the_path_in_process",
    "curves-metrics-fifo":
        "test_security.py::test_readers_never_block_on_a_fifo_nor_read_a_device",
    "run-name-dotdot": "test_security.py::test_run_name_is_one_directory_name",
    "home-empty": "test_security.py::test_the_cache_without_a_home",
}


def quick_test_exists(ref: str) -> bool:
    """`file::name` names a test function in tests/ that the quick tier runs."""
    file, name = ref.split("::")
    text = (Path(__file__).parent / file).read_text()
    at = text.find(f"\ndef {name}(")
    decorators = text[:at].rsplit("\n\n", 1)[-1].splitlines()
    return at >= 0 and not any(x.startswith("@pytest.mark.slow") for x in decorators)


def test_hostile_table_covers_every_class():
    quick = {c.id for c in HOSTILE if c.quick}
    assert len({c.id for c in HOSTILE}) == len(HOSTILE)
    classes = {"deep-config", "model-type-list", "eot-id-billion", "regex-invalid",
               "n-layer-million", "config-link-out", "model-dir-unreadable",
               "curves-metrics-fifo", "run-name-dotdot", "home-empty"}
    assert classes <= {c.id for c in HOSTILE}
    assert quick == classes - set(HOSTILE_IN_PROCESS)  # the others: a quick in-process test
    assert all(quick_test_exists(ref) for ref in HOSTILE_IN_PROCESS.values())


@pytest.mark.slow
def test_curves_of_a_run_whose_lock_is_a_fifo_draws_them(hostile, tmp_path):
    """curves reads metrics.jsonl only: a FIFO train.lock beside it neither hangs nor fails."""
    r = run_minigpt(["curves", str(hostile.runs["lock-fifo"]), "--out", str(tmp_path / "c.png")],
                    tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------
# Files from elsewhere and names that are not plain text (issue 26), through the installed
# `minigpt` console script in a subprocess, each in bounded time (TIME_LIMIT) and memory (an
# address-space limit, one intra-op thread): a special file (/dev/zero, /dev/urandom, a FIFO,
# a directory, a link to a device) named as a text is one `error:` line and exit 2, a huge
# text costs what the model can use of it, attention that is not finite is refused instead of
# written as a bare NaN, and escape sequences in a run's name never reach the terminal raw.

MINIGPT = shutil.which("minigpt")
TIME_LIMIT = 90  # seconds: a process that blocks on a FIFO never ends by itself
MEMORY_LIMIT = 2 << 30  # bytes of address space: reading /dev/zero whole would exceed it
BIG_TEXT_BYTES = 100 << 20
EVIL_NAME = "\x1b[2J\x1b]0;pwned\x07\x1b[31mevil\u202e"  # clear screen, set title, red, RTL


@dataclass
class Elsewhere:
    """What is on disk besides the world: special files, a huge text, runs whose weights are
    not finite, a run whose name holds escape sequences."""

    files: dict[str, Path]
    runs: dict[str, Path]


def nan_run(run_dir: Path, layer: int | None) -> Path:
    """make_run's model with NaN in the input norm of block `layer` (its attention is NaN), or
    (None) in the final norm (the attention is finite, the logits are not)."""
    model = GPT.from_config(from_dict({"model": {**TINY_MODEL, "vocab_size": 257}}), seed=0)
    module = model.ln_f if layer is None else model.blocks[layer]
    with torch.no_grad():
        next(module.parameters()).fill_(float("nan"))
    cfg = from_dict({"model": {**TINY_MODEL, "vocab_size": 257}, "tokenizer": {"vocab_size": 256}})
    save_checkpoint(run_dir, step=7, model=model, cfg=cfg, tokenizer=bytes_tokenizer(),
                    trainer_state={"step": 7})
    return run_dir


@pytest.fixture(scope="module")
def elsewhere(world, tmp_path_factory) -> Iterator[Elsewhere]:
    root = tmp_path_factory.mktemp("elsewhere")
    files = {"fifo": root / "prompt.fifo", "dir": root / "a-directory.txt",
             "zero-link": root / "zero.txt", "big": root / "big.txt"}
    os.mkfifo(files["fifo"])
    files["dir"].mkdir()
    os.symlink("/dev/zero", files["zero-link"])
    line = b"all the world's a stage, and all the men and women merely players\n"
    with open(files["big"], "wb") as fh:
        chunk = line * 16384
        fh.writelines(chunk for _ in range(BIG_TEXT_BYTES // len(chunk) + 1))
    runs = {"nan-attention": nan_run(root / "nan-attention", layer=1),
            "nan-logits": nan_run(root / "nan-logits", layer=None)}
    evil = root / "evil-runs" / EVIL_NAME
    shutil.copytree(world.runs["with-metrics"], evil, symlinks=True)
    runs["evil"] = evil
    yield Elsewhere(files, runs)
    files["big"].unlink()  # 100 MB: not left for pytest's kept temporary directories


def _limits() -> None:  # in the child, before exec
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def installed(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`minigpt ARGS` as a user runs it, within TIME_LIMIT and MEMORY_LIMIT."""
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    env = {**os.environ, "MINIGPT_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run([MINIGPT, *args], cwd=cwd, env=env, capture_output=True,
                              text=True, errors="backslashreplace", timeout=TIME_LIMIT,
                              preexec_fn=_limits, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"minigpt {' '.join(args)}: still running after {TIME_LIMIT} s")


@dataclass
class Outside:
    id: str
    args: Callable[[World, Elsewhere, Path], list[str]]
    needles: tuple[str, ...] = ()  # the error line's; empty: the command succeeds
    check: Callable[[subprocess.CompletedProcess, Path], None] | None = None
    slow: bool = False  # the quick tier keeps one case of each kind (~4 s a process)


def _sample_file(name: str, *extra: str) -> Callable[[World, Elsewhere, Path], list[str]]:
    return lambda w, e, t: ["sample", "--run", str(w.good), "-n", "2", "--seed", "0",
                            "--prompt-file", str(e.files.get(name) or name), *extra]


def _inspect_file(name: str) -> Callable[[World, Elsewhere, Path], list[str]]:
    return lambda w, e, t: ["inspect-heads", "--run", str(w.good), "--json",
                            "--text-file", str(e.files.get(name) or name)]


def _big_prompt_used_its_end(r: subprocess.CompletedProcess, tmp: Path) -> None:
    doc = json.loads(r.stdout)
    assert doc["prompt_tokens"] == BLOCK and doc["prompt"].endswith("merely players\n")
    assert len(doc["prompt"]) < 1 << 20  # what was read, not 100 MB
    assert "bytes, longer than the model's context" in r.stderr


def _big_text_used_its_start(r: subprocess.CompletedProcess, tmp: Path) -> None:
    doc = json.loads(r.stdout)
    assert "".join(doc["token_strs"]) == "all the world's " and doc["n_tokens"] == BLOCK
    assert f"inspecting the first {BLOCK}" in r.stderr


def _no_scores_written(r: subprocess.CompletedProcess, tmp: Path) -> None:
    assert not list((tmp / "heads-out").iterdir())


def _name_escaped(r: subprocess.CompletedProcess, tmp: Path) -> None:
    shown = r.stdout + r.stderr
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert "\\x1b[2J\\x1b]0;pwned\\x07\\x1b[31mevil\\u202e" in shown


OUTSIDE = [
    # Slow where a quick in-process test checks the rule: the reader's refusals in
    # test_security.py::test_the_reader_refuses_what_is_not_a_regular_file_with_one_line,
    # a long prompt file in test_cli_sample.py::test_a_long_prompt_file_keeps_the_tokens_...
    Outside("sample-prompt-file-dev-zero", _sample_file("/dev/zero"),
            ("--prompt-file /dev/zero", "not a regular file (a character device)"), slow=True),
    Outside("sample-prompt-file-dev-urandom", _sample_file("/dev/urandom"),
            ("--prompt-file /dev/urandom", "not a regular file"), slow=True),
    Outside("sample-prompt-file-fifo", _sample_file("fifo"),
            ("--prompt-file", "prompt.fifo", "not a regular file (a FIFO)")),
    Outside("sample-prompt-file-directory", _sample_file("dir"),
            ("--prompt-file", "a-directory.txt", "not a regular file (a directory)"), slow=True),
    Outside("sample-prompt-file-link-to-dev-zero", _sample_file("zero-link"),
            ("--prompt-file", "zero.txt", "not a regular file"), slow=True),
    Outside("inspect-text-file-dev-zero", _inspect_file("/dev/zero"),
            ("--text-file /dev/zero", "not a regular file"), slow=True),
    Outside("inspect-text-file-dev-urandom", _inspect_file("/dev/urandom"),
            ("--text-file /dev/urandom", "not a regular file"), slow=True),
    Outside("inspect-text-file-fifo", _inspect_file("fifo"),
            ("--text-file", "prompt.fifo", "not a regular file (a FIFO)"), slow=True),
    Outside("inspect-text-file-directory", _inspect_file("dir"),
            ("--text-file", "a-directory.txt", "not a regular file (a directory)"), slow=True),
    Outside("inspect-text-file-link-to-dev-zero", _inspect_file("zero-link"),
            ("--text-file", "zero.txt", "not a regular file"), slow=True),
    Outside("sample-prompt-file-100mb", _sample_file("big", "--json"),
            check=_big_prompt_used_its_end, slow=True),
    Outside("inspect-text-file-100mb", _inspect_file("big"), check=_big_text_used_its_start,
            slow=True),
    Outside("inspect-nan-attention", lambda w, e, t: [
        "inspect-heads", "--run", str(e.runs["nan-attention"]), "--probe", "induction",
        "--format", "json", "--out", str(t / "heads-out")],
        ("attention of layer 1 head 0", "not finite", "NaN"), check=_no_scores_written),
    Outside("inspect-nan-logits", lambda w, e, t: [
        "inspect-heads", "--run", str(e.runs["nan-logits"]), "--probe", "induction", "--json"],
        ("the logits are not finite",), slow=True),
    Outside("runs-escape-codes-in-a-name",
            lambda w, e, t: ["runs", str(e.runs["evil"].parent)], check=_name_escaped),
    Outside("sample-escape-codes-in-a-name", lambda w, e, t: [
        "sample", "--run", str(e.runs["evil"]), "-n", "2"], check=_name_escaped, slow=True),
    Outside("curves-escape-codes-in-a-name", lambda w, e, t: [
        "curves", str(e.runs["evil"]), str(e.runs["evil"] / "nope"), "--out",
        str(t / "c.png")], ("unknown run",), check=_name_escaped, slow=True),
    Outside("error-naming-a-run-with-escape-codes", lambda w, e, t: [
        "sample", "--run", str(e.runs["evil"] / "nowhere")], ("does not exist",),
        check=_name_escaped),
]


@pytest.mark.parametrize("case, how", where_run(OUTSIDE))
def test_from_elsewhere_through_the_installed_command(case: Outside, how: str, world: World,
                                                      elsewhere: Elsewhere, tmp_path: Path):
    before = tree_hash(world.good)
    (tmp_path / "heads-out").mkdir()
    args = case.args(world, elsewhere, tmp_path)
    r = installed(args, tmp_path) if how == "process" else in_process(args)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    if case.needles:
        line = error_line(r)
        for needle in case.needles:
            assert needle in line, f"{needle!r} not in {line!r}"
    else:
        assert r.returncode == 0, r.stderr
    if case.check is not None:
        case.check(r, tmp_path)
    assert tree_hash(world.good) == before


# --------------------------------------------------------------------------------------------
# One door for files (issue 32): configs, run files, token caches, tokenizer files and
# compressed corpora read with bounds; outputs that never replace a device or a FIFO; stdout
# that is full or closed; a resume that fails before its first commit changes nothing. Every
# case runs the installed `minigpt` (time and memory capped, as HOSTILE). The quick tier keeps
# one case per cause; the rules themselves are checked in-process in tests/test_security.py,
# tests/test_data.py and tests/test_tokenizer.py.


@dataclass
class Door:
    root: Path
    files: dict[str, Path]
    runs: dict[str, Path]
    caches: dict[str, Path]
    unprivileged: list[str] | None


def _tfrecord(payload: bytes) -> bytes:
    """One TFRecord framing `payload`, with both masked CRC-32Cs right (checked against the
    tensorboard package's own in tests/test_tensorboard.py): only the payload is wrong."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    head = len(payload).to_bytes(8, "little")
    return (head + masked_crc32c(head).to_bytes(4, "little") + payload
            + masked_crc32c(payload).to_bytes(4, "little"))


def build_door(root: Path, world: World) -> Door:
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    files: dict[str, Path] = {}
    runs: dict[str, Path] = {}
    d = root / "files"
    d.mkdir(parents=True)

    def put(name: str, data: bytes) -> Path:
        files[name] = d / name
        files[name].write_bytes(data)
        return files[name]

    os.symlink("/dev/urandom", d / "urandom.yaml")
    files["urandom.yaml"] = d / "urandom.yaml"
    os.mkfifo(d / "fifo.yaml")
    files["fifo.yaml"] = d / "fifo.yaml"
    levels = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    put("alias.yaml", ("x:\n" + "".join(f"  {x}\n" for x in levels)
                       + "train:\n  sample_prompts: [*a8, *a8]\n").encode())
    put("complex-key.yaml", b"model:\n  ? [a, b]\n  : 1\n")
    put("bigint.yaml", b"model:\n  n_layer: " + b"9" * 5000 + b"\n")
    put("bigint.jsonl", b'{"text": "hello there", "id": ' + b"9" * 5000 + b"}\n")
    # tokenizer.encoding files: hostile ranks
    good = [f"{base64_of(bytes([b]))} {b}" for b in range(256)]
    put("rank-billion.tiktoken", "\n".join(good + ["YWI= 1000000000"]).encode())
    put("rank-trillion.tiktoken", "\n".join(good + ["YWI= 1000000000000"]).encode())
    put("rank-negative.tiktoken", "\n".join(good + ["YWI= -5"]).encode())
    put("rank-duplicate.tiktoken", "\n".join(good + ["YWI= 7"]).encode())
    put("base64-invalid.tiktoken", "\n".join(good + ["!!!! 256"]).encode())
    with gzip.open(d / "long-line.jsonl.gz", "wb", compresslevel=1) as fh:
        fh.write(b'{"text": "' + b"a" * (80 << 20))  # one 80 MiB line, never ended
    files["long-line.jsonl.gz"] = d / "long-line.jsonl.gz"
    table = pa.table([pa.array(["x"] * 4), pa.array(["y"] * 4)], names=["text", "text"])
    pq.write_table(table, d / "two-text.parquet")
    files["two-text.parquet"] = d / "two-text.parquet"
    weird = put("we[ir]d.txt", world.corpus.read_bytes())
    files["weird"] = weird
    sub = d / "corpus-dir"
    (sub / "locked").mkdir(parents=True)
    (sub / "a.txt").write_text(world.corpus.read_text())
    (sub / "locked" / "b.txt").write_text(world.corpus.read_text())
    (sub / "locked").chmod(0)
    files["corpus-dir"] = sub
    put("empty-prompt.txt", b"")
    os.mkfifo(d / "out.png")
    files["fifo-out"] = d / "out.png"
    os.symlink("/dev/null", d / "null.png")
    files["null-link"] = d / "null.png"

    # Runs: a line nested 100,000 deep in metrics.jsonl; a manifest nested as deep; `latest`
    # a regular file; copies of a resumable run whose TensorBoard directory is in the way.
    deep = "[" * 100_000 + "]" * 100_000

    def copy(name: str, src: Path) -> Path:
        runs[name] = dst = root / "runs" / name
        shutil.copytree(src, dst, symlinks=True)
        return dst

    log = copy("deep-metrics", world.runs["with-metrics"]) / "metrics.jsonl"
    log.write_text(log.read_text() + deep + "\n")
    weights_of(copy("deep-manifest", world.good)).with_name("manifest.json").write_text(deep)
    latest = copy("latest-file", world.good) / "checkpoints" / "latest"
    latest.unlink()
    latest.write_text("step-000007\n")
    trained = world.root / "runs" / "trained"
    (copy("tb-file", trained) / "tensorboard").write_text("not a directory\n")
    events = copy("tb-not-events", trained) / "tensorboard"
    events.mkdir()
    (events / "events.out.tfevents.1.host.1.0").write_bytes(_tfrecord(b"not an event"))
    ro = copy("tb-read-only", trained) / "tensorboard"
    ro.mkdir()
    ro.chmod(0o555)
    (copy("metrics-dir", trained) / "metrics.jsonl").unlink()
    (runs["metrics-dir"] / "metrics.jsonl").mkdir()
    build_issue_39(root, world, files, runs, copy)
    return Door(root, files, runs, build_caches(root / "caches", world), unprivileged_prefix())


def build_issue_39(root: Path, world: World, files: dict[str, Path], runs: dict[str, Path],
                   copy: Callable[[str, Path], Path]) -> None:
    """Issue 39: event files that are no event files (a note, 1 GiB of zeros, random bytes), a
    run whose checkpoint directory is mode 000, a .tiktoken file without every single byte,
    an inspect-heads --out with a FIFO where a file goes, an empty read-only directory."""
    trained = world.root / "runs" / "trained"
    for name, fill in (("tb-note", b"my notes about this run\n"), ("tb-random", None),
                       ("tb-zeros", 1 << 30)):
        where = copy(name, trained) / "tensorboard"
        where.mkdir()
        with (where / "events.out.tfevents.notes").open("wb") as fh:
            if isinstance(fill, int):
                fh.truncate(fill)  # sparse: 1 GiB of zeros that takes no disk
            else:
                fh.write(fill or __import__("random").Random(0).randbytes(1 << 16))
    (copy("locked-step", world.good) / "checkpoints" / "step-000007").chmod(0)
    d = root / "files"
    kept = [b for b in range(256) if b not in (0x00, 0x7F)]
    ranks = [f"{base64_of(bytes([b]))} {i}" for i, b in enumerate(kept)]
    files["no-bytes.tiktoken"] = d / "no-bytes.tiktoken"
    files["no-bytes.tiktoken"].write_text("\n".join([*ranks, "dGg= 254", "aGU= 255"]) + "\n")
    fifo_dir = d / "heads-fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "scores.json")
    files["heads-fifo"] = fifo_dir
    ro = d / "read-only-out"
    ro.mkdir()
    ro.chmod(0o555)
    files["read-only-out"] = ro


def base64_of(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def build_caches(root: Path, world: World) -> dict[str, Path]:
    """A token cache of the world's corpus for TINY_SETS, and copies damaged in place: ids
    overwritten with 0xFF, bytes_per_token "x" and 0."""
    from minigpt.config import load_config
    from minigpt.data.cache import prepare_dataset
    from minigpt.data.tokenizer import build_tokenizer

    sets = {**TINY_SETS, "data.corpus": world.corpus, "data.cache_dir": root / "good"}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    prepare_dataset(cfg, build_tokenizer(cfg))
    caches = {"good": root / "good"}

    def damaged(name: str, change: Callable[[Path, Path], None]) -> None:
        caches[name] = dst = root / name
        shutil.copytree(root / "good", dst)
        (meta,) = (dst / "tokens").glob("*.json")
        change(meta, meta.with_suffix(".bin"))

    def ids_ff(meta: Path, bin_: Path) -> None:
        data = bytearray(bin_.read_bytes())
        data[10:20] = b"\xff" * 10
        bin_.write_bytes(bytes(data))

    def bpt(value: object) -> Callable[[Path, Path], None]:
        def change(meta: Path, bin_: Path) -> None:
            doc = json.loads(meta.read_text())
            doc["bytes_per_token"] = value
            meta.write_text(json.dumps(doc))
        return change

    damaged("ids-ff", ids_ff)
    damaged("bpt-x", bpt("x"))
    damaged("bpt-zero", bpt(0))
    return caches


@pytest.fixture(scope="module")
def door(world, tmp_path_factory) -> Iterator[Door]:
    d = build_door(tmp_path_factory.mktemp("door"), world)
    yield d
    (d.files["corpus-dir"] / "locked").chmod(0o755)  # so pytest can remove it
    (d.runs["locked-step"] / "checkpoints" / "step-000007").chmod(0o755)
    d.files["read-only-out"].chmod(0o755)


@dataclass
class DoorCase:
    id: str
    cause: str
    args: Callable[[World, Door, Path], list[str]]
    needles: tuple[str, ...] = ()          # the error line's; () with ok=True: exit 0
    ok: bool = False
    quick: bool = False
    unprivileged: bool = False
    target: str | None = None              # a door run that must stay byte-identical
    stdout: str = "pipe"                   # "full": > /dev/full; "closed": >&-; "reader-left":
    #                                        a pipe whose reader closed it (`| head`)
    stderr: str = "pipe"                   # "full": 2> /dev/full (the error line is lost)
    check: Callable[[subprocess.CompletedProcess, World, Door, Path], None] | None = None


def _train(**over) -> Callable[[World, Door, Path], list[str]]:
    return lambda w, d, t: ["train", "--out", str(t / "new-run"),
                            *w.tiny(**{k: _door_sub(d, v) for k, v in over.items()})]


def _door_sub(d: Door, v: object) -> str:
    """'@name' -> a door file's path; '%name' -> a door cache's path."""
    v = str(v)
    if v.startswith("@"):
        return str(d.files[v[1:]])
    return str(d.caches[v[1:]]) if v.startswith("%") else v


def _config(name: str) -> Callable[[World, Door, Path], list[str]]:
    return lambda w, d, t: ["train", "--print-config", "--config",
                            name if name.startswith("/") else str(d.files[name])]


def _resume(run: str) -> Callable[[World, Door, Path], list[str]]:
    return lambda w, d, t: ["train", "--out", str(d.runs[run]), "--resume", "--set",
                            "train.tensorboard=true", "--set", "train.max_steps=8"]


def _still_char_device(path: str) -> Callable:
    def check(r, w, d, t) -> None:
        import stat

        assert stat.S_ISCHR(os.stat(path).st_mode), f"{path} was replaced"
    return check


def _still_fifo(r, w, d, t) -> None:
    import stat

    assert stat.S_ISFIFO(os.lstat(d.files["fifo-out"]).st_mode), "the FIFO was replaced"


def _runs_status(run: str, status: str) -> Callable:
    def check(r, w, d, t) -> None:
        listed = in_process(["runs", str(d.runs[run]), "--json"])
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout)["runs"][0]["status"] == status
    return check


def _no_cache_entry(r, w, d, t) -> None:
    assert not [p for p in (t / "cache").rglob("*.bin")], "a short split was cached"


# Issue 39: what still ended in a traceback, a crash or a silent deletion.


def _still_there(run: str, name: str, size: int) -> Callable:
    """The event file `name` of door run `run` is where it was, as large (read no further:
    tree_hash would read a 1 GiB file twice)."""
    def check(r, w, d, t) -> None:
        st = (d.runs[run] / "tensorboard" / name).stat()
        assert st.st_size == size and len(list((d.runs[run] / "tensorboard").iterdir())) == 1
    return check


def _locked(command: list[str]) -> Callable[[World, Door, Path], list[str]]:
    """`command` on the door run whose checkpoint directory is mode 000 (`--run`, or `--out`
    for train --resume)."""
    def args(w, d, t) -> list[str]:
        flag = "--out" if command[0] == "train" else "--run"
        return [*command, flag, str(d.runs["locked-step"]),
                *(["--out", str(t / "exported")] if command[0] == "export" else [])]
    return args


def _no_run(command: list[str]) -> Callable[[World, Door, Path], list[str]]:
    """`command` without --run in a working directory whose runs/ (holding a good run, as
    `runs/good`) is mode 000."""
    def args(w, d, t) -> list[str]:
        runs = t / "runs"
        shutil.copytree(w.good, runs / "good", symlinks=True)
        runs.chmod(0)
        return [*command, *(["--out", str(t / "exported")] if command[0] == "export" else [])]
    return args


def _runs_readable_again(r, w, d, t) -> None:
    (t / "runs").chmod(0o755)  # so pytest can remove it
    assert sorted(p.name for p in (t / "runs").iterdir()) == ["good"]
    assert not (t / "exported").exists() and not (t / "exported.gguf").exists()


def _stale_temps(w, d, t) -> list[str]:
    """An inspect-heads --out holding what killed writers left: temps of dead processes last
    written two hours ago (new-style and as minigpt named them before they carried a pid),
    one written just now, and a user's file of a similar name."""
    out = t / "heads-out"
    out.mkdir()
    old = __import__("time").time() - 7200
    for name in (".attention.html.4194999-0badf00d.tmp", ".scores.json.4194999-0badf00d.tmp",
                 ".attention.html.k3j_x9az.tmp", ".attention.html.4194998-00000001.tmp",
                 ".attention.html.mine.tmp", "attention.html.4194999-0badf00d.tmp"):
        (out / name).write_bytes(b"x" * 1000)
        if "00000001" not in name:
            os.utime(out / name, (old, old))
    return ["inspect-heads", "--run", str(w.good), "--format", "html", "--out", str(out)]


def _only_abandoned_temps_removed(r, w, d, t) -> None:
    left = sorted(p.name for p in (t / "heads-out").iterdir())
    assert left == [".attention.html.4194998-00000001.tmp", ".attention.html.mine.tmp",
                    "attention.html", "attention.html.4194999-0badf00d.tmp"], left


def _nothing_written_beside_the_fifo(r, w, d, t) -> None:
    import stat

    fifo = d.files["heads-fifo"]
    assert [p.name for p in fifo.iterdir()] == ["scores.json"]  # no attention_grid.png first
    assert stat.S_ISFIFO((fifo / "scores.json").lstat().st_mode)


def _quiet(r, w, d, t) -> None:
    """A reader that left: nothing said about it (no error, no traceback)."""
    assert "error" not in r.stderr.lower() and "Traceback" not in r.stderr, r.stderr


def _lines_short(r, w, d, t) -> None:
    assert "patch (noising, from text: " in r.stderr
    assert all(len(x) < 600 for x in r.stderr.splitlines()), max(map(len, r.stderr.split()))


def _still_empty(r, w, d, t) -> None:
    assert list(d.files["read-only-out"].iterdir()) == []


def _help(*command: str) -> Callable[[World, Door, Path], list[str]]:
    return lambda w, d, t: [*command, "--help"]


ISSUE_39_CASES = [
    # 1. A *tfevents* file that is not an event file: one line, nothing cut or removed.
    DoorCase("resume-tensorboard-a-note", "tensorboard-not-events", _resume("tb-note"),
             ("events.out.tfevents.notes", "not a TensorBoard event file", "fails its CRC"),
             quick=True, target="tb-note"),
    DoorCase("resume-tensorboard-1-gib-of-zeros", "tensorboard-not-events", _resume("tb-zeros"),
             ("events.out.tfevents.notes", "header at byte 0 fails its CRC"),
             check=_still_there("tb-zeros", "events.out.tfevents.notes", 1 << 30)),
    DoorCase("resume-tensorboard-random-bytes", "tensorboard-not-events",
             _resume("tb-random"), ("events.out.tfevents.notes", "fails its CRC"),
             target="tb-random"),
    # 3. An unreadable checkpoint directory or runs/: one "permission denied" line naming it.
    DoorCase("sample-checkpoint-unreadable", "unreadable-dir", _locked(["sample", "-n", "2"]),
             ("locked-step/checkpoints/step-000007: permission denied",), quick=True,
             unprivileged=True),
    *[DoorCase(f"{name}-checkpoint-unreadable", "unreadable-dir", _locked(command),
               ("locked-step/checkpoints/step-000007: permission denied",), unprivileged=True)
      for name, command in (("inspect-heads", ["inspect-heads"]), ("export-hf", ["export"]),
                            ("export-gguf", ["export", "--format", "gguf"]),
                            ("resume", ["train", "--resume"]))],
    *[DoorCase(f"{name}-runs-unreadable", "unreadable-dir", _no_run(command),
               ("/runs: permission denied",), unprivileged=True, check=_runs_readable_again)
      for name, command in (("sample", ["sample", "-n", "2"]),
                            ("inspect-heads", ["inspect-heads"]), ("export-hf", ["export"]),
                            ("export-gguf", ["export", "--format", "gguf"]),
                            ("resume", ["train", "--resume", "--set", "run.name=good"]))],
    # 4. A .tiktoken file without every single byte: refused when read, not in the encoder.
    DoorCase("tiktoken-missing-single-bytes", "tiktoken-bytes", _train(**{
        "tokenizer.encoding": "@no-bytes.tiktoken"}),
        ("no-bytes.tiktoken", "2 of the 256 single-byte tokens", "0x00, 0x7f"), quick=True),
    # 5. --help into a full stdout: one line, exit 2, for every command.
    DoorCase("help-stdout-full", "help-stdout-full", _help(), ("stdout",), quick=True,
             stdout="full"),
    *[DoorCase(f"{c}-help-stdout-full", "help-stdout-full", _help(c), ("stdout",),
               stdout="full")
      for c in ("train", "sample", "inspect-heads", "runs", "curves", "bench", "export")],
    # The minor ones.
    DoorCase("stale-temps-removed-by-a-later-run", "minor", _stale_temps, ok=True,
             check=_only_abandoned_temps_removed),
    DoorCase("inspect-out-fifo-refused-before-any-work", "minor", lambda w, d, t: [
        "inspect-heads", "--run", str(w.good), "--format", "png,json", "--out",
        str(d.files["heads-fifo"])], ("--out", "scores.json there", "a FIFO"),
        check=_nothing_written_beside_the_fifo),
    *[DoorCase(f"{name}-reader-left", "minor", args, ok=True, stdout="reader-left",
               check=_quiet) for name, args in (
        ("version", lambda w, d, t: ["--version"]),
        ("runs-json", lambda w, d, t: ["runs", str(w.runs["with-metrics"]), "--json"]),
        ("inspect-heads-json", lambda w, d, t: ["inspect-heads", "--run", str(w.good),
                                                "--json"]),
        ("sample", lambda w, d, t: ["sample", "--run", str(w.good), "-n", "200"]))],
    DoorCase("induction-probe-max-tokens-3", "minor", lambda w, d, t: [
        "inspect-heads", "--run", str(w.good), "--probe", "induction", "--max-tokens", "3"],
        ("--max-tokens 3", "valid: 4..16", "two copies")),
    DoorCase("patch-from-long-text-echo-cut", "minor", lambda w, d, t: [
        "inspect-heads", "--run", str(w.good), "--text", "ab" * 30000, "--patch-from",
        "cd" * 30000, "--json"], ok=True, check=_lines_short),
    DoorCase("patch-direction-without-patch-from", "minor", lambda w, d, t: [
        "inspect-heads", "--run", str(w.good), "--patch-direction", "denoising"],
        ("--patch-direction", "--patch-from")),
    DoorCase("error-to-a-full-stderr", "minor", lambda w, d, t: [
        "train", "--print-config", "--set", "model.n_layer=abc"], stderr="full"),
    DoorCase("export-out-read-only-empty", "minor", lambda w, d, t: [
        "export", "--run", str(w.good), "--out", str(d.files["read-only-out"])],
        ("--out", "read-only-out", "read-only directory"), check=_still_empty),
]


DOOR_CASES = [
    # Configs that are not regular files: refused before a byte is read.
    DoorCase("config-dev-zero", "config-not-regular", _config("/dev/zero"),
             ("/dev/zero", "character device")),
    DoorCase("config-link-to-urandom", "config-not-regular", _config("urandom.yaml"),
             ("urandom.yaml", "character device")),
    DoorCase("config-fifo", "config-not-regular", _config("fifo.yaml"), ("fifo.yaml", "FIFO")),
    # YAML: aliases, complex keys, integers past Python's limit; the line stays short.
    DoorCase("yaml-alias-tree", "yaml-limits", _config("alias.yaml"),
             ("alias.yaml", "aliases")),
    DoorCase("yaml-complex-key", "yaml-limits", _config("complex-key.yaml"),
             ("complex-key.yaml", "line 2", "plain names")),
    DoorCase("yaml-5000-digits", "integer-length", _config("bigint.yaml"),
             ("bigint.yaml", "5,000 digits")),
    DoorCase("set-5000-digits", "integer-length", lambda w, d, t: [
        "train", "--print-config", "--set", "model.n_layer=" + "9" * 5000],
        ("model.n_layer", "5,000 digits")),
    DoorCase("jsonl-5000-digits", "integer-length", _train(**{
        "data.corpus": "@bigint.jsonl", "data.cache_dir": "%good"}),
        ("bigint.jsonl: line 1", "5,000 digits")),
    # Run files nested 100,000 deep.
    DoorCase("runs-deep-metrics-line", "deep-json", lambda w, d, t: [
        "runs", str(d.runs["deep-metrics"]), "--json"], ok=True, quick=True,
        target="deep-metrics",
        check=lambda r, w, d, t: json.loads(r.stdout)["runs"][0]["skipped_lines"] == 1 or
        pytest.fail(r.stdout)),
    DoorCase("curves-deep-metrics-line", "deep-json", lambda w, d, t: [
        "curves", str(d.runs["deep-metrics"]), "--out", str(t / "c.png")], ok=True,
        target="deep-metrics"),
    DoorCase("sample-deep-manifest", "deep-json", lambda w, d, t: [
        "sample", "--run", str(d.runs["deep-manifest"]), "-n", "2"],
        ("manifest.json", "corrupted"), target="deep-manifest",
        check=_runs_status("deep-manifest", "damaged")),
    # tokenizer.encoding files with hostile ranks: refused before tiktoken sees them.
    DoorCase("tiktoken-rank-billion", "tiktoken-ranks", _train(**{
        "tokenizer.encoding": "@rank-billion.tiktoken"}),
        ("rank-billion.tiktoken", "1,000,000,000", "contiguous")),
    DoorCase("tiktoken-rank-trillion", "tiktoken-ranks", _train(**{
        "tokenizer.encoding": "@rank-trillion.tiktoken"}),
        ("rank-trillion.tiktoken", "line 257")),
    DoorCase("tiktoken-rank-negative", "tiktoken-ranks", _train(**{
        "tokenizer.encoding": "@rank-negative.tiktoken"}),
        ("rank-negative.tiktoken", "-5")),
    DoorCase("tiktoken-rank-duplicate", "tiktoken-ranks", _train(**{
        "tokenizer.encoding": "@rank-duplicate.tiktoken"}),
        ("rank-duplicate.tiktoken", "share the id 7")),
    DoorCase("tiktoken-base64-invalid", "tiktoken-ranks", _train(**{
        "tokenizer.encoding": "@base64-invalid.tiktoken"}),
        ("base64-invalid.tiktoken", "line 257")),
    # Compressed and columnar corpora.
    DoorCase("gz-line-past-the-cap", "compressed-corpus", _train(**{
        "data.corpus": "@long-line.jsonl.gz", "tokenizer.vocab_size": 260}),
        ("long-line.jsonl.gz: line 1", "longer than 64 MiB")),
    DoorCase("parquet-two-text-columns", "compressed-corpus", _train(**{
        "data.corpus": "@two-text.parquet", "tokenizer.vocab_size": 260}),
        ("two-text.parquet", '2 columns are named "text"')),
    # Token caches damaged in place: one line, no run directory.
    DoorCase("cache-ids-ff", "token-cache", _train(**{"data.cache_dir": "%ids-ff"}),
             ("token cache", "past the tokenizer's 257", "delete")),
    DoorCase("cache-bytes-per-token-x", "token-cache", _train(**{"data.cache_dir": "%bpt-x"}),
             ("token cache", "bytes_per_token x")),
    DoorCase("cache-bytes-per-token-zero", "token-cache",
             _train(**{"data.cache_dir": "%bpt-zero"}), ("token cache", "bytes_per_token 0")),
    DoorCase("eval-batches-trillion", "huge-size", _train(**{
        "train.eval_batches": 10**12}), ("train.eval_batches", "lower"), quick=True),
    # Outputs that are not regular files are never replaced.
    DoorCase("curves-out-fifo", "never-replace", lambda w, d, t: [
        "curves", str(w.runs["with-metrics"]), "--out", str(d.files["fifo-out"])],
        ("--out", "out.png", "a FIFO, not a regular file"), check=_still_fifo),
    DoorCase("bench-json-fifo", "never-replace", lambda w, d, t: [
        "bench", "--quick", "--suite", "attention", "--seq-lens", "8", "--json",
        str(d.files["fifo-out"])], ("--json", "out.png", "a FIFO"), check=_still_fifo),
    DoorCase("curves-out-link-to-dev-null", "never-replace", lambda w, d, t: [
        "curves", str(w.runs["with-metrics"]), "--out", str(d.files["null-link"])],
        ("null.png", "character device"), check=_still_char_device("/dev/null")),
    DoorCase("bench-json-dev-null", "never-replace", lambda w, d, t: [
        "bench", "--quick", "--json", "/dev/null"], ("--json /dev/null", "character device"),
        check=_still_char_device("/dev/null")),
    # stdout full (> /dev/full) or closed (>&-): one line on stderr, exit 2.
    # (the quick one: closed, refused before torch loads; a full stdout: help-stdout-full)
    *[DoorCase(f"{name}-stdout-{how}", "stdout", args,
               ("stdout",), quick=(name, how) == ("print-config", "closed"), stdout=how)
      for how in ("full", "closed") for name, args in (
          ("print-config", lambda w, d, t: ["train", "--print-config"]),
          ("sample", lambda w, d, t: ["sample", "--run", str(w.good), "-n", "2"]),
          ("inspect-heads", lambda w, d, t: ["inspect-heads", "--run", str(w.good),
                                             "--json"]),
          ("runs", lambda w, d, t: ["runs", str(w.runs["with-metrics"])]),
          ("export", lambda w, d, t: ["export", "--run", str(w.good), "--out",
                                      str(t / "exported")]))],
    # A resume that fails before its first commit changes nothing (guarantee 3).
    DoorCase("resume-tensorboard-a-file", "failed-resume", _resume("tb-file"),
             ("tensorboard", "not a directory"), quick=True, target="tb-file",
             check=_runs_status("tb-file", "stopped")),
    DoorCase("resume-tensorboard-not-events", "failed-resume", _resume("tb-not-events"),
             ("events.out.tfevents", "not a TensorBoard event file"), target="tb-not-events"),
    DoorCase("resume-tensorboard-read-only", "failed-resume", _resume("tb-read-only"),
             ("tensorboard", "permission denied"), target="tb-read-only", unprivileged=True),
    DoorCase("resume-metrics-a-directory", "failed-resume", _resume("metrics-dir"),
             ("metrics.jsonl", "a directory"), target="metrics-dir"),
    # The minor ones.
    DoorCase("empty-prompt-file-like-empty-prompt", "minor", lambda w, d, t: [
        "sample", "--run", str(w.good), "-n", "2", "--seed", "0", "--json", "--prompt-file",
        str(d.files["empty-prompt.txt"])], ok=True, quick=True,
        check=lambda r, w, d, t: json.loads(r.stdout)["prompt_tokens"] == 1 or
        pytest.fail(r.stdout)),
    DoorCase("resume-latest-a-regular-file", "minor", lambda w, d, t: [
        "train", "--out", str(d.runs["latest-file"]), "--resume"],
        ("latest is a regular file", "ln -s"), target="latest-file",
        check=_runs_status("latest-file", "damaged")),
    DoorCase("inspect-seed-negative", "minor", lambda w, d, t: [
        "inspect-heads", "--run", str(w.good), "--seed", "-1"], ("--seed", "2**64")),
    DoorCase("inspect-seed-huge", "minor", lambda w, d, t: [
        "inspect-heads", "--run", str(w.good), "--seed", str(10**23)], ("--seed", "2**64")),
    DoorCase("num-samples-huge", "minor", lambda w, d, t: [
        "sample", "--run", str(w.good), "--num-samples", str(10**12)],
        ("--num-samples", "10,000")),
    DoorCase("corpus-named-like-a-glob", "minor", _train(**{"data.corpus": "@weird"}), ok=True,
             check=lambda r, w, d, t: (t / "new-run" / "checkpoints").is_dir() or
             pytest.fail(r.stderr)),
    DoorCase("corpus-dir-unreadable-subdir", "minor", _train(**{"data.corpus": "@corpus-dir"}),
             ("corpus-dir/locked", "permission denied"), unprivileged=True),
    DoorCase("working-directory-deleted", "minor", lambda w, d, t: ["runs"],
             ("working directory no longer exists",)),
    DoorCase("split-too-short-not-cached", "minor", _train(**{"model.block_size": 2000}),
             ("model.block_size=2000",), check=_no_cache_entry),
    *ISSUE_39_CASES,
]


def _door_run(case: DoorCase, args: list[str], cwd: Path, prefix: list[str]
              ) -> subprocess.CompletedProcess:
    """run_minigpt with stdout to /dev/full, closed, a pipe nobody reads, or captured; stderr
    to /dev/full or captured; a deleted working directory for the case that needs one."""
    assert MINIGPT is not None, "the `minigpt` console script is not on PATH: pip install -e ."
    env = {**os.environ, "MINIGPT_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    gone = cwd / "gone"

    def child() -> None:
        _capped()
        if case.stdout == "closed":
            os.close(1)
        if case.id == "working-directory-deleted":
            os.rmdir(gone)

    if case.id == "working-directory-deleted":
        gone.mkdir()
    with contextlib.ExitStack() as stack:
        streams = {}
        for name, how in (("stdout", case.stdout), ("stderr", case.stderr)):
            if how == "full":
                streams[name] = stack.enter_context(open("/dev/full", "w"))
            elif how == "reader-left":  # the read end closed before the command starts
                read, streams[name] = os.pipe()
                os.close(read)
                stack.callback(os.close, streams[name])
            else:
                streams[name] = subprocess.PIPE
        r = subprocess.run([*prefix, MINIGPT, *args], check=False, env=env,
                           cwd=gone if gone.exists() else cwd, stdin=subprocess.DEVNULL,
                           **streams, text=True, timeout=CASE_TIMEOUT_S, preexec_fn=child)
    r.stdout, r.stderr = r.stdout or "", r.stderr or ""
    return r


@pytest.mark.parametrize("case, how", where_run(DOOR_CASES))
def test_one_door_for_files(case: DoorCase, how: str, door: Door, world: World,
                            tmp_path: Path):
    prefix: list[str] = []
    if case.unprivileged:
        if door.unprivileged is None:
            pytest.skip("running as root without a way to drop CAP_DAC_OVERRIDE (setpriv)")
        prefix = door.unprivileged
    if case.cause == "failed-resume":
        pytest.importorskip("tensorboard")
    target = door.runs[case.target] if case.target else None
    before = tree_hash(world.good), tree_hash(target) if target else None
    args = case.args(world, door, tmp_path)
    r = _door_run(case, args, tmp_path, prefix) if how == "process" else in_process(args)
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-2000:]
    if case.ok:
        assert r.returncode == 0, r.stderr[-2000:]
    elif case.stderr == "full":  # the error line could not be written; the exit code says it
        assert r.returncode == 2, f"exit {r.returncode}"
    else:  # progress lines (data:, sampling from ...) may come first; one error line, last
        line = error_line(r, after_progress=True)
        for needle in case.needles:
            assert needle in line, f"{needle!r} not in {line!r}"
        assert len(line) < 600, line
        assert not (tmp_path / "new-run").exists(), "a failed command left a run directory"
    assert (tree_hash(world.good), tree_hash(target) if target else None) == before
    if case.check is not None:
        case.check(r, world, door, tmp_path)


# Causes whose rule a quick in-process test checks: their process cases are all slow.
DOOR_IN_PROCESS = {
    "config-not-regular":
        "test_security.py::test_the_reader_refuses_what_is_not_a_regular_file_with_one_line",
    "yaml-limits": "test_security.py::test_json_and_yaml_limits_are_one_line_errors",
    "integer-length": "test_security.py::test_json_and_yaml_limits_are_one_line_errors",
    "tiktoken-ranks": "test_tokenizer.py::test_hostile_rank_files_are_one_line_naming_the_file",
    "compressed-corpus":
        "test_data.py::test_gzip_records_are_bounded_per_line_and_report_compressed_progress",
    "token-cache": "test_data.py::test_a_token_cache_damaged_in_place_is_one_line",
    "never-replace": "test_security.py::test_writes_never_replace_a_fifo_or_a_device",
}


def test_door_table_covers_every_cause():
    causes = {c.cause for c in DOOR_CASES}
    assert causes == {"config-not-regular", "yaml-limits", "integer-length", "deep-json",
                      "tiktoken-ranks", "compressed-corpus", "token-cache", "huge-size",
                      "never-replace", "stdout", "failed-resume", "minor",
                      "tensorboard-not-events", "unreadable-dir", "tiktoken-bytes",
                      "help-stdout-full"}
    # One process case of each cause in the quick tier, unless a quick in-process test checks it.
    assert {c.cause for c in DOOR_CASES if c.quick} == causes - set(DOOR_IN_PROCESS)
    assert all(quick_test_exists(ref) for ref in DOOR_IN_PROCESS.values())
    assert len({c.id for c in DOOR_CASES}) == len(DOOR_CASES)
