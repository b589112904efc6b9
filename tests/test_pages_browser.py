"""Every page minigpt makes, opened in headless Chromium as a person would, on the default
induction run (configs/induction.yaml, trained here) and on an imported GPT-2-shaped model: the
inspect-heads viewer (one score row per head, the chosen head's pattern drawn, the QK grid of
the split head), features.html (a section per feature, a column per head), the circuit page
(the table of edges, both pictures drawn), and the circuit as
an attribution graph in circuit-tracer's own viewer served by its own server (its nodes drawn,
as many as the JSON keeps after the viewer's pruning, its links drawn, a head node's panel
naming the QK terms `inspect-heads --qk` prints: for the induction head, embed x the
previous-token head first); no error or warning in the console on any page; a screenshot of
each kept in test-artifacts/browser/ (tests/browser.py). Skips, saying why, without Chromium,
chromedriver, selenium or the viewer's libraries."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from browser import Routed, console_errors, make_driver, screenshot, viewer_libs

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
GPT2_TEXT = "the cat sat on the mat and the dog sat on the log"
GPT2_CORRUPT = "the dog sat on the log and the cat sat on the mat"  # the same words, swapped


def minigpt(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "minigpt", *args], cwd=cwd, env=ENV,
                       capture_output=True, text=True, timeout=1800, check=False)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = make_driver(tmp_path_factory.mktemp("chromium-profile"))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def induction(tmp_path_factory):
    """configs/induction.yaml trained until its heads form (at most 3,000 steps): the induction
    and previous-token heads by their probe scores."""
    root = tmp_path_factory.mktemp("induction")
    minigpt("train", "--config", "induction", "--out", "runs/induction", "--set",
            "run.seed=3011", "--set", "train.max_steps=3000", cwd=root)
    r = minigpt("inspect-heads", "--run", "runs/induction", "--probe", "induction", "--json",
                cwd=root)
    heads = json.loads(r.stdout)["heads"]
    best = {k: max((h for h in heads if h["layer"] == la), key=lambda h: h[k] or 0)
            for k, la in (("induction", 1), ("previous", 0))}
    return {"cwd": root, "args": ["--run", "runs/induction", "--probe", "induction"],
            "patch": ["--patch-from", "corrupted"], "name": "induction",
            "induction": best["induction"]["head"],
            "previous": best["previous"]["head"], "n_layer": 2, "n_head": 4}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A 2-layer, 4-head GPT-2 (transformers' own classes, random weights) with a BPE."""
    transformers = pytest.importorskip("transformers", reason="transformers (the dev extra)")
    import torch
    from conftest import perturb
    from test_hf import EOT, save_tokenizer, train_bpe

    root = tmp_path_factory.mktemp("gpt2")
    bpe = train_bpe()
    eot = bpe.token_to_id(EOT)
    config = transformers.GPT2Config(vocab_size=bpe.get_vocab_size(), bos_token_id=eot,
                                     eos_token_id=eot, n_layer=2, n_head=4, n_embd=64,
                                     n_positions=128)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    perturb(model, 0)
    model.save_pretrained(root / "gpt2")
    save_tokenizer(bpe, root / "gpt2", "json")
    return {"cwd": root, "args": ["--model", "gpt2", "--text", GPT2_TEXT],
            "patch": ["--patch-from", GPT2_CORRUPT], "name": "gpt2", "induction": "L1.H0",
            "previous": None, "n_layer": 2, "n_head": 4}


MODELS = ["induction", "gpt2"]


@pytest.fixture(params=MODELS)
def model(request):
    return request.getfixturevalue(request.param)


def _drawn(driver, canvas_js: str) -> int:
    """How many pixels of a canvas are not transparent."""
    return driver.execute_script(
        "const c = " + canvas_js + "; const d = c.getContext('2d').getImageData(0, 0, c.width,"
        " c.height).data; let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++;"
        " return n;")


def test_the_inspect_heads_viewer(driver, model, tmp_path):
    head = model["induction"]
    minigpt("inspect-heads", *model["args"], "--format", "html", "--qk", head, "--out",
            str(tmp_path), cwd=model["cwd"])
    console_errors(driver)
    driver.get((tmp_path / "attention.html").as_uri())
    rows = driver.execute_script("return document.querySelectorAll('#scores tbody tr').length")
    assert rows == model["n_layer"] * model["n_head"]  # one row per head
    assert _drawn(driver, "document.getElementById('map')") > 1000  # the pattern drawn
    terms = driver.execute_script("return [...document.querySelectorAll('#glossary dt')]"
                                  ".map(e => e.textContent)")
    assert len(terms) == len(set(terms)), terms  # each word explained once ("local" was twice)
    from selenium.webdriver.support.ui import Select

    layer, index = head[1:].split(".H")
    Select(driver.find_element("id", "layer")).select_by_value(layer)
    Select(driver.find_element("id", "head")).select_by_value(index)
    cells = driver.execute_script("return [...document.querySelectorAll('#qk tr')]"
                                  ".map(r => r.textContent)")
    assert len(cells) > 2 and driver.find_element("id", "qk-section").is_displayed()
    assert console_errors(driver) == []
    screenshot(driver, f"inspect-heads-{model['name']}.png")
    driver.execute_script("document.getElementById('qk-section').scrollIntoView()")
    screenshot(driver, f"inspect-heads-{model['name']}-qk.png")


def test_features_html(driver, model, tmp_path):
    sae = tmp_path / "sae"
    text = []
    if model["name"] != "induction":
        (tmp_path / "text.txt").write_text((GPT2_TEXT + " ") * 150)
        text = ["--text-file", str(tmp_path / "text.txt")]
    minigpt("features", "train", *model["args"][:2], *text, "--layer", "1", "--steps", "30",
            "--tokens", "800", "--held-out", "200", "--out", str(sae), cwd=model["cwd"])
    minigpt("features", "show", "--sae", str(sae), *model["args"][:2], *text, "--format",
            "html", "--out", str(tmp_path), cwd=model["cwd"])
    page = next(tmp_path.glob("*.html"))
    console_errors(driver)
    driver.get(page.as_uri())
    sections = driver.execute_script("return document.querySelectorAll('section').length")
    heads = driver.execute_script("return document.querySelectorAll('section th').length")
    assert sections > 0 and heads == sections * model["n_head"]
    assert console_errors(driver) == []
    screenshot(driver, f"features-{model['name']}.png")


def test_the_circuit_page(driver, model, tmp_path):
    minigpt("circuit", *model["args"], *model["patch"], "--format", "html,json", "--positions",
            "--out", str(tmp_path), cwd=model["cwd"])
    edges = json.loads((tmp_path / "circuit.json").read_text())["edges"]
    console_errors(driver)
    driver.get((tmp_path / "circuit.html").as_uri())
    rows = driver.execute_script("return document.querySelectorAll('#edges tbody tr').length")
    assert rows == min(len(edges), 500) and all("positions" in e for e in edges)
    widths = driver.execute_script("return [...document.images].map(i => i.naturalWidth)")
    assert len(widths) == 2 and min(widths) > 100  # circuit.png and faithfulness.png, drawn
    assert "edges recover" in driver.find_element("id", "summary").text
    assert console_errors(driver) == []
    screenshot(driver, f"circuit-page-{model['name']}.png")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(graphs: Path, port: int) -> subprocess.Popen:
    """circuit-tracer's own local server (`python -m circuit_tracer start-server`)."""
    env = {**ENV, "PYTHONPATH": str(viewer_libs())}
    proc = subprocess.Popen([sys.executable, "-m", "circuit_tracer", "start-server",
                             "--graph_file_dir", str(graphs), "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    raise AssertionError("circuit-tracer's server did not start")


def test_the_graph_in_circuit_tracers_viewer(driver, model, tmp_path):
    viewer_libs()
    slug = f"{model['name']}-circuit"
    minigpt("circuit", *model["args"], *model["patch"], "--format", "graph", "--out",
            str(tmp_path), "--slug", slug, "--no-curve", cwd=model["cwd"])
    doc = json.loads((tmp_path / f"{slug}.json").read_text())
    threshold = doc["metadata"]["node_threshold"]
    shown = [n for n in doc["nodes"] if n["feature_type"] in ("embedding", "logit")
             or n["influence"] <= threshold]  # the viewer's own pruning at its default
    head = _clicked_head(doc, model["induction"])
    port = _free_port()
    server = _serve(tmp_path, port)
    try:
        with Routed(driver) as routed:
            console_errors(driver)
            driver.get(f"http://localhost:{port}/index.html?slug={slug}"
                       f"&clickedId={head['node_id']}")
            for _ in range(100):  # the viewer draws once its data and libraries are in
                if driver.execute_script("return document.querySelectorAll("
                                         "'.link-graph text.node').length"):
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            drawn = driver.execute_script(
                "return document.querySelectorAll('.link-graph text.node').length")
            links = sum(_drawn(driver, f"document.querySelectorAll('.link-graph canvas')[{i}]")
                        for i in range(4))
            title = driver.execute_script(
                "return document.querySelector('.node-connections .feature-title')?.textContent")
            errors = console_errors(driver)
            screenshot(driver, f"circuit-tracer-{model['name']}.png")
        assert len(routed.seen) >= 6  # the viewer's six scripts came from the npm packages
    finally:
        server.terminate()
        server.wait(10)
    assert errors == []
    assert drawn == len(shown) and drawn > 0
    assert links > 100
    assert title == head["clerp"]
    _check_qk(model, head, title)


def _clicked_head(doc: dict, name: str) -> dict:
    """The node of head `name` (L1.H2) with a QK split whose influence is smallest (the most
    important place it acts at)."""
    layer, index = name[1:].split(".H")
    nodes = [n for n in doc["nodes"] if n["feature_type"] == "lorsa" and n["layer"] == layer
             and n["feature"] == int(index) and "qk_tracing_results" in n]
    assert nodes, f"no node of {name} in the graph"
    return min(nodes, key=lambda n: n["influence"])


def _check_qk(model, head: dict, title: str) -> None:
    """The panel's label names the split's top terms as `inspect-heads --qk` prints them."""
    t = head["ctx_idx"]
    key = int(title.split("@")[1].split(":")[0])
    r = minigpt("inspect-heads", *model["args"], "--qk", model["induction"], "--qk-pairs",
                f"{t}:{key}", "--json", cwd=model["cwd"])
    terms = json.loads(r.stdout)["qk"][0]["terms"]
    first = f"{terms[0]['query']} x {terms[0]['key']} {terms[0]['margin']:+.2f}"
    assert first in title, (first, title)
    if model["previous"] is not None:  # the induction head: the textbook term first
        assert (terms[0]["query"], terms[0]["key"]) == ("embed", model["previous"])
