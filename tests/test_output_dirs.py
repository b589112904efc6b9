"""Where a command writes its files: no `.write-test-*` probe file is ever left in an output
directory (nothing is written to find out whether one is writable); a read-only (0555)
directory is refused by its mode, root or not (inspect-heads' and circuit's --out, the gguf
export, as the hf export); a full disk says which files were written and which not."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SHARP_INDUCTION, error_line, in_process, make_run

from minigpt.heads import output


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("minor") / "tiny", **SHARP_INDUCTION)


def test_no_probe_file_is_left_in_heads(run_dir, tmp_path):
    out = tmp_path / "out"
    r = in_process(["inspect-heads", "--run", run_dir, "--device", "cpu", "--probe",
                    "induction", "--format", "json", "--out", out])
    assert r.returncode == 0, r.stderr
    assert [p.name for p in out.iterdir()] == ["scores.json"]
    # a refused run (a bad flag after the directory is made) leaves none either
    r = in_process(["circuit", "--run", run_dir, "--device", "cpu", "--probe", "induction",
                    "--patch-from", "corrupted", "--format", "json", "--out", tmp_path / "o2",
                    "--target", "no-such-token-xyz"])
    assert r.returncode == 2
    assert not [p for p in tmp_path.rglob(".write-test-*")]


def test_a_read_only_out_is_refused_without_a_probe(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(Exception, match=r"read-only directory \(mode 555\)"):
            output.make_out_dir(ro)
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def test_gguf_export_refuses_a_read_only_directory(run_dir, tmp_path):
    """As root the directory could be written; the hf export refuses it by its mode, and so
    does gguf now (in this process: the refusal is the library's; a real process's one error
    line is tests/test_gguf.py's test_a_write_that_fails_mid_file_leaves_nothing)."""
    pytest.importorskip("gguf")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        r = in_process(["export", "--format", "gguf", "--run", run_dir, "--out", ro / "m.gguf"])
        line = error_line(r)
        assert f"{ro} is a read-only directory (mode 555)" in line and "--out" in line
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


def _full_disk_at(monkeypatch, name: str) -> None:
    """Every durable write raises the full disk's WriteError when it reaches the file `name`
    (patched wherever a module imported the writer)."""
    import errno
    import sys

    from minigpt import files

    real = files.atomic_write_bytes

    def full(path, data, *a, **k):
        if Path(path).name == name:
            raise files.disk_error(OSError(errno.ENOSPC, "No space left on device"), Path(path))
        return real(path, data, *a, **k)

    for mod in list(sys.modules.values()):
        if getattr(mod, "atomic_write_bytes", None) is real:
            monkeypatch.setattr(mod, "atomic_write_bytes", full)


@pytest.mark.parametrize("command,args,fails,done", [
    ("circuit", ["--patch-from", "corrupted", "--format", "png,html,json"], "circuit.html",
     ["circuit.png", "faithfulness.png"]),
    ("inspect-heads", ["--format", "png,html,json", "--layer", "0", "--head", "0"],
     "attention.html", ["attention_grid.png", "attention_L0_H0.png"]),
])
def test_a_full_disk_says_what_was_written_and_what_not(run_dir, tmp_path, monkeypatch,
                                                        unrendered_pictures, command, args,
                                                        fails, done):
    _full_disk_at(monkeypatch, fails)  # (which files: the pictures need not be rendered)
    out = tmp_path / "out"
    r = in_process([command, "--run", run_dir, "--device", "cpu", "--probe", "induction", *args,
                    "--out", out])
    line = error_line(r, after_progress=True)
    assert "no space left on device" in line and fails in line
    written = line.split("(complete): ")[1].split(";")[0].split(", ")
    not_written = line.split("not written: ")[1].split(", ")
    assert set(done) <= set(written) and fails in not_written
    assert {p.name for p in out.iterdir()} == set(written)  # what it says is what is there
    assert not {n for n in not_written if (out / n).exists()}
