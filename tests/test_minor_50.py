"""Issue 50's minor items, each through the installed command or in-process as the user types
it: no `.write-test-*` probe file is ever left in an output directory (nothing is written to
find out whether one is writable); `export --format gguf` refuses a read-only (0555) directory,
as the hf export does, root or not; a config-name typo gets a did-you-mean."""

from __future__ import annotations

import shutil
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


def test_a_config_name_typo_gets_a_did_you_mean(tmp_path):
    line = error_line(in_process(["train", "--config", "inductoin"], cwd=tmp_path))
    assert "did you mean" in line.lower() and "induction" in line, line


def test_a_cut_checkpoint_config_is_blamed_not_the_users_set(trained_runs, tmp_path):
    run = Path(shutil.copytree(trained_runs["stopped"]["dir"], tmp_path / "run", symlinks=True))
    cfg = (run / "checkpoints" / "latest").resolve() / "config.yaml"
    data = cfg.read_bytes()
    cfg.write_bytes(data[: len(data) // 2])
    line = error_line(in_process(["train", "--out", run, "--resume", "--set",
                                "train.batch_size=8"]))
    assert f"{cfg}" in line and "corrupted" in line, line
    assert "cannot change on --resume" not in line


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


def test_shown_cuts_between_words():
    from minigpt.files import shown

    text = ("corrupted-second: the induction probe with its second copy replaced by fresh "
            "tokens: the first copy's tokens are there, but no query asks for them)")
    short = shown(text)
    assert " ... " in short and len(short) <= 80
    head, tail = short.split(" ... ")
    assert text.startswith(head) and text.endswith(tail)
    words = set(text.split())
    assert head.split()[-1] in words and tail.split()[0] in words  # no word cut in two


def test_probe_induction_is_not_suggested_to_who_gave_it(tmp_path):
    make_run(tmp_path / "runs" / "tiny", **SHARP_INDUCTION)
    given = in_process(["inspect-heads", "--device", "cpu", "--probe", "induction"],
                       cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    assert "trained on synthetic induction data" in given.stderr
    assert "try --probe induction" not in given.stderr
    plain = in_process(["inspect-heads", "--device", "cpu", "--text", "abcdefgh"], cwd=tmp_path)
    assert "(try --probe induction)" in plain.stderr


def test_circuit_picture_geometry(run_dir):
    """circuit.png's data: no kept edge's curve passes another node (the embed -> L1.H1 value
    edge ran through L0.H1); every label fits its circle; the title names the corruption."""
    from minigpt.heads import edge_png as C
    from minigpt.heads.edge_circuit import circuit_pairs, circuit_title
    from minigpt.interp.edge_graph import find_circuit
    from minigpt.run import load_run

    loaded = load_run(run_dir, "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from="corrupted-first",
                      probe="induction")
    result = find_circuit(loaded.model, p.clean, p.corrupted, p.metric, p.targets, ig_steps=2,
                          curves=False)
    pos = C._positions(result)
    x, y0 = pos["embed"]
    assert (x, y0 + 1) in pos.values() and (x, y0 + 2) in pos.values()  # the layout
    for e in result.edges():  # every edge of the graph, kept or not
        a, b = pos[e["from"]], pos[e["to"]]
        others = [q for n, q in pos.items() if n not in (e["from"], e["to"])]
        rad = C.route(a, b, C.BEND.get(e["input"], 0.08), others)
        curve = [C._bezier(a, b, rad, t / 40) for t in range(4, 37)]
        assert min((cx - ox) ** 2 + (cy - oy) ** 2 for ox, oy in others
                   for cx, cy in curve) >= C.CLEAR ** 2, e
    for name in pos:
        label = name.replace(".", "\n")
        wide = max(len(x) for x in label.split("\n")) * 0.62 * 6
        assert C.node_size(label, 6) ** 0.5 >= wide + 6, name  # the diameter holds the text
    title = circuit_title("runs/tiny", p)
    assert title.endswith("corrupted: corrupted-first")
    assert C._title(result, title).startswith("runs/tiny, corrupted: corrupted-first: ")


def test_the_readme_says_where_runs_and_the_cache_go(tmp_path, monkeypatch):
    """Issue 50's newcomer: the README did not say where `minigpt train` writes. It says
    `runs/default/` under the current directory and `~/.cache/minigpt` (or $MINIGPT_CACHE):
    what the code resolves."""
    from minigpt.paths import cache_root
    from minigpt.run.resume import train_config

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`runs/default/` under the current directory" in readme
    assert "`~/.cache/minigpt` (or `$MINIGPT_CACHE`)" in readme
    monkeypatch.chdir(tmp_path)
    assert train_config(None, [])[1].resolve() == (tmp_path / "runs" / "default").resolve()
    for var in ("MINIGPT_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root("") == tmp_path / ".cache" / "minigpt"
    monkeypatch.setenv("MINIGPT_CACHE", str(tmp_path / "c"))
    assert cache_root("") == tmp_path / "c"
