"""The data a model trains on, beside the `data.*` and `tokenizer.*` settings that describe it:
corpus files (text, JSON Lines, Parquet) found, fingerprinted and split; the byte-level BPE
through tiktoken; the token cache; and the rows of token ids a session reads (windows of the
cache, of a text file, or synthetic induction sequences). docs/internals.md lists the modules.

Nothing here imports the trainer: `minigpt.train.batches` picks which rows each step reads.
"""
