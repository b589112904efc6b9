"""What a student sees (issue 34): flags refused before torch loads, outputs that follow the
umask, `sample` picking a run trained on text, the terminal map of a long input, the head the
viewer opens on, the pictures' scales and labels, `curves` refusing runs that do not compare,
the training view's ETA, best-and-last figures and overfitting warning, and the induction
run's copy metrics."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import induction_inspection

from minigpt import events
from minigpt.heads.inspection import Inspection

# --------------------------------------------------------------------------------------------
# Flags before torch.

NO_TORCH = """
import contextlib, io, json, sys
from minigpt.cli import app
out = []
for argv in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            app(args=argv, prog_name="minigpt")
            code = 0
        except SystemExit as e:
            code = e.code
    out.append({"torch": "torch" in sys.modules, "exit": code, "stdout": stdout.getvalue(),
                "stderr": stderr.getvalue()})
print(json.dumps(out))
"""

REFUSED_BEFORE_TORCH = [
    (["sample", "-t", "-1"], "--temperature"),
    (["sample", "--top-p", "2"], "--top-p"),
    (["sample", "--seed", "-1"], "--seed"),
    (["inspect-heads", "--format", "gif"], "--format"),
    (["inspect-heads", "--ablate", "everything"], "--ablate"),
    (["train", "--set", "train.threads=-1"], "--set train.threads"),
    (["train", "--config", "no-such-config"], "config file not found"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> list[dict]:
    """Every command of REFUSED_BEFORE_TORCH, one after the other in ONE fresh process (one
    interpreter start-up instead of seven): its exit code, stdout, stderr, and whether torch
    was loaded once it (and those before it) had run."""
    import json

    argvs = [argv for argv, _ in REFUSED_BEFORE_TORCH]
    r = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(argvs)],
                       cwd=tmp_path_factory.mktemp("no-torch"), text=True, capture_output=True,
                       timeout=120, check=False,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("i, argv, flag", [(i, a, f) for i, (a, f) in
                                           enumerate(REFUSED_BEFORE_TORCH)])
def test_a_bad_flag_is_refused_before_torch_loads(refused, i, argv, flag):
    first = next((REFUSED_BEFORE_TORCH[j][0] for j, x in enumerate(refused) if x["torch"]), None)
    assert not refused[i]["torch"], f"torch was loaded by minigpt {' '.join(first)}"
    assert refused[i]["exit"] == 2 and refused[i]["stdout"] == "", refused[i]
    err = refused[i]["stderr"]
    assert err.startswith(f"error: {flag}") and err.count("\n") == 1, err


# --------------------------------------------------------------------------------------------
# Files follow the umask.


def test_outputs_follow_the_umask(tmp_path):
    from minigpt.files import atomic_write_bytes, atomic_write_text

    before = os.umask(0o022)
    try:
        a = atomic_write_bytes(tmp_path / "a.png", b"x")
        os.umask(0o027)
        b = atomic_write_text(tmp_path / "b.md", "y")
    finally:
        os.umask(before)
    assert a.stat().st_mode & 0o777 == 0o644
    assert b.stat().st_mode & 0o777 == 0o640


# --------------------------------------------------------------------------------------------
# `sample` without --run: the latest finished run trained on text (minigpt.run.choice).


def fake_run(root: Path, name: str, source: str, when: float) -> Path:
    d = root / name
    (d / "checkpoints" / "step-000001").mkdir(parents=True)
    (d / "config.yaml").write_text(f"data:\n  source: {source}\ntokenizer:\n  vocab_size: 256\n")
    link = d / "checkpoints" / "latest"
    link.symlink_to("step-000001")
    os.utime(link, (when, when), follow_symlinks=False)
    return d


def test_sample_passes_over_newer_induction_runs(tmp_path):
    from minigpt.cli.sample import _trained_on_text
    from minigpt.run.choice import pick_run
    from minigpt.run.load import find_latest_run

    now = time.time()
    text = fake_run(tmp_path, "default", "text", now - 300)
    fake_run(tmp_path, "old", "text", now - 900)
    ind = fake_run(tmp_path, "induction", "induction", now - 10)
    assert find_latest_run(tmp_path) == ind
    pick = pick_run(_trained_on_text, tmp_path, require_fit=False)
    assert (pick.run_dir, pick.misfit) == (text, None)
    assert pick.passed == [(ind, "trained on synthetic induction data, not text", True)]
    only = tmp_path / "only"
    only.mkdir()
    alone = fake_run(only, "induction", "induction", now)
    pick = pick_run(_trained_on_text, only, require_fit=False)  # nothing on text: the latest
    assert (pick.run_dir, pick.passed) == (alone, [])
    assert pick.misfit == "trained on synthetic induction data, not text"


# --------------------------------------------------------------------------------------------
# The terminal map of a long input, and the head shown first.


def induction_probe(half: int = 16) -> Inspection:
    return induction_inspection(half, base=100)


def test_the_terminal_map_shows_the_second_copy_and_says_what_it_hides():
    from rich.console import Console

    from minigpt.cli.heads import _attention_table

    insp = induction_probe(16)
    rows, cols = insp.window(1, 1, 16)
    assert rows == list(range(16, 32))  # the second copy, where the stripe is
    assert set(range(1, 16)) <= set(cols)  # the keys the induction stripe lands on
    console = Console(width=80, record=True, color_system=None)
    console.print(_attention_table(insp, 1, 1, 80))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "do not fit 80 columns" in text and "queries 16..31" in text
    wide = Console(width=200, record=True, color_system=None)
    wide.print(_attention_table(insp, 1, 1, 200))
    assert "do not fit" not in wide.export_text()


def test_the_viewer_opens_on_the_most_distinctive_head():
    insp = induction_probe(8)
    assert insp.most_distinctive() == (1, 1)  # the induction head, before the previous one
    assert insp.most_distinctive([(0, 0), (0, 1)]) == (0, 0)
    assert insp.most_distinctive([(0, 1)]) == (0, 1)


# --------------------------------------------------------------------------------------------
# Pictures.


def test_the_grid_has_a_colour_bar_tick_labels_and_the_copy_boundary():
    from minigpt.heads.attention_png import grid_figure

    fig = grid_figure(induction_probe(8))
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and bars[0].get_ylabel() == "attention weight"
    maps = [ax for ax in fig.axes if ax not in bars]
    assert len(maps) == 4
    assert all(len(ax.get_xticks()) >= 2 for ax in maps)
    assert maps[-1].get_xlabel() == "key position"
    assert any(line.get_color() == "red" for line in maps[0].get_lines())  # copy boundary
    assert "second copy starts at position 8" in fig.get_suptitle()


def test_heads_png_draws_a_single_measurement():
    from minigpt.heads import timeline

    record = {"kind": "heads", "step": 250, "scores": {
        "induction": [[0.1, 0.2]], "previous": [[0.9, 0.1]], "duplicate": [[0.0, 0.3]]}}
    assert timeline.draw_timeline([record])[:4] == b"\x89PNG"
    lines = _timeline_lines([record])
    assert len(lines) == 3 and all(line.get_marker() == "o" for line in lines)


def _timeline_lines(records):
    """The plotted lines of draw_timeline's figure (drawn again with Figure.savefig patched)."""
    from matplotlib.figure import Figure

    from minigpt.heads import timeline

    seen = []
    original = Figure.savefig

    def keep(self, *a, **k):
        seen.extend(line for ax in self.axes for line in ax.get_lines())
        return original(self, *a, **k)

    Figure.savefig = keep
    try:
        timeline.draw_timeline(records)
    finally:
        Figure.savefig = original
    return [ln for ln in seen if ln.get_label().startswith("best")]


def test_curves_legend_sits_outside_the_plot(tmp_path):
    from minigpt.run.curves import Series, curves_figure

    s = Series("r", tmp_path)
    for step in (10, 20, 30):
        s.add({"kind": "train", "step": step, "loss": 3.0 - step / 100, "lr": step * 1e-4,
               "elapsed": step, "tokens_seen": step * 100})
    s.add({"kind": "eval", "step": 30, "val_loss": 2.5, "val_bpb": 3.0, "elapsed": 30,
           "tokens_seen": 3000})
    fig = curves_figure(s)
    fig.canvas.draw()
    top = fig.axes[0]
    legend = top.get_legend().get_window_extent()
    assert legend.y0 >= top.get_window_extent().y1 - 1  # above the panel: nothing crosses it


def test_curves_refuses_text_beside_synthetic_and_flags_tokenizers(tmp_path):
    from minigpt.errors import MinigptError
    from minigpt.run.curves import Series, comparable

    text = Series("default", tmp_path, kind={"source": "text", "tokenizer": "BPE 1024 (gpt4)"})
    raw = Series("bytes", tmp_path, kind={"source": "text", "tokenizer": "bytes"})
    ind = Series("induction", tmp_path, kind={"source": "induction",
                                              "tokenizer": "synthetic ids 0..127"})
    with pytest.raises(MinigptError, match="induction trained on synthetic induction ids"):
        comparable([text, ind])
    assert "tokenizers differ" in comparable([text, raw])
    assert comparable([text, text]) == "" and comparable([ind, ind]) == ""


# --------------------------------------------------------------------------------------------
# Training: the summary, the warning, the ETA, the induction run's copies.


def eval_event(step: int, val: float, best: float, best_step: int, **kw) -> events.EvalEvent:
    return events.EvalEvent(step, val, math.exp(val), val * 1.4, best, best * 1.4, 1.0, [],
                            step * 10, best_step=best_step, **kw)


def done_event(last: events.EvalEvent, source: str = "text") -> events.DoneEvent:
    return events.DoneEvent(Path("runs/x"), 2000, 2000, "finished", "", 1000, 20000, 10.0,
                            2000.0, 1.6, 1.6 * 1.4, None, best_step=750, last_eval=last,
                            data_source=source)


def test_the_summary_shows_the_best_and_the_last_value():
    rows = dict(done_event(eval_event(2000, 1.95, 1.6, 750)).summary_rows())
    assert rows["val bits/byte"] == "best 2.2400 at step 750; last 2.7300 at step 2000 " \
                                    "(the saved model)"
    assert rows["sample"] == "minigpt sample --run runs/x"


def test_an_induction_summary_shows_the_copies_and_no_bits_per_byte():
    last = eval_event(2000, 2.3, 2.3, 2000, copy_loss=0.05, copy_accuracy=0.981)
    rows = dict(done_event(last, "induction").summary_rows())
    assert rows["copies (val)"] == "loss 0.0500 nats/token, 98.1% predicted, at step 2000"
    assert "val bits/byte" not in rows and "sample" not in rows
    assert rows["next"] == "minigpt inspect-heads --run runs/x --probe induction"


def heads_event(step: int, induction: list, previous: list) -> events.HeadScoresEvent:
    return events.HeadScoresEvent(step, 0.1, {"induction": induction, "previous": previous})


def test_an_induction_summary_says_whether_the_circuit_formed():
    last = eval_event(2000, 2.3, 2.3, 2000, copy_loss=0.05, copy_accuracy=0.981)
    done = done_event(last, "induction")
    done.heads = heads_event(2000, [[0.0, 0.0], [0.2, 0.94]], [[0.9512, 0.3], [0.99, 0.1]])
    rows = dict(done.summary_rows())
    # the previous-token head is the best of the layers below the induction head's
    assert rows["heads"] == ("formed at step 2000: L1.H1 is an induction head (0.940) and L0.H0 a "
                             "previous-token head (0.951), on the induction probe")
    assert rows["next"] == "minigpt inspect-heads --run runs/x --probe induction"

    done.heads = heads_event(2000, [[0.0, 0.0], [0.8996, None]], [[0.93, 0.1], [0.0, 0.0]])
    rows = dict(done.summary_rows())
    assert rows["heads"] == (
        "NOT formed by step 2000: no induction head (the best, L1.H0, scores 0.899; 0.9 "
        "needed); previous-token head formed (L0.H0, 0.930). The model predicts 98.1% of the "
        "copies (val, step 2000) some other way.")
    assert rows["next"].startswith("see what the model does instead: minigpt inspect-heads "
                                   "--run runs/x --probe induction (each head's pattern); ")
    assert "minigpt circuit --run runs/x --probe induction --patch-from corrupted" in rows["next"]
    # an induction head without a previous-token head: it may well be what copies
    done.heads = heads_event(2000, [[0.0, 0.0], [0.95, 0.1]], [[0.88, 0.1], [0.0, 0.0]])
    assert dict(done.summary_rows())["heads"] == (
        "NOT formed by step 2000: induction head formed (L1.H0, 0.950); no previous-token head "
        "(the best, L0.H0, scores 0.880; 0.9 needed). The model predicts 98.1% of the copies "
        "(val, step 2000).")
    assert events.circuit_check(5, {"induction": [[0.99]], "previous": [[0.99]]}) is None
    assert events.circuit_check(5, {"induction": [[1], "x"], "previous": [[1], [1]]}) is None


def test_runs_says_what_an_induction_runs_heads_came_to():
    from types import SimpleNamespace

    from minigpt.cli.runs import _status

    check = events.circuit_check(8000, {"induction": [[0.0], [0.2]], "previous": [[0.95], [0.0]]})
    assert check.short() == "no induction head"
    row = SimpleNamespace(status="finished", heads=check)
    assert _status(row) == "finished, no induction head"
    assert _status(SimpleNamespace(status="training", heads=check)) == "training"
    formed = events.circuit_check(9, {"induction": [[0.0], [0.92]], "previous": [[0.95], [0]]})
    assert _status(SimpleNamespace(status="formed", heads=formed)) == "formed"
    assert _status(SimpleNamespace(status="finished", heads=formed)) == "finished, heads formed"
    assert _status(SimpleNamespace(status="finished", heads=None)) == "finished"


def train_view():
    from minigpt.cli.train import _TrainView

    view = _TrainView()
    lines: list[str] = []
    view.line = lines.append
    return view, lines


def test_rising_validation_is_warned_about_once():
    from minigpt.cli.train import RISING_EVALS

    view, lines = train_view()
    view.on_event(eval_event(250, 2.0, 2.0, 250))
    view.on_event(eval_event(500, 1.8, 1.8, 500))
    for i in range(RISING_EVALS + 2):
        view.on_event(eval_event(750 + 250 * i, 1.9 + i / 10, 1.8, 500))
    warnings = [x for x in lines if x.startswith("warning:")]
    assert len(warnings) == 1
    assert "above its best (1.8000, step 500)" in warnings[0] and "not the best" in warnings[0]


def test_the_eta_is_the_average_speed_since_the_start(monkeypatch):
    view, _ = train_view()
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    view.t0, view.start_step = 1000.0, 0
    now[0] = 1100.0  # 100 steps in 100 s, the last ones fast or slow: the average counts
    assert view.eta(100, 400) == "5m00s"
    assert view.eta(100, 10000) == "2h45m"
    assert view.eta(0, 400) == "?"


def test_the_induction_run_says_what_it_trains_on():
    view, lines = train_view()
    view.on_event(events.StartEvent(Path("r"), 0, 10, 1, "cpu", 1, 64, 256, 1.0, 1, "induction"))
    view.on_event(events.DatasetReady(None, 0, 0, False, synthetic="synthetic induction rows"))
    view.on_event(eval_event(10, 2.4, 2.4, 10, copy_loss=0.1, copy_accuracy=0.5))
    assert "(1 thread: train.threads)" in lines[0]
    assert lines[1] == "data: synthetic induction rows" and "0 train" not in "\n".join(lines)
    assert "on the copies: loss 0.1000, 50.0% predicted" in lines[2]
    assert "bits/byte" not in lines[2]


def test_the_first_line_says_when_training_runs_under_bf16_autocast():
    """train.precision resolved to bf16 (auto on a CPU with bf16 instructions, or asked): the
    first line says so; fp32 adds nothing."""
    shown = {}
    for precision in ("bf16", "fp32"):
        view, lines = train_view()
        view.on_event(events.StartEvent(Path("r"), 0, 10, 1, "cpu", 1, 64, 256, 1.0, 2, "text",
                                        precision))
        shown[precision] = lines[0]
    assert shown["bf16"].endswith("device cpu (2 threads: train.threads), bf16 autocast "
                                  "(train.precision)")
    assert "bf16" not in shown["fp32"] and "autocast" not in shown["fp32"]


def test_the_training_loop_reports_the_precision_it_resolved(tmp_path):
    """The StartEvent carries what train.precision resolved to on this machine."""
    from test_train import tiny_sets

    from minigpt.config import load_config
    from minigpt.device import amp_dtype
    from minigpt.train import train

    got = {}
    for asked in ("auto", "fp32", "bf16"):
        seen = []
        (tmp_path / asked).mkdir()
        train(load_config(None, [*tiny_sets(tmp_path / asked), "train.max_steps=1",
                                 f"train.precision={asked}"]), tmp_path / asked / "run",
              on_event=seen.append)
        got[asked] = next(e for e in seen if isinstance(e, events.StartEvent)).precision
    cpu = torch.device("cpu")
    assert got == {"auto": "bf16" if amp_dtype("auto", cpu) else "fp32", "fp32": "fp32",
                   "bf16": "bf16"}


@pytest.mark.parametrize("threads,load,hint", [(2, 9.1, True), (2, 1.5, False),
                                                (1, 9.1, False)])
def test_an_interrupted_run_on_a_busy_machine_hears_of_threads(monkeypatch, threads, load, hint):
    """The resume hint after Ctrl-C names one thread only when the session ran on several
    and the machine was busier than its CPUs (issue 41: 522 tokens/s, 4x faster on one)."""
    import minigpt.threads

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(minigpt.threads, "usable_cpus", lambda: 2)
    view, lines = train_view()
    view.on_event(events.StartEvent(Path("r"), 0, 10, 1, "cpu", 1, 64, 256, 1.0, threads, "text"))
    done = events.DoneEvent(Path("runs/x"), 5, 10, "interrupted", "SIGINT", 1, 320, 0.6, 522.0,
                            math.nan, math.nan, Path("runs/x/checkpoints/step-000005"))
    view.finish(done)
    said = [x for x in lines if x.startswith("note: this run trained at 522 tokens/s on 2 "
                                             "threads while the machine was busy (load 9.1 on 2 "
                                             "CPUs)")]
    assert len(said) == hint
    if hint:
        assert said[0].endswith("minigpt train --out runs/x --resume --set train.threads=1")


def test_copy_positions_are_the_targets_seen_before():
    from minigpt.train.copies import copy_mask

    x = torch.tensor([[5, 6, 7, 5, 6, 7]])
    y = torch.tensor([[6, 7, 5, 6, 7, 9]])
    assert copy_mask(x, y).tolist() == [[False, False, True, True, True, False]]


def test_training_threads_are_set_and_restored():
    from minigpt.device import training_threads

    before = torch.get_num_threads()
    with training_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    with training_threads(0) as n:
        assert n == before
    assert torch.get_num_threads() == before


def test_a_hub_error_is_cut_at_a_sentence_not_mid_word():
    from minigpt.hf.hub import _gist

    long = "First sentence here. " + "word " * 100
    assert _gist(long) == "First sentence here."
    assert _gist("short one") == "short one"
    assert _gist("x" * 10 + " " + "y" * 400).endswith(" ...")


def test_runs_shows_the_best_and_the_last_value(tmp_path):
    import json

    from minigpt.cli.runs import _val
    from minigpt.run.listing import read_row

    run = tmp_path / "r"
    run.mkdir()
    evals = [(250, 2.9), (750, 2.3061), (2000, 2.7319)]
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "eval", "step": s, "val_loss": 1.0, "val_bpb": b, "elapsed": 1.0})
        + "\n" for s, b in evals))
    row = read_row(run)
    assert (row.best_val_bpb, row.best_step, row.last_val_bpb, row.last_step) == (
        2.3061, 750, 2.7319, 2000)
    assert _val(row) == "2.3061 (750), 2.7319"
    assert row.to_json()["last_val_bpb"] == 2.7319


def test_on_a_terminal_the_prompt_comes_before_the_continuation(capsys):
    from types import SimpleNamespace

    from minigpt.cli.sample import _SampleView

    prompt = SimpleNamespace(text="ROMEO:", ids=[1, 2])
    view = _SampleView(prompt, 1, 1, json_out=False, streaming=True, t_start=0.0,
                       shown_prompt="ROMEO:\x1b[31m\n")
    view.on_text(0, " But")
    view.on_text(0, " soft")
    out = capsys.readouterr().out
    assert out == "\x1b[2mROMEO:\\x1b[31m\n\x1b[0m But soft"  # once, dimmed, escapes shown
    piped = _SampleView(prompt, 1, 1, json_out=False, streaming=False, t_start=0.0)
    piped.on_done(SimpleNamespace(index=0, text=" But soft", token_ids=[3], tokens_per_s=1.0,
                                  first_token_s=0.1, finish_reason="length"))
    assert capsys.readouterr().out == " But soft\n"  # piped: the generated text only


# -- every circuit number explains itself (issue 41) ----------------------------------------


def circuit_inspection(dla_heads, patch_effect, logit: float = 5.0) -> Inspection:
    """The hand-built induction inspection with DLA and patching numbers of our choosing."""
    from minigpt.interp.head_circuits import Attribution, Patching

    insp = induction_inspection(8)
    insp.dla = Attribution(torch.tensor(dla_heads, dtype=torch.float64), {}, logit,
                           "the logit of the next token", 7)
    effect = torch.tensor(patch_effect, dtype=torch.float64)
    insp.patch = Patching("noising", "loss", "the loss", effect, effect, 0.1, 4.0,
                          "corrupted-first: the probe with its first copy's tokens replaced")
    insp.patch_tokens = list(range(16))
    return insp


def test_circuits_png_has_one_scale_per_quantity_and_says_how_to_read_it():
    """DLA on +-the model's logit, patching on +-1 (the whole change), whatever the largest
    cell: a 0.14 next to a 2.2 is pale; a fraction above 1 takes the end colour, the colour
    bar's arrow says so, and the picture says why a fraction can pass 1."""
    from minigpt.heads.head_circuits_png import circuits_figure

    insp = circuit_inspection([[0.14, 0.0], [0.0, 2.2]], [[0.14, 0.0], [-0.3, 2.2]], logit=3.0)
    fig = circuits_figure(insp)
    dla_ax, patch_ax = [ax for ax in fig.axes if ax.images]
    assert dla_ax.images[0].get_clim() == (-3.0, 3.0)
    assert patch_ax.images[0].get_clim() == (-1.0, 1.0)
    assert "do not add up" in patch_ax.get_xlabel() and "corrupted-first" in patch_ax.get_title()
    bars = [ax for ax in fig.axes if not ax.images]
    assert any("the whole change" in ax.get_ylabel() for ax in bars)
    small = circuit_inspection([[0.14, 0.0], [0.0, 0.0]], [[0.14, 0.0], [0.0, 0.0]], logit=0.0)
    dla_ax, patch_ax = [ax for ax in circuits_figure(small).axes if ax.images]
    assert dla_ax.images[0].get_clim() == pytest.approx((-0.14, 0.14))  # its largest share
    assert patch_ax.images[0].get_clim() == (-1.0, 1.0)  # 0.14 of the change stays pale


def test_the_viewer_shows_dla_and_patching():
    from minigpt.heads.viewer import viewer_data

    data = viewer_data(circuit_inspection([[0.5, 0.0], [0.0, 2.0]], [[0.1, 0.0], [0.0, 1.5]]))
    assert data["columns"][-2:] == ["dla", "patch"] and "prev@k" in data["columns"]
    row = data["scores"].index(next(r for r in data["scores"]
                                    if (r["layer"], r["index"]) == (1, 1)))
    cells = dict(zip(data["columns"], data["cells"][row]))
    assert cells["dla"] == "+2.000" and cells["patch"] == "+1.500" and cells["ind@k"] == "0.875@1"
    assert data["patch"]["corrupted_tokens"] == list(range(16))
    assert "do not add up" in data["patch"]["reading"] and data["dla"]["logit"] == 5.0
    assert all(data["column_help"][c] for c in data["columns"])


def heads_record(step, prev_head, ind_head, prev, ind, dla_head=(1, 1)):
    scores = {"previous": [[0.1, 0.1], [0.1, 0.1]], "induction": [[0.0, 0.0], [0.0, 0.0]],
              "duplicate": [[0.0, 0.0], [0.0, 0.0]]}
    scores["previous"][prev_head[0]][prev_head[1]] = prev
    scores["induction"][ind_head[0]][ind_head[1]] = ind
    return {"kind": "heads", "step": step, "scores": scores, "circuit": {
        "previous_head": list(prev_head), "induction_head": list(ind_head),
        "k_composition": 0.1 + step / 1000, "k_baseline": 0.12, "dla_head": list(dla_head),
        "dla": step / 100}}


def test_heads_png_names_the_pair_at_each_point_and_calls_a_head_formed_only_when_it_is():
    from matplotlib.figure import Figure

    from minigpt.heads import timeline

    recs = [heads_record(100, (0, 1), (1, 0), 0.2, 0.1, (0, 1)),
            heads_record(200, (0, 0), (1, 1), 0.5, 0.3),
            heads_record(300, (0, 0), (1, 1), 0.95, 0.92)]
    seen = []
    original = Figure.savefig

    def keep(self, *a, **k):
        seen.append(self)
        return original(self, *a, **k)

    Figure.savefig = keep
    try:
        assert timeline.draw_timeline(recs)[:4] == b"\x89PNG"
    finally:
        Figure.savefig = original
    ax = seen[0].axes[2]  # the circuit panel
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "L0.H1 -> L1.H0" in labels and "L0.H0 -> L1.H1" in labels
    assert "L0.H0 (previous 0.95) -> L1.H1 (induction 0.92)" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]  # the DLA heads, by marker
    assert "best DLA: L0.H1" in labels and "best DLA: L1.H1" in labels
    early = timeline._pair_title(recs[0]["circuit"], recs[0]["scores"])
    assert early == ("L0.H1 (best previous 0.20, not formed) -> "
                     "L1.H0 (best induction 0.10, not formed)")


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
