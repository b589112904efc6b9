"""Hugging Face models in, minigpt models out: `--model PATH | hf:REPO_ID[@REVISION]` resolved
to a local directory, its config.json mapped to a ModelConfig (and what is refused), its
safetensors read, checked and renamed, GPT-2's BPE files turned into tiktoken ranks; and the
way back, a directory transformers loads with no custom code, or a GGUF file for llama.cpp.
Nothing here imports transformers. docs/internals.md lists the modules.

    from minigpt.hf import load_model
    gpt2 = load_model("hf:gpt2", "cpu")       # or a local directory
    ids = gpt2.tokenizer.encode("Hello")
    logits, _ = gpt2.model(torch.tensor([ids]))
"""

from minigpt.hf.export import Exported, export_hf
from minigpt.hf.load import load_model

__all__ = ["Exported", "export_hf", "load_model"]
