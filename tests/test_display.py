"""The one sanitiser of untrusted text (minigpt.display): every control a terminal obeys is
escaped, in names and messages (`printable`), in generated samples printed by `minigpt train`
(newlines and tabs kept), and in token labels (`visible_token`)."""

from __future__ import annotations

import pytest

from minigpt import events
from minigpt.display import CONTROLS, printable, visible_token

# One of each kind: ESC (C0), CR (C0, overwrites a line), DEL, CSI (C1), NEL (C1), the line
# separator, a right-to-left override and isolate, a right-to-left mark.
HOSTILE = {"\x1b": "\\x1b", "\r": "\\x0d", "\x7f": "\\x7f", "\x9b": "\\x9b", "\x85": "\\x85",
           "\u2028": "\\u2028", "\u202e": "\\u202e", "\u2067": "\\u2067", "\u200f": "\\u200f"}


@pytest.mark.parametrize(("char", "shown"), HOSTILE.items())
def test_printable_escapes_every_kind_of_control(char, shown):
    assert printable(f"run{char}[31mname") == f"run{shown}[31mname"
    assert ord(char) in CONTROLS


def test_printable_keeps_only_what_it_is_told_and_ordinary_text():
    text = "a\nb\tc\x1b\u202ed"
    assert printable(text) == "a\\x0ab\\x09c\\x1b\\u202ed"
    assert printable(text, keep="\n\t") == "a\nb\tc\\x1b\\u202ed"
    plain = "ROMEO: é ü ß 東京 😀 ·"  # printable non-ASCII stays as it is
    assert printable(plain) == plain
    assert printable(3) == "3"


def test_every_control_is_escaped_and_nothing_else_below_u_0100():
    for c in range(0x100):
        out = printable(chr(c))
        assert (out != chr(c)) == (c in CONTROLS), hex(c)
    assert all(printable(chr(c)).isprintable() for c in CONTROLS)


def test_visible_token():
    assert visible_token(" a\n\tb\r") == "·a↵→b␍"
    assert visible_token("\x01\x7f\x9b\u202e") == "\\x01\\x7f\\x9b\\u202e"
    assert visible_token("") == "∅"
    assert visible_token("abcdefghij", 5) == "abcd…"


def test_train_prints_a_sample_with_its_controls_escaped(capsys):
    """A generated sample is untrusted text: its layout (newlines, tabs) is kept, every other
    control (here a C1 CSI and a right-to-left override) is escaped."""
    from minigpt.cli.train import _TrainView

    view = _TrainView()
    view.tty = False  # plain lines on stderr
    view.on_event(events.EvalEvent(10, 2.0, 7.4, 2.9, 2.0, 2.9, 1.0,
                                   [("ROMEO:", " hi\x9b2J\n\tthere\u202etxt.exe\x1b[0m")], 640))
    err = capsys.readouterr().err
    assert "  | ROMEO: hi\\x9b2J\n  | \tthere\\u202etxt.exe\\x1b[0m" in err
    assert not any(ord(ch) in CONTROLS - {0x0A, 0x09} for ch in err)


def test_a_head_has_one_spelling_everywhere():
    """Tables, logs, pictures and the edge graph's nodes (interp/edge_graph.py) name a head and
    an MLP the same way (display.head_name, display.mlp_name): L1.H2, L0.MLP."""
    from minigpt.config import ModelConfig
    from minigpt.display import head_name, mlp_name
    from minigpt.interp.edge_graph import graph_of

    g = graph_of(ModelConfig(n_layer=2, n_head=3, n_embd=12, block_size=8, vocab_size=16))
    nodes = {g.writer_name(u) for u in range(g.n_writers)}
    assert nodes == {"embed", *(head_name(la, h) for la in range(2) for h in range(3)),
                     *(mlp_name(la) for la in range(2))}
    assert head_name(1, 2) == "L1.H2" and mlp_name(0) == "L0.MLP"
    assert events._head((1, 2, 0.95)) == "L1.H2"


def _heads_in(doc, where: str = "") -> list[tuple[str, dict]]:
    """Every JSON object of `doc` that names a head (`head` and `layer` keys)."""
    found = []
    if isinstance(doc, dict):
        if "head" in doc and "layer" in doc:
            found.append((where, doc))
        for k, v in doc.items():
            found += _heads_in(v, f"{where}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            found += _heads_in(v, f"{where}[{i}]")
    return found


def test_every_json_names_a_head_one_way(tmp_path):
    """One rule in every JSON document: `"head": "L1.H2"` with `"layer": 1, "index": 2`
    beside it (`heads` was an int in inspect-heads' JSON and "L1.H2" in its qk entries);
    two heads in one record: from / to with their layers and indices."""
    import json
    import re

    from conftest import in_process, make_run

    from minigpt.events import CircuitCheck

    run = make_run(tmp_path / "run", top_files=True)
    r = in_process(["inspect-heads", "--run", run, "--probe", "induction", "--json",
                    "--composition", "--qk", "all"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    c = in_process(["circuit", "--run", run, "--probe", "induction", "--patch-from",
                    "corrupted", "--json", "--ig-steps", "1"])
    assert c.returncode == 0, c.stderr
    docs = {"inspect-heads": doc, "circuit": json.loads(c.stdout),
            "runs": CircuitCheck(5, (1, 2, 0.95), (0, 1, 0.9)).to_json()}
    seen = 0
    for name, d in docs.items():
        for where, obj in _heads_in(d):
            seen += 1
            if obj["head"] is None:  # a node that is not a head: embed, an MLP, the logits
                assert obj.get("index") is None, (name, where)
                continue
            assert obj["head"] == f"L{obj['layer']}.H{obj['index']}", (name, where, obj)
    assert seen >= 3 + 2 * 2 + 2  # the heads, the qk entries, the nodes, the check
    for rec in doc["composition"]:
        for end in ("from", "to"):
            assert rec[end] == f"L{rec[end + '_layer']}.H{rec[end + '_index']}"
    assert all(re.fullmatch(r"L\d+\.H\d+", k) for k in doc["qk_writer_roles"])


def test_one_token_renderer_in_the_terminal_the_pictures_and_the_pages():
    """A space, a control byte, a byte that is not text alone and a newline read the same in
    the terminal (features, inspect-heads --features, the logit lens), the pictures' labels and
    the HTML pages: display.visible_token's `·`, `\\x0f`, `\\xd5`, `↵` (the features table wrote
    `\\x0f` and `\\\\xd5`, and no `·`)."""
    import html

    from rich.console import Console

    from minigpt.cli.features import features_table
    from minigpt.cli.heads import active_table
    from minigpt.display import visible_token
    from minigpt.features.features_html import html_page
    from minigpt.features.show import Feature, FeaturesView
    from minigpt.heads import attention_png, lens_png

    tokens = [" the", "\x0f", "\\xd5", "\n"]
    shown = [visible_token(t) for t in tokens]
    assert shown == ["·the", "\\x0f", "\\xd5", "↵"]
    view = FeaturesView("sae", 1, 2, {}, [Feature(
        0, 0.05, [0.5, 0.5], contexts=[{"tokens": tokens, "at": 3, "act": 1.0, "next": " the"}],
        promoted=[(t, 1.0) for t in tokens], suppressed=[(t, -1.0) for t in tokens],
        selectivity=0.9, spot="next", token="\x0f", firings=40)])
    console = Console(width=200, record=True)
    for part in features_table(view, 200):
        console.print(part)
    console.print(active_table({"layer": 1, "positions": [[{"feature": 0, "act": 1.0}]] * 4},
                               tokens))
    terminal = console.export_text()
    page = html_page(view)
    for t, s in zip(tokens, shown):
        assert s in terminal and html.escape(s) in page
        assert attention_png._label(t) == s and lens_png._short(t) == visible_token(t, 8)
    assert "\\\\xd5" not in terminal and "\\\\x0f" not in terminal


def test_one_spelling_of_a_time_and_of_a_size():
    """display.duration and display.size: what every elapsed time, ETA, estimate, run wall
    time, file limit and memory figure is shown as."""
    from minigpt.display import duration, size

    assert [duration(s) for s in (0, 0.44, 42, 185, 3600, 7800, 3 * 86400, 1e21)] == [
        "0.0s", "0.4s", "42s", "3m05s", "1h00m", "2h10m", "3d", "3.17e+13 years"]
    assert duration(-1) == "0.0s" and duration(59.6) == "1m00s"
    assert [size(n) for n in (0, 512, 4096, 16 << 20, 5.8 * 2**30, 2**50)] == [
        "0 bytes", "512 bytes", "4 KiB", "16 MiB", "5.8 GiB", "1.02e+03 TiB"]
