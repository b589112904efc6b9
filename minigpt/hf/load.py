"""`load_model`: a Hugging Face GPT-2 or GPT-NeoX model as a minigpt GPT, ready for the same
code paths as a trained run."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from minigpt.config import ModelConfig
from minigpt.core.gpt import GPT, Rotary
from minigpt.device import resolve_device
from minigpt.errors import MinigptError
from minigpt.hf.arch import import_config, import_inputs, kind_of
from minigpt.hf.hub import model_directory, model_file, read_model_json
from minigpt.hf.tokenizer import load_hf_tokenizer
from minigpt.hf.weights import check_weights, map_weights, to_minigpt
from minigpt.run.load import LoadedRun

CONFIG = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # GPT-2's is under 1 KiB; id2label tables make some larger


def read_config(directory: Path) -> dict:
    """config.json of a model directory, parsed: a JSON object of a supported model_type."""
    path = model_file(directory, CONFIG)
    if path is None:
        raise MinigptError(f"{directory}: no {CONFIG}; not a Hugging Face model directory "
                           f"(it needs {CONFIG}, safetensors weights and tokenizer files)")
    raw = read_model_json(path, MAX_CONFIG_BYTES)
    kind_of(raw, str(path))  # a JSON object of a supported model_type
    return raw


def load_model(spec: str | Path, device: str | torch.device = "cpu") -> LoadedRun:
    """A Hugging Face model for inference: `spec` is a local model directory or
    `hf:REPO_ID[@REVISION]` (downloaded into huggingface_hub's cache; needs the extra
    `minigpt-lab[hf]`).

    Returns the same LoadedRun as `minigpt.run.load_run` (run_dir None, step 0, eot_first:
    inputs to inspect start with <|endoftext|>, unless config.json's "minigpt" section, which
    a minigpt export writes, says otherwise and names the run's data source and induction ids:
    `arch.import_inputs`), model on `device` in eval mode. Architectures:
    GPT2LMHeadModel and GPTNeoXForCausalLM in minigpt's shape (see `minigpt.hf.arch`); weights
    from safetensors only, memory-mapped: on CPU the model's float32 weights ARE the file's
    pages (one copy in memory, GPT-NeoX's fused QKV excepted). Every failure is a one-line
    MinigptError naming the file, field or tensor.

    Order: config.json, then every size it gives checked against the weights' headers, then
    the tokenizer's ids against that vocabulary, and only then is anything built or a tensor
    read: a crafted file cannot make it allocate what the weights do not hold."""
    directory = model_directory(spec)
    dev = device if isinstance(device, torch.device) else resolve_device(str(device))
    raw = read_config(directory)
    kind = kind_of(raw, str(directory / CONFIG))
    name = str(spec).removeprefix("hf:") if str(spec).startswith("hf:") else directory.name
    cfg = import_config(raw, str(directory / CONFIG), name)
    eot_first = import_inputs(raw, cfg, str(directory / CONFIG))  # None: not a minigpt export
    bias = raw.get("attention_bias", True)
    files = check_weights(directory, kind, cfg.model, attention_bias=bias is not False)
    tokenizer = load_hf_tokenizer(directory, name, cfg.model.vocab_size)
    model = assemble(cfg.model, to_minigpt(kind, cfg.model, map_weights(files)))
    model.to(dev).eval()
    return LoadedRun(model=model, cfg=cfg, tokenizer=tokenizer, step=0, run_dir=None,
                     source=str(spec), eot_first=True if eot_first is None else eot_first)


class _NoDraws(TorchFunctionMode):
    """Random init becomes a no-op. On the meta device there is nothing to draw, and `normal_`
    (nn.Embedding's and GPT's init) has no compiled meta kernel: its Python one imports
    torch._dynamo on first use, seconds of a CLI command's start-up."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is Tensor.normal_ or func is torch.nn.init.normal_:
            return args[0] if args else kwargs["tensor"]  # the tensor, left as it is
        return func(*args, **(kwargs or {}))


def assemble(m: ModelConfig, state: dict[str, Tensor]) -> GPT:
    """A GPT whose parameters are `state`'s tensors themselves (the tied head left out): built
    on the meta device (no random init, nothing allocated), then the tensors assigned, so
    memory-mapped views stay views."""
    with torch.device("meta"), _NoDraws():
        model = GPT(m)
    if m.tie_weights:
        state = {**state, "lm_head.weight": state["wte.weight"]}
    model.load_state_dict(state, strict=True, assign=True)
    if m.tie_weights:
        model.lm_head.weight = model.wte.weight  # one Parameter again, as GPT.__init__ ties it
    if model.rotary is not None:  # its cos/sin tables were made on the meta device
        model.rotary = Rotary(m.head_dim, m.block_size, m.rope_base)
    left = [n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"imported model still has meta tensors: {left}")  # a minigpt bug
    return model
