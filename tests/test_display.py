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


def test_one_spelling_of_a_time_and_of_a_size():
    """display.duration and display.size: what every elapsed time, ETA, estimate, run wall
    time, file limit and memory figure is shown as."""
    from minigpt.display import duration, size

    assert [duration(s) for s in (0, 0.44, 42, 185, 3600, 7800, 3 * 86400, 1e21)] == [
        "0.0s", "0.4s", "42s", "3m05s", "1h00m", "2h10m", "3d", "3.17e+13 years"]
    assert duration(-1) == "0.0s" and duration(59.6) == "1m00s"
    assert [size(n) for n in (0, 512, 4096, 16 << 20, 5.8 * 2**30, 2**50)] == [
        "0 bytes", "512 bytes", "4 KiB", "16 MiB", "5.8 GiB", "1.02e+03 TiB"]
