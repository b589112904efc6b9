"""What a head does at every distance (interp.heads' offset profile and lag scores) on hand-built
attention patterns, the logit lens (interp.lens) on tiny models, and how inspect-heads shows
both (table, JSON, viewer, lens.png). TransformerLens parity of the lens is in
test_transformer_lens.py (slow)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import induction_inspection
from rich.console import Console

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT
from minigpt.interp import heads as h
from minigpt.interp.lens import logit_lens, point_names


def shifted(T: int, back: int) -> torch.Tensor:
    """A head attending from every query t >= back to t - back (earlier queries: to 0)."""
    a = torch.zeros(T, T)
    for t in range(T):
        a[t, t - back if t >= back else 0] = 1.0
    return a


def random_attention(L: int, H: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, H, T, T, generator=g) * 3
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return logits.masked_fill(~mask, float("-inf")).softmax(-1)


def test_the_offset_profile_is_where_a_head_looks():
    T = 20
    prof = h.offset_profile(torch.stack([shifted(T, 1), shifted(T, 6)]), max_offset=8)
    assert prof.shape == (2, 9)
    assert prof[0, 1] == 1.0 and prof[0, 2:].abs().sum() == 0  # every query t >= 1 at t-1
    assert prof[1, 6] == 1.0 and prof[1, 7:].abs().sum() == 0
    # queries 0..5 attend to key 0, at distance t: one of the T - d queries at each d < 6
    assert prof[1, :6].tolist() == pytest.approx([1 / (T - d) for d in range(6)])
    short = h.offset_profile(shifted(4, 1), max_offset=8)
    assert torch.isnan(short[4:]).all() and not torch.isnan(short[:4]).any()  # d > T-1


def test_lag_one_is_the_previous_and_the_induction_score():
    ids = [5, 1, 9, 3, 5, 1, 9, 3, 2, 5, 9, 9, 1]  # repeats at several distances
    attn = random_attention(2, 3, len(ids))
    scores = h.score_heads(attn, ids)
    lags = h.lag_scores(attn, ids, max_lag=5)
    assert lags["previous"].shape == lags["induction"].shape == (2, 3, 5)
    assert torch.allclose(lags["previous"][..., 0], scores["previous"], atol=1e-6)
    assert torch.allclose(lags["induction"][..., 0], scores["induction"], atol=1e-6)
    for k in range(1, 6):  # previous at lag k: the mean of A[t, t-k]
        want = attn.diagonal(offset=-k, dim1=-2, dim2=-1).mean(-1)
        assert torch.allclose(lags["previous"][..., k - 1], want, atol=1e-6)


def test_induction_at_lag_k_by_brute_force():
    ids = [4, 7, 4, 2, 7, 7, 4, 1, 2, 4, 7, 0]
    attn = random_attention(1, 2, len(ids), seed=3)
    lags = h.lag_scores(attn, ids, max_lag=6)["induction"]
    T = len(ids)
    for k in range(1, 7):
        masses = []
        for t in range(T):
            keys = {s + k for s in range(t) if ids[s] == ids[t] and s + k < t
                    and (k == 1 or s + k != t - 1)}  # past lag 1, not the previous token
            if keys:
                masses.append(sum(attn[..., t, j] for j in keys))
        want = (torch.stack(masses).mean(0) if masses
                else torch.full((1, 2), float("nan")))
        assert torch.allclose(lags[..., k - 1], want, atol=1e-6, equal_nan=True), k


def test_a_previous_token_head_has_no_induction_lag_on_a_repeated_probe():
    """Issue 50: on the induction probe (period P = 12) a previous-token head showed
    `ind@k 0.89@11`: lag P-1's target is the query's previous token. Left out past lag 1."""
    P = 12
    ids = list(range(100, 100 + P)) * 2
    T = len(ids)
    prev = torch.zeros(1, 1, T, T)
    prev[0, 0, 0, 0] = 1
    prev[0, 0, torch.arange(1, T), torch.arange(T - 1)] = 1
    lags = h.lag_scores(prev, ids, max_lag=16)
    assert lags["previous"][0, 0, 0] == 1
    ind = lags["induction"][0, 0]
    assert torch.nan_to_num(ind, nan=0.0).max() < 0.1, ind


def test_a_lag_6_induction_head_is_found_at_lag_6():
    """A head attending from each token of the second copy to the token 6 after its first
    occurrence (keys reading a layer-0 head that looks 6 back): lag 6, not lag 1."""
    half = 12
    ids = list(range(100, 100 + half)) * 2
    T = 2 * half
    a = torch.zeros(T, T)
    a[:, 0] = 1.0
    for t in range(half, T):
        if t - half + 6 < t:
            a[t] = 0.0
            a[t, t - half + 6] = 1.0
    lags = h.lag_scores(a[None], ids, max_lag=8)
    assert lags["induction"][0, 5] == 1.0 and lags["induction"][0, 0] == 0.0
    assert int(h.best_lag(lags["induction"])[0]) == 6
    assert int(h.best_lag(lags["previous"])[0]) == half - 6  # t -> t - (half - 6)


def test_best_lag_takes_the_first_maximum_and_none_when_nothing_applies():
    s = torch.tensor([[0.1, 0.7, 0.7], [float("nan")] * 3])
    assert h.best_lag(s).tolist() == [2, 0]


def test_inspection_rows_carry_the_offsets_and_lags():
    insp = induction_inspection(8)
    row = insp.head_row(1, 1)
    assert len(row["offsets"]) == h.LAG_WINDOW + 1
    assert len(row["previous_lags"]) == len(row["induction_lags"]) == h.LAG_WINDOW
    assert row["best_induction_lag"] == 1 and row["induction_lags"][0] == pytest.approx(7 / 8)
    assert insp.head_row(0, 0)["best_previous_lag"] == 1
    doc = json.loads(json.dumps(insp.to_json(), allow_nan=False))  # no NaN reaches JSON
    assert set(doc["lag_definitions"]) >= {"offsets", "previous_lags", "induction_lags"}


def test_the_table_shows_the_best_lags_within_80_columns():
    from minigpt.cli.heads import _heads_tables

    insp = induction_inspection(8)
    console = Console(width=80, record=True, color_system=None)
    for table in _heads_tables(insp, [0, 1], [0, 1], 80):
        console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "prev@k" in text and "ind@k" in text and "1.00@1" in text and "0.88@1" in text


def test_a_narrow_part_of_the_table_keeps_its_caption_readable():
    """Issue 50: piped (80 columns), the second part of the head table (a few columns) had its
    caption squeezed to the part's own ~24 columns. Each part's caption now uses the width."""
    from minigpt.cli.heads import _heads_tables

    insp = induction_inspection(8)
    for width in (60, 80):
        for part in _heads_tables(insp, [0, 1], [0, 1], width):
            console = Console(width=width, record=True, color_system=None)
            console.print(part)
            lines = console.export_text().splitlines()
            caption = [x for x in lines if "L = layer" in x or "=" in x]
            assert caption and max(len(x) for x in lines) > width - 15, lines


# --------------------------------------------------------------------------------------------
# The logit lens.


def tiny_model(**over) -> GPT:
    cfg = ModelConfig(**{"n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16,
                         "vocab_size": 30, "bias": True, **over})
    model = GPT.from_config(cfg, seed=4).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6.0) if p.ndim == 2 else p.add_(0.2)
    return model


@pytest.mark.parametrize("over", [{}, {"norm": "rmsnorm", "pos_encoding": "learned"},
                                  {"logit_softcap": 5.0}])
def test_the_lens_reads_each_point_through_the_models_own_readout(over):
    model = tiny_model(**over)
    ids = [3, 7, 1, 9, 3, 7, 1, 9, 12, 4]
    lens = logit_lens(model, ids, positions=[2, 5, 8])
    assert lens.points == point_names(3) == ["embed", "L0", "L1", "L2"]
    idx = torch.tensor([ids])
    with torch.no_grad():
        final = model(idx)[0][0, [2, 5, 8]]
        stream = model.residual_stream(idx)
        first = model.unembed(stream[0][0, [2, 5, 8]])
    targets = torch.tensor([ids[3], ids[6], ids[9]])
    for i, logits in ((3, final), (0, first)):  # the last point is the model's own output
        assert torch.allclose(lens.logit[i], logits.gather(1, targets[:, None])[:, 0],
                              atol=1e-5)
        assert torch.equal(lens.top[i], logits.argmax(-1))
        assert torch.equal(lens.rank[i], (logits > logits.gather(1, targets[:, None])).sum(-1))
        assert torch.allclose(lens.prob[i], logits.softmax(-1).gather(1, targets[:, None])[:, 0],
                              atol=1e-6)
    assert (lens.logit[0] - lens.logit[3]).abs().max() > 0.1  # the points differ


def test_the_lens_target_and_records():
    model = tiny_model()
    ids = [3, 7, 1, 9, 3]
    lens = logit_lens(model, ids, positions=[1, 3], targets=[5, 5])
    recs = lens.records(token_str=lambda i: f"t{i}")
    assert len(recs) == 4 * 2 and recs[0]["point"] == "embed" and recs[0]["after_layer"] is None
    assert recs[-1]["after_layer"] == 2 and {r["target"] for r in recs} == {5}
    assert recs[0]["target_str"] == "t5" and recs[0]["top_str"] == f"t{recs[0]['top']}"
    assert all(0 <= r["prob"] <= 1 and r["rank"] >= 0 for r in recs)
    summary = lens.summary()
    assert [s["point"] for s in summary] == lens.points
    with pytest.raises(ValueError):
        logit_lens(model, ids, positions=[1], targets=[2, 3])


def test_the_model_is_restored_to_training_mode():
    model = tiny_model().train()
    logit_lens(model, [1, 2, 3])
    assert model.training


def test_lens_tables_fit_80_columns_and_say_what_they_leave_out():
    from minigpt.cli.lens_tables import lens_tables

    model = tiny_model(n_layer=12)
    ids = list(range(16))
    lens = logit_lens(model, ids)  # 15 positions x 13 points
    console = Console(width=80, record=True, color_system=None)
    for table in lens_tables(lens, [f"w{i}" for i in ids], lambda i: f"w{i}", 80):
        console.print(table)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "part 1 of 2" in text and "L11" in text and "median rank" in text


def test_lens_png_and_viewer_section(tmp_path):
    from minigpt.heads.lens_png import write_lens_png
    from minigpt.heads.viewer import render_html, viewer_data

    model = tiny_model()
    insp = induction_inspection(6, base=3)
    insp.lens = logit_lens(model, insp.tokens, positions=list(range(6, 11)))
    insp.token_str = lambda i: f"t{i}"
    (path,) = write_lens_png(insp, tmp_path)
    assert path.name == "lens.png" and path.read_bytes().startswith(b"\x89PNG")
    data = viewer_data(insp)
    assert data["lens"]["points"] == ["embed", "L0", "L1", "L2"]
    assert len(data["lens"]["top"]) == 4 and len(data["lens"]["top"][0]) == 5
    assert 'id="lens"' in render_html(insp) and 'id="offsets"' in render_html(insp)
    insp.lens = None
    assert viewer_data(insp)["lens"] is None and write_lens_png(insp, tmp_path) == []


def test_an_empty_lens_is_refused():
    with pytest.raises(ValueError):
        logit_lens(tiny_model(), [1, 2, 3], positions=[])
    assert not math.isnan(float(logit_lens(tiny_model(), [1, 2]).prob[0, 0]))
