"""Compiled programs whose circuit is known (minigpt.truth), without tracr: tracr's weights of two
built-in programs are stored as fixtures (tests/fixtures/compiled/, written by
tools/truth_fixture.py), so the conversion is checked against tracr's own residual streams, and
a run made from them is opened by every command. The slow tier compiles every built-in program
with tracr itself (tests/test_truth_tracr.py)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import error_line, in_process
from safetensors.numpy import load_file

from minigpt.data.tokenizer import Tokenizer, WordTokenizer
from minigpt.errors import MinigptError
from minigpt.interp import edge_graph as G
from minigpt.interp.recovery import auroc, largest_false, precision_recall
from minigpt.run import load_run
from minigpt.truth.store import (
    Truth,
    build_model,
    compiled_config,
    compiled_tokenizer,
    read_truth,
    write_compiled_run,
)

FIXTURES = Path(__file__).parent / "fixtures" / "compiled"
PROGRAMS = ("induction", "frac_prevs")


def fixture(name: str) -> tuple[dict, dict, dict]:
    """(compiled.json, tracr's params, tracr's outputs) of a stored compiled program."""
    where = FIXTURES / name
    doc = json.loads((where / "compiled.json").read_text())
    return (doc, load_file(str(where / "tracr_params.safetensors")),
            load_file(str(where / "tracr_outputs.safetensors")))


def fixture_model(name: str):
    doc, params, _ = fixture(name)
    cfg = compiled_config(doc["program"], doc["dims"], len(doc["output"]["directions"]))
    return doc, cfg, build_model(cfg, params, doc["dims"], doc["residual"],
                                 doc["output"]["directions"])


def make_compiled_run(name: str, out: Path) -> Path:
    """A run directory of a stored compiled program, as `minigpt compile` writes it."""
    doc, cfg, model = fixture_model(name)
    t = doc["truth"]
    truth = Truth(doc["program"], doc["output"], t["directions"], t["nodes"], t["edges"],
                  {"fixture": name})
    metrics = {"step": 0, "kind": "compiled", "inputs": 0, "max_residual_diff": 0.0,
               "outputs_equal": True}
    return write_compiled_run(out, cfg, model, compiled_tokenizer(doc["program"],
                                                                  doc["input_ids"]),
                              truth, metrics)


@pytest.fixture(scope="module")
def induction_run(tmp_path_factory) -> Path:
    return make_compiled_run("induction", tmp_path_factory.mktemp("runs") / "induction")


# --------------------------------------------------------------------------------------------
# The conversion.


@pytest.mark.parametrize("name", PROGRAMS)
def test_the_converted_model_computes_tracrs_residual_stream_and_output(name):
    from minigpt.core.gpt import ForwardSpec
    from minigpt.interp.patching import Record

    class MidBlock(Record):  # the stream each MLP reads: after the layer's attention
        def mlp_in(self, layer, x):
            self.mlp[("in", layer)] = x
            return x

    doc, cfg, model = fixture_model(name)
    _, _, theirs = fixture(name)
    ids = torch.tensor([[doc["input_ids"][t] for t in row] for row in doc["inputs"]])
    mid = MidBlock()
    with torch.no_grad():
        stream = model.residual_stream(ids, attn=ForwardSpec(intervention=mid))
        logits = model(ids)[0]
    for layer in range(cfg.model.n_layer):  # tracr: after each attention and each MLP
        for i, ours in ((2 * layer, mid.mlp[("in", layer)]), (2 * layer + 1, stream[layer + 1])):
            diff = (ours - torch.from_numpy(theirs[f"residual_{i}"])).abs().max()
            assert float(diff) <= 1e-5, (i, float(diff))
    out = torch.from_numpy(theirs["output"])[:, 1:]
    if doc["output"]["kind"] == "categorical":
        assert torch.equal(logits.argmax(-1)[:, 1:], out.long())
    else:
        assert float((logits[..., 0][:, 1:] - out).abs().max()) <= 1e-5
    m = cfg.model
    assert (m.norm, m.activation, m.pos_encoding, m.tie_weights) == \
        ("none", "relu", "learned", False)
    assert m.head_dim == doc["dims"]["head_dim"] != m.n_embd // m.n_head
    assert model.lm_head.weight.shape == (len(doc["output"]["directions"]), m.n_embd)


def test_each_true_edge_is_read_by_weights_that_are_there():
    """The truth (from tracr's graph) against the converted weights: every edge it names is a
    reader whose input weights are non-zero on the directions it carries, taken from a writer
    whose output weights are (a truth made up, or a conversion that lost a weight, fails)."""
    doc, cfg, model = fixture_model("induction")
    index = {label: i for i, label in enumerate(doc["residual"])}
    H, D = cfg.model.n_head, cfg.model.head_dim
    for e in doc["truth"]["edges"]:
        dims = [index[f"{c['variable']}:{v}"] if c["values"] else index[c["variable"]]
                for c in e["carries"] for v in (c["values"] or [None])]
        if e["to"] == "logits":
            read = model.lm_head.weight[:, dims]
        else:
            layer, head = (int(x[1:]) for x in e["to"].split("."))
            w = model.blocks[layer].attn.c_attn.weight.view(3, H, D, -1)
            read = w["qkv".index(e["input"]), head][:, dims]
        assert bool(read.abs().sum(0).gt(0).all()), e
        if e["from"] == "embed":
            wrote = model.wte.weight[:, dims].abs().sum(0) + model.wpe.weight[:, dims].abs().sum(0)
        else:
            layer, head = (int(x[1:]) for x in e["from"].split("."))
            wrote = model.blocks[layer].attn.c_proj.weight.view(-1, H, D)[dims, head].abs().sum(1)
        assert bool(wrote.gt(0).all()), e
    kinds = {n["node"]: n["kind"] for n in doc["truth"]["nodes"]}
    assert kinds == {"L0.H0": "previous", "L1.H0": "induction"}


# --------------------------------------------------------------------------------------------
# The run: an ordinary run that every command opens.


def test_the_run_is_ordinary_and_its_truth_reads_back(induction_run):
    loaded = load_run(induction_run, "cpu")
    assert loaded.eot_first and loaded.cfg.data.source == "program"
    tok = loaded.tokenizer
    assert isinstance(tok, WordTokenizer) and tok.token_str(tok.eot_id) == "BOS"
    assert tok.decode(tok.encode("a b  c")) == "a b c"
    truth = read_truth(induction_run)
    assert truth.program["name"] == "induction" and len(truth.edges) == 8
    assert len(truth.directions) == loaded.cfg.model.n_embd
    assert not list(induction_run.parent.glob(".*compile*"))  # no temp left beside it
    r = in_process(["runs", "--run", str(induction_run)])
    assert r.returncode == 0 and "compiled" in r.stdout


def test_inspect_heads_types_the_programs_heads_and_qk_names_the_reason(induction_run):
    r = in_process(["inspect-heads", "--run", induction_run, "--probe", "induction",
                    "--qk", "L1.H0", "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    types = {(h["layer"], h["index"]): h["dominant"] for h in doc["heads"]}
    assert types == {(0, 0): "previous", (1, 0): "induction"}
    terms = doc["qk"][0]["terms"]
    assert (terms[0]["query"], terms[0]["key"]) == ("embed.tok", "L0.H0")


def test_circuit_scores_every_finder_against_the_truth(induction_run):
    r = in_process(["circuit", "--run", induction_run, "--pairs", "4", "--patch-from", "mean",
                    "--json"])
    assert r.returncode == 0, r.stderr
    truth = json.loads(r.stdout)["truth"]
    assert truth["edges"] == 8 and truth["revealed"] == 8
    for name in ("eap", "eap-ig", "patching"):
        assert truth["finders"][name]["auroc"]["all"] == 1.0
        assert truth["finders"][name]["largest_false"] == 0.0  # a non-edge scores its zero
    assert truth["circuit"]["recall"] == 1.0
    assert {h["head"]: (h["program"], h["typed"]) for h in truth["heads"]} == \
        {"L0.H0": ("previous", "previous"), "L1.H0": ("induction", "induction")}


def test_resampled_inputs_cannot_reveal_what_only_positions_carry(induction_run):
    r = in_process(["circuit", "--run", induction_run, "--pairs", "4", "--json"])
    assert r.returncode == 0, r.stderr
    truth = json.loads(r.stdout)["truth"]
    hidden = [(e["from"], e["to"], e["input"]) for e in truth["true_edges"] if not e["revealed"]]
    assert set(hidden) == {("embed", "L0.H0", "q"), ("embed", "L0.H0", "k"),
                           ("embed", "L1.H0", "k")}  # indices, one and BOS's token: no tokens
    for e in truth["true_edges"]:
        if not e["revealed"]:
            assert all(v == 0.0 for v in e["scores"].values()), e
    assert all(f["auroc"]["revealed"] == 1.0 for f in truth["finders"].values())


@pytest.mark.parametrize("source", ["resample", "zero"])
def test_a_programs_edges_split_by_position(induction_run, source):
    """A compiled model has no norm and a head width of its own (model.d_head): `--positions`
    splits its edges as they are. Every edge's positions sum to its score, a non-edge has none
    (exactly 0 everywhere), the previous-token head reaches the induction head's key at a
    later query (i < j), and the position-aware curve is there beside the summed one."""
    extra = [] if source == "resample" else ["--patch-from", source]
    r = in_process(["circuit", "--run", induction_run, "--pairs", "2", "--positions",
                    "--json", *extra])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    true = {(e["from"], e["to"], e["input"]) for e in doc["truth"]["true_edges"]}
    for e in doc["edges"]:
        at = e.get("positions", [])
        assert abs(sum(x["score"] for x in at) - e["score"]) < 1e-5, e
        assert at or e["score"] == 0.0
        if (e["from"], e["to"], e["input"]) not in true:
            assert not at, e
    key = next(e for e in doc["edges"] if (e["from"], e["to"], e["input"])
               == ("L0.H0", "L1.H0", "k"))
    assert any(x["from_pos"] < x["to_pos"] and abs(x["score"]) > 1e-3 for x in key["positions"])
    for name in ("eap-ig@positions", "eap-ig@summed"):
        assert doc["curves"][name][-1]["recovered"] == pytest.approx(1.0, abs=1e-6)


def test_the_circuit_table_fits_80_columns(induction_run):
    r = in_process(["circuit", "--run", induction_run, "--pairs", "2", "--no-curve"],
                   COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert all(len(line) <= 80 for line in r.stdout.splitlines()) and "…" not in r.stdout
    assert "against the truth of induction" in r.stdout and "truth: 8 edges" in r.stderr
    # nothing cut at the edge, no name broken: every finder's column is there, and each of
    # the program's edges is one row that names its variables whole
    assert re.search(r"\beap\s+eap-ig\s+patching\b", r.stdout), r.stdout
    rows = [line.split() for line in r.stdout.splitlines()
            if re.match(r"\s*(embed|L\d\.H\d|L\d\.MLP)\s+(L\d|logits)", line)]
    assert "previous_token" in r.stdout and len([w for w in rows if w[2] in "qkv"]) >= 6


def test_sample_prints_the_programs_output(induction_run):
    r = in_process(["sample", "--run", induction_run, "-p", "a b c a b", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["output"][3:] == ["b", "c"]  # after the earlier a, b


@pytest.mark.parametrize("args, expect", [
    (["inspect-heads", "--text", "a b q"], "'q' is not a token of the program's vocabulary"),
    (["inspect-heads", "--text", "BOS a"], "'BOS' is the beginning token"),
    (["inspect-heads", "--dla"], "--dla: scores next-token predictions"),
    (["inspect-heads", "--ablate", "zero"], "--ablate: scores next-token predictions"),
    (["circuit", "--probe", "induction"], "--probe: does not apply to a compiled program"),
    (["circuit", "--patch-from", "corrupted-first"], "--patch-from: 'corrupted-first' is not"),
    (["circuit", "--patch-from", "zero", "--patch-direction", "denoising"],
     "--patch-from and --patch-direction exclude each other"),
    (["export", "--out", "OUT"], "model.norm is 'none'"),
])
def test_what_does_not_apply_to_a_program_is_one_line(induction_run, tmp_path, args, expect):
    args = [str(tmp_path / "x") if a == "OUT" else a for a in args]
    r = in_process([*args, "--run", induction_run])
    assert expect in error_line(r), r.stderr
    assert not (tmp_path / "x").exists()


def test_compile_refuses_an_unknown_program_and_leaves_nothing(tmp_path):
    r = in_process(["compile", "inductoin", "--out", tmp_path / "x"])
    assert "'inductoin' is not a built-in program" in error_line(r)
    assert not (tmp_path / "x").exists()
    r = in_process(["compile", "--list"])
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) >= 6


def test_compile_refuses_an_out_in_use(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("mine")
    r = in_process(["compile", "induction", "--out", tmp_path / "x"])
    assert "never overwrites" in error_line(r)
    assert (tmp_path / "x" / "keep").read_text() == "mine"


def test_compile_without_tracr_says_how_to_install_it(tmp_path):
    import importlib.util

    if importlib.util.find_spec("tracr") is not None:
        pytest.skip("tracr is installed here, so its absence cannot be shown")
    r = in_process(["compile", "induction", "--out", tmp_path / "x"])
    assert "pip install 'minigpt-lab[truth]'" in error_line(r)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------
# The pieces.


def test_auroc_ranks_ties_by_half_and_ignores_what_is_no_edge():
    nan = math.nan
    scores = torch.tensor([[3.0, -2.0, 0.0], [0.0, 1.0, nan]], dtype=torch.float64)
    truth = torch.tensor([[True, True, False], [False, False, False]])
    assert auroc(scores, truth) == 1.0
    assert auroc(scores, torch.tensor([[False, False, True], [True, False, False]])) == 0.0
    tied = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, nan]], dtype=torch.float64)
    assert auroc(tied, truth) == pytest.approx(4 / 6)  # 6 pairs: 4 ties (1/2 each), 2 wins
    assert auroc(scores, torch.zeros(2, 3, dtype=torch.bool)) is None
    assert precision_recall(truth, truth) == (1.0, 1.0)
    assert precision_recall(torch.ones(2, 3, dtype=torch.bool), truth) == (2 / 6, 1.0)
    assert largest_false(scores, truth) == 1.0


@pytest.mark.parametrize("source", ["zero", "mean"])
def test_an_ablation_patches_every_edge_to_its_source(source, tmp_path):
    """On an ordinary run: all edges patched from the ablation is the ablated run; none is the
    clean one; a single edge's real effect is the patched run's change."""
    from conftest import make_run

    from minigpt.heads.edge_circuit import circuit_pairs

    loaded = load_run(make_run(tmp_path / "tiny", top_files=True), "cpu")
    p = circuit_pairs(loaded.cfg, loaded.tokenizer, patch_from=source, probe="induction",
                      pairs=2)
    assert p.corrupted == source
    patcher = G.Patcher(loaded.model, p.clean, source, p.metric, p.targets)
    valid = patcher.graph.valid()
    none, every = patcher.run(torch.stack([torch.zeros_like(valid), valid]))
    assert float(none) == pytest.approx(patcher.m_base, abs=1e-6)
    assert float(every) == pytest.approx(patcher.m_source, abs=1e-9)
    assert abs(patcher.m_source - patcher.m_base) > 1e-3
    result = G.find_circuit(loaded.model, p.clean, source, p.metric, p.targets, ig_steps=3,
                            curves=False)
    assert result.recovered >= 0.9 and set(result.rankings) == {"eap", "eap-ig"}


def test_the_ablation_flags_in_circuit(tmp_path):
    from conftest import make_run

    run = make_run(tmp_path / "tiny", top_files=True)
    r = in_process(["circuit", "--run", run, "--probe", "induction", "--patch-from", "mean",
                    "--edges", "3", "--no-curve", "--json"])
    assert r.returncode == 0, r.stderr
    assert "mean: every edge's source value" in r.stderr
    assert "truth" not in json.loads(r.stdout)


def test_a_word_tokenizer_saves_loads_and_refuses_strangers(tmp_path):
    tok = WordTokenizer({b"a": 2, b"(": 3, b"10": 4}, {"BOS": 0}, "program-x")
    tok.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert isinstance(back, WordTokenizer) and back.hash == tok.hash
    assert back.encode(" 10\ta ( ") == [4, 2, 3] and back.n_vocab == 5
    assert back.encode("BOS a", allow_special=True) == [0, 2]
    with pytest.raises(MinigptError, match="'ab' is not a token"):
        back.encode("a ab")
    assert np.array_equal(back.token_byte_lengths()[[2, 3, 4]], [1, 1, 2])


def test_hooks_on_a_compiled_models_modules_fire():
    """The no-norm blocks' nn.Identity, the MLP's layers and the output read are modules like
    any other: a forward hook on each fires, and one that changes an output changes the
    program's output."""
    doc, _, model = fixture_model("induction")
    ids = torch.tensor([[doc["input_ids"][t] for t in doc["inputs"][0]]])
    seen = []
    for name in ("blocks.0.ln_1", "blocks.1.mlp.c_fc", "ln_f", "lm_head"):
        model.get_submodule(name).register_forward_hook(
            lambda m, i, o, name=name: seen.append(name))
    with torch.no_grad():
        clean = model(ids)[0]
    assert seen == ["blocks.0.ln_1", "blocks.1.mlp.c_fc", "ln_f", "lm_head"]
    model.blocks[1].attn.c_proj.register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    with torch.no_grad():
        assert not torch.equal(model(ids)[0], clean)  # the induction head silenced


def test_the_lens_of_a_program_names_its_output_values(induction_run):
    r = in_process(["circuit", "--run", induction_run, "--pairs", "1", "--no-curve", "--lens",
                    "--json"])
    assert r.returncode == 0, r.stderr
    lens = json.loads(r.stdout)["lens"]
    assert {rec["top_str"] for rec in lens} <= {"a", "b", "c", "d"}


def test_train_refuses_a_compiled_run_and_leaves_it_as_it_was(induction_run, tmp_path):
    before = sorted(p.name for p in induction_run.iterdir())
    r = in_process(["train", "--out", induction_run, "--resume"])
    assert "is a compiled program" in error_line(r), r.stderr
    assert sorted(p.name for p in induction_run.iterdir()) == before  # no lock left either
    r = in_process(["train", "--set", "data.source=program", "--out", tmp_path / "new"])
    assert "it is not trained" in error_line(r) and not (tmp_path / "new").exists()
