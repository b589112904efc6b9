"""What a head does, not only where it looks: knock one head out and measure what the model
loses. `ablate_heads` returns, for every head alone, the loss with that head ablated minus the
unablated loss, in nats per token: 0 = the prediction never needed it, > 0 = it carried part
of the prediction (< 0: the model does better without it on this input).

The intervention is the forward pass's one head hook (`AttnSpec.head_hook`): the head's output
z `[batch, head, query, d_head]` (its attention-weighted values, before W_O mixes the heads
into the residual stream) is replaced, in one layer, for one head:

- `zero`: by zeros, so W_O receives nothing from the head (a bias of W_O stays: it belongs to
  no head);
- `mean`: by its mean over the input's positions (the same vector at every query), which
  keeps the average signal the rest of the model may rely on and removes what depends on the
  position and the tokens (Wang et al. 2022's mean ablation, averaged over this input);
- `resample`: by its output at the same positions on the same tokens in a random order (a
  seeded permutation): what the head would say about an input with the same tokens but none of
  this one's order (the resample ablation of Chan et al. 2022, with the permuted input as the
  reference distribution).

Ablating head h of layer l leaves every layer before l unchanged, so inside its layer the head
sees exactly the inputs of the unablated pass: the mean and the resampled outputs are those of
the unablated model. Every head is ablated in one batched forward pass (one row per head, plus
one unablated row), in chunks that bound the memory; each row's effect is measured against the
unablated row of its own batch, so a head whose output is already what replaces it gives an
effect of exactly 0.

Where the loss is scored is the caller's choice (`positions`): every next-token prediction of a
text; on the induction probe only the predictions inside the second copy, where copying is
possible (`heads.probes.ProbeInput.scored`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minigpt.attention import AttnSpec
from minigpt.errors import ArgumentError

MODES = ("zero", "mean", "resample")
MODE_HELP = {
    "zero": "the head's output replaced by zeros",
    "mean": "the head's output replaced by its mean over the input's positions",
    "resample": "the head's output replaced by its output on the same tokens in a random order",
}
# Floats of activations per row a chunk may hold (rows x T x the widest of 4C and V): ~256 MB.
CHUNK_FLOATS = 64 * 1024 * 1024


@dataclass
class Ablation:
    """Per-head ablation effects on one input.

    effect: (n_layer, n_head) float64: loss with that head ablated - `base_loss`, nats/token.
    base_loss: the unablated loss over the scored predictions (nats/token).
    positions: the query positions whose next-token prediction is scored."""

    mode: str
    effect: Tensor
    base_loss: float
    positions: list[int]
    scored: str  # what the scored predictions are, for people: "every next-token prediction"

    def to_json(self) -> dict:
        return {"mode": self.mode, "what": MODE_HELP[self.mode], "scored": self.scored,
                "n_scored": len(self.positions), "base_loss": round(self.base_loss, 6),
                "unit": "nats/token"}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ArgumentError("ablate", f"'{mode}' is not an ablation mode; valid: "
                            f"{', '.join(MODES)}")
    return mode


def check_positions(n_tokens: int, positions: Sequence[int] | None, minimum: int = 2) -> list[int]:
    """The scored query positions (None: every one with a next token); ArgumentError when the
    input leaves nothing to score (`minimum`: the shortest input that would)."""
    scored = list(range(n_tokens - 1)) if positions is None else list(positions)
    if not scored:
        raise ArgumentError("ablate", f"the input has {n_tokens} tokens, too short to score a "
                            f"prediction: it needs at least {minimum} (see --max-tokens)")
    assert all(0 <= p < n_tokens - 1 for p in scored), "positions must have a next token"
    return scored


@torch.no_grad()
def ablate_heads(model, tokens: Sequence[int], mode: str = "zero", *,
                 positions: Sequence[int] | None = None, scored: str = "every next-token "
                 "prediction", minimum: int = 2, seed: int = 0) -> Ablation:
    """Every head's ablation effect on `tokens` (one sequence within the model's block_size);
    `positions` and `minimum` as in `check_positions`; `seed` orders the resample reference.
    The model runs in eval mode with its own attention kernel and is restored afterwards."""
    check_mode(mode)
    pos = check_positions(len(tokens), positions, minimum)
    cfg = model.cfg
    L, H = cfg.n_layer, cfg.n_head
    device = next(model.parameters()).device
    idx = torch.tensor([list(tokens)], dtype=torch.long, device=device)  # (1, T)
    targets = idx[0, 1:][pos]  # (P,)
    was_training = model.training
    model.eval()
    try:
        reference = _resampled_outputs(model, idx, seed) if mode == "resample" else None
        heads = [(layer, head) for layer in range(L) for head in range(H)]
        rows = max(1, CHUNK_FLOATS // (idx.shape[1] * max(4 * cfg.n_embd, cfg.vocab_size)) - 1)
        effect = torch.zeros(L * H, dtype=torch.float64)
        base = None
        for start in range(0, len(heads), rows):
            chunk = heads[start:start + rows]
            losses = _chunk_losses(model, idx, chunk, mode, reference, pos, targets)
            base = losses[0] if base is None else base
            effect[start:start + len(chunk)] = losses[1:] - losses[0]
    finally:
        model.train(was_training)
    return Ablation(mode, effect.view(L, H), float(base), pos, scored)


def _chunk_losses(model, idx: Tensor, chunk: list[tuple[int, int]], mode: str,
                  reference: list[Tensor] | None, pos: list[int], targets: Tensor) -> Tensor:
    """Losses (1 + len(chunk),) float64 of one batched pass: row 0 unablated, row r + 1 with
    head chunk[r] ablated."""
    n_rows = 1 + len(chunk)
    L, H = model.cfg.n_layer, model.cfg.n_head
    hit = torch.zeros(n_rows, L, H, dtype=torch.bool, device=idx.device)  # (rows, L, H)
    for r, (layer, head) in enumerate(chunk, start=1):
        hit[r, layer, head] = True

    def hook(layer: int, z: Tensor) -> Tensor:  # z: (rows, H, T, D)
        mask = hit[:, layer, :, None, None]  # (rows, H, 1, 1)
        if not mask.any():
            return z
        if mode == "zero":
            new = torch.zeros_like(z)
        elif mode == "mean":
            new = z.mean(dim=2, keepdim=True).expand_as(z)  # (rows, H, 1, D) at every query
        else:
            new = reference[layer].expand_as(z)  # (1, H, T, D) from the permuted input
        return torch.where(mask, new, z)

    spec = AttnSpec(model.cfg.attn_impl, head_hook=hook)
    logits, _ = model(idx.expand(n_rows, -1), attn=spec)  # (rows, T, V)
    picked = logits[:, pos]  # (rows, P, V)
    loss = F.cross_entropy(picked.reshape(-1, picked.shape[-1]).double(),
                           targets.repeat(n_rows), reduction="none")
    return loss.view(n_rows, -1).mean(dim=1).cpu()  # (rows,)


def _resampled_outputs(model, idx: Tensor, seed: int) -> list[Tensor]:
    """Every layer's head outputs z (1, H, T, D) on `idx` with its tokens in a seeded random
    order: the reference of resample ablation."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(idx.shape[1], generator=gen).to(idx.device)
    outputs: list[Tensor] = []

    def keep(layer: int, z: Tensor) -> Tensor:
        outputs.append(z.clone())
        return z

    model(idx[:, perm], attn=AttnSpec(model.cfg.attn_impl, head_hook=keep))
    return outputs
