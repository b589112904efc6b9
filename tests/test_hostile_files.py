"""Files from elsewhere (issue 26): hostile Hugging Face model directories, special files and
permissions in runs, run names that leave runs/, an empty HOME. Every case runs the installed
`minigpt` console script in a subprocess, under a time limit and an address-space cap: a hang
or a runaway allocation fails the case instead of the machine. Each must end in one `error:`
line naming the file and exit 2. One case of each class runs in the quick tier; the rest are
`slow` (each process imports torch: ~2 s of CPU).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cli_world import (
    in_process,
    quick_test_exists,
    run_minigpt,
    tree_hash,
    unprivileged_prefix,
    where_run,
)
from conftest import error_line

from minigpt.run.lock import LOCK_NAME

pytestmark = pytest.mark.usefixtures("isolated")


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
