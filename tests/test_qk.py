"""QK attribution (minigpt.interp.qk): a head's score split into (query writer x key writer)
terms. The terms add up to the model's own score and margin (float64: <= 1e-5, in fact ~1e-12)
for every position scheme, norm, QK-norm, MLPs and biases; the scores are the model's (their
softmax is forward_with_attention's attention); the margins are the scores minus their means
over the query's keys; `inspect-heads --qk` renders the library's numbers (table, JSON,
safetensors, PNG) and refuses bad input with one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SHARP_INDUCTION, attention_maps_unrendered, error_line, in_process, make_run
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import load_config
from minigpt.config.fields import comma_list
from minigpt.core.gpt import GPT
from minigpt.errors import ArgumentError
from minigpt.interp.qk import (
    induction_pairs,
    parse_pairs,
    qk_attribution,
    resolve_heads,
)

CONFIGS = {
    "learned-mlp-bias": ["model.pos_encoding=learned", "model.mlp=true", "model.bias=true"],
    "rope-bias": ["model.pos_encoding=rope", "model.mlp=false", "model.bias=true"],
    "rope-qknorm-rmsnorm-mlp": ["model.pos_encoding=rope", "model.qk_norm=true",
                                "model.norm=rmsnorm", "model.mlp=true", "model.bias=false"],
    "sinusoidal-qknorm": ["model.pos_encoding=sinusoidal", "model.qk_norm=true",
                          "model.mlp=true", "model.bias=true"],
    "none": ["model.pos_encoding=none", "model.mlp=false", "model.bias=false"],
}
T = 10


def tiny(sets: list[str], dtype=torch.float64) -> GPT:
    """A 3-layer model whose norms and biases are not 1 and 0 (every constant shows)."""
    cfg = load_config(None, ["model.vocab_size=40", "model.n_layer=3", "model.n_head=2",
                             "model.n_embd=16", "model.block_size=12", *sets])
    model = GPT.from_config(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(dtype).eval()


def every_pair(n: int) -> list[tuple[int, int, int]]:
    return [(0, t, s) for t in range(n) for s in range(t + 1)]


@pytest.fixture(scope="module", params=list(CONFIGS))
def split(request):
    """The model of each config and its last layer's heads split at every (query, key)."""
    model = tiny(CONFIGS[request.param])
    idx = torch.randint(0, 40, (1, T), generator=torch.Generator().manual_seed(2))
    heads = [(2, 0), (2, 1), (0, 1)]
    return model, idx, qk_attribution(model, idx, heads, every_pair(T))


def test_the_terms_add_up_to_the_score_and_the_margin(split):
    _, _, res = split
    for h in res:
        assert h.closure <= 1e-5
        assert (h.grid.sum((1, 2)) - h.scores).abs().max() <= 1e-10
        assert (h.margin_grid.sum((1, 2)) - h.margins).abs().max() <= 1e-10
        assert h.writers[-1] == "bias" and h.grid.shape[1:] == (len(h.writers),) * 2


def test_the_scores_are_the_models_attention(split):
    """softmax over each query's keys of the summed terms = forward_with_attention's weights."""
    model, idx, res = split
    _, probs = model.forward_with_attention(idx)
    for h in res:
        scores = torch.full((T, T), float("-inf"), dtype=torch.float64)
        for p, (_, t, s) in enumerate(h.pairs):
            scores[t, s] = h.grid[p].sum()
        assert torch.allclose(scores.softmax(-1), probs[h.layer][0, h.head], atol=1e-10)


def test_the_margin_is_the_score_minus_its_mean_over_the_keys(split):
    _, _, res = split
    for h in res:
        for p, (_, t, s) in enumerate(h.pairs):
            row = [q for q, (_, t2, _) in enumerate(h.pairs) if t2 == t]
            mean = h.grid[row].mean(0)  # every term's mean over the keys 0..t
            assert torch.allclose(h.margin_grid[p], h.grid[p] - mean, atol=1e-12)
            assert float(h.margins[p]) == pytest.approx(
                float(h.scores[p] - h.scores[row].mean()), abs=1e-12)


def test_the_writers_are_the_graphs_nodes(split):
    model, _, res = split
    cfg = model.cfg
    h = next(r for r in res if r.layer == 2)
    embed = ["embed.tok", "embed.pos"] if cfg.pos_encoding in ("learned", "sinusoidal") \
        else ["embed"]
    per_layer = lambda la: [f"L{la}.H0", f"L{la}.H1", *([f"L{la}.MLP"] if cfg.mlp else [])]
    assert h.writers == [*embed, *per_layer(0), *per_layer(1), "bias"]
    assert next(r for r in res if r.layer == 0).writers == [*embed, "bias"]


def test_float32_closes_too_and_pairs_default_to_the_most_attended_key():
    model = tiny(CONFIGS["rope-qknorm-rmsnorm-mlp"], torch.float32)
    idx = torch.randint(0, 40, (1, T), generator=torch.Generator().manual_seed(3))
    (h,) = qk_attribution(model, idx, [(1, 1)])
    _, probs = model.forward_with_attention(idx)
    assert [t for _, t, _ in h.pairs] == list(range(1, T))
    assert [s for _, _, s in h.pairs] == probs[1][0, 1, 1:].argmax(-1).tolist()
    assert h.closure < 1e-4
    assert h.grid.dtype == torch.float64 and model.training is False


def test_a_term_that_adds_the_same_to_every_key_has_no_margin():
    """Layer 0 of a model without positions: the key side's bias (the norm's beta and b_K)
    is the same at every key, so every (query writer, bias) term has margin 0 whatever its
    score."""
    model = tiny(["model.pos_encoding=none", "model.bias=true"])
    idx = torch.randint(0, 40, (1, T), generator=torch.Generator().manual_seed(4))
    (h,) = qk_attribution(model, idx, [(0, 0)], every_pair(T))
    b = h.writers.index("bias")
    assert h.margin_grid[:, :, b].abs().max() < 1e-12 < h.grid[:, :, b].abs().max()


def test_head_names_are_the_circuits_and_pairs_are_checked():
    cfg = tiny(CONFIGS["none"]).cfg
    assert resolve_heads(cfg, comma_list(["L1.H0,L0.H1", "L1.H0"])) == [(1, 0), (0, 1)]
    assert len(resolve_heads(cfg, ["all"])) == 6
    for bad in ("L9.H9", "L1H0", "L0.MLP", "embed", "1.0", ""):
        with pytest.raises(ArgumentError, match="qk"):
            resolve_heads(cfg, [bad])
    assert parse_pairs(comma_list(["7:3, 9:5", "2:2"]), 10) == [(0, 7, 3), (0, 9, 5), (0, 2, 2)]
    for bad, why in (("3:5", "after query"), ("10:1", "past the input"), ("3-5", "QUERY:KEY"),
                     ("-1:0", "QUERY:KEY")):
        with pytest.raises(ArgumentError, match=why):
            parse_pairs([bad], 10)
    with pytest.raises(ArgumentError, match="1 token"):
        qk_attribution(tiny(CONFIGS["none"]), torch.tensor([[3]]), [(0, 0)])


def test_induction_pairs_are_the_key_after_the_earlier_copy():
    tokens = [5, 6, 7, 8, 5, 6, 7, 8]
    assert induction_pairs(tokens, 4) == [(0, 4, 1), (0, 5, 2), (0, 6, 3), (0, 7, 4)]


# ---- the command ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("runs") / "tiny", **SHARP_INDUCTION)


def invoke(run_dir: Path, *args: str):
    return CliRunner().invoke(app, ["inspect-heads", "--run", str(run_dir), "--device", "cpu",
                                    *args], env={"COLUMNS": "100"}, catch_exceptions=False)


def library(run_dir: Path, heads, pairs=None):
    from minigpt.heads.probes import prepare_input
    from minigpt.run import load_run

    loaded = load_run(run_dir, "cpu")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    if pairs is None:
        pairs = induction_pairs(inp.tokens, inp.positions[0])
    return qk_attribution(loaded.model, torch.tensor([inp.tokens]), heads, pairs)


def test_json_is_the_librarys_in_the_issues_shape(run_dir):
    r = invoke(run_dir, "--probe", "induction", "--qk", "L1.H2", "--qk", "L1.H0", "--json",
               "--qk-pairs", "induction")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [e["head"] for e in doc["qk"]] == ["L1.H2", "L1.H0"]
    assert [(e["layer"], e["index"]) for e in doc["qk"]] == [(1, 2), (1, 0)]
    assert "induction targets" in doc["qk_pairs"]
    for entry, h in zip(doc["qk"], library(run_dir, [(1, 2), (1, 0)])):
        assert [(p["batch"], p["query"], p["key"]) for p in entry["pairs"]] == h.pairs
        for p, row in enumerate(entry["pairs"]):
            assert row["score"] == pytest.approx(float(h.scores[p]), abs=1e-6)
            assert row["margin"] == pytest.approx(float(h.margins[p]), abs=1e-6)
        assert len(entry["terms"]) == len(h.writers) ** 2
        assert set(entry["terms"][0]) == {"query", "key", "score", "margin"}
        margins = [t["margin"] for t in entry["terms"]]
        assert margins == sorted(margins, reverse=True)
        assert sum(margins) == pytest.approx(float(h.margins.mean()), abs=1e-4)
        assert sum(t["score"] for t in entry["terms"]) == pytest.approx(
            float(h.scores.mean()), abs=1e-4)


def test_each_head_is_split_at_its_own_keys_unless_pairs_are_given(run_dir):
    """`--qk all` on the induction probe: each head at its own most attended key of each query
    of the second copy (not every head at the induction targets, keys a layer-0 head does not
    look at), said per head with how many of its pairs are the induction targets; every
    writer that has a role on this input is named with it."""
    from minigpt.heads.probes import prepare_input
    from minigpt.interp.heads import attention_maps
    from minigpt.run import load_run

    r = invoke(run_dir, "--probe", "induction", "--qk", "all", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    loaded = load_run(run_dir, "cpu")
    inp = prepare_input(loaded.cfg, loaded.tokenizer, probe="induction")
    attn, _ = attention_maps(loaded.model, inp.tokens, "cpu")
    first = inp.positions[0]
    targets = set(induction_pairs(inp.tokens, first))
    assert "its own most attended key" in doc["qk_pairs"]
    for e in doc["qk"]:
        own = [(0, t, int(attn[e["layer"], e["index"], t, :t + 1].argmax()))
               for t in range(first, len(inp.tokens))]
        assert [(p["batch"], p["query"], p["key"]) for p in e["pairs"]] == own
        hit = sum(p in targets for p in own)
        assert e["pairs_are"].startswith(f"{len(own)} pairs") and \
            f"{hit} of them the induction targets" in e["pairs_are"]
    roles = doc["qk_writer_roles"]
    for row in doc["heads"]:
        name = row["head"]
        assert (name in roles) == (row["dominant"] in ("induction", "previous", "duplicate",
                                                       "first", "self", "delimiter"))
        if name in roles:
            assert roles[name]["score"] == pytest.approx(row[row["dominant"]], abs=1e-3)
    table = invoke(run_dir, "--probe", "induction", "--qk", "all")
    assert table.exit_code == 0
    for name, role in roles.items():
        assert f"{name} ({role['role']} {role['score']:.2f})" in table.stdout
    words = " ".join(table.stdout.split())  # the captions wrap at words
    assert words.count("of them the induction targets") == len(doc["qk"])


def test_the_table_names_the_pairs_and_the_closure(run_dir):
    r = invoke(run_dir, "--probe", "induction", "--qk", "L1.H1", "--qk-pairs", "20:9,15:4")
    assert r.exit_code == 0, r.stderr
    title = next(line for line in r.stdout.splitlines() if "why it attends" in line)
    assert title.strip().startswith("L1.H1") and "2 pairs (20:9, 15:4)" in r.stdout
    assert "query:key 20:9, 15:4" in r.stderr and "closure" in r.stdout
    (h,) = library(run_dir, [(1, 1)], [(0, 20, 9), (0, 15, 4)])
    q, k, _, margin = h.terms()[0]
    first = next(line for line in r.stdout.splitlines() if line.strip().startswith(q + " "))
    assert k in first and f"{margin:+.3f}" in first


def test_the_files(run_dir, tmp_path):
    from safetensors.torch import load_file

    r = invoke(run_dir, "--probe", "induction", "--qk", "L0.H1,L1.H2", "--format",
               "safetensors", "--out", str(tmp_path), "--qk-pairs", "induction")
    assert r.exit_code == 0, r.stderr
    with attention_maps_unrendered():  # qk_L1_H2.png is read here, not the attention maps
        r = invoke(run_dir, "--probe", "induction", "--qk", "L1.H2", "--format", "png", "--out",
                   str(tmp_path / "png"))
    assert r.exit_code == 0, r.stderr
    assert (tmp_path / "png" / "qk_L1_H2.png").read_bytes()[:4] == b"\x89PNG"
    grids = load_file(tmp_path / "qk.safetensors")
    (h,) = library(run_dir, [(1, 2)])
    assert torch.equal(grids["L1.H2.margin"], h.margin_grid)
    assert torch.equal(grids["L1.H2.score"], h.grid)
    assert grids["L1.H2.pairs"].tolist() == [list(p) for p in h.pairs]
    assert grids["L0.H1.score"].shape[1:] == (2, 2)  # embed and bias


def test_the_viewer_carries_the_grid(run_dir, tmp_path):
    r = invoke(run_dir, "--probe", "induction", "--qk", "L1.H2", "--format", "html", "--out",
               str(tmp_path))
    assert r.exit_code == 0, r.stderr
    page = (tmp_path / "attention.html").read_text()
    assert 'id="qk-section"' in page and '"L1.H2":{"writers":["embed"' in page


@pytest.mark.parametrize("args, expect", [
    (["--qk", "L9.H9"], "--qk: 'L9.H9' is not a head of this model"),
    (["--qk", "L1H2"], "--qk: 'L1H2' is not a head"),
    (["--qk", "L1.H2", "--qk-pairs", "3:5"], "--qk-pairs: 3:5: key 5 is after query 3"),
    (["--qk", "L1.H2", "--qk-pairs", "40:1"], "--qk-pairs: 40:1: query 40 is past"),
    (["--qk-pairs", "3:1"], "--qk-pairs: chooses the pairs of --qk"),
    (["--qk", "L1.H2", "--text", "a"], "--qk: the input has 1 token"),
])
def test_bad_input_is_one_line_exit_2(run_dir, args, expect):
    assert expect in error_line(invoke(run_dir, *args))


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["--qk", "L9.H9"], "'L9.H9' is not a head"), (["--qk", "L1.X"], "'L1.X' is not a head"),
    (["--qk", "L1.H2", "--qk-pairs", "3:5"], "key 5 is after query 3"),
    (["--qk", "L1.H2", "--text", "a"], "the input has 1 token")])
def test_the_installed_command_refuses_bad_input(run_dir, tmp_path, args, needle):
    program = shutil.which("minigpt")
    assert program, "the `minigpt` console script is not on PATH: pip install -e ."
    r = subprocess.run([program, "inspect-heads", "--run", str(run_dir), "--device", "cpu",
                        *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_in_process_works_like_the_command(run_dir, tmp_path):
    r = in_process(["inspect-heads", "--run", str(run_dir), "--device", "cpu", "--qk", "all",
                    "--text", "abcdefabcdef"], cwd=tmp_path, COLUMNS="80")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("why it attends where it does") == 6
    assert "each head at its own most attended key of each query (positions 1..11" in r.stderr


def test_qk_pairs_induction_needs_the_induction_probe_and_pairs_are_bounded(run_dir):
    """`--qk-pairs induction` names the probe's targets (refused on a text); a position of more
    digits than any input has, or an item that is not QUERY:KEY, is one line; an empty item
    between commas and a pair given twice are taken once."""
    r = invoke(run_dir, "--text", "abcdefgh", "--qk", "L1.H0", "--qk-pairs", "induction")
    assert r.exit_code == 2 and "--probe induction" in r.stderr
    for bad in ("9" * 5000 + ":1", "3-1", "x"):
        r = invoke(run_dir, "--text", "abcdefgh", "--qk", "L1.H0", "--qk-pairs", bad)
        assert r.exit_code == 2 and "--qk-pairs" in r.stderr and len(r.stderr) < 400
    r = invoke(run_dir, "--text", "abcdefgh", "--qk", "L1.H0,,L0.H1", "--qk-pairs",
               "5:2,,5:2,6:1", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [e["head"] for e in doc["qk"]] == ["L1.H0", "L0.H1"]
    assert [(p["query"], p["key"]) for p in doc["qk"][0]["pairs"]] == [(5, 2), (6, 1)]


def test_piped_tables_wrap_their_words_at_word_boundaries(run_dir):
    """At 80 columns (a pipe), a table's title and caption are lines of their own, as wide as
    the terminal: every word whole and on one line (`closure` and its figure were broken apart
    inside a caption squeezed to the table's width)."""
    import re

    r = invoke(run_dir, "--probe", "induction", "--qk", "L1.H2", "--composition")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("split at "))
    caption = []
    for line in lines[start:]:
        caption.append(line)
        if "closure" in line and re.search(r"closure \d\.\de[-+]\d\d", " ".join(caption)):
            break
    assert all(len(x) <= 100 and not x.startswith(" ") for x in caption), caption
    words = " ".join(caption).split()
    assert re.fullmatch(r"\d\.\de[-+]\d\d", words[-1]) and words[-2] == "closure", words[-3:]
    assert all(not line.startswith("  ") for line in lines if "from = the earlier head" in line)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_cost_counts_the_writers_the_split_makes(name):
    """interp.qk.writer_count, the count qk_cost prices, is the number of writers the split
    of a head of each layer actually has (embedding parts, biases, earlier heads and MLPs)."""
    from minigpt.interp.qk import writer_count

    model = tiny(CONFIGS[name])
    idx = torch.randint(0, 40, (1, 4), generator=torch.Generator().manual_seed(0))
    for h in qk_attribution(model, idx, [(la, 0) for la in range(3)], every_pair(4)[:2]):
        assert len(h.writers) == writer_count(model.cfg, h.layer), (h.layer, h.writers)
