"""What each attention head does, for people: the inputs that reveal it (probes, texts and their
corruptions), the inspection of a model with every head scored, the heads forming while a model
trains, the circuit of `minigpt circuit` on its inputs, and the files a person looks at (each
picture module named for what it draws, ending in `_png`; the offline HTML viewer; the raw attention
and the scores as safetensors and JSON). The numbers come from `minigpt.interp`; the flags of
inspect-heads and circuit are checked here before torch loads. Data in, data out:
`minigpt.cli` renders the tables. docs/internals.md lists the modules.
"""
