"""Every reader of a run's files fails or notes in one line naming the file when it cannot read
it, and never states a conclusion drawn from defaults (issue 50): a config.yaml that is not
UTF-8, empty or random bytes made `minigpt curves` say "tokenizers differ (BPE 1024 (gpt4),
bytes)" of two byte-level runs, or nothing at all."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import in_process

from minigpt.config import load_config, to_yaml
from minigpt.run.listing import data_kind, read_row

DAMAGES = {
    "not-utf8": b"model:\n  n_layer: \xff\n",
    "empty": b"",
    "random": random.Random(3).randbytes(300),
    "no-tokenizer": b"model:\n  n_layer: 2\n",
}


def make_byte_run(run: Path) -> Path:
    """A run directory as training leaves it, for the readers: a byte-level config and a few
    records."""
    run.mkdir(parents=True)
    cfg = load_config(None, ["tokenizer.vocab_size=256"])
    (run / "config.yaml").write_text(to_yaml(cfg))
    recs = [{"kind": "train", "step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "elapsed": s,
             "tokens_seen": 100 * s} for s in range(1, 5)]
    recs.append({"kind": "eval", "step": 4, "val_loss": 4.0, "val_bpb": 3.0, "elapsed": 4,
                 "tokens_seen": 400})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readers")
    make_byte_run(root / "runs" / "good")
    make_byte_run(root / "runs" / "other")
    return root


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_data_kind_never_guesses(tmp_path, damage):
    run = make_byte_run(tmp_path / "r")
    assert data_kind(run) == {"source": "text", "tokenizer": "bytes"}
    (run / "config.yaml").write_bytes(DAMAGES[damage])
    kind = data_kind(run)
    assert "tokenizer" not in kind, kind
    assert kind["problem"].startswith(f"{run / 'config.yaml'}: "), kind


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_curves_notes_the_file_and_concludes_nothing(two_runs, tmp_path, damage,
                                                     unrendered_pictures):
    """The note, not the picture (drawn and checked in tests/test_curves.py)."""
    root = Path(shutil.copytree(two_runs, tmp_path / "w"))
    bad = root / "runs" / "other" / "config.yaml"
    bad.write_bytes(DAMAGES[damage])
    r = in_process(["curves", "runs/good", "runs/other", "--out", "c.png"], cwd=root)
    assert r.returncode == 0, r.stderr
    assert "tokenizers differ" not in r.stderr
    notes = [x for x in r.stderr.splitlines() if x.startswith("note: ")]
    assert len(notes) == 1 and notes[0].startswith(f"note: {Path('runs/other/config.yaml')}: ")
    assert "not checked" in notes[0]


def test_runs_notes_an_unreadable_config(two_runs, tmp_path):
    root = Path(shutil.copytree(two_runs, tmp_path / "w"))
    (root / "runs" / "other" / "config.yaml").write_bytes(DAMAGES["not-utf8"])
    row = read_row(root / "runs" / "other")
    assert row.problem.startswith(str(root / "runs" / "other" / "config.yaml")) and \
        "not UTF-8" in row.problem
    assert read_row(root / "runs" / "good").problem is None


@pytest.mark.slow
def test_installed_curves_on_a_config_that_is_not_utf8(two_runs, tmp_path):
    """Through the installed program (the quick tier: the same damage in this process,
    test_curves_notes_the_file_and_concludes_nothing[not-utf8])."""
    root = Path(shutil.copytree(two_runs, tmp_path / "w"))
    (root / "runs" / "other" / "config.yaml").write_bytes(DAMAGES["not-utf8"])
    r = subprocess.run([shutil.which("minigpt"), "curves", "runs/good", "runs/other", "--out",
                        "c.png"], cwd=root, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "tokenizers differ" not in r.stderr
    assert "note: runs/other/config.yaml: not UTF-8 text (invalid byte at offset 18)" in r.stderr
