"""Security: no file can run code, a crafted weights header cannot make minigpt allocate, token
text cannot inject markup into the HTML viewer, config paths are resolved and reported, and
nothing is written outside the run and cache directories.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import re
import resource
import shutil
import struct
import subprocess
import sys
import textwrap
import zipfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from cli_world import weights_of
from conftest import AS_TRAINED, TINY_MODEL, error_line, make_run
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.core.gpt import GPT
from minigpt.files import _StrictLoader
from minigpt.paths import PACKAGE_DIR
from minigpt.run.checkpoint import Checkpoint
from minigpt.run.load import load_model_weights
from minigpt.run.safetensors_io import read_header

# --------------------------------------------------------------------------------------------
# 1. A static scan of the package: no call that deserialises code.

FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal",
                     "shelve", "copyreg", "runpy"}
# The one file minigpt runs as code, on purpose: the Python program a user hands `minigpt compile
# --program-file` (its help and docs/security.md say so), run as `python FILE` would.
RUNS_A_USERS_PROGRAM = {"programs.py import runpy", "programs.py runpy.run_path"}


def forbidden_calls(source: str, filename: str = "<src>") -> list[str]:
    """Every import of a code-deserialising module, eval/exec/compile call, torch.load,
    yaml.load without the strict SafeLoader subclass, yaml.unsafe_load/full_load, and
    np.load(allow_pickle=True) in `source` (comments and docstrings are ignored)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names
                      if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where} from {node.module} import")
            if node.module in ("torch", "yaml", "numpy") and any(
                    a.name in ("load", "unsafe_load", "full_load") for a in node.names):
                found.append(f"{where} from {node.module} import load")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in ("eval", "exec", "compile", "__import__"):
                found.append(f"{where} {fn.id}()")
            if isinstance(fn, ast.Attribute):
                base = fn.value.id if isinstance(fn.value, ast.Name) else ""
                kw = {k.arg: k.value for k in node.keywords}
                if base == "torch" and fn.attr == "load":
                    found.append(f"{where} torch.load")
                if base in FORBIDDEN_MODULES:
                    found.append(f"{where} {base}.{fn.attr}")
                if base == "yaml" and fn.attr in ("unsafe_load", "full_load", "unsafe_load_all",
                                                  "full_load_all"):
                    found.append(f"{where} yaml.{fn.attr}")
                if base == "yaml" and fn.attr in ("load", "load_all"):
                    loader = kw.get("Loader", node.args[1] if len(node.args) > 1 else None)
                    if not (isinstance(loader, ast.Name) and loader.id == "_StrictLoader"):
                        found.append(f"{where} yaml.{fn.attr} without _StrictLoader")
                if base in ("np", "numpy") and fn.attr == "load":
                    ap = kw.get("allow_pickle")
                    if not (isinstance(ap, ast.Constant) and ap.value is False):
                        found.append(f"{where} np.load without allow_pickle=False")
    return found


def test_package_never_deserialises_code():
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) > 10  # the whole package is scanned
    found = [hit for p in files for hit in forbidden_calls(p.read_text(), p.name)]
    assert {re.sub(r":\d+ ", " ", hit) for hit in found} == RUNS_A_USERS_PROGRAM, found
    # The one yaml.load in the package uses a SafeLoader subclass that adds no constructors
    # beyond the safe ones (so no python/object tags).
    assert issubclass(_StrictLoader, yaml.SafeLoader)
    assert not any("python" in tag for tag in _StrictLoader.yaml_constructors if tag)


def test_the_scanner_catches_what_it_looks_for():
    bad = textwrap.dedent("""
        import pickle
        from marshal import loads
        import torch, yaml, numpy as np
        x = torch.load("f.pt")
        y = yaml.load(open("c"), Loader=yaml.Loader)
        z = yaml.unsafe_load("a")
        w = np.load("a.npy")
        eval("1")
        exec("pass")
        model.eval()      # a method call, fine
        '''pickle.loads in a docstring is fine'''
    """)
    hits = forbidden_calls(bad)
    assert len(hits) == 8, hits
    assert forbidden_calls("yaml.load(t, Loader=_StrictLoader)\nnp.load(p, allow_pickle=False)"
                           ) == []


# 1b. One door for files (issue 32): outside minigpt/files.py nothing opens, reads or parses a
# file by itself. Each exception is listed with why it is not a read of a file from elsewhere
# (or is one the door has already checked); a new one fails the test until it is listed.

FILE_CALLS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "json.load",
              "json.loads", "yaml.load", "yaml.safe_load", "yaml.load_all",
              "yaml.safe_load_all", "yaml.full_load", "np.load", "np.fromfile", "np.memmap",
              "gzip.open", "os.open", "safe_open", "ParquetFile", "load_tiktoken_bpe",
              "torch.load", "read_parquet", "fdopen"}

DOOR_EXCEPTIONS = {
    ("data/records.py", "json.loads"): "one JSON Lines record, already cut to MAX_RECORD_BYTES, "
                                  "parsed with files.json_int and RecursionError caught (its "
                                  "error names the column)",
    ("data/records.py", "ParquetFile"): "pyarrow opens the path after files.open_file checked it",
    ("hf/weights.py", "safe_open"): "memory-maps a shard that hub.model_file let through and "
                                    "whose header read_header checked",
    ("data/cache.py", "np.memmap"): "maps the token cache after open_regular checked it and "
                                    "its size against the metadata",
    ("train/outputs.py", "open"): "appends to metrics.jsonl, which this session rewrote or "
                                  "created (atomic_write_bytes / _text) just before",
    ("train/tensorboard.py", "open"): "creates a new event file exclusively ('xb'): never "
                                      "replaces or reads anything",
    ("run/lock.py", "open"): "the run lock, opened after files.check_replaceable",
    ("run/safetensors_io.py", "json.loads"): "the header of bytes safetensors just serialised",
    ("run/checkpoint.py", "read_bytes"): "the files this save itself just wrote, to hash them",
    ("cli/main.py", "os.open"): "/dev/null onto a failed stdout or stderr",
    ("bench/timing.py", "open"): "the kernel's /proc/self/status, clear_refs and cpuinfo",
}


def file_calls(source: str) -> set[str]:
    """The FILE_CALLS names called in `source` ('open', 'json.loads', 'read_bytes', ...)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name):  # a bare read_text() is minigpt.files' own
            name = fn.id if fn.id in ("open", "safe_open", "load_tiktoken_bpe") else ""
        elif isinstance(fn, ast.Attribute):
            base = fn.value.id if isinstance(fn.value, ast.Name) else ""
            name = f"{base}.{fn.attr}" if f"{base}.{fn.attr}" in FILE_CALLS else fn.attr
        else:
            continue
        if name in FILE_CALLS:
            found.add(name)
    return found


def test_every_file_goes_through_the_door():
    """Outside files.py, only the listed calls touch a file directly; every listed exception is
    still there (an entry that no longer applies is removed)."""
    seen = set()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR).as_posix()
        if rel == "files.py":
            continue
        for call in file_calls(path.read_text()):
            assert (rel, call) in DOOR_EXCEPTIONS, (
                f"minigpt/{rel} calls {call}() itself: read through minigpt.files (read_file, "
                "load_json, load_yaml, open_file) or list why not in "
                "DOOR_EXCEPTIONS")
            seen.add((rel, call))
    assert seen == set(DOOR_EXCEPTIONS)


def test_the_door_scanner_catches_what_it_looks_for():
    bad = textwrap.dedent("""
        import json, yaml, gzip, numpy as np
        from pathlib import Path
        a = open("x")
        b = Path("x").read_text()
        c = json.load(fh)
        d = yaml.safe_load(t)
        e = gzip.open("x.gz")
        f = np.memmap("x")
        g = json.dumps({})   # writing a string, fine
        h = "open('x') in a string is fine"
    """)
    assert file_calls(bad) == {"open", "read_text", "json.load", "yaml.safe_load", "gzip.open",
                               "np.memmap"}


# --------------------------------------------------------------------------------------------
# 2. A pickle (or torch zip) in place of the weights is never unpickled, by any command.


class _Payload:
    """Unpickling this creates `marker`: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("sec") / "good", **AS_TRAINED)


@pytest.mark.parametrize("container", ["pickle", "zip"])
def test_malicious_weights_never_run(good_run, tmp_path, container, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"wte.weight": _Payload(marker)}, protocol=2)
    pickle.loads(payload)  # the payload really works ...
    assert marker.exists()
    marker.unlink()
    run = tmp_path / "run"
    shutil.copytree(good_run, run, symlinks=True)
    w = weights_of(run)
    if container == "pickle":
        w.write_bytes(payload)
    else:  # the layout of torch.save's zip
        with zipfile.ZipFile(w, "w") as z:
            z.writestr("archive/data.pkl", payload)
    for args in (["sample", "--run", str(run), "-n", "1"],
                 ["inspect-heads", "--run", str(run)],
                 ["train", "--out", str(run), "--resume"]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and container in r.stderr, (args, r.stderr)
        assert not marker.exists(), f"{args[0]} ran code from the weights file"


def test_a_safetensors_header_that_starts_like_a_pickle_still_loads(tmp_path):
    """A header of 1,408 bytes has the length bytes 80 05 00 ...: a pickle's first two bytes
    (protocol 5). The JSON header's '{' at byte 8 tells the two apart (found when a model
    setting, `model.d_mlp`, made a real checkpoint's header that long)."""
    import torch
    from safetensors.torch import save_file

    from minigpt.errors import MinigptError

    meta = {"pad": "x" * 1300}
    for n in range(100):
        path = tmp_path / "w.safetensors"
        save_file({"w": torch.zeros(2)}, str(path), metadata={**meta, "n": "y" * n})
        if path.read_bytes()[:2] == b"\x80\x05":
            break
    else:
        pytest.fail("no header length of the form 0x05 0x80 was made")
    header, got = read_header(path, "weights")
    assert set(header) == {"w"} and got["n"] == "y" * n
    path.write_bytes(pickle.dumps({"w": [0.0, 0.0]}, protocol=5))
    with pytest.raises(MinigptError, match="is a Python pickle"):
        read_header(path, "weights")


# --------------------------------------------------------------------------------------------
# 3. safetensors headers are validated before any tensor is used or allocated.


def crafted(path: Path, header: dict, data_bytes: int = 0, sparse_to: int = 0) -> Path:
    blob = json.dumps(header).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob + b"\0" * data_bytes)
        if sparse_to:
            fh.truncate(8 + len(blob) + sparse_to)  # a hole: no disk, no memory
    return path


HUGE = 2**40  # elements claimed


def test_header_claiming_a_huge_tensor_is_rejected_without_reading(tmp_path):
    p = crafted(tmp_path / "m.safetensors",
                {"wte.weight": {"dtype": "F32", "shape": [2**20, 2**20],
                                "data_offsets": [0, 4 * HUGE]}}, data_bytes=64)
    with pytest.raises(Exception, match="do not fit in the file"):
        read_header(p, "weights")
    for bad, needle in [({"x": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}},
                         "unknown dtype"),
                        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
                         "malformed"),
                        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
                         "do not fit")]:
        with pytest.raises(Exception, match=needle):
            read_header(crafted(tmp_path / "b.safetensors", bad, data_bytes=4), "weights")
    # A header length field claiming 2**60 bytes of JSON.
    (tmp_path / "len.safetensors").write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(Exception, match="header length"):
        read_header(tmp_path / "len.safetensors", "weights")


def test_consistent_huge_header_is_checked_against_the_config_before_loading(tmp_path):
    """A sparse file whose header really does describe a 2**40-element tensor (4 TiB, all hole):
    the shape check against the model config rejects it before a byte of data is read."""
    from minigpt.config import from_dict

    ckdir = tmp_path / "ckpt"
    ckdir.mkdir()
    try:
        crafted(ckdir / "model.safetensors",
                {"wte.weight": {"dtype": "F32", "shape": [2**20, 2**20],
                                "data_offsets": [0, 4 * HUGE]}}, sparse_to=4 * HUGE)
    except OSError as e:  # a filesystem without sparse files this big
        pytest.skip(f"cannot create a 4 TiB sparse file here: {e}")
    cfg = from_dict({"model": {**TINY_MODEL, "vocab_size": 257}})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(Exception, match="wte.weight"):
        load_model_weights(GPT(cfg.model), Checkpoint(ckdir, 1, cfg, {}))
    grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grew_kib < 200_000  # peak memory did not balloon (4 TiB claimed)


def _memory_capped_cli(args: list[str], cwd: Path, cap_bytes: int = 6 << 30):
    """Run `minigpt ARGS` with an address-space cap: allocating what a crafted file claims
    would fail with MemoryError (a traceback, exit 1) instead of exhausting the machine."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, "
            f"({cap_bytes}, {cap_bytes})); sys.argv = ['minigpt', *{args!r}]; "
            "from minigpt.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code], check=False, cwd=cwd, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "MINIGPT_CACHE": str(cwd / "cache")})


def _sample_a_huge_crafted_run(good_run: Path, tmp_path: Path, **data):
    """`minigpt sample` (memory-capped) on a copy of `good_run` whose weights file is a
    crafted header declaring one 4 TiB tensor; `data`: crafted()'s data_bytes / sparse_to."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run, symlinks=True)
    w = weights_of(run)
    w.unlink()
    try:
        crafted(w, {"wte.weight": {"dtype": "F32", "shape": [2**20, 2**20],
                                   "data_offsets": [0, 4 * HUGE]}}, **data)
    except OSError as e:
        if not data.get("sparse_to"):
            raise
        pytest.skip(f"cannot create a 4 TiB sparse file here: {e}")
    return _memory_capped_cli(["sample", "--run", str(run), "-n", "1"], tmp_path)


@pytest.mark.slow
def test_huge_sparse_weights_in_a_run_are_rejected_by_the_cli(good_run, tmp_path):
    r = _sample_a_huge_crafted_run(good_run, tmp_path, sparse_to=4 * HUGE)
    assert "Traceback" not in r.stderr, r.stderr[-800:]
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.slow
def test_crafted_header_in_a_run_is_rejected_by_the_cli_within_a_memory_cap(good_run, tmp_path):
    r = _sample_a_huge_crafted_run(good_run, tmp_path, data_bytes=1024)
    assert r.returncode == 2, r.stderr[-800:]
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "model.safetensors" in r.stderr


# --------------------------------------------------------------------------------------------
# 4. The HTML viewer: token text is data, never markup (static check of the real file; the
# headless-browser test in test_viewer_browser.py runs it in Chromium where available).


class _Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def test_viewer_html_escapes_hostile_token_text(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = make_run(tmp_path / "run", block_size=64, **AS_TRAINED)
    hostile = "<script>alert(1)</script><img src=x onerror=alert(2)>\u2028&amp;"
    assert len(hostile.encode()) <= 64  # byte tokens: the whole text fits the context
    r = CliRunner().invoke(app, ["inspect-heads", "--run", str(run), "--text", hostile,
                                 "--format", "html", "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.stderr
    html = (tmp_path / "out" / "attention.html").read_text()
    parser = _Elements()
    parser.feed(html)
    tags = [t for t, _ in parser.tags]
    assert tags.count("script") == 2  # the JSON data block and the page's own code
    assert "img" not in tags
    assert not any(k.startswith("on") for _, attrs in parser.tags for k in attrs)
    assert "<script>alert" not in html and "<img" not in html
    assert "http://" not in html and "https://" not in html  # self-contained, no network
    # The data block parses back to the exact token text (escaped, not mangled).
    start = html.index('id="viewer-data">') + len('id="viewer-data">')
    data = json.loads(html[start:html.index("</script>", start)])
    text = "".join(data["strs"])
    assert text.startswith("<script>alert(1)</script><img src=x onerror=alert(2)>")
    assert text.endswith("&amp;")


# --------------------------------------------------------------------------------------------
# 5. Paths from configs are resolved (relative to the working directory, then the project
# root) and reported; nothing is written outside the run and cache directories.


def tiny_sets(corpus: str, cache: Path | None = None) -> list[str]:
    base = {"model.n_layer": 1, "model.n_head": 2, "model.n_embd": 32, "model.block_size": 16,
            "tokenizer.vocab_size": 256, "train.batch_size": 2, "train.max_steps": 2,
            "train.warmup_steps": 1, "train.eval_interval": 2, "train.eval_batches": 1,
            "train.sample_tokens": 2, "data.corpus": corpus}
    if cache is not None:
        base["data.cache_dir"] = str(cache)
    return [x for k, v in base.items() for x in ("--set", f"{k}={v}")]


def test_relative_config_paths_are_resolved_and_named_in_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["train", "--out", "run", *tiny_sets("sub/missing.txt")])
    assert r.exit_code == 2
    assert str(tmp_path / "sub" / "missing.txt") in r.stderr  # absolute, resolved from cwd
    # The bundled corpus is found from any working directory (project root fallback).
    r = CliRunner().invoke(app, ["train", "--print-config"])
    assert "data/tinyshakespeare.txt" in r.stdout


def test_train_reports_the_resolved_corpus_and_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("to be or not to be, that is the question\n" * 40)
    r = CliRunner().invoke(app, ["train", "--out", "run", *tiny_sets("c.txt", tmp_path / "k")])
    assert r.exit_code == 0, r.stderr
    assert str(tmp_path / "c.txt") in r.stderr and str(tmp_path / "k") in r.stderr


def snapshot(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _train_sample_inspect(tmp_path: Path, corpus: Path) -> list:
    run = tmp_path / "work" / "run"
    return [
        CliRunner().invoke(app, ["train", "--out", str(run), *tiny_sets(str(corpus))]),
        CliRunner().invoke(app, ["sample", "--run", str(run), "-n", "3", "--seed", "0"]),
        CliRunner().invoke(app, ["inspect-heads", "--run", str(run), "--format",
                                 "json,html,safetensors"]),
    ]


def test_nothing_is_written_outside_the_run_and_cache(tmp_path, monkeypatch):
    """A tiny train + sample + inspect-heads with cwd an empty directory, MINIGPT_CACHE, HOME
    and TMPDIR all inside tmp: new files appear only under the run and the cache."""
    corpus = tmp_path / "corpus" / "c.txt"
    corpus.parent.mkdir()
    corpus.write_text("to be or not to be, that is the question\n" * 40)
    work = tmp_path / "work"
    for d in ("work", "home", "tmp"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    before = snapshot(tmp_path)
    for r in _train_sample_inspect(tmp_path, corpus):
        assert r.exit_code == 0, r.stderr
    new = snapshot(tmp_path) - before
    outside = sorted(p for p in new if not p.startswith(("work/run", "cache")))
    assert outside == []
    assert any(p.startswith("cache/tokens/") for p in new)  # the cache was really used
    assert {"work/run/config.yaml", "work/run/heads/attention.html"} <= new


@pytest.mark.slow
def test_nothing_is_written_outside_in_a_fresh_process(tmp_path):
    """The same in real processes (fresh imports: matplotlib, torch and tiktoken caches would
    show up under HOME or TMPDIR here), including the PNG heatmaps."""
    corpus = tmp_path / "corpus" / "c.txt"
    corpus.parent.mkdir()
    corpus.write_text("to be or not to be, that is the question\n" * 40)
    for d in ("work", "home", "tmp"):
        (tmp_path / d).mkdir()
    env = {**os.environ, "MINIGPT_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path /
                                                                               "home"),
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("MPLCONFIGDIR", None)
    env.pop("XDG_CACHE_HOME", None)
    env.pop("XDG_CONFIG_HOME", None)
    before = snapshot(tmp_path)
    cmds = [["train", "--out", "run", *tiny_sets(str(corpus))],
            ["sample", "--run", "run", "-n", "3", "--seed", "0"],
            ["inspect-heads", "--run", "run", "--format", "png,html,json"]]
    for cmd in cmds:
        r = subprocess.run([sys.executable, "-m", "minigpt", *cmd], check=False,
                           cwd=tmp_path / "work",
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-1000:]
    new = snapshot(tmp_path) - before
    # Third-party libraries keep their own caches in the standard per-user places: matplotlib's
    # font list (~/.cache/matplotlib, an empty ~/.config/matplotlib) and torch's inductor
    # scratch dir ($TMPDIR/torchinductor_<user>). minigpt itself writes nothing else.
    third_party = ("home/.cache", "home/.config", "tmp/torchinductor_")
    outside = sorted(p for p in new if not p.startswith(("work/run", "cache", *third_party)))
    assert outside == []
    assert not any(p.startswith(third_party) and "minigpt" in p for p in new)


# --------------------------------------------------------------------------------------------
# 6. Files from elsewhere (issue 26; docs/security.md): what `--model` may read through a
# symlink, the readers that never block or balloon, run names that stay inside run.out_dir,
# and the cache when HOME is empty. The hostile-input table is in tests/test_hostile_files.py.


def hf_cache_layout(model: Path, hub: Path, repo: str) -> Path:
    """`model` as huggingface_hub lays a download out: every file a blob under
    models--ORG--NAME/blobs/<sha256>, the snapshot's files relative links to them."""
    import hashlib

    folder = hub / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in model.iterdir():
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, folder / "blobs" / sha)
        os.symlink(f"../../blobs/{sha}", snap / f.name)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    from minigpt.hf import export_hf
    from minigpt.run import load_run

    root = tmp_path_factory.mktemp("exported")
    run = make_run(root / "run", pos_encoding="learned", bias=True, **AS_TRAINED)
    return export_hf(load_run(run, "cpu"), root / "model").out


def test_a_hugging_face_cache_snapshot_loads_through_its_blob_links_in_process(exported,
                                                                             tmp_path):
    """The cache layout's links into the repo's blobs/ are followed (the same weights as the
    directory itself); a link into ANOTHER repo's cache folder is refused, naming the repo
    folder (the process and hf:REPO: the slow test below)."""
    import torch

    from minigpt.errors import MinigptError
    from minigpt.hf import load_model

    snap = hf_cache_layout(exported, tmp_path / "hf-home" / "hub", "someone/tiny")
    assert (snap / "config.json").is_symlink()
    local, cached = load_model(exported), load_model(snap)
    assert cached.model.state_dict().keys() == local.model.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(cached.model.state_dict().values(),
                                                 local.model.state_dict().values()))
    other = hf_cache_layout(exported, tmp_path / "hf-home" / "hub", "someone/other")
    (snap / "tokenizer.json").unlink()
    os.symlink(os.path.relpath(other / "tokenizer.json", snap), snap / "tokenizer.json")
    with pytest.raises(MinigptError, match="outside the model directory") as e:
        load_model(snap)
    assert str(tmp_path / "hf-home" / "hub" / "models--someone--tiny") in str(e.value)


@pytest.mark.slow
def test_a_hugging_face_cache_snapshot_loads_through_its_blob_links(exported, tmp_path):
    """The real cache layout (links out of the snapshot into the repo's blobs/) is accepted,
    through the installed command, both as a directory and as hf:REPO offline; a link from a
    snapshot into ANOTHER repo's cache folder is not."""
    from cli_world import run_minigpt

    snap = hf_cache_layout(exported, tmp_path / "hf-home" / "hub", "someone/tiny")
    assert (snap / "config.json").is_symlink()
    args = ["sample", "-p", "ab", "-n", "4", "-t", "0", "--json"]
    local = run_minigpt([*args, "--model", str(exported)], tmp_path)
    cached = run_minigpt([*args, "--model", str(snap)], tmp_path)
    assert local.returncode == 0 and cached.returncode == 0, (local.stderr, cached.stderr)
    assert json.loads(cached.stdout)["text"] == json.loads(local.stdout)["text"]
    if __import__("importlib").util.find_spec("huggingface_hub") is not None:
        hub = run_minigpt([*args, "--model", "hf:someone/tiny"], tmp_path,
                          HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
        assert hub.returncode == 0, hub.stderr
        assert json.loads(hub.stdout)["text"] == json.loads(local.stdout)["text"]
    other = hf_cache_layout(exported, tmp_path / "hf-home" / "hub", "someone/other")
    (snap / "tokenizer.json").unlink()
    os.symlink(os.path.relpath(other / "tokenizer.json", snap), snap / "tokenizer.json")
    line = error_line(run_minigpt([*args, "--model", str(snap)], tmp_path))
    assert "tokenizer.json" in line and "outside the model directory" in line
    assert str(tmp_path / "hf-home" / "hub" / "models--someone--tiny") in line


def test_links_inside_a_model_directory_are_followed_and_links_out_refused(exported, tmp_path):
    from minigpt.errors import MinigptError
    from minigpt.hf import load_model

    model = tmp_path / "model"
    shutil.copytree(exported, model)
    (model / "weights").mkdir()
    os.replace(model / "model.safetensors", model / "weights" / "real.safetensors")
    os.symlink("weights/real.safetensors", model / "model.safetensors")  # inside: fine
    via_link = tmp_path / "link-to-model"
    os.symlink(model, via_link)  # the directory itself through a link: its target is the root
    assert load_model(via_link).model.num_params() == load_model(exported).model.num_params()
    secret = tmp_path / "secret.txt"
    secret.write_text("password\n")
    for target in (secret, Path("/etc/hostname"), model / ".." / "secret.txt"):
        (model / "config.json").unlink()
        os.symlink(target, model / "config.json")
        with pytest.raises(MinigptError, match="outside the model directory"):
            load_model(model)
    (model / "config.json").unlink()
    os.symlink("config.json", model / "config.json")  # a loop
    with pytest.raises(MinigptError, match="config.json: cannot read it"):
        load_model(model)


def test_permission_denied_is_reported_with_the_path_in_process(exported, tmp_path,
                                                                monkeypatch):
    """What an unreadable directory or config.json says, where the process cannot be made to
    lack the permission (root without setpriv): the OS error is simulated. The real thing runs
    in tests/test_hostile_files.py (model-dir-unreadable, config-unreadable)."""
    import errno

    from minigpt.errors import MinigptError
    from minigpt.hf import load_model

    real_listdir, real_open = os.listdir, os.open

    def listdir(path="."):
        if Path(path) == exported:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(MinigptError, match=f"^model {exported}: .*permission denied"):
        load_model(exported)
    monkeypatch.setattr(os, "listdir", real_listdir)

    def deny_config(path, flags, *a, **k):
        if str(path).endswith("config.json"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", deny_config)
    with pytest.raises(MinigptError, match=r"config\.json: cannot read it \(permission denied\)"):
        load_model(exported)


def test_readers_never_block_on_a_fifo_nor_read_a_device(tmp_path):
    from minigpt.files import NotRegularFile, read_regular

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes: an ordinary open() would wait forever
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device"),
                       (tmp_path, "a directory")):
        with pytest.raises(NotRegularFile, match=kind):
            read_regular(path, 1 << 20)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2000)
    with pytest.raises(OSError, match="larger than 1000 bytes"):
        read_regular(big, 1000)
    assert read_regular(big, 2000) == b"x" * 2000


def test_json_nested_too_deeply_is_an_error_not_a_crash():
    from minigpt.files import parse_json

    assert parse_json(b'{"a": [1, {"b": "[[[[[[["}]}') == {"a": [1, {"b": "[[[[[[["}]}
    assert parse_json(b"[" * 200 + b"]" * 200) is not None
    for bad, why in ((b"[" * 1_000_000 + b"]" * 1_000_000, "nested too deeply"),
                     (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
                     (b'{"a": 1', "not valid JSON"), (b"\xff{}", "not UTF-8"),
                     (b"1" * 5000, "not valid JSON")):
        with pytest.raises(ValueError, match=why):
            parse_json(bad)


@pytest.mark.parametrize("name, ok", [
    ("my-run", True), ("a=b", True), ("run 2 (long context)", True), ("résumé", True),
    ("..", False), (".", False), ("../elsewhere", False), ("/tmp/x", False), ("a/b", False),
    ("a\\b", False), ("red\x1b[31m", False), ("line\nbreak", False), ("x" * 256, False),
])
def test_run_name_is_one_directory_name(name, ok):
    from minigpt.config import ConfigError, from_dict

    if ok:
        assert from_dict({"run": {"name": name}}).run.name == name
    else:
        with pytest.raises(ConfigError, match="run.name"):
            from_dict({"run": {"name": name}})


def test_a_config_file_name_that_is_no_run_name_says_to_set_one(tmp_path):
    from minigpt.config import ConfigError, load_config

    (tmp_path / "..yaml").write_text("train:\n  max_steps: 3\n")  # its stem is "."
    with pytest.raises(ConfigError, match=r"\.\.yaml: run\.name: '\.' .*set run\.name"):
        load_config(str(tmp_path / "..yaml"))
    (tmp_path / "ok.yaml").write_text("run:\n  name: fine\n")
    assert load_config(str(tmp_path / "ok.yaml")).run.name == "fine"


def test_the_cache_without_a_home(monkeypatch, tmp_path):
    from minigpt.errors import MinigptError
    from minigpt.paths import cache_root

    monkeypatch.delenv("MINIGPT_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root("") == tmp_path / ".cache" / "minigpt"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert cache_root("") == tmp_path / ".cache" / "minigpt"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("") == tmp_path / "xdg" / "minigpt"
    monkeypatch.delenv("XDG_CACHE_HOME")
    for home in ("", "relative"):
        monkeypatch.setenv("HOME", home)
        with pytest.raises(MinigptError, match="set MINIGPT_CACHE"):
            cache_root("")
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "mine"))
    assert cache_root("") == tmp_path / "mine"
    assert cache_root(str(tmp_path / "cfg")) == tmp_path / "cfg"


def test_a_tokenizer_with_too_many_special_tokens_is_refused_before_tiktoken_builds_it():
    """tiktoken matches special tokens with one regex whose build grows with their count (a
    million: over a minute): more than MAX_SPECIAL_TOKENS is one line."""
    from minigpt.errors import MinigptError
    from minigpt.hf.tokenizer import MAX_SPECIAL_TOKENS, bytes_to_text, ranks_from_hf

    vocab = {bytes_to_text(bytes([b])): b for b in range(256)}
    added = {f"<|t{i}|>": 256 + i for i in range(MAX_SPECIAL_TOKENS + 1)}
    with pytest.raises(MinigptError, match="65,537 special tokens"):
        ranks_from_hf(vocab, [], added, "tokenizer.json", vocab_size=10**6)
    del added["<|t0|>"]
    ranks, specials = ranks_from_hf(vocab, [], added, "tokenizer.json", vocab_size=10**6)
    assert len(ranks) == 256 and len(specials) == MAX_SPECIAL_TOKENS


# --------------------------------------------------------------------------------------------
# 7. The file door (issue 32; minigpt/files.py): the rules every read and write goes through,
# checked in-process. The same causes through the installed command:
# tests/test_file_door.py::test_one_door_for_files.


def test_the_reader_refuses_what_is_not_a_regular_file_with_one_line(tmp_path):
    from minigpt.files import ReadError, load_json, load_yaml, read_file

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    os.symlink("/dev/urandom", tmp_path / "random.yaml")
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device"),
                       (tmp_path / "random.yaml", "a character device"),
                       (tmp_path, "a directory"), (tmp_path / "missing", "no such file")):
        for reader in (read_file, load_json, load_yaml):
            with pytest.raises(ReadError, match=kind) as e:
                reader(path)
            assert str(path) in str(e.value) and "\n" not in str(e.value)
    big = tmp_path / "big.json"
    big.write_bytes(b"[" + b"1," * 1000 + b"1]")
    with pytest.raises(ReadError, match="larger than 1000 bytes"):
        load_json(big, cap=1000)


def test_json_and_yaml_limits_are_one_line_errors():
    from minigpt.errors import ConfigError
    from minigpt.files import MAX_YAML_VALUES, parse_json, parse_yaml

    with pytest.raises(ValueError, match="5,000 digits"):
        parse_json(b'{"n": ' + b"9" * 5000 + b"}")
    assert parse_json(b'{"n": ' + b"9" * 400 + b"}")["n"] == int("9" * 400)
    laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    cases = {"\n".join(laughs): "aliases", "? [a, b]\n: 1\n": "plain names",
             "n: " + "9" * 5000: "5,000 digits", "[" * 100 + "]" * 100: "nested more than 64",
             "t: 2001-13-45\n": "invalid YAML"}
    for text, needle in cases.items():
        with pytest.raises(ConfigError, match=needle) as e:
            parse_yaml(text, "c.yaml")
        assert str(e.value).startswith("c.yaml: ") and len(str(e.value)) < 300
    # Aliases that stay small are fine: a config may reuse a value.
    ok = parse_yaml("p: &p [a, b]\nq: [*p, *p]\n")
    assert ok["q"] == [["a", "b"], ["a", "b"]]
    assert MAX_YAML_VALUES >= 10_000


def test_a_huge_value_is_never_echoed_whole():
    from minigpt.config import load_config
    from minigpt.errors import ConfigError
    from minigpt.files import shown

    assert shown("x" * 10_000, 80) == "x" * 37 + " ... " + "x" * 37
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.n_layer=[" + "1, " * 5_000 + "1]"])  # 15 kB
    assert len(str(e.value)) < 400


def test_writes_never_replace_a_fifo_or_a_device(tmp_path):
    import stat

    from minigpt.errors import WriteError
    from minigpt.files import atomic_write_bytes, not_replaceable

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    os.symlink("/dev/null", tmp_path / "null.png")
    for path, kind in ((fifo, "a FIFO"), (tmp_path / "null.png", "a character device")):
        with pytest.raises(WriteError, match=kind):
            atomic_write_bytes(path, b"data")
        assert kind in not_replaceable(path)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and (tmp_path / "null.png").is_symlink()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    regular = tmp_path / "ok.json"
    regular.write_text("old")
    assert not_replaceable(regular) is None and not_replaceable(tmp_path / "new") is None
    atomic_write_bytes(regular, b"new")
    assert regular.read_bytes() == b"new"


# --------------------------------------------------------------------------------------------
# Issue 39: unreadable run directories, abandoned temp files, stdout and stderr that fail.


def _mode_bits_bind(tmp: Path) -> bool:
    """Whether a mode-000 directory stops this process (not root, or root without
    CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH, e.g. under setpriv)."""
    probe = tmp / "probe"
    probe.mkdir(mode=0)
    try:
        os.listdir(probe)
        return False
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)
        probe.rmdir()


def _as_if_unreadable(monkeypatch, locked: Path) -> None:
    """As if `locked` were mode 000 for this process (the tests run as root, for whom no mode
    bit holds): nothing inside it can be looked up or opened, it cannot be listed or entered.
    Only the OS calls are replaced; minigpt's code runs as it would."""
    import errno

    def guard(fn, listing: bool = False):
        def call(path, *a, **k):
            if not isinstance(path, int):
                p = Path(os.path.abspath(os.fsdecode(path)))
                if (p != locked and p.is_relative_to(locked)) or (listing and p == locked):
                    raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
            return fn(path, *a, **k)
        return call

    for name in ("stat", "lstat", "open"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))
    for name in ("listdir", "scandir"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), listing=True))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if Path(p) == locked
                        else real_access(p, m, **k))


@pytest.mark.parametrize("where", ["checkpoint", "runs"])
def test_an_unreadable_run_directory_is_one_permission_denied_line(tmp_path, monkeypatch,
                                                                    where):
    """Issue 39: an unreadable `checkpoints/step-*` (or `runs/`, for the commands without
    --run) was a PermissionError traceback in sample, inspect-heads, export and train
    --resume. Now one line naming the directory. Where mode bits bind, the directory really
    is mode 000; as root they do not, and the denial is simulated at the OS calls
    (`_as_if_unreadable`). Through the installed command, under setpriv as root:
    tests/test_file_door.py (the `unreadable-dir` cases)."""
    from minigpt.errors import MinigptError
    from minigpt.run import load_run
    from minigpt.run.choice import pick_run
    from minigpt.run.resume import train_config

    run = make_run(tmp_path / "runs" / "good", **AS_TRAINED)
    locked = run / "checkpoints" / "step-000007" if where == "checkpoint" else tmp_path / "runs"
    monkeypatch.chdir(tmp_path)
    calls = [lambda: load_run(None), lambda: train_config(None, ["run.name=good"], resume=True)]
    calls += ([lambda: load_run(run), lambda: train_config(None, [], out=run, resume=True)]
              if where == "checkpoint" else [pick_run])
    if _mode_bits_bind(tmp_path):
        locked.chmod(0)
    else:  # root with CAP_DAC_OVERRIDE: simulated
        _as_if_unreadable(monkeypatch, locked)
    try:
        for call in calls:
            with pytest.raises(MinigptError) as e:
                call()
            line = str(e.value)
            assert line.startswith(f"{locked}: permission denied") and "\n" not in line, line
            assert "chmod" in line and len(line) < 600
    finally:
        monkeypatch.undo()
        locked.chmod(0o755)


def test_a_permission_error_nobody_worded_is_still_one_line(monkeypatch):
    """The one error path turns a PermissionError the library did not word (none is known)
    into the same line: exit 2, never a traceback."""
    import errno

    import minigpt.infer.inputs

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", "/srv/x/model.safetensors")

    monkeypatch.setattr(minigpt.infer.inputs, "load_run_or_model", denied)
    r = CliRunner().invoke(app, ["sample", "--run", "/srv/x"])
    assert r.exit_code == 2 and r.stderr.splitlines() == [(
        "error: /srv/x/model.safetensors: permission denied; make it readable (chmod u+rwX) "
        "or run minigpt as its owner")]


def test_what_a_killed_durable_write_leaves_is_removed_once_abandoned(tmp_path):
    """Issue 39: a kill -9 during a durable write (inspect-heads' attention.html, 7 MB) left
    its temp file forever. A later durable write into the same directory deletes every temp
    named as minigpt names them whose process is gone and that nobody wrote for an hour; a
    live process's, a fresh one, and any file of another name stay."""
    import signal
    import time

    from minigpt.files import STALE_TEMP_S, atomic_write_bytes

    code = ("import os, signal, sys\nfrom minigpt.files import atomic_file\n"
            f"with atomic_file(__import__('pathlib').Path({str(tmp_path / 'attention.html')!r}))"
            " as fh:\n    fh.write(b'x' * 1000); fh.flush()\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                       check=False)
    assert r.returncode == -signal.SIGKILL, r.stderr
    (killed,) = tmp_path.iterdir()  # what the kill left: .attention.html.PID-XXXXXXXX.tmp
    assert killed.name.startswith(".attention.html.") and killed.name.endswith(".tmp")
    old = time.time() - STALE_TEMP_S - 60
    names = {".scores.json.4194999-0badf00d.tmp": False,   # another file's, dead, old
             ".attention.html.k3j_x9az.tmp": False,        # named before temps had a pid
             ".scores.json.k3j_x9az.tmp": True,            # ... but not this write's name
             f".attention.html.{os.getppid()}-0badf00d.tmp": True,  # a live process's
             ".attention.html.mine.tmp": True, "attention.html.4194999-0badf00d.tmp": True}
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / ".hf.4194999-0badf00d.tmp").mkdir()  # a killed export's directory
    names[".hf.4194999-0badf00d.tmp"] = False
    atomic_write_bytes(tmp_path / "attention.html", b"new")
    assert killed.exists()  # written a moment ago: not yet abandoned
    names[killed.name] = False
    for name in names:
        os.utime(tmp_path / name, (old, old))
    fresh = tmp_path / ".scores.json.4194998-00000001.tmp"
    fresh.write_bytes(b"x")  # dead, but written just now
    atomic_write_bytes(tmp_path / "attention.html", b"newer")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["attention.html", fresh.name, *(n for n, kept in names.items() if kept)])


def test_stdout_failures_are_kept_and_a_reader_leaving_is_exit_0(tmp_path):
    """cli.main's streams: a write failure of stdout is a StdoutError and is remembered (a
    library that swallows it, like the parser's probe before --help, cannot lose it); a
    reader that closed the pipe is ReaderLeft (exit 0); stderr that fails loses the line."""
    from minigpt.cli.main import ReaderLeft, StdoutError, _GuardedStdout, _QuietStderr

    with open("/dev/full", "w") as full:
        out = _GuardedStdout(full)
        with pytest.raises(StdoutError, match="No space left on device"):
            out.write("x" * 10000)
            out.flush()
        assert isinstance(out.error, StdoutError)
        out.write("more")  # the descriptor now points at /dev/null
        out.flush()
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as pipe:
        out = _GuardedStdout(pipe)
        with pytest.raises(ReaderLeft) as e:
            out.write("x" * 100000)
            out.flush()
        assert e.value.code == 0 and out.error is None
    with open("/dev/full", "w") as full:
        err = _QuietStderr(full)
        assert err.write("error: lost\n") == len("error: lost\n")
        err.flush()
