"""What each attention head does, for people: the inputs that reveal it (`probes.py`), attention
maps of a model with every head scored (`inspection.py`; the numbers come from core/heads.py),
the heads forming while a model trains (`timeline.py`), and the files a person looks at
(`output.py`: PNG heatmaps from `heatmap.py`, `circuits_png.py` and `lens_png.py`, the
offline HTML viewer from `viewer.py`, the raw attention and the scores as safetensors and
JSON); inspect-heads' flags are checked before torch loads (`flags.py`). Data in, data out:
`minigpt.cli` renders the tables."""
