"""The HTML viewer in a real headless browser (Debian's Chromium driven by chromedriver through
selenium): the page loads, picking another head redraws the map, hovering shows a weight, no
console errors, and token text containing `<script>` / event handlers never runs.

Skips, saying why, where selenium, Chromium or chromedriver is missing
(`apt-get install -y chromium chromium-driver`; `pip install -e '.[dev]'` brings selenium)."""

from __future__ import annotations

import pytest
import torch
from browser import make_driver
from conftest import induction_inspection

from minigpt.display import visible_token
from minigpt.heads.inspection import Inspection
from minigpt.interp.heads import score_heads

pytestmark = pytest.mark.slow

HOSTILE = ["<script>window.__pwned = 1</script>", "<img src=x onerror=\"window.__pwned = 2\">",
           "</script><script>window.__pwned = 3</script>", " ", "\n", "&lt;b&gt;", "\u2028",
           "\"'`${x}`"]


def hand_built() -> Inspection:
    """2 layers x 2 heads with four different, recognisable patterns over 12 tokens."""
    T = 12
    prev = torch.zeros(T, T)
    prev[0, 0] = 1
    prev[torch.arange(1, T), torch.arange(T - 1)] = 1
    uniform = torch.ones(T, T).tril()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    sink = torch.zeros(T, T)
    sink[:, 0] = 1
    attn = torch.stack([torch.stack([prev, uniform]), torch.stack([sink, torch.eye(T)])])
    strs = (HOSTILE * 2)[:T]
    tokens = list(range(100, 100 + T))
    return Inspection(tokens=tokens, token_strs=strs, attention=attn,
                      scores=score_heads(attn, tokens, strs), parity_max_diff=0.0,
                      parity_tol=1e-4, source="test")


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = make_driver(tmp_path_factory.mktemp("chromium-profile"))
    yield d
    d.quit()


@pytest.fixture(scope="module")
def page(driver, tmp_path_factory):
    from minigpt.heads.viewer import write_html

    path = write_html(hand_built(), tmp_path_factory.mktemp("viewer") / "attention.html")
    driver.get(path.resolve().as_uri())
    return driver


def js(d, code: str):
    return d.execute_script(code)


def canvas_png(d) -> str:
    return js(d, "return document.getElementById('map').toDataURL()")


def test_page_loads_with_tokens_and_scores(page):
    insp = hand_built()
    assert page.title == "minigpt inspect-heads"
    items = js(page, "return [...document.querySelectorAll('#tokens li')].map(e => e.textContent)")
    assert items == [visible_token(s, 16) for s in insp.token_strs]
    assert js(page, "return document.querySelectorAll('#scores tbody tr').length") == 4
    assert page.find_element("id", "current").text == "layer 0, head 0: previous"
    assert js(page, "return document.getElementById('map').width") > 100


def test_injected_token_markup_does_not_run(page):
    assert js(page, "return window.__pwned === undefined")
    assert js(page, "return document.querySelectorAll('script').length") == 2
    assert js(page, "return document.querySelectorAll('img').length") == 0
    title = js(page, "return document.querySelector('#tokens li').title")
    assert "<script>window.__pwned = 1</script>" in title  # shown as text, not parsed


def test_picking_another_head_changes_the_map(page):
    from selenium.webdriver.support.ui import Select

    before = canvas_png(page)
    Select(page.find_element("id", "head")).select_by_value("1")
    after = canvas_png(page)
    assert after != before
    assert page.find_element("id", "current").text == "layer 0, head 1: diffuse"
    Select(page.find_element("id", "layer")).select_by_value("1")
    assert page.find_element("id", "current").text == "layer 1, head 1: self"
    assert canvas_png(page) not in (before, after)
    page.find_elements("css selector", "#scores tbody tr")[2].click()  # layer 1 head 0
    assert page.find_element("id", "current").text == "layer 1, head 0: first"
    Select(page.find_element("id", "layer")).select_by_value("0")
    Select(page.find_element("id", "head")).select_by_value("0")
    assert canvas_png(page) == before  # same head, same picture


def test_hover_shows_the_weight(page):
    # a mouse move over query 5, key 4 of head (0, 0), a previous-token head: weight 1
    text = js(page, """
        const c = document.getElementById('map'), r = c.getBoundingClientRect();
        const cell = Math.max(3, Math.min(24, Math.floor(720 / 12))), label = 110;
        c.dispatchEvent(new MouseEvent('mousemove', {bubbles: true,
            clientX: r.left + label + 4.5 * cell, clientY: r.top + label + 5.5 * cell}));
        return document.getElementById('hover').textContent;""")
    assert text.startswith("query 5 ") and "key 4 " in text and text.endswith("1.0000")


def test_no_console_errors(page):
    errors = [e for e in page.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    # the log channel works: a deliberate error is seen (so the check above can fail)
    js(page, "console.error('minigpt-probe')")
    assert any("minigpt-probe" in e["message"] for e in page.get_log("browser"))


# -- what a student needs to read the page (issue 34) -------------------------------------------


def induction_probe_inspection() -> Inspection:
    """2 x 8 tokens whose strings are control bytes (labelled \\xNN in the viewer)."""
    return induction_inspection(8, base=40, strs=[chr(0x10 + i) for i in range(8)])


def test_screenshot_shows_the_colour_scale_and_the_glossary(page, tmp_path):
    from minigpt.heads.viewer import GLYPHS
    from minigpt.interp.heads import SCORE_NAMES

    page.set_window_size(1400, 1000)
    shot = page.get_screenshot_as_png()
    (tmp_path / "viewer.png").write_bytes(shot)
    assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
    # the colour scale: a canvas beside the map, drawn from dark (0) at the bottom to bright (1)
    box = js(page, "const r = document.getElementById('scale').getBoundingClientRect(); "
                   "return [r.left, r.top, r.width, r.height]")
    assert box[2] > 20 and box[3] > 100 and box[1] < 1000, box  # in the first screenful
    top, bottom = js(page, """
        const g = document.getElementById('scale').getContext('2d');
        return [[...g.getImageData(5, 10, 1, 1).data], [...g.getImageData(5, 205, 1, 1).data]];""")
    assert sum(top[:3]) > 2 * sum(bottom[:3])  # viridis: yellow at 1, dark violet at 0
    assert "attention" in page.find_element("id", "scalebox").text
    # the glossary: every score, the types that are not scores and every glyph, explained
    terms = js(page, "return [...document.querySelectorAll('#glossary dt')]"
                     ".map(e => e.textContent)")
    for name in (*SCORE_NAMES, "dominant", "mixed", "diffuse", *GLYPHS):
        assert name in terms, name
    meanings = js(page, "return [...document.querySelectorAll('#glossary dd')]"
                        ".map(e => e.textContent)")
    assert all(m.strip() for m in meanings) and len(meanings) == len(terms)
    # the explanation sits above the map, not under it
    above = js(page, "return document.getElementById('explain').getBoundingClientRect().bottom <="
                     " document.getElementById('map').getBoundingClientRect().top")
    assert above and "query" in page.find_element("id", "explain").text


def test_the_induction_probe_opens_on_the_induction_head_with_the_copy_marked(driver, tmp_path):
    from minigpt.heads.viewer import write_html

    path = write_html(induction_probe_inspection(), tmp_path / "attention.html")
    driver.get(path.resolve().as_uri())
    assert driver.find_element("id", "current").text == "layer 1, head 1: induction"
    assert "position 8" in driver.find_element("id", "explain").text
    # the dashed red line at the copy boundary: row 8's top edge, between two label columns
    pixel = js(driver, """
        const c = document.getElementById('map'), g = c.getContext('2d');
        const cell = Math.max(3, Math.min(24, Math.floor(720 / 16))), label = 110;
        return [...g.getImageData(label + 2, label + 8 * cell, 1, 1).data];""")
    assert pixel[0] > 180 and pixel[1] < 120 and pixel[2] < 100, pixel
    labels = js(driver, "return [...document.querySelectorAll('#tokens li')]"
                        ".map(e => e.textContent)")
    assert labels[0] == "\\x10"
