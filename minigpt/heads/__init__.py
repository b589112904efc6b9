"""What each attention head does, for people: the inputs that reveal it (`probes.py`), attention
maps of a model with every head scored (`inspection.py`; the numbers come from core/heads.py
and core/head_circuits.py), the heads forming while a model trains (`timeline.py`), the circuit
of `minigpt circuit` on its inputs and its files (`edge_circuit.py`; the search is
core/edge_graph.py), and the files a person looks at (`output.py`: the pictures, each module
named for what it draws: `attention_png.py` the attention maps, `head_circuits_png.py` head
composition and attribution, `edge_png.py` the edge circuit and its faithfulness curve,
`lens_png.py` the logit lens; the offline HTML viewer from `viewer.py`; the raw attention and
the scores as safetensors and JSON); inspect-heads' and circuit's flags are checked before
torch loads (`flags.py`). Data in, data out: `minigpt.cli` renders the tables."""
