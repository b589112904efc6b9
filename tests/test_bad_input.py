"""Every bad input through the real CLI gets exit code 2, one `error:` line naming the
file/field/flag (and what would fix it), no traceback, and leaves every existing run
byte-for-byte unchanged.

The table below (CASES) drives one test per case through `typer.testing.CliRunner` on
`minigpt.cli.app`; a few cases are repeated in a real `python -m minigpt` subprocess to prove
the process exit code and stderr, and the record-corpus cases through the installed command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cli_world import World, tree_hash
from conftest import error_line
from typer.testing import CliRunner

from minigpt.cli import app

pytestmark = pytest.mark.usefixtures("isolated")


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
