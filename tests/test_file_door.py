"""One door for files (issue 32): configs, run files, token caches, tokenizer files and
compressed corpora read with bounds; outputs that never replace a device or a FIFO; stdout
that is full or closed; a resume that fails before its first commit changes nothing. Every
case runs the installed `minigpt` (time and memory capped, as tests/test_hostile_files.py).
The quick tier keeps one case per cause; the rules themselves are checked in-process in
tests/test_security.py, tests/test_data.py and tests/test_tokenizer.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_world import (
    CASE_TIMEOUT_S,
    MINIGPT,
    TINY_SETS,
    World,
    capped_memory,
    in_process,
    quick_test_exists,
    tree_hash,
    unprivileged_prefix,
    weights_of,
    where_run,
)
from conftest import error_line

pytestmark = pytest.mark.usefixtures("isolated")


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
        capped_memory()
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
