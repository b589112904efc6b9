"""The world the command-line tests of bad input run against, and how they run the CLI.

One good run, damaged copies of it, bad corpora, bad config files and Hugging Face model
directories (`build_world`: no training, random-init models saved through the real save
path; conftest's `world` fixture builds it once a session), `tree_hash` to prove a command
changed nothing, and the installed command run with its time and memory capped
(`run_minigpt`) or the app in this process (`in_process`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import AS_TRAINED, TINY_MODEL, make_run
from typer.testing import CliRunner

from minigpt.cli import app
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


def capped_memory() -> None:
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
                          preexec_fn=capped_memory)


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


def quick_test_exists(ref: str) -> bool:
    """`file::name` names a test function in tests/ that the quick tier runs."""
    file, name = ref.split("::")
    text = (Path(__file__).parent / file).read_text()
    at = text.find(f"\ndef {name}(")
    decorators = text[:at].rsplit("\n\n", 1)[-1].splitlines()
    return at >= 0 and not any(x.startswith("@pytest.mark.slow") for x in decorators)
