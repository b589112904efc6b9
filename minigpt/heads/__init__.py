"""What each attention head does: scores on attention patterns (`scores.py`), the inputs that
reveal them (`probes.py`), attention maps of a model with every head scored
(`inspection.py`), and the files a person looks at: PNG heatmaps (`heatmap.py`) and the
offline HTML viewer (`viewer.py`). Data in, data out: `minigpt.cli` renders the tables."""
