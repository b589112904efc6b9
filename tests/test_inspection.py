"""Head scores on hand-built attention patterns, attention maps of tiny random-init models,
probes, input checks, and the file outputs (safetensors, JSON, PNG, HTML)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from minigpt.config import MinigptError, from_dict
from minigpt.core.gpt import GPT
from minigpt.data.tokenizer import bytes_tokenizer
from minigpt.heads import inspection as ins
from minigpt.heads import output
from minigpt.heads import probes as prb
from minigpt.interp import heads as sc

T = 16


def one_hot_rows(targets: list[int]) -> torch.Tensor:
    """(T, T) map whose row t puts all attention on key targets[t] (targets[t] <= t)."""
    a = torch.zeros(len(targets), len(targets))
    for t, j in enumerate(targets):
        assert j <= t
        a[t, j] = 1.0
    return a


def uniform(n: int) -> torch.Tensor:
    a = torch.ones(n, n).tril()
    return a / a.sum(-1, keepdim=True)


def scores_of(a: torch.Tensor, tokens, strs=None) -> dict[str, float]:
    s = sc.score_heads(a[None, None], tokens, strs)
    return {k: float(v[0, 0]) for k, v in s.items()}


REPEATED = list(range(10, 10 + T // 2)) * 2  # r_0..r_7 r_0..r_7, no repeat within a copy


# --------------------------------------------------------------------------------------------
# Scores on hand-built patterns


def test_perfect_previous_token_head_scores_one():
    s = scores_of(one_hot_rows([0] + list(range(T - 1))), list(range(T)))
    assert s["previous"] == pytest.approx(1.0)
    assert s["self"] == 0.0 and s["entropy"] == pytest.approx(0.0, abs=1e-6)
    assert s["local"] == pytest.approx(1.0)
    assert sc.dominant_type(s) == "previous"


def test_uniform_head_scores_low_and_is_diffuse():
    s = scores_of(uniform(64), list(range(64)))
    for name in ("previous", "first", "self"):
        assert s[name] < 0.1, name
    assert s["local"] < 0.3
    assert s["entropy"] == pytest.approx(1.0, abs=1e-5)
    assert sc.dominant_type(s) == "diffuse"


def test_perfect_induction_head_scores_one():
    half = T // 2
    # queries of the second copy (t = half + i) attend to i + 1; first-copy queries to 0
    targets = [0] * half + [t - half + 1 for t in range(half, T)]
    s = scores_of(one_hot_rows(targets), REPEATED)
    assert s["induction"] == pytest.approx(1.0)
    assert s["duplicate"] == 0.0 and s["previous"] < 0.2
    assert sc.dominant_type(s) == "induction"
    # a previous-token head on the same probe is no induction head
    prev = scores_of(one_hot_rows([0] + list(range(T - 1))), REPEATED)
    assert prev["induction"] == 0.0 and prev["previous"] == 1.0


def test_duplicate_first_and_self_heads():
    half = T // 2
    dup = scores_of(one_hot_rows(list(range(half)) + [t - half for t in range(half, T)]),
                    REPEATED)
    assert dup["duplicate"] == pytest.approx(1.0) and dup["induction"] == 0.0
    sink = scores_of(one_hot_rows([0] * T), list(range(T)))
    assert sink["first"] == pytest.approx(1.0) and sc.dominant_type(sink) == "first"
    diag = scores_of(torch.eye(T), list(range(T)))
    assert diag["self"] == pytest.approx(1.0) and sc.dominant_type(diag) == "self"


def test_scores_that_do_not_apply_are_nan():
    s = scores_of(uniform(T), list(range(T)))  # no token repeats
    assert math.isnan(s["induction"]) and math.isnan(s["duplicate"])
    assert math.isnan(s["delimiter"])  # no token strings given
    assert sc.dominant_type(s) == "diffuse"


def test_delimiter_head_scores_high_and_uniform_does_not():
    strs = ["a", " ", "b", "."] * (T // 4)
    last_delim = [max([j for j in range(t) if strs[j] in (" ", ".")], default=0) for t in range(T)]
    s = scores_of(one_hot_rows(last_delim), list(range(T)), strs)
    assert s["delimiter"] > 0.9 and sc.dominant_type(s) == "delimiter"
    assert scores_of(uniform(T), list(range(T)), strs)["delimiter"] == pytest.approx(0, abs=1e-6)


def test_scores_keep_leading_dims_and_lie_in_unit_interval():
    a = torch.softmax(torch.randn(3, 5, T, T).masked_fill(~torch.ones(T, T).tril().bool(),
                                                          float("-inf")), -1)
    s = sc.score_heads(a, REPEATED, ["x", "."] * (T // 2))
    assert set(s) == set(sc.SCORE_NAMES)
    for name, v in s.items():
        assert v.shape == (3, 5), name
        assert ((v >= -1e-6) & (v <= 1 + 1e-6)).all(), name


def test_score_heads_rejects_mismatched_tokens():
    with pytest.raises(ValueError):
        sc.score_heads(uniform(T)[None], list(range(T - 1)))


# --------------------------------------------------------------------------------------------
# Attention maps of a real (tiny, random-init) model


def tiny_model(**model) -> GPT:
    sec = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, "vocab_size": 257, **model}
    return GPT.from_config(from_dict({"model": sec}), seed=0)


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_maps_are_causal_distributions_with_the_right_shape(pos):
    model = tiny_model(pos_encoding=pos)
    tokens = list(range(40, 60))
    attn, diff = ins.attention_maps(model, tokens)
    assert attn.shape == (2, 2, 20, 20) and attn.dtype == torch.float32
    assert torch.allclose(attn.sum(-1), torch.ones(2, 2, 20), atol=1e-5)
    assert (attn.triu(1) == 0).all()
    assert diff < 1e-4


def test_explicit_vs_sdpa_check_uses_sdpa_even_for_an_explicit_run():
    model = tiny_model(attn_impl="explicit")
    insp = ins.inspect(model, prb.ProbeInput(list(range(12)), ["x"] * 12, "text"))
    assert insp.parity_ok and insp.parity_max_diff < 1e-4
    assert model.cfg.attn_impl == "explicit"  # restored


def test_a_probes_token_strings_are_not_scored_as_delimiters():
    """inspect() reads whether the strings are text from the input (`is_text`), not from its
    label: the same ids and strings score a delimiter head as text and nothing as a probe."""
    tokens, strs = list(range(12)), [" ", "a", ".", "b"] * 3
    as_text = ins.inspect(tiny_model(), prb.ProbeInput(tokens, strs, "probe:lookalike"))
    as_probe = ins.inspect(tiny_model(), prb.ProbeInput(tokens, strs, "text", is_text=False))
    assert not torch.isnan(as_text.scores["delimiter"]).any()
    assert torch.isnan(as_probe.scores["delimiter"]).all()


def test_explicit_vs_sdpa_check_detects_a_broken_explicit_path(monkeypatch):
    model = tiny_model()
    real = model.forward_with_attention

    def skewed(idx, scale=None):
        logits, maps = real(idx, scale)
        return logits + 0.01, maps

    monkeypatch.setattr(model, "forward_with_attention", skewed)
    insp = ins.inspect(model, prb.ProbeInput(list(range(12)), ["x"] * 12, "text"))
    assert insp.parity_max_diff == pytest.approx(0.01, rel=1e-3) and not insp.parity_ok


def test_inspection_json_has_every_head_and_no_nan():
    insp = ins.inspect(tiny_model(), prb.ProbeInput(list(range(12)), ["x"] * 12, "text"))
    doc = json.loads(json.dumps(insp.to_json(), allow_nan=False))
    assert len(doc["heads"]) == 4 and doc["heads"][0]["induction"] is None
    assert doc["heads"][0]["dominant"] in (*sc.SCORE_NAMES, "diffuse", "mixed")


# --------------------------------------------------------------------------------------------
# Probes and input checks


def test_probes_are_seeded_and_shaped():
    pool = list(range(64))
    ind = prb.probe_tokens("induction", 32, pool, seed=3)
    assert ind == prb.probe_tokens("induction", 32, pool, seed=3)
    assert ind != prb.probe_tokens("induction", 32, pool, seed=4)
    assert ind[:16] == ind[16:] and len(set(ind[:16])) == 16 and set(ind) <= set(pool)
    prev = prb.probe_tokens("previous", 32, pool)
    assert len(set(prev)) == 32
    dup = prb.probe_tokens("duplicate", 32, pool)
    assert len(set(dup)) <= 8 and len(dup) == 32
    small = prb.probe_tokens("induction", 32, [5, 6])  # pool smaller than half: with repeats
    assert small[:16] == small[16:] and set(small) <= {5, 6}
    with pytest.raises(MinigptError, match="valid: induction, previous, duplicate"):
        prb.probe_tokens("nope", 32, pool)


def cfg_for(source: str = "text", block: int = 32):
    return from_dict({"model": {"block_size": block, "vocab_size": 257},
                      "tokenizer": {"vocab_size": 256},
                      "data": {"source": source, "induction_vocab": 40}})


def test_probe_pool_matches_the_runs_vocabulary():
    tok = bytes_tokenizer()
    assert prb.probe_pool(cfg_for("induction"), tok) == list(range(40))
    assert prb.probe_pool(cfg_for("text"), tok) == list(range(256))  # no <|endoftext|>


def test_prepare_input_text_probe_and_truncation():
    tok = bytes_tokenizer()
    inp = prb.prepare_input(cfg_for(), tok, text="hello")
    assert inp.tokens == list(b"hello") and inp.token_strs == list("hello") and not inp.truncated
    long = prb.prepare_input(cfg_for(), tok, text="x" * 100)
    assert len(long.tokens) == 32 and long.truncated and long.n_text_tokens == 100
    short = prb.prepare_input(cfg_for(), tok, text="x" * 100, max_tokens=10)
    assert len(short.tokens) == 10
    probe = prb.prepare_input(cfg_for("induction"), tok, probe="induction")
    assert len(probe.tokens) == 32 and probe.source == "probe:induction"
    default = prb.prepare_input(cfg_for(), tok)
    assert default.source == "default text" and len(default.tokens) == 32


@pytest.mark.parametrize("kwargs, match", [
    ({"text": ""}, "^text: the text is empty"),
    ({"text": " \n\t"}, "^text: the text is empty"),
    ({"text": "a", "probe": "induction"}, "^text and probe exclude each other"),
    ({"text": "abc", "max_tokens": 33}, r"valid: 2\.\.32"),
    ({"text": "abc", "max_tokens": 1}, r"valid: 2\.\.32"),
])
def test_prepare_input_errors(kwargs, match):
    with pytest.raises(MinigptError, match=match):
        prb.prepare_input(cfg_for(), bytes_tokenizer(), **kwargs)


def test_text_file_errors(tmp_path):
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "nul").write_bytes(b"abc\x00def")
    (tmp_path / "empty").write_bytes(b"")
    for name, match in (("bin", "not UTF-8"), ("nul", "NUL bytes"), ("empty", "empty"),
                        ("missing", "no such file"), (".", r"not a regular file \(a directory\)")):
        with pytest.raises(MinigptError, match=match):
            prb.prepare_input(cfg_for(), bytes_tokenizer(), text_file=tmp_path / name)


def test_a_long_text_file_is_read_from_its_start_only(tmp_path):
    """--text-file reads what max_tokens tokens can reach (with room to spare), and those
    tokens are the whole file's first ones; a file that starts with blank space is no
    'empty text' when only its start was read."""
    from minigpt.infer.inputs import text_budget

    tok = bytes_tokenizer()
    path = tmp_path / "long.txt"
    path.write_text("été and the rest " * 20000, encoding="utf-8")  # ~360 KB
    inp = prb.prepare_input(cfg_for(block=32), tok, text_file=path, max_tokens=20)
    assert inp.tokens == tok.encode(path.read_text(encoding="utf-8"))[:20]
    assert inp.file_bytes == path.stat().st_size and inp.truncated
    assert inp.n_text_tokens <= text_budget(tok, 20)  # bytes tokenizer: a token per byte
    path.write_text(" " * 400_000 + "words")
    inp = prb.prepare_input(cfg_for(block=32), tok, text_file=path)
    assert inp.token_strs == [" "] * 32 and inp.file_bytes == 400_005


def test_select_heads_and_formats():
    assert ins.select_heads(2, 4) == ([0, 1], [0, 1, 2, 3])
    assert ins.select_heads(2, 4, [1, 1], [3, 0]) == ([1], [0, 3])
    with pytest.raises(MinigptError, match=r"^layer 2: out of range; valid: 0\.\.1"):
        ins.select_heads(2, 4, [2])
    with pytest.raises(MinigptError, match=r"^head -1: out of range; valid: 0\.\.3"):
        ins.select_heads(2, 4, [], [-1])
    assert output.parse_formats([]) == ["table"]
    assert output.parse_formats(["png,html", "PNG", "json"]) == ["png", "html", "json"]
    with pytest.raises(MinigptError, match="valid: table, png, html, safetensors, json"):
        output.parse_formats(["gif"])


# --------------------------------------------------------------------------------------------
# Files


@pytest.fixture(scope="module")
def insp() -> ins.Inspection:
    model = tiny_model()
    tokens = list(range(60, 80))
    strs = ["<script>window.__pwned=1</script>", "</script><b>x", " ", "\n", "$x$", "&amp;"]
    strs = (strs * 4)[:20]
    return ins.inspect(model, prb.ProbeInput(tokens, strs, "test"), run="runs/x", step=3)


def test_out_dir_must_be_writable(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(MinigptError, match="^out .*cannot write there"):
        output.make_out_dir(tmp_path / "file" / "sub")
    assert output.make_out_dir(tmp_path / "a" / "b").is_dir()
    assert not list((tmp_path / "a" / "b").iterdir())  # the write probe leaves nothing


def test_safetensors_dump_loads_with_plain_safetensors(insp, tmp_path):
    from safetensors import safe_open

    path = output.write_safetensors(insp, tmp_path / "a.safetensors")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        attn = f.get_tensor("attention")
        tokens = f.get_tensor("tokens")
    assert attn.shape == (2, 2, 20, 20) and attn.dtype.name == "float32"
    assert torch.equal(torch.from_numpy(attn), insp.attention)
    assert tokens.tolist() == insp.tokens
    assert json.loads(meta["tokens"]) == insp.tokens
    assert json.loads(meta["token_strs"]) == insp.token_strs
    assert meta["run"] == "runs/x" and meta["step"] == "3"


def test_json_file_round_trips(insp, tmp_path):
    doc = json.loads(output.write_json(insp, tmp_path / "s.json", [1], [0]).read_text())
    assert [(h["layer"], h["index"]) for h in doc["heads"]] == [(1, 0)]
    assert doc["token_strs"] == insp.token_strs


def test_pngs_are_produced_and_not_blank(insp, tmp_path):
    import matplotlib.image

    from minigpt.heads.attention_png import write_pngs

    paths = write_pngs(insp, tmp_path, [(0, 1)])
    assert [p.name for p in paths] == ["attention_grid.png", "attention_L0_H1.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
        img = matplotlib.image.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 200
        assert img[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.parametrize("tokens", [
    [60, 32, 61, 60, 32, 61],  # 6 tokens, every score applies: the longest title, smallest figure
    list(range(60, 80)),
    [60 + (i % 7) for i in range(90)],
])
def test_head_png_text_lies_inside_the_image(tokens):
    """Issue #15 finding 7: the per-head title (all eight scores on one line) ran off the
    right edge. Every drawn text (title, axis and tick labels, colour bar) now lies inside."""
    from matplotlib.text import Text

    from minigpt.heads.attention_png import head_figure

    insp = ins.inspect(tiny_model(), prb.ProbeInput(tokens, [chr(t) for t in tokens], "text"),
                       run="r", step=1)
    if len(tokens) == 6:  # the case that overflowed: all eight scores in the title
        assert not any(math.isnan(v) for v in insp.head_scores(0, 1).values())
    fig = head_figure(insp, 0, 1)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    W, H = fig.bbox.width, fig.bbox.height
    texts = [a for a in fig.findobj(Text) if a.get_visible() and a.get_text().strip()]
    assert any("entropy" in a.get_text() for a in texts)  # the title is among them
    for a in texts:
        box = a.get_window_extent(renderer)
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= W + 0.5 and box.y1 <= H + 0.5, (
            a.get_text(), box, (W, H))


def test_html_is_self_contained_and_escapes_tokens(insp, tmp_path):
    from minigpt.heads.viewer import write_html

    html = write_html(insp, tmp_path / "v.html", [(1, 1)]).read_text(encoding="utf-8")
    assert len(html) > 10000
    # exactly our two script elements: the data block and the viewer code
    assert len(re.findall(r"<script\b", html, flags=re.IGNORECASE)) == 2
    assert "window.__pwned" in html and "<script>window.__pwned" not in html
    assert "</script><b>" not in html
    assert not re.search(r"(src|href)=\"(https?:)?//", html)  # nothing from the network
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    data = re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', html,
                     flags=re.DOTALL).group(1)
    assert "<" not in data and ">" not in data and "&" not in data
    doc = json.loads(data)
    assert doc["strs"] == insp.token_strs and doc["first"] == [1, 1]
    row5 = doc["attn"][0][1][15:21]  # lower triangle: query 5 starts at 5*6/2 = 15
    assert row5 == pytest.approx(insp.attention[0, 1, 5, :6].tolist(), abs=1e-4)


def test_html_csp_hash_matches_the_inline_script(insp):
    import base64
    import hashlib

    from minigpt.heads.viewer import render_html

    html = render_html(insp)
    code = re.findall(r"<script>(.*?)</script>", html, flags=re.DOTALL)
    assert len(code) == 1
    digest = base64.b64encode(hashlib.sha256(code[0].encode()).digest()).decode()
    assert f"'sha256-{digest}'" in html


def test_files_are_written_atomically(insp, tmp_path, monkeypatch):
    path = tmp_path / "s.json"
    path.write_text("old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("minigpt.files.os.replace", boom)
    with pytest.raises(MinigptError, match="no space left"):
        output.write_json(insp, path)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_default_text_is_cut_to_a_tiny_context():
    # the default text must fit a tiny context: truncated with a note, not an error
    inp = prb.prepare_input(cfg_for(block=8), bytes_tokenizer())
    assert len(inp.tokens) == 8 and inp.truncated
