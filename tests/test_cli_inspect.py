"""`minigpt inspect-heads` through typer's CliRunner on a tiny random-init run (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARP_INDUCTION, error_line, in_process, make_run
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import from_dict
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.run.checkpoint import save_checkpoint

BLOCK = 24


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tok = bytes_tokenizer()
    cfg = from_dict({"model": {"n_layer": 2, "n_head": 3, "n_embd": 24, "block_size": BLOCK,
                               "vocab_size": tok.n_vocab, "mlp": False},
                     "tokenizer": {"vocab_size": 256},
                     "data": {"source": "induction", "induction_vocab": 50}})
    run = tmp_path_factory.mktemp("runs") / "tiny"
    save_checkpoint(run, step=5, model=GPT.from_config(cfg, seed=0), cfg=cfg, tokenizer=tok,
                    trainer_state={"step": 5})
    return run


def invoke(run_dir: Path, *args: str):
    return CliRunner().invoke(app, ["inspect-heads", "--run", str(run_dir), "--device", "cpu",
                                    *args], catch_exceptions=False)


def test_default_prints_summary_and_the_parity_check(run_dir):
    r = invoke(run_dir)
    assert r.exit_code == 0, r.stderr
    assert "type" in r.stdout and "ind" in r.stdout and "diffuse" in r.stdout
    assert r.stdout.count("\n") > 6
    assert "explicit vs SDPA logits: max |diff| = " in r.stderr and "ok" in r.stderr
    assert "--layer L --head H" in r.stderr  # 6 heads: no weight tables, a hint instead
    assert not (run_dir / "heads").exists()  # table only: no files


def test_one_head_shows_its_weights(run_dir):
    r = invoke(run_dir, "--layer", "1", "--head", "2", "--text", "To be, or not")
    assert r.exit_code == 0, r.stderr
    assert "layer 1 head 2" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines()]
    assert ["0", "T", "100"] in rows  # query 0 puts all its attention on key 0
    assert ["1", "o", "50", "50"] in rows  # random init: nearly uniform over the keys so far
    assert "·" in r.stdout  # spaces made visible


def markup_run(run: Path) -> Path:
    """A run whose tokenizer has the tokens "[red]" and "[b]" (rich markup if read as such)."""
    from minigpt.data.tokenizer import Tokenizer

    ranks = {bytes([b]): b for b in range(256)}
    for tok in (b"[r", b"[re", b"[red", b"[red]", b"[b", b"[b]"):
        ranks[tok] = len(ranks)
    tok = Tokenizer(ranks, r"\S+|\s+", {"<|endoftext|>": len(ranks)}, "markup")
    cfg = from_dict({"model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8,
                               "vocab_size": tok.n_vocab}})
    save_checkpoint(run, step=1, model=GPT.from_config(cfg, seed=0), cfg=cfg, tokenizer=tok,
                    trainer_state={"step": 1})
    return run


def test_token_text_and_file_names_are_not_markup_or_escape_codes(tmp_path, monkeypatch):
    """Tokens and the text file's name are shown as they are: never read as rich markup, and
    control characters in a name (an escape sequence) are escaped, not sent to the terminal."""
    run = markup_run(tmp_path / "markup")
    monkeypatch.chdir(tmp_path)  # a short name: the title fits on one line
    Path("[i]notes\x1b[31m.txt").write_text("[red][b]x")
    r = invoke(run, "--text-file", "[i]notes\x1b[31m.txt", "--layer", "0", "--head", "0")
    assert r.exit_code == 0, r.stderr
    assert "[red]" in r.stdout and "[b]" in r.stdout  # the row labels of the weight table
    assert "[i]notes\\x1b[31m.txt" in r.stdout  # the score table's title
    assert "\x1b" not in r.stdout + r.stderr


def test_json_on_stdout(run_dir):
    r = invoke(run_dir, "--probe", "induction", "--json", "--layer", "1")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(h["layer"], h["index"]) for h in doc["heads"]] == [(1, 0), (1, 1), (1, 2)]
    assert doc["source"] == "probe:induction" and doc["n_tokens"] == BLOCK
    assert all(0 <= t < 50 for t in doc["tokens"])  # the ids the run was trained on
    assert doc["tokens"][: BLOCK // 2] == doc["tokens"][BLOCK // 2:]
    assert doc["parity_ok"] is True and doc["heads"][0]["induction"] is not None


def test_every_file_format_under_out(run_dir, tmp_path, unrendered_pictures):
    """Which files, and where (the pictures unrendered: tests/test_inspection.py draws them)."""
    out = tmp_path / "o"
    r = invoke(run_dir, "--format", "png,html", "--format", "safetensors", "--format", "json",
               "--out", str(out), "--layer", "0", "--head", "1", "--probe", "previous")
    assert r.exit_code == 0, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["attention.html", "attention.safetensors", "attention_L0_H1.png",
                     "attention_grid.png", "scores.json"]
    for name in names:
        assert f"wrote {out / name}" in r.stderr
    assert "head scores" in r.stdout  # the table comes with the files (issue 34)


def test_files_default_to_the_run_dir(run_dir):
    r = invoke(run_dir, "--format", "json", "--text", "abcabc")
    assert r.exit_code == 0, r.stderr
    doc = json.loads((run_dir / "heads" / "scores.json").read_text())
    assert doc["token_strs"] == list("abcabc") and len(doc["heads"]) == 6


def test_long_text_is_cut_with_a_note(run_dir):
    r = invoke(run_dir, "--text", "x" * 100, "--json")
    assert r.exit_code == 0, r.stderr
    assert f"note: the text has 100 tokens; inspecting the first {BLOCK}" in r.stderr
    assert json.loads(r.stdout)["n_tokens"] == BLOCK


@pytest.mark.parametrize("args, expect", [
    (["--text", ""], "--text: the text is empty"),
    (["--layer", "2"], "--layer 2: out of range; valid: 0..1"),
    (["--head", "3"], "--head 3: out of range; valid: 0..2"),
    (["--probe", "bogus"], "valid: induction, previous, duplicate"),
    (["--format", "gif"], "valid: table, png, html, safetensors, json"),
    (["--max-tokens", "1000"], f"valid: 2..{BLOCK}"),
    (["--text", "a", "--probe", "induction"], "exclude each other"),
    (["--probe", "induction", "--max-tokens", "3"],  # two copies of 2 tokens at least
     f"--max-tokens 3: out of range; valid: 4..{BLOCK}"),
    (["--probe", "induction", "--max-tokens", "2"], "the induction probe needs two copies"),
    (["--patch-direction", "denoising"],
     "--patch-direction: applies to --patch-from only; give --patch-from too"),
])
def test_bad_input_is_one_line_exit_2(run_dir, args, expect):
    assert expect in error_line(invoke(run_dir, *args))


def test_unwritable_out_dir(run_dir, tmp_path):
    (tmp_path / "f").write_text("x")
    line = error_line(invoke(run_dir, "--format", "png", "--out", str(tmp_path / "f" / "d")))
    assert "cannot write there" in line


def test_missing_run_dir(tmp_path):
    line = error_line(invoke(tmp_path / "nope"))
    assert "nope" in line


def test_binary_text_file(run_dir, tmp_path):
    (tmp_path / "b.bin").write_bytes(b"\x00\xff\xfe")
    assert "not UTF-8" in error_line(invoke(run_dir, "--text-file", str(tmp_path / "b.bin")))


def test_every_destination_is_checked_before_any_work(run_dir, tmp_path):
    """A FIFO (or a directory) where one of the files goes is refused before anything is
    computed or written: the other formats' files are not written first (issue 39)."""
    import os
    import stat

    os.mkfifo(tmp_path / "attention.html")
    (tmp_path / "scores.json").mkdir()
    for fmt, name, kind in (("png,html", "attention.html", "a FIFO"),
                            ("png,json", "scores.json", "a directory")):
        line = error_line(invoke(run_dir, "--format", fmt, "--out", str(tmp_path)))
        assert f"--out {tmp_path}: {name} there: it is {kind}" in line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["attention.html", "scores.json"]
    assert stat.S_ISFIFO((tmp_path / "attention.html").lstat().st_mode)


def test_the_destinations_checked_are_the_files_written(run_dir, tmp_path, unrendered_pictures):
    """`output.file_names` (what is checked before the work) names exactly what `write_files`
    wrote, with every format and measurement that adds a file (the pictures unrendered: what
    they show is checked in tests/test_inspection.py and tests/test_cli_inspect_circuits.py)."""
    from minigpt.heads import output

    r = invoke(run_dir, "--format", "png,html,safetensors,json", "--out", str(tmp_path),
               "--layer", "1", "--head", "0", "--head", "2", "--ablate", "zero", "--dla",
               "--composition", "--probe", "induction", "--lens")
    assert r.exit_code == 0, r.stderr
    names = output.file_names(["png", "html", "safetensors", "json"], [1], [0, 2],
                              ablation=True, composition=True, circuits=True, lens=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_probe_induction_is_not_suggested_to_who_gave_it(tmp_path):
    make_run(tmp_path / "runs" / "tiny", **SHARP_INDUCTION)
    given = in_process(["inspect-heads", "--device", "cpu", "--probe", "induction"],
                       cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    assert "trained on synthetic induction data" in given.stderr
    assert "try --probe induction" not in given.stderr
    plain = in_process(["inspect-heads", "--device", "cpu", "--text", "abcdefgh"], cwd=tmp_path)
    assert "(try --probe induction)" in plain.stderr
