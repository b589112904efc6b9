"""The data a model trains on, beside the `data.*` and `tokenizer.*` settings that describe it:

    records.py    record files (JSON Lines, Parquet): one document per record
    corpus.py     corpus files on disk: found, fingerprinted, streamed, split train/validation
    tokenizer.py  byte-level BPE through tiktoken (raw bytes, trained with rustbpe, named, saved)
    cache.py      the token cache: the corpus tokenized once into a memory-mapped file

Nothing here imports the trainer: `minigpt.train.batches` picks which rows each step reads.
"""
