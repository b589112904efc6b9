"""Hugging Face models in, minigpt models out. Nothing here imports transformers.

    hub.py        --model PATH | hf:REPO_ID[@REVISION] -> a local directory (huggingface_hub)
    arch.py       config.json <-> ModelConfig for gpt2 and gpt_neox; what is refused
    weights.py    safetensors read (checked, memory-mapped) and renamed both ways
    tokenizer.py  GPT-2's byte-level BPE files <-> tiktoken ranks
    load.py       `load_model(spec, device) -> LoadedRun`, the one import entry point
    export.py     `export_hf(loaded, out)`: a directory transformers loads with no custom code

    from minigpt.hf import load_model
    gpt2 = load_model("hf:gpt2", "cpu")       # or a local directory
    ids = gpt2.tokenizer.encode("Hello")
    logits, _ = gpt2.model(torch.tensor([ids]))
"""

from minigpt.hf.export import Exported, export_hf
from minigpt.hf.load import load_model

__all__ = ["Exported", "export_hf", "load_model"]
