"""The data a model trains on, beside the `data.*` and `tokenizer.*` settings that describe it:

    records.py    record files (JSON Lines, Parquet): one document per record
    corpus.py     corpus files on disk: found, fingerprinted, streamed, split train/validation
    tokenizer.py  byte-level BPE through tiktoken (raw bytes, trained with rustbpe, named, saved)
    cache.py      the token cache: the corpus tokenized once into a memory-mapped file
    rows.py       the rows of token ids a training session reads: windows of the token cache
                  (`TokenRows`) or synthetic induction sequences (`InductionRows`), `rows_for`

Nothing here imports the trainer: `minigpt.train.batches` picks which rows each step reads.
"""
