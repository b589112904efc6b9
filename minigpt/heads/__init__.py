"""What each attention head does: scores on attention patterns (`core/heads.py`), the inputs that
reveal them (`probes.py`), attention maps of a model with every head scored
(`inspection.py`), and the files a person looks at (`output.py`: PNG heatmaps from
`heatmap.py`, `circuits_png.py` and `lens_png.py`, the offline HTML viewer from `viewer.py`,
the raw attention and the scores as safetensors and JSON). Data in, data out: `minigpt.cli`
renders the tables."""
