"""What `sample` and `inspect-heads` run on, with the rules between their flags checked once,
here:

- `load_run_or_model(run, model, device, checkpoint)`: a trained run (`run`; neither given:
  the latest run under runs/; `checkpoint` picks one of its kept steps) or an imported
  Hugging Face model (`model`: a directory or hf:REPO_ID[@REV]), as a `LoadedRun`.
- `read_prompt(tokenizer, block_size, prompt, prompt_file)`: sample's prompt as token ids,
  cut to the last `block_size` tokens the model keeps. A file is read only as far as those
  tokens can reach (`text_budget`: a bound from the longest token), through
  `minigpt.files.read_text_part` (regular files only): a 100 MB prompt file costs what a page
  does. inspect-heads reads `--text-file` the same way (`minigpt.heads.probes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from minigpt.core.generate import truncate_prompt
from minigpt.data.tokenizer import Tokenizer
from minigpt.device import resolve_device
from minigpt.errors import ConflictError
from minigpt.files import read_text_part
from minigpt.run import LoadedRun, load_run

MIN_TEXT_BYTES = 64 * 1024  # a text file up to this size is always read whole


def load_run_or_model(run: Path | None = None, model: str | None = None,
                      device: str | torch.device = "auto",
                      checkpoint: int | None = None) -> LoadedRun:
    """The model a command runs: the trained run `run` (None and no `model`: the latest run
    under runs/), at its kept step `checkpoint` (None: the latest), or the imported model
    `model`, on `device` (checked first). Giving both `run` and `model`, or `checkpoint` with
    `model`, is a ConflictError."""
    if run is not None and model is not None:
        raise ConflictError(("run", "model"))
    if model is not None and checkpoint is not None:
        raise ConflictError(("model", "checkpoint"), "a checkpoint step belongs to a "
                            "trained run")
    dev = resolve_device(device) if isinstance(device, str) else device  # before any loading
    if model is None:
        return load_run(run, dev, step=checkpoint)
    from minigpt.hf import load_model

    return load_model(model, dev)


def text_budget(tokenizer: Tokenizer, n_tokens: int) -> int:
    """Bytes of text that always hold `n_tokens` tokens with room to spare: no token stands
    for more than the longest one's bytes, so n tokens never cover more than n x longest
    bytes; twice that keeps the tokens used away from the cut, whose neighbours may split
    differently than in the whole text."""
    longest = max([len(b) for b in tokenizer.ranks]
                  + [len(s.encode()) for s in tokenizer.special_tokens])
    return max(MIN_TEXT_BYTES, 2 * n_tokens * longest)


@dataclass
class Prompt:
    """sample's prompt: `ids` (at most block_size: the last tokens of `text`), the text read,
    how many tokens it has, and a `--prompt-file`'s size when only its end was read."""

    text: str
    ids: list[int]
    n_tokens: int
    file_bytes: int | None = None

    @property
    def cut(self) -> bool:
        """The prompt's start was dropped: the model keeps only its last block_size tokens."""
        return self.n_tokens > len(self.ids)


def read_prompt(tokenizer: Tokenizer, block_size: int, prompt: str | None = None,
                prompt_file: Path | None = None, allow_special: bool = False) -> Prompt:
    """The prompt from at most one of `prompt` / `prompt_file` (neither, or an empty one:
    <|endoftext|> alone), encoded (`allow_special`: <|endoftext|> in the text is
    the special token) and cut to its last `block_size` tokens."""
    if prompt is not None and prompt_file is not None:
        raise ConflictError(("prompt", "prompt_file"))
    text, file_bytes = prompt or "", None
    if prompt_file is not None:
        budget = text_budget(tokenizer, block_size)
        text, size = read_text_part(prompt_file, "prompt_file", budget, tail=True)
        file_bytes = size if size > budget else None
    ids = tokenizer.encode(text, allow_special=allow_special) if text else [tokenizer.eot_id]
    kept, _ = truncate_prompt(ids, block_size)
    return Prompt(text, kept, len(ids), file_bytes)
