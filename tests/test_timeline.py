"""Heads forming during training (minigpt.heads.timeline and its hooks): probe scores per
step in metrics.jsonl, the "became an induction head" events, heads.png, kept checkpoints
and `inspect-heads --checkpoint STEP`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import pictures_off
from test_train import losses, tiny_sets

from minigpt.config import ConfigError, ModelConfig, load_config
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.errors import ArgumentError
from minigpt.events import HeadFormedEvent
from minigpt.heads import timeline
from minigpt.run import load_run
from minigpt.run.checkpoint import kept_steps
from minigpt.train import train


def heads_records(run) -> list[dict]:
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "heads"]


# ---- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5", "often", "2.5"])
def test_a_bad_interval_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match=f"train.head_scores_interval: '{value}' is not a "
                       "positive number of steps, 'eval' or 'off'"):
        load_config(None, [f"train.head_scores_interval={value}"])


def test_intervals_and_the_probe_minimum():
    from minigpt.config import head_scores_every

    every = lambda v: head_scores_every(load_config(None, [
        f"train.head_scores_interval={v}", "train.eval_interval=40"]).train)
    assert (every("eval"), every("off"), every("7")) == (40, 0, 7)
    with pytest.raises(ConfigError, match=r"need model.block_size >= 4, got 3; set "
                       "train.head_scores_interval: off"):
        load_config(None, ["model.block_size=3"])
    load_config(None, ["model.block_size=3", "train.head_scores_interval=off"])


# ---- scores and events ----------------------------------------------------------------------


def tiny_model(**kw) -> GPT:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=12, vocab_size=257, **kw)
    return GPT.from_config(cfg, seed=0)


def test_probe_scores_cover_every_head_and_leave_the_model_as_it_was():
    model = tiny_model().train()
    cfg = load_config(None, ["model.n_layer=2", "model.n_head=2", "model.n_embd=16",
                             "model.block_size=12", "tokenizer.vocab_size=256"])
    rng_before = torch.get_rng_state()
    scores = timeline.probe_scores(model, cfg, bytes_tokenizer())
    assert set(scores) == {"induction", "previous", "duplicate", "first"}
    for rows in scores.values():
        assert len(rows) == 2 and all(len(r) == 2 and all(0 <= v <= 1 for v in r) for r in rows)
    assert model.training and torch.equal(torch.get_rng_state(), rng_before)


def test_a_head_is_announced_once_when_it_crosses_the_threshold(monkeypatch):
    script = iter([
        {"induction": [[0.1, 0.2], [0.5, 0.89]], "previous": [[0.95, 0.1], [0.1, 0.1]],
         "duplicate": [[0.0, 0.0], [0.0, 0.0]], "first": [[0.0, 0.0], [0.0, 0.0]]},
        {"induction": [[0.1, 0.2], [0.5, 0.93]], "previous": [[0.97, 0.1], [0.1, 0.1]],
         "duplicate": [[0.0, 0.0], [0.0, 0.0]], "first": [[0.0, 0.0], [0.0, 0.0]]},
        {"induction": [[0.1, 0.2], [0.5, 0.80]], "previous": [[0.97, 0.1], [0.1, 0.1]],
         "duplicate": [[0.0, 0.0], [0.0, 0.0]], "first": [[0.0, 0.0], [0.0, 0.0]]},
    ])
    monkeypatch.setattr(timeline, "probe_scores", lambda *a, **k: next(script))
    monkeypatch.setattr(timeline, "circuit_record", lambda *a, **k: None)
    earlier = [{"kind": "heads", "step": 100, "scores": {"previous": [[0.91, 0], [0, 0]]}}]
    watch = timeline.HeadWatch(None, None, None, earlier)  # formed before a resume: silent
    scores, events = watch.measure(200)
    assert scores.step == 200 and scores.scores["induction"][1][1] == 0.89 and events == []
    scores, events = watch.measure(300)
    assert events == [HeadFormedEvent(300, 1, 1, "induction", "an induction head", 0.93)]
    assert watch.measure(400)[1] == []  # dipping below and back is not news


def test_draw_timeline_is_a_png_with_a_panel_per_layer(monkeypatch):
    recs = [{"kind": "heads", "step": s, "scores": {
        k: [[0.1 * s / 100, 0.2], [0.3, 0.4]] for k in ("induction", "previous", "duplicate")}}
        for s in (100, 200, 300)]
    png = timeline.draw_timeline(recs + [{"kind": "eval", "step": 300}])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and timeline.draw_timeline([]) is None
    # The panels below are compared by the figure's height, before it is rendered (rendering
    # is most of a drawing's CPU time, and the PNG's height is the figure's x dpi).
    monkeypatch.setattr(timeline, "figure_png", lambda fig: fig)
    height = lambda fig: fig.get_size_inches()[1]
    base = height(timeline.draw_timeline(recs))
    for r in recs:  # with the circuit: one more panel, so a taller picture
        r["circuit"] = {"previous_head": [0, 0], "induction_head": [1, 1],
                        "k_composition": r["step"] / 1000, "k_baseline": 0.12,
                        "dla_head": [1, 1], "dla": r["step"] / 20}
    taller = height(timeline.draw_timeline(recs))
    assert taller > base
    for r in recs:  # with the edges: one more panel again
        r["circuit"]["edges"] = {"edges": {"L0.H0->L1.H1:k": r["step"] / 100,
                                           "L1.H1->logits:logits": 1.0}, "clean": 0.1,
                                 "corrupted": 4.0}
    with_edges = height(timeline.draw_timeline(recs))
    assert with_edges > taller
    for r in recs:  # with the QK margin: one more panel again
        r["circuit"]["qk"] = {"term": ["embed", "L0.H0"], "margin": r["step"] / 50,
                              "top": ["embed", "L0.H0", r["step"] / 50]}
    assert height(timeline.draw_timeline(recs)) > with_edges


def test_the_circuit_record_finds_the_hand_built_induction_circuit():
    """On the model of tests/test_head_circuits.py: L0.H0 is the previous-token head, L1.H0 the
    induction head, their K-composition is above random weights', L1.H0 writes the logit."""
    from test_head_circuits import induction_circuit_model

    model = induction_circuit_model()
    cfg = load_config(None, ["data.source=induction", "data.induction_vocab=12",
                             "model.block_size=16", "tokenizer.vocab_size=256"])
    scores = timeline.probe_scores(model, cfg, bytes_tokenizer())
    rec = timeline.circuit_record(model, cfg, bytes_tokenizer(), scores)
    assert rec["previous_head"] == [0, 0] and rec["induction_head"] == [1, 0]
    assert rec["k_composition"] > 2 * rec["k_baseline"] > 0
    assert rec["dla_head"] == [1, 0] and rec["dla"] > 5
    # why L1H0 attends to the key after the earlier copy: the query's token x L0H0 at the key
    assert rec["qk"]["term"] == ["embed.tok", "L0.H0"] == rec["qk"]["top"][:2]
    assert rec["qk"]["margin"] == rec["qk"]["top"][2] > 10
    one_layer = {k: v[:1] for k, v in scores.items()}
    assert timeline.circuit_record(model, cfg, bytes_tokenizer(), one_layer) is None


# ---- in a training run ----------------------------------------------------------------------


@pytest.mark.parametrize("n_layer", [1, 2])
def test_head_scores_never_change_the_training(tmp_path, n_layer):
    """The same seed trains to bit-identical losses with and without head scores (with two
    layers the circuit and its edges' gradient scores are measured too). heads.png is drawn
    with one layer (with two, the picture is the same code with more panels: test_presentation,
    test_draw_timeline_is_a_png_with_a_panel_per_layer), curves.png is not drawn."""
    on, off = tmp_path / "on", tmp_path / "off"
    layers = {"model.n_layer": n_layer}
    with pictures_off(heads=n_layer > 1):
        train(load_config(None, tiny_sets(tmp_path, **layers,
                                          **{"train.head_scores_interval": 2})), on)
        train(load_config(None, tiny_sets(tmp_path, **layers,
                                          **{"train.head_scores_interval": "off"})), off)
    # every train and eval record (loss, val loss) is the same; "heads" records come on top
    strip = lambda run: [x for x in losses(run) if x[1] is not None or x[2] is not None]
    assert len(strip(on)) == 8 and strip(on) == strip(off)
    assert [r["step"] for r in heads_records(on)] == [2, 4, 6] and heads_records(off) == []
    assert ("circuit" in heads_records(on)[-1]) == (n_layer == 2)  # one layer: no circuit
    assert not (off / "heads.png").exists()
    if n_layer == 1:
        assert (on / "heads.png").read_bytes()[:4] == b"\x89PNG"


def test_a_two_layer_run_records_the_circuit(tmp_path, no_pictures):
    run = tmp_path / "two"
    train(load_config(None, tiny_sets(tmp_path, **{"model.n_layer": 2, "train.max_steps": 2,
                                                   "train.head_scores_interval": 2})), run)
    circuit = heads_records(run)[-1]["circuit"]
    assert set(circuit) == {"previous_head", "induction_head", "k_composition", "k_baseline",
                            "dla_head", "dla", "edges", "qk"}
    assert circuit["induction_head"][0] == 1 and circuit["previous_head"][0] == 0
    assert 0 < circuit["k_composition"] < 1 and 0 < circuit["k_baseline"] < 1
    edges = circuit["edges"]
    assert len(edges["edges"]) == timeline.EDGE_RECORD_TOP
    assert all("->" in k and ":" in k for k in edges["edges"])
    assert isinstance(edges["clean"], float) and isinstance(edges["corrupted"], float)


def test_the_edge_record_finds_the_hand_built_induction_circuit():
    """With the probe's first copy replaced, the hand-built model's two strongest EAP edges (the
    next token's logit) are the induction head into the logits and the embedding into its
    value input (the token it copies). Its key edge from the previous-token head, whose real
    single-edge effect on the loss is 2.55 nats (interp.edge_graph.edge_effects, measured when
    written), scores ~0 here: the hand-built attention is saturated, so the gradient through
    the keys is ~0 (EAP's known blind spot, which `minigpt circuit --ig-steps` addresses; the
    timeline stays EAP to stay cheap)."""
    from test_head_circuits import induction_circuit_model

    model = induction_circuit_model()
    cfg = load_config(None, ["data.source=induction", "data.induction_vocab=12",
                             "model.block_size=16", "tokenizer.vocab_size=256"])
    rec = timeline.edge_record(model, cfg, bytes_tokenizer())
    top = sorted(rec["edges"], key=lambda k: -abs(rec["edges"][k]))
    assert rec["clean"] > rec["corrupted"] + 5  # the copied token's logit, then without copy
    assert set(top[:2]) == {"L1.H0->logits:logits", "embed->L1.H0:v"}
    assert model.blocks[0].attn.c_attn.weight.grad is None  # no gradient into the weights


def test_the_default_scores_heads_at_each_evaluation_and_resume_keeps_the_log(tmp_path,
                                                                            no_pictures):
    run = tmp_path / "run"
    sets = tiny_sets(tmp_path)  # eval_interval 3, max_steps 6, head scores at 'eval'
    train(load_config(None, sets), run, stop_after=3)
    assert [r["step"] for r in heads_records(run)] == [3]
    from minigpt.run.resume import resume_config

    train(resume_config(run, []), run, resume=True)
    assert [r["step"] for r in heads_records(run)] == [3, 6]
    assert kept_steps(run) == [6]  # keep_checkpoints 1 (the default): only the latest


# ---- kept checkpoints -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def keeps_two(tmp_path_factory) -> Path:
    """A 9-step run that keeps its 2 newest checkpoints (steps 6 and 9), trained once."""
    from conftest import pictures_off

    tmp = tmp_path_factory.mktemp("keeps-two")
    with pictures_off():  # no test here reads its pictures
        train(load_config(None, tiny_sets(tmp, **{"train.max_steps": 9,
                                                  "train.keep_checkpoints": 2})), tmp / "run")
    return tmp / "run"


def test_keep_checkpoints_keeps_the_newest_and_inspect_can_load_each(keeps_two):
    run = keeps_two
    assert kept_steps(run) == [6, 9]
    assert load_run(run, "cpu", step=6).step == 6 and load_run(run, "cpu").step == 9
    with pytest.raises(ArgumentError, match=r"^checkpoint 3: .* kept: 6, 9 \(train"):
        load_run(run, "cpu", step=3)


def test_an_uncommitted_step_dir_is_never_kept(tmp_path, no_pictures):
    """A save killed after its rename and before the commit leaves a newer, uncommitted step
    dir: it is not a kept checkpoint, the resume leaves it alone until its own first commit,
    which removes it."""
    from minigpt.run.resume import resume_config

    run = tmp_path / "run"
    sets = tiny_sets(tmp_path, **{"train.keep_checkpoints": 3})
    train(load_config(None, sets), run, stop_after=3)
    import shutil

    shutil.copytree(run / "checkpoints" / "step-000003", run / "checkpoints" / "step-000005")
    assert kept_steps(run) == [3]
    train(resume_config(run, []), run, resume=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest", "step-000003", "step-000006"]
    assert kept_steps(run) == [3, 6]


def test_inspect_heads_checkpoint_through_the_command(keeps_two):
    """`inspect-heads --checkpoint STEP` through the command in this process: the one error
    path the console script runs (tests/test_cli_real.py shows exit codes and stderr survive
    the process boundary for every command)."""
    from typer.testing import CliRunner

    from minigpt.cli import app

    run = keeps_two
    cmd = ["inspect-heads", "--run", str(run), "--probe", "induction", "--device", "cpu", "--json"]
    ok = CliRunner().invoke(app, [*cmd, "--checkpoint", "6"])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["step"] == 6
    bad = CliRunner().invoke(app, [*cmd, "--checkpoint", "7"])
    assert bad.exit_code == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [(
        f"error: --checkpoint 7: {run} keeps no checkpoint of that step; kept: 6, 9 "
        "(train.keep_checkpoints sets how many are kept)")]


def test_heads_png_has_every_legend_beside_its_panel_and_no_label_among_the_points():
    """heads.png read at a glance: with every panel drawn (layers, circuit, edges, QK term),
    each legend lies outside every plot area (beside its panel, not over a line), no two
    legends overlap, and no text is written among the points (the head and term names that
    overlapped are legend entries: one marker per name)."""
    recs = [{"kind": "heads", "step": s, "scores": {
        k: [[0.1 * s / 100, 0.2], [0.3, 0.4]] for k in ("induction", "previous", "duplicate")},
        "circuit": {"previous_head": [0, s // 100 % 2], "induction_head": [1, 1],
                    "k_composition": s / 1000, "k_baseline": 0.12,
                    "dla_head": [1, s // 100 % 2], "dla": s / 20,
                    "edges": {"edges": {"L0.H0->L1.H1:k": s / 100, "L1.H1->logits:logits": 1.0},
                              "clean": 0.1, "corrupted": 4.0},
                    "qk": {"term": ["embed", "L0.H0"], "margin": s / 50,
                           "top": ["embed" if s < 300 else "bias", "L0.H0", s / 50]}}}
        for s in (100, 200, 300, 400)]
    fig = timeline.timeline_figure(recs, "t")
    renderer = fig.canvas.get_renderer() if hasattr(fig.canvas, "get_renderer") else None
    if renderer is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    plots = [ax.get_window_extent(renderer) for ax in fig.axes]
    legends = [ax.get_legend().get_window_extent(renderer) for ax in fig.axes
               if ax.get_legend() is not None]
    assert len(legends) >= 4  # the scores', the circuit's, the edges' and the QK panel's
    for box in legends:
        assert not any(box.overlaps(p) for p in plots), "a legend over a plot"
    for i, a in enumerate(legends):
        assert not any(a.overlaps(b) for b in legends[i + 1:]), "two legends overlap"
    for ax in fig.axes:
        assert not [t for t in ax.texts if t.get_text()], ax.texts
    labels = [t.get_text() for ax in fig.axes if ax.get_legend()
              for t in ax.get_legend().get_texts()]
    assert "best DLA: L1.H0" in labels and "largest: bias x L0.H0" in labels
