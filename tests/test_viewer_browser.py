"""The HTML viewer in a real headless browser (Debian's Chromium driven by chromedriver through
selenium): the page loads, picking another head redraws the map, hovering shows a weight, no
console errors, and token text containing `<script>` / event handlers never runs.

Skips, saying why, where selenium, Chromium or chromedriver is missing
(`apt-get install -y chromium chromium-driver`; `pip install -e '.[dev]'` brings selenium)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from minigpt.core.heads import score_heads
from minigpt.heads.inspection import Inspection, visible_token

pytestmark = pytest.mark.slow

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p),
                None)
CHROMEDRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")
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
    webdriver = pytest.importorskip(
        "selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (apt-get install -y chromium chromium-driver)")
    if CHROMEDRIVER is None:
        pytest.skip("chromedriver is not installed (apt-get install -y chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(60)
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
