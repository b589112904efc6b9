"""`minigpt sample` through typer's CliRunner on a tiny random-init run (no training)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, error_line, make_run
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.errors import MinigptError
from minigpt.run.checkpoint import latest_checkpoint_dir

BLOCK = TINY_MODEL["block_size"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny")


def invoke(*args: str):
    """CliRunner keeps stdout and stderr apart (click >= 8.2)."""
    return CliRunner().invoke(app, ["sample", *args], catch_exceptions=False)


# --------------------------------------------------------------------------------------------
# Output


def test_json_per_sample_parses_and_stdout_has_nothing_else(run_dir):
    r = invoke("--run", str(run_dir), "-p", "To be", "-n", "12", "--num-samples", "3",
               "--seed", "1", "--json")
    assert r.exit_code == 0, r.stderr
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [d["sample"] for d in docs] == [0, 1, 2]
    for d in docs:
        assert d["prompt"] == "To be" and isinstance(d["text"], str)
        assert 1 <= d["tokens"] <= 12 and d["tokens_per_s"] > 0
        assert d["seed"] == 1
    assert "tokens/s" in r.stderr and "step 7" in r.stderr  # timings go to stderr


def test_same_seed_same_text_and_greedy_is_deterministic(run_dir):
    a = invoke("--run", str(run_dir), "-n", "20", "--seed", "3", "--json")
    b = invoke("--run", str(run_dir), "-n", "20", "--seed", "3", "--json")
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]
    g1 = invoke("--run", str(run_dir), "-n", "20", "-t", "0", "--seed", "1", "--json")
    g2 = invoke("--run", str(run_dir), "-n", "20", "-t", "0", "--seed", "2", "--json")
    assert json.loads(g1.stdout)["text"] == json.loads(g2.stdout)["text"]


def test_stream_and_no_stream_print_the_same_text(run_dir):
    common = ("--run", str(run_dir), "-p", "abc", "-n", "25", "--seed", "4")
    streamed = invoke(*common, "--stream")
    whole = invoke(*common, "--no-stream")
    as_json = json.loads(invoke(*common, "--json").stdout)
    assert streamed.exit_code == whole.exit_code == 0
    assert streamed.stdout == whole.stdout == as_json["text"] + "\n"


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_same_tokens(run_dir):
    """--compile decodes through the compiled one-token step (it compiles: slow tier)."""
    common = ("--run", str(run_dir), "-n", "40", "-t", "0", "--json")  # 40 > block_size
    a = json.loads(invoke(*common).stdout)
    b = invoke(*common, "--compile")
    assert b.exit_code == 0 and "compiled decode step" in b.stderr
    assert json.loads(b.stdout)["tokens"] == a["tokens"]


def test_no_kv_cache_gives_the_same_tokens(run_dir):
    common = ("--run", str(run_dir), "-n", "40", "--seed", "5", "--json")  # 40 > block_size
    a = json.loads(invoke(*common).stdout)
    b = json.loads(invoke(*common, "--no-kv-cache").stdout)
    assert a["text"] == b["text"] and a["tokens"] == b["tokens"]


def test_stop_text_ends_the_sample_and_is_not_printed(run_dir):
    common = ("--run", str(run_dir), "-n", "30", "--seed", "6", "--json")
    full = json.loads(invoke(*common).stdout)["text"]
    stop = full[10:12]
    assert len(stop) == 2
    cut = json.loads(invoke(*common, "--stop", stop, "--stop", "never-there").stdout)
    assert cut["text"] == full[:full.find(stop)] and cut["finish_reason"] == "stop"


@pytest.mark.parametrize("byte, typed", [(10, r"\n\n"), (9, r"\t"), (92, "\\\\")])
def test_stop_escapes_match_newline_tab_and_backslash(tmp_path, byte, typed):
    r"""Issue #15 finding 3: `--stop "\n\n"` (a shell passes backslash + n) now means a blank
    line. A run that writes only `byte` stops at once on the escaped form and never on the
    same characters taken literally."""
    run = make_run(tmp_path / "says", says=byte, top_files=True)
    common = ("--run", str(run), "-n", "8", "--seed", "0", "--json")
    full = json.loads(invoke(*common).stdout)
    assert full["text"] == chr(byte) * 8 and full["finish_reason"] == "length"
    cut = json.loads(invoke(*common, "--stop", typed).stdout)
    assert cut["text"] == "" and cut["finish_reason"] == "stop"
    if byte != 92:  # typed with doubled backslashes: backslash + n, which it never writes
        doubled = typed.replace("\\", "\\\\")
        assert json.loads(invoke(*common, "--stop", doubled).stdout)["finish_reason"] == "length"


def test_unescape_stop_reads_left_to_right():
    from minigpt.cli.sample import unescape_stop

    assert unescape_stop(r"\n\n") == "\n\n"
    assert unescape_stop(r"a\tb") == "a\tb"
    assert unescape_stop("\\\\n") == "\\n"  # an escaped backslash, then a plain n
    assert unescape_stop(r"C:\path\x") == r"C:\path\x"  # other backslashes stay
    assert unescape_stop("end\\") == "end\\"


def test_tiny_temperature_is_greedy_through_the_cli(run_dir):
    """Issue #15 finding 2: `-t 1e-40` used to end in an IndexError (NaN probabilities and an
    id equal to the vocabulary size); `-n 1` printed id 257."""
    greedy = json.loads(invoke("--run", str(run_dir), "-n", "12", "-t", "0", "--seed", "1",
                               "--json").stdout)
    for t in ("1e-40", "1e-300"):
        r = invoke("--run", str(run_dir), "-n", "12", "-t", t, "--seed", "1", "--json")
        assert r.exit_code == 0, r.stderr
        assert json.loads(r.stdout)["text"] == greedy["text"]


def test_non_finite_logits_are_one_error_line_naming_the_step(tmp_path):
    run = make_run(tmp_path / "nan", nan="ln_f", top_files=True)
    for t in ("0", "1", "1e-40"):
        r = invoke("--run", str(run), "-n", "1", "-t", t, "--seed", "0")
        assert r.exit_code == 2 and r.stdout == "" and "Traceback" not in r.stderr
        last = r.stderr.strip().splitlines()[-1]  # after the "sampling from ..." line
        assert last.startswith("error: generation step 1: ") and "not finite" in last


def test_long_prompt_is_left_truncated_with_a_note(run_dir):
    r = invoke("--run", str(run_dir), "-p", "x" * 100 + "tail", "-n", "3", "--seed", "0")
    assert r.exit_code == 0
    assert f"using its last {BLOCK} tokens" in r.stderr


def test_num_samples_are_separated(run_dir):
    r = invoke("--run", str(run_dir), "-n", "5", "--num-samples", "2", "--no-stream")
    assert r.exit_code == 0
    assert "----- sample 2/2 -----" in r.stdout


def test_latest_run_under_runs_is_used_and_named(run_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_run(tmp_path / "runs" / "only")
    r = invoke("-n", "3", "--seed", "0")
    assert r.exit_code == 0, r.stderr
    assert "the latest run" in r.stderr and "only" in r.stderr


def test_special_token_text_is_plain_unless_allowed(run_dir):
    common = ("--run", str(run_dir), "-p", "<|endoftext|>", "-n", "1", "-t", "0", "--json")
    plain = json.loads(invoke(*common).stdout)
    special = json.loads(invoke(*common, "--allow-special").stdout)
    bare = json.loads(invoke("--run", str(run_dir), "-n", "1", "-t", "0", "--json").stdout)
    assert plain["prompt_tokens"] == len("<|endoftext|>")  # bytes tokenizer: one id per byte
    assert special["prompt_tokens"] == bare["prompt_tokens"] == 1
    assert special["text"] == bare["text"]  # no prompt = start from <|endoftext|>


# --------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit code 2


@pytest.mark.parametrize("args, needle", [
    (["-t", "-1"], "--temperature"),
    (["-t", "nan"], "--temperature"),
    (["-t", "inf"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-2"], "--top-k"),
    (["-n", "0"], "--max-new-tokens"),
    (["-n", "100000000000"], "--max-new-tokens"),
    (["--num-samples", "0"], "--num-samples"),
    (["--device", "cuda"], "--device cuda"),
    (["-p", "a", "--prompt-file", "x.txt"], "give one of them"),
    (["--compile", "--no-kv-cache"], "--compile compiles the KV-cache decode step"),
])
def test_bad_flags(run_dir, args, needle):
    if needle == "--device cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = invoke("--run", str(run_dir), *args)
    assert r.exit_code == 2 and needle in error_line(r)
    assert r.stdout == ""


def test_prompt_file_missing_empty_and_good(run_dir, tmp_path):
    missing = invoke("--run", str(run_dir), "--prompt-file", str(tmp_path / "nope.txt"))
    assert missing.exit_code == 2 and "no such file" in error_line(missing)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = invoke("--run", str(run_dir), "--prompt-file", str(empty), "-n", "2", "--json")
    assert r.exit_code == 0, r.stderr  # like -p '': <|endoftext|> alone
    assert json.loads(r.stdout)["prompt"] == "" and json.loads(r.stdout)["prompt_tokens"] == 1
    good = tmp_path / "p.txt"
    good.write_text("hello")
    r = invoke("--run", str(run_dir), "--prompt-file", str(good), "-n", "2", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["prompt"] == "hello"


def test_no_run_found_says_where_and_how(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("-n", "2")
    line = error_line(r)
    assert r.exit_code == 2 and "runs" in line and "minigpt train" in line


def test_run_dir_that_does_not_exist(tmp_path):
    r = invoke("--run", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "does not exist" in error_line(r)


def broken_run(tmp_path: Path, name: str = "run") -> tuple[Path, Path]:
    run = make_run(tmp_path / name)
    return run, latest_checkpoint_dir(run)


@pytest.mark.parametrize("missing", ["model.safetensors", "config.yaml", "tokenizer.tiktoken",
                                     "tokenizer.json"])
def test_run_missing_a_file(tmp_path, missing):
    run, ckpt = broken_run(tmp_path)
    (ckpt / missing).unlink()
    r = invoke("--run", str(run))
    line = error_line(r)
    assert r.exit_code == 2 and missing in line and "missing" in line


def test_weights_not_matching_config_name_the_tensor(tmp_path):
    run = make_run(tmp_path / "run", weights_model={"n_embd": 48})
    r = invoke("--run", str(run))
    line = error_line(r)
    assert r.exit_code == 2 and "tensor '" in line and "[" in line


def test_corrupted_weights(tmp_path):
    run, ckpt = broken_run(tmp_path)
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside tensor data: header still valid
    path.write_bytes(bytes(data))
    r = invoke("--run", str(run))
    assert r.exit_code == 2 and "corrupted" in error_line(r)


def test_truncated_weights(tmp_path):
    run, ckpt = broken_run(tmp_path)
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    r = invoke("--run", str(run))
    line = error_line(r)
    assert r.exit_code == 2 and "model.safetensors" in line and "truncated" in line


@pytest.mark.parametrize("kind", ["pickle", "zip"])
def test_pickle_or_torch_zip_in_place_of_weights_is_never_loaded(tmp_path, kind):
    run, ckpt = broken_run(tmp_path)
    path = ckpt / "model.safetensors"
    if kind == "pickle":
        # Loading this would create a file: the test proves it is never unpickled.
        marker = tmp_path / "pwned"
        payload = pickle.dumps(_Boom(str(marker)))
        path.write_bytes(payload)
    else:
        torch.save({"w": torch.zeros(2)}, path)  # a PyTorch zip archive
    r = invoke("--run", str(run))
    line = error_line(r)
    assert r.exit_code == 2 and ("pickle" in line or "zip" in line)
    if kind == "pickle":
        assert not (tmp_path / "pwned").exists()


class _Boom:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def console(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minigpt", "sample", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


def test_console_entry_point_exits_2_with_one_line(tmp_path):
    """Through `python -m minigpt` (main(), not CliRunner) a MinigptError is exit code 2."""
    p = console(["-t", "-1"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: --temperature") and len(p.stderr.splitlines()) == 1
    assert p.stdout == ""


@pytest.mark.slow
def test_console_entry_point_usage_error_exits_2(tmp_path):
    p = console(["--bogus"], tmp_path)
    assert p.returncode == 2 and "No such option" in p.stderr and "Traceback" not in p.stderr


def test_in_process_thread_count_is_restored(run_dir):
    torch.set_num_threads(2)  # the autouse fixture restores the original afterwards
    assert invoke("--run", str(run_dir), "-n", "2", "--seed", "0").exit_code == 0
    assert torch.get_num_threads() == 2


# --------------------------------------------------------------------------------------------
# Prompt files: read only as far as the model can use (minigpt.infer.inputs.read_prompt over
# minigpt.files.read_text_part)


def merges_tokenizer():
    """Bytes plus a few merges (ASCII and multi-byte), on the GPT-4 split pattern: tokens of
    1 to 5 bytes, so where a cut falls matters."""
    from minigpt.data.tokenizer import PATTERNS, Tokenizer

    ranks = {bytes([b]): b for b in range(256)}
    for tok in ("th", "the", " t", " th", " the", "é", "ét", "été", " é", "日", "日本", " a",
                " an", " and"):
        for i in range(2, len(tok.encode()) + 1):  # every prefix, as BPE merges build it
            ranks.setdefault(tok.encode()[:i], len(ranks))
    return Tokenizer(ranks, PATTERNS["gpt4"], {"<|endoftext|>": len(ranks)}, "merges")


WORDS = ["the", "été", "日本", "and", "a", "then", "thé", "x", "\n", "日", "é"]


@pytest.mark.parametrize("shift", range(4))
def test_a_long_prompt_file_keeps_the_tokens_the_whole_file_would(tmp_path, shift):
    """The file is read from its end only, and its last block_size tokens are those of the
    whole file (the cut falls inside a multi-byte character for some shifts)."""
    import random

    from minigpt.infer.inputs import read_prompt, text_budget

    tok, block = merges_tokenizer(), 64
    rng = random.Random(shift)
    text = "x" * shift + " ".join(rng.choice(WORDS) for _ in range(40000))
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8")
    p = read_prompt(tok, block, prompt_file=path)
    assert p.file_bytes == path.stat().st_size > text_budget(tok, block)
    assert len(p.text.encode()) <= text_budget(tok, block) and text.endswith(p.text)
    assert p.ids == tok.encode(text)[-block:] and p.cut


def test_a_short_prompt_file_is_read_whole(tmp_path):
    from minigpt.infer.inputs import read_prompt

    tok = merges_tokenizer()
    path = tmp_path / "p.txt"
    path.write_text("the été 日本", encoding="utf-8")
    p = read_prompt(tok, 64, prompt_file=path)
    assert p.text == "the été 日本" and p.file_bytes is None and not p.cut
    assert p.ids == tok.encode(p.text)


def test_read_text_part_cuts_on_character_boundaries(tmp_path):
    from minigpt.files import read_text_part

    path = tmp_path / "t.txt"
    path.write_bytes("aé日b".encode())  # a | c3 a9 | e6 97 a5 | b
    assert read_text_part(path, "text_file", 3) == ("aé", 7)  # head: whole characters only
    assert read_text_part(path, "text_file", 2) == ("a", 7)
    assert read_text_part(path, "text_file", 3, tail=True) == ("b", 7)  # 97 a5: half a 日
    assert read_text_part(path, "text_file", 4, tail=True) == ("日b", 7)
    assert read_text_part(path, "text_file", 100, tail=True) == ("aé日b", 7)
    path.write_bytes(b"ok " * 10 + b"\xff")
    with pytest.raises(MinigptError, match=r"^text_file .*invalid byte at offset 30"):
        read_text_part(path, "text_file", 8, tail=True)  # the offset in the file, not the part
