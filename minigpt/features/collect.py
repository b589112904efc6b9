"""What an SAE of `minigpt features` trains on and is measured with: layer L's head outputs z,
read through the forward pass's one intervention point (`core.gpt.Intervention.heads`), each
position's z `[head, d_head]` flattened head by head (`n_head * d_head` wide: TransformerLens's
`blocks.L.attn.hook_z` order, [pos, head, d_head] flattened); and the same point spliced with
a replacement for the cross-entropy loss recovered.

Rows of tokens come from the run's own data (`data.rows.rows_for`: its corpus's token
cache, train split for training and validation split for the held-out numbers, or fresh
synthetic induction rows) or from a text file (`data.rows.text_rows`: its first 90% of tokens
for training, the rest held out).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from minigpt.core.gpt import ForwardSpec, Intervention, eval_mode
from minigpt.errors import ArgumentError, MinigptError

BATCH_TOKENS = 8192  # tokens per forward pass while collecting


def z_width(mcfg) -> int:
    """The width of a position's flattened z for a model of `mcfg` (a ModelConfig): n_head x
    d_head, the SAE's d_in."""
    return mcfg.n_head * mcfg.head_dim


def flat_z(z: Tensor) -> Tensor:
    """z (B, H, T, D) -> (B, T, H*D), head-major per position (hook_z's order)."""
    B, H, T, D = z.shape
    return z.transpose(1, 2).reshape(B, T, H * D)


def unflat_z(x: Tensor, n_head: int) -> Tensor:
    """(B, T, H*D) -> z (B, H, T, D): the inverse of flat_z."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


class Enough(Exception):
    """Raised by `Record(stop=True)` once it has its layer: the rest of the pass is skipped."""


class Record(Intervention):
    """Keeps layer `layer`'s flattened z (B, T, H*D) of the last pass in `self.z`; with
    `stop`, ends the pass there (Enough): the later layers and the LM head are not run."""

    def __init__(self, layer: int, stop: bool = False) -> None:
        self.layer, self.z, self.stop = layer, None, stop

    def heads(self, layer: int, z: Tensor) -> Tensor:
        if layer == self.layer:
            self.z = flat_z(z).detach()
            if self.stop:
                raise Enough
        return z


class Splice(Intervention):
    """Replaces layer `layer`'s z by `replace(flat z)` (B, T, H*D) -> (B, T, H*D)."""

    def __init__(self, layer: int, replace: Callable[[Tensor], Tensor]) -> None:
        self.layer, self.replace = layer, replace

    def heads(self, layer: int, z: Tensor) -> Tensor:
        if layer != self.layer:
            return z
        return unflat_z(self.replace(flat_z(z)).to(z.dtype).contiguous(), z.shape[1])


def run_rows(loaded, text_file: Path | None):
    """The rows a loaded run's SAE trains on: `text_file`'s, else the run's own data (an
    imported model has none: --text-file is needed)."""
    if text_file is not None:
        from minigpt.data.rows import text_rows

        return text_rows(text_file, loaded.tokenizer, loaded.cfg.model.block_size)
    if loaded.run_dir is None:
        raise ArgumentError("text_file", "is needed with --model: an imported model has no "
                            "corpus of its own")
    from minigpt.data.rows import rows_for

    return rows_for(loaded.cfg, loaded.tokenizer)


def draw_rows(rows, split: str, n_tokens: int, seed: int) -> Tensor:
    """(n, block_size + 1) rows holding at least `n_tokens` input positions, drawn from
    `split` with a generator seeded by `seed` (the same rows for the same seed)."""
    T = rows.block_size
    n = max(1, math.ceil(n_tokens / T))
    try:
        offsets = rows.sample_offsets(split, n, torch.Generator().manual_seed(seed))
    except RuntimeError as e:  # randint's high <= 0: a split shorter than one row
        raise MinigptError(f"the {split} split has fewer than block_size + 1 = {T + 1} tokens; "
                           "features need a longer corpus or --text-file") from e
    return rows.rows(split, offsets)


@torch.no_grad()
def collect(model, rows: Tensor, layer: int, on_rows: Callable[[int], None] | None = None
            ) -> Tensor:
    """Layer `layer`'s flattened z at every input position of `rows` (n, T + 1):
    (n * T, n_head * d_head) float32 on the CPU, row by row. `on_rows(done)` after each pass.
    Each pass stops at the layer read (nothing after it changes z)."""
    device = next(model.parameters()).device
    rec = Record(layer, stop=True)
    spec = ForwardSpec(intervention=rec)
    per = max(1, BATCH_TOKENS // (rows.shape[1] - 1))
    out = []
    with eval_mode(model):
        for i in range(0, rows.shape[0], per):
            try:
                model(rows[i:i + per, :-1].to(device), attn=spec)
            except Enough:
                pass
            out.append(rec.z.float().cpu().reshape(-1, rec.z.shape[-1]))
            if on_rows is not None:
                on_rows(min(i + per, rows.shape[0]))
    return torch.cat(out)


@torch.no_grad()
def spliced_losses(model, rows: Tensor, layer: int, reconstruct: Callable[[Tensor], Tensor],
                   own_output: bool = False) -> tuple[float, float, float]:
    """The mean next-token loss on `rows` (n, T + 1): clean, with layer `layer`'s z
    zero-ablated, and with it replaced by `reconstruct(z)` (nats/token). `own_output` (a
    compiled program, whose outputs are not next tokens): the loss of the clean run's own
    output at every position instead, the cross-entropy of its argmax (several outputs) or
    the squared error of its value (one output)."""
    device = next(model.parameters()).device
    per = max(1, BATCH_TOKENS // (rows.shape[1] - 1))
    specs = (None, ForwardSpec(intervention=Splice(layer, torch.zeros_like)),
             ForwardSpec(intervention=Splice(layer, reconstruct)))
    sums = [0.0, 0.0, 0.0]
    with eval_mode(model):
        for i in range(0, rows.shape[0], per):
            x = rows[i:i + per, :-1].to(device)
            y = rows[i:i + per, 1:].to(device)
            if own_output:
                clean = model(x)[0]  # (b, T, n_out)
            for j, spec in enumerate(specs):
                if own_output:
                    loss = _own_output_loss(model(x, attn=spec)[0], clean)
                else:
                    _, loss = model(x, y, attn=spec)
                sums[j] += float(loss) * x.shape[0]
    n = rows.shape[0]
    return sums[0] / n, sums[1] / n, sums[2] / n


def _own_output_loss(logits: Tensor, clean: Tensor) -> Tensor:
    """`spliced_losses`' loss of a compiled program: against the clean run's own output."""
    if clean.shape[-1] == 1:
        return (logits - clean).square().mean()
    return F.cross_entropy(logits.flatten(0, 1), clean.argmax(-1).flatten())
