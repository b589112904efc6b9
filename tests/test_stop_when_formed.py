"""train.stop_when_formed: training ends at the first head-score measurement that finds a
head of every named kind at the formed threshold (0.9), with a checkpoint of that step; runs
that do not set it train exactly as before, and a resumed run stops where an uninterrupted one
does, with the same weights."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import in_process
from test_train import tiny_sets

from minigpt.config import HEAD_KINDS, ConfigError, load_config
from minigpt.events import DoneEvent, StepEvent
from minigpt.heads import timeline
from minigpt.run.checkpoint import kept_steps
from minigpt.run.resume import resume_config
from minigpt.train import train

# Trainings here draw no pictures (conftest.pictures_off: no test here reads curves.png or
# heads.png, and drawing is most of a tiny run's CPU time).
pytestmark = pytest.mark.usefixtures("no_pictures")

MINIGPT = shutil.which("minigpt")


def records(run, kind=None) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if kind is None or r["kind"] == kind]


def trained(run) -> list[tuple]:
    """(step, loss, val loss) of every train and eval record: what the training did."""
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records(run)
            if r["kind"] in ("train", "eval")]


class Scripted:
    """Stands in for the head-score probes: every head scores 0.1 until the step (read from
    the StepEvents, logged every step) reaches `induction_at` / `previous_at`, where the last
    layer's head 0 becomes an induction head / layer 0's last head a previous-token head."""

    def __init__(self, induction_at: int = 10**9, previous_at: int = 10**9) -> None:
        self.step, self.induction_at, self.previous_at = 0, induction_at, previous_at

    def on_event(self, event) -> None:
        if isinstance(event, StepEvent):
            self.step = event.step

    def probe_scores(self, model, cfg, tokenizer, seed=0) -> dict[str, list]:
        L, H = cfg.model.n_layer, cfg.model.n_head
        scores = {kind: [[0.1] * H for _ in range(L)] for kind in HEAD_KINDS}
        if self.step >= self.induction_at:
            scores["induction"][L - 1][0] = 0.93
        if self.step >= self.previous_at:
            scores["previous"][0][H - 1] = 0.97
        return scores


def sets(tmp_path, **over) -> list[str]:
    """The tiny byte model (one layer: the scripted scores make its heads form), head scores
    every 2 steps, 12 steps."""
    return tiny_sets(tmp_path, **{"train.max_steps": 12,
                                  "train.head_scores_interval": 2, "train.eval_interval": 4,
                                  "train.checkpoint_interval": 4, **over})


@pytest.fixture(scope="module")
def without_the_option(tmp_path_factory) -> Path:
    """The 12-step run of `sets` without train.stop_when_formed (the scripted head scores never
    form; they change nothing in the training), trained once for the tests that compare a run
    with the option against it."""
    tmp = tmp_path_factory.mktemp("without")
    script = Scripted()
    from conftest import pictures_off

    with pytest.MonkeyPatch.context() as m, pictures_off():
        m.setattr(timeline, "probe_scores", script.probe_scores)
        done = train(load_config(None, sets(tmp)), tmp / "run", on_event=script.on_event)
    assert (done.reason, done.step) == ("finished", 12)
    return tmp / "run"


# ---- config ---------------------------------------------------------------------------------


def test_kinds_are_checked_one_by_one_and_need_head_scores():
    t = load_config(None, ["train.stop_when_formed=induction,previous"]).train
    assert t.stop_when_formed == ["induction", "previous"]
    assert load_config(None).train.stop_when_formed == []
    # YAML's flow list, as a user copies it from a config file, means the same
    assert load_config(None, ["train.stop_when_formed=[induction, previous]"]).train \
        .stop_when_formed == ["induction", "previous"]
    assert load_config(None, ["train.stop_when_formed=[]"]).train.stop_when_formed == []
    with pytest.raises(ConfigError, match=r"^--set train.stop_when_formed: 'inductoin' is not "
                       r"one of induction, previous, duplicate, first \(did you mean "
                       r"'induction'\?\)$"):
        load_config(None, ["train.stop_when_formed=previous,inductoin"])
    with pytest.raises(ConfigError, match=r"train.stop_when_formed: induction needs head scores "
                       r"during training, but train.head_scores_interval is off; set it to a "
                       r"number of steps$"):
        load_config(None, ["train.stop_when_formed=induction", "train.head_scores_interval=off"])


def test_the_kinds_are_the_ones_the_training_scores_measure():
    assert set(HEAD_KINDS) == set(timeline.TIMELINE_SCORES) == set(timeline.KIND_NAMES)


# ---- training -------------------------------------------------------------------------------


def test_training_ends_at_the_first_measurement_with_every_kind_formed(tmp_path, monkeypatch,
                                                                     without_the_option):
    script = Scripted(induction_at=4, previous_at=7)
    monkeypatch.setattr(timeline, "probe_scores", script.probe_scores)
    run, full = tmp_path / "run", without_the_option
    done = train(load_config(None, sets(tmp_path, **{
        "train.stop_when_formed": "induction,previous"})), run, on_event=script.on_event)
    # induction alone at steps 4 and 6 is not enough; both at step 8, the measurement after 7
    assert isinstance(done, DoneEvent) and (done.reason, done.step) == ("formed", 8)
    assert [r["step"] for r in records(run, "heads")] == [2, 4, 6, 8]
    assert kept_steps(run) == [8] and records(run, "eval")[-1]["step"] == 8
    assert "| status | formed at step 8/12 |" in (run / "summary.md").read_text()

    # the same run without the option: the same steps, then on to max_steps
    assert trained(full)[:len(trained(run))] == trained(run)


def test_a_run_whose_heads_never_form_trains_exactly_as_without_the_option(
        tmp_path, monkeypatch, without_the_option):
    script = Scripted(induction_at=2)  # an induction head, never a previous-token head
    monkeypatch.setattr(timeline, "probe_scores", script.probe_scores)
    on, off = tmp_path / "on", without_the_option
    done = train(load_config(None, sets(tmp_path, **{
        "train.stop_when_formed": "induction,previous"})), on, on_event=script.on_event)
    assert (done.reason, done.step) == ("finished", 12)
    assert trained(on) == trained(off) and len(trained(on)) == 15  # 12 train + 3 eval
    assert (on / "checkpoints" / "latest" / "model.safetensors").read_bytes() == \
        (off / "checkpoints" / "latest" / "model.safetensors").read_bytes()


def test_a_resumed_run_stops_where_an_uninterrupted_one_does(tmp_path, monkeypatch):
    script = Scripted(induction_at=6, previous_at=6)
    monkeypatch.setattr(timeline, "probe_scores", script.probe_scores)
    opt = {"train.stop_when_formed": "induction,previous"}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert train(load_config(None, sets(tmp_path, **opt)), whole,
                 on_event=script.on_event).step == 6
    script.step = 0
    assert train(load_config(None, sets(tmp_path, **opt)), parts, stop_after=3,
                 on_event=script.on_event).reason == "stopped"
    done = train(resume_config(parts, []), parts, resume=True, on_event=script.on_event)
    assert (done.reason, done.step) == ("formed", 6)
    assert trained(parts) == trained(whole)
    assert (parts / "checkpoints" / "latest" / "model.safetensors").read_bytes() == \
        (whole / "checkpoints" / "latest" / "model.safetensors").read_bytes()
    # resumed with the option off, the run trains on to max_steps
    done = train(resume_config(parts, ["train.stop_when_formed="]), parts, resume=True,
                 on_event=script.on_event)
    assert (done.reason, done.step) == ("finished", 12)


# ---- through the installed command ----------------------------------------------------------


def test_a_bad_kind_is_one_line_through_the_command(tmp_path):
    r = subprocess.run([MINIGPT, "train", "--config", "induction", "--out", str(tmp_path / "r"),
                        "--set", "train.stop_when_formed=induction,prev"],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and not (tmp_path / "r").exists()
    assert r.stderr.strip().splitlines() == [(
        "error: --set train.stop_when_formed: 'prev' is not one of induction, previous, "
        "duplicate, first (did you mean 'previous'?)")]


def installed(*args: str) -> subprocess.CompletedProcess:
    """`minigpt ARGS` through the installed console script."""
    return subprocess.run([MINIGPT, *args], capture_output=True, text=True, check=False,
                          timeout=300)


def here(*args: str) -> subprocess.CompletedProcess:
    """`minigpt ARGS` by the app in this process (pictures off, as everywhere in this file)."""
    return in_process(list(args))


# The commands in this process in the quick tier; through the installed command in the slow.
@pytest.mark.parametrize("minigpt", [pytest.param(here, id="in-process"),
                                     pytest.param(installed, id="installed",
                                                  marks=pytest.mark.slow)])
def test_a_run_whose_heads_did_not_form_says_so_through_the_command(tmp_path, minigpt):
    """Four steps of the induction config cannot form the circuit: the end of `minigpt train`,
    summary.md and `minigpt runs` say so in words, with the copies and where to look next."""
    run = tmp_path / "runs" / "short"
    r = minigpt("train", "--config", "induction", "--out", str(run), "--set",
                "train.max_steps=4", "--set", "train.head_scores_interval=2", "--set",
                "train.eval_interval=4", "--set", "train.threads=1")
    assert r.returncode == 0, r.stderr
    said = dict(x.split(": ", 1) for x in r.stderr.splitlines() if x.startswith(("heads: ",
                                                                                    "next: ")))
    # 4 steps from a random init: every head is far from 0.9
    assert re.fullmatch(r"NOT formed by step 4: no induction head \(the best, L1\.H\d, scores "
                        r"0\.\d{3}; 0\.9 needed\); no previous-token head \(the best, L0\.H\d, "
                        r"scores 0\.\d{3}; 0\.9 needed\)\. The model predicts \d+\.\d% of the "
                        r"copies \(val, step 4\) some other way\.", said["heads"]), said["heads"]
    inspect = f"minigpt inspect-heads --run {run} --probe induction"
    assert said["next"] == (
        f"see what the model does instead: {inspect} (each head's pattern); {inspect} --ablate "
        f"zero (what removing each head costs); minigpt circuit --run {run} --probe induction "
        "--patch-from corrupted (which heads carry the copies)")
    summary = (run / "summary.md").read_text()
    assert f"| heads | {said['heads']} |" in summary and f"| next | {said['next']} |" in summary
    # the commands it points to run on this run
    r = minigpt(*inspect.split()[1:], "--ablate", "zero", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ablation"]["mode"] == "zero", r.stderr

    r = minigpt("runs", str(run.parent))
    assert r.returncode == 0 and "finished, no heads formed" in r.stdout, r.stdout
    r = minigpt("runs", str(run.parent), "--json")
    heads = json.loads(r.stdout)["runs"][0]["heads"]
    assert heads["step"] == 4 and heads["formed"] is False
    assert heads["status"] == "no heads formed" and heads["induction"]["layer"] == 1


def test_induction_and_previous_together_need_the_previous_token_head_below():
    """A layer-1 head attending to the previous token cannot feed the induction head's keys:
    with both kinds named, only a layer-0 previous-token head under a layer-1 induction head
    counts; each kind alone still counts in any layer."""
    def scores(prev0: float, prev1: float) -> dict:
        return {"induction": [[0.0, 0.0], [0.95, 0.0]], "previous": [[prev0, 0.1], [0.0, prev1]]}

    both = ["induction", "previous"]
    assert not timeline.all_formed(scores(0.5, 0.99), both)  # the early layer-1 kind
    assert timeline.all_formed(scores(0.5, 0.99), ["previous"])
    assert timeline.all_formed(scores(0.91, 0.0), both)
    assert not timeline.all_formed(scores(0.89, 0.0), both)
