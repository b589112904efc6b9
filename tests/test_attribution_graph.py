"""`minigpt circuit --format graph` (minigpt/heads/attribution_graph.py) and `--positions`: the
attribution graph validates against Neuronpedia's published graph schema (vendored as
tests/data/graph-schema.json: Neuronpedia's "Anthropic Attribution Graph" JSON Schema,
draft-07, from its webapp's graph API), its links join its nodes, its logit labels carry the
viewer's `(p=...)`, its influence is the viewer's cumulative share, each head node's QK split
is the one `inspect-heads --qk` prints; the JSON's position lists sum to the edges' scores; bad
input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARP_INDUCTION, error_line, make_run
from typer.testing import CliRunner

from minigpt.cli import app
from minigpt.config import from_dict
from minigpt.heads.attribution_graph import scan_of

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev dependency "
                                 "(pip install -e '.[dev]')")
SCHEMA = json.loads((Path(__file__).parent / "data" / "graph-schema.json").read_text())
PROBE = ("--probe", "induction", "--patch-from", "corrupted")


def invoke(*args: str):
    return CliRunner().invoke(app, [*args], catch_exceptions=False)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    """The tiny run's circuit as a graph, and its JSON with positions."""
    run = make_run(tmp_path_factory.mktemp("runs") / "tiny", **SHARP_INDUCTION)
    out = tmp_path_factory.mktemp("graph")
    r = invoke("circuit", "--run", str(run), "--device", "cpu", *PROBE, "--ig-steps", "3",
               "--format", "graph", "--out", str(out), "--slug", "tiny-induction", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads((out / "tiny-induction.json").read_text())
    return {"run": run, "out": out, "doc": doc, "json": json.loads(r.stdout)}


def test_the_graph_validates_against_neuronpedias_schema(graph):
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = list(jsonschema.Draft7Validator(SCHEMA).iter_errors(graph["doc"]))
    assert errors == []
    broken = {**graph["doc"], "nodes": [{"node_id": "x"}]}  # the check can fail
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(broken))
    listed = json.loads((graph["out"] / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listed] == ["tiny-induction"]
    assert listed[0]["scan"] == "tiny" and listed[0]["node_threshold"] == 0.8


def test_links_join_nodes_at_positions(graph):
    doc = graph["doc"]
    ids = [n["node_id"] for n in doc["nodes"]]
    assert len(ids) == len(set(ids))
    assert all(e["source"] in ids and e["target"] in ids for e in doc["links"])
    assert doc["links"] and all(e["weight"] != 0 for e in doc["links"])
    T = len(doc["metadata"]["prompt_tokens"])
    emb = sorted(n["ctx_idx"] for n in doc["nodes"] if n["feature_type"] == "embedding")
    assert emb == list(range(T))  # every position's token
    heads = [n for n in doc["nodes"] if n["feature_type"] == "lorsa"]
    assert heads and all(n["layer"] in ("0", "1") and 0 <= n["ctx_idx"] < T for n in heads)
    metric = graph["json"]["metric"]
    logits = [n for n in doc["nodes"] if n["feature_type"] == "logit"]
    assert sorted(n["ctx_idx"] for n in logits) == metric["positions"]
    for n in logits:  # the viewer reads p from the label
        p = float(n["clerp"].split("(p=")[1].split(")")[0])
        assert 0 <= p <= 1 and abs(p - n["token_prob"]) < 5e-4


def test_influence_is_the_viewers_cumulative_share(graph):
    nodes = [n for n in graph["doc"]["nodes"] if n["feature_type"] != "logit"]
    inf = [n["influence"] for n in nodes]
    assert all(0 < x <= 1 for x in inf)
    # the viewer keeps a node while its influence is at most the slider's value: at the
    # graph's threshold the pruned graph keeps heads; the most influential node comes first
    kept = [n for n in nodes if n["feature_type"] == "lorsa"
            and n["influence"] <= graph["doc"]["metadata"]["node_threshold"]]
    assert kept
    assert min(inf) < 0.5 < max(inf)


def test_head_nodes_carry_the_qk_split_inspect_heads_prints(graph):
    doc = graph["doc"]
    head = next(n for n in doc["nodes"] if n.get("qk_tracing_results") and n["layer"] == "1")
    res = head["qk_tracing_results"]
    layer, index, t = head["node_id"].split("_")
    key = int(head["clerp"].split("@")[1].split(":")[0])
    r = invoke("inspect-heads", "--run", str(graph["run"]), "--device", "cpu", "--probe",
               "induction", "--qk", f"L{layer}.H{index}", "--qk-pairs", f"{t}:{key}", "--json")
    assert r.exit_code == 0, r.stderr
    terms = json.loads(r.stdout)["qk"][0]["terms"]
    top = res["pair_wise_contributors"]
    assert len(top) == min(10, len(terms))
    for (q_id, k_id, margin), term in zip(top, terms):
        assert abs(margin - term["margin"]) < 1e-4
        assert _writer(q_id, int(t)) == term["query"] and _writer(k_id, key) == term["key"]
    # the marginals: each writer's terms summed over the other side
    by_query = {}
    for term in terms:
        by_query[term["query"]] = by_query.get(term["query"], 0.0) + term["margin"]
    q_id, q_sum = res["top_q_marginal_contributors"][0]
    assert abs(q_sum - by_query[_writer(q_id, int(t))]) < 1e-4
    assert abs(q_sum - max(by_query.values())) < 1e-4


def _writer(node_id: str, pos: int) -> str:
    """The writer name (interp/qk.py's) of a node id at position pos."""
    if node_id == "bias":
        return "bias"
    first, second, at = node_id.split("_")
    assert int(at) == pos
    return "embed" if first == "E" else f"L{first}.H{second}"


def test_json_positions_sum_to_each_edges_score(graph):
    edges = graph["json"]["edges"]
    assert all("positions" in e for e in edges)
    for e in edges:
        total = sum(p["score"] for p in e["positions"])
        assert abs(total - e["score"]) < 1e-5, e
        for p in e["positions"]:
            assert p["from_pos"] <= p["to_pos"] if e["input"] in ("k", "v") else \
                p["from_pos"] == p["to_pos"]
    assert any(e["input"] == "k" and any(p["from_pos"] < p["to_pos"] for p in e["positions"])
               for e in edges)


def test_the_table_names_positions_by_their_tokens(graph):
    r = invoke("circuit", "--run", str(graph["run"]), "--device", "cpu", *PROBE, "--ig-steps",
               "2", "--positions", "--top", "5", "--no-curve")
    assert r.exit_code == 0, r.stderr
    assert "strongest edges by position" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line.strip()[:2] in
            ("1 ", "2 ", "3 ")]
    assert len(rows) == 3 and all(row[2].isdigit() for row in rows)


def test_scan_is_gpt2_small_for_an_imported_gpt2_small():
    small = from_dict({"model": {"n_layer": 12, "n_head": 12, "n_embd": 768,
                                 "vocab_size": 50257, "block_size": 1024,
                                 "pos_encoding": "learned"}})
    small.run.name = "openai-community/gpt2"
    assert scan_of(small, None) == "gpt2-small"
    assert scan_of(small, Path("runs/x")) == "x"  # a run of that shape is a run
    other = from_dict({"model": {"n_layer": 2}})
    other.run.name = "me/my model"
    assert scan_of(other, None) == "me-my-model"


@pytest.mark.parametrize("args, needle", [
    (["--format", "graph", "--slug", "my/graph"], "--slug my/graph: must be 1 to 100 letters"),
    (["--format", "graph", "--slug", "a b"], "--slug a b: must be"),
    (["--positions", "--ig-steps", "0"], "--ig-steps 0: must be at least 1"),
    (["--positions", "--ig-steps", "1000000000"], "--ig-steps 1000000000: 1000000000 steps"),
])
def test_bad_input_is_one_line(graph, args, needle):
    r = invoke("circuit", "--run", str(graph["run"]), "--device", "cpu", *PROBE, *args)
    line = error_line(r)
    assert needle in line, line


def test_an_output_directory_that_is_a_file_is_one_line(graph, tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    r = invoke("circuit", "--run", str(graph["run"]), "--device", "cpu", *PROBE, "--format",
               "graph", "--out", str(afile))
    line = error_line(r)
    assert "--out" in line and str(afile) in line
    assert afile.read_text() == "x"


def test_graphs_in_one_directory_are_listed_together(graph, tmp_path):
    import shutil

    out = tmp_path / "graphs"
    shutil.copytree(graph["out"], out)
    args = ["circuit", "--run", str(graph["run"]), "--device", "cpu", *PROBE, "--ig-steps", "1",
            "--no-curve", "--format", "graph", "--out", str(out)]
    r = invoke(*args, "--slug", "second")
    assert r.exit_code == 0, r.stderr
    listed = json.loads((out / "graph-metadata.json").read_text())["graphs"]
    assert [g["slug"] for g in listed] == ["tiny-induction", "second"]
    r = invoke(*args, "--slug", "tiny-induction")  # the same slug again: replaced, not doubled
    listed = json.loads((out / "graph-metadata.json").read_text())["graphs"]
    assert r.exit_code == 0 and [g["slug"] for g in listed] == ["second", "tiny-induction"]
    (out / "graph-metadata.json").write_text('{"graphs": 3}')
    line = error_line(invoke(*args, "--slug", "third"))
    assert "graph-metadata.json: not the viewer's list of graphs" in line
    assert not (out / "third.json").exists()


def test_the_graphs_memory_is_part_of_the_cost_and_refused_when_it_cannot_fit(graph, tmp_path,
                                                                               monkeypatch):
    """--format graph holds its N x N links at once (N = the writers at every position and the
    logits): on a machine with too little memory free for them, one line naming the graph's
    size and the fix (fewer tokens), nothing written; the same search without the graph runs."""
    from minigpt import device
    from minigpt.heads.attribution_graph import graph_bytes
    from minigpt.interp.edge_graph import graph_of
    from minigpt.run import load_run

    cfg = load_run(graph["run"], "cpu").cfg.model
    n = graph_of(cfg).n_writers * 24 + 24
    assert graph_bytes(cfg, 24) == 32.0 * n * n  # grows with the square of the tokens
    assert graph_bytes(cfg, 48) > 3.9 * graph_bytes(cfg, 24)
    monkeypatch.setattr(device, "available_bytes", lambda d: 5e5)  # 0.5 MB free
    out = tmp_path / "g"
    r = invoke("circuit", "--run", str(graph["run"]), "--device", "cpu", *PROBE, "--ig-steps",
               "1", "--format", "graph", "--out", str(out), "--max-tokens", "24")
    line = error_line(r)
    assert "attribution graph of 24 tokens alone holds" in line and "fewer tokens" in line, line
    assert not out.exists() or not any(out.iterdir())
