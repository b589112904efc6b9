"""Sparse autoencoders (SAEs): a dictionary of sparse features for a `[n, d_in]` set of
activations, here the concatenated head outputs `z` of one attention layer (`minigpt features`,
after "Interpreting Attention Layer Outputs with Sparse Autoencoders", Kissane et al. 2024).

The coder (TopK, after "Scaling and evaluating sparse autoencoders", Gao et al. 2024), in
SAELens's inference convention (`apply_b_dec_to_input`, its `TopKSAE.encode` / `decode`):

    pre  = (x - b_dec) @ W_enc + b_enc              (n, d_sae)
    acts = ReLU of the k largest entries of pre per row, zeros elsewhere
    x_hat = acts @ W_dec + b_dec                    (n, d_in)

W_enc [d_in, d_sae], W_dec [d_sae, d_in] with unit-norm rows (renormalised after every step,
the gradient along each row removed first), b_dec initialised to the data's mean and W_enc to
W_dec's transpose. Dead features (none of their activations among the top k for
`dead_after` training tokens) are fed by the AuxK loss: the `aux_k` largest pre-activations
of the dead features alone reconstruct the residual x - x_hat, scaled by 1/32, as in Gao et al.

Why a coder of our own and not a library's: SAELens (6.x) trains through TransformerLens < 4
and a hub model and data set (the project uses TransformerLens 4.3 and trains offline on its own
runs), and eai-sparsify trains from a transformers model's hooks and pulls its own stack
(triton kernels, datasets); both are heavy installs for ~100 lines of maths. The saved files
are SAELens's own layout, and a slow test loads them with SAELens (tests/test_features.py).

Quality numbers, as SAELens and SAEBench report them (`quality`): L0 (mean active features per
token), the fraction of variance explained (1 - sum |x - x_hat|^2 / sum |x - mean x|^2), the
fraction of features that never fire on the held-out tokens, and (`ce_recovered`, from three
losses the caller measures) the cross-entropy loss recovered, (zero - sae) / (zero - clean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

AUX_SCALE = 1.0 / 32  # Gao et al.'s AuxK coefficient


class TopKSAE(nn.Module):
    """A TopK sparse autoencoder (module docstring) of `d_in` inputs, `d_sae` features, `k`
    active per row."""

    def __init__(self, d_in: int, d_sae: int, k: int, *, generator: torch.Generator | None = None
                 ) -> None:
        super().__init__()
        if not 0 < k <= d_sae:  # a bug: callers check user input (features.fit)
            raise ValueError(f"need 0 < k <= d_sae, got k={k}, d_sae={d_sae}")
        self.d_in, self.d_sae, self.k = d_in, d_sae, k
        w_dec = torch.randn(d_sae, d_in, generator=generator)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(w_dec)
        self.W_enc = nn.Parameter(w_dec.T.clone())
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.b_dec = nn.Parameter(torch.zeros(d_in))

    def pre(self, x: Tensor) -> Tensor:
        """Pre-activations (..., d_sae) of x (..., d_in)."""
        return (x - self.b_dec) @ self.W_enc + self.b_enc

    def topk(self, pre: Tensor) -> Tensor:
        """The k largest pre-activations per row, ReLU'd, zeros elsewhere (..., d_sae)."""
        vals, idx = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, idx, vals.relu())

    def encode(self, x: Tensor) -> Tensor:
        """Feature activations (..., d_sae) of x (..., d_in)."""
        return self.topk(self.pre(x))

    def decode(self, acts: Tensor) -> Tensor:
        """The reconstruction (..., d_in) of feature activations (..., d_sae)."""
        return acts @ self.W_dec + self.b_dec

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Rescale every decoder row to unit norm."""
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def remove_parallel_grad(self) -> None:
        """Drop the part of W_dec's gradient along each row: a step then turns a row and does
        not only rescale it (the renormalisation would undo that)."""
        if self.W_dec.grad is not None:
            g, w = self.W_dec.grad, self.W_dec
            g -= (g * w).sum(dim=1, keepdim=True) * w


@dataclass
class StepLosses:
    """One training step's losses: `mse` (the reconstruction's squared error over the batch's
    variance: the fraction of variance unexplained) and `aux` (AuxK, 0 with no dead feature)."""

    total: Tensor
    mse: float
    aux: float
    fired: Tensor  # (d_sae,) bool: the features active on some row of the batch


def losses(sae: TopKSAE, x: Tensor, dead: Tensor, aux_k: int) -> StepLosses:
    """The training loss on the batch x (n, d_in): the normalised MSE plus, when some
    features are dead (`dead`, (d_sae,) bool), AUX_SCALE x the AuxK loss (module docstring)."""
    pre = sae.pre(x)
    acts = sae.topk(pre)
    x_hat = sae.decode(acts)
    var = (x - x.mean(0)).pow(2).sum().clamp_min(1e-12)
    err = x - x_hat
    mse = err.pow(2).sum() / var
    aux = torch.zeros((), device=x.device)
    n_dead = int(dead.sum())
    if n_dead:
        kk = min(aux_k, n_dead)
        masked = pre.masked_fill(~dead, float("-inf"))
        vals, idx = masked.topk(kk, dim=-1, sorted=False)
        aux_acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
        e_hat = aux_acts @ sae.W_dec  # no bias: the residual has none to add
        target = err.detach()
        aux = (target - e_hat).pow(2).sum() / (target - target.mean(0)).pow(2).sum().clamp_min(
            1e-12)
        aux = torch.nan_to_num(aux, nan=0.0)
    return StepLosses(mse + AUX_SCALE * aux, float(mse.detach()), float(aux.detach()),
                      (acts > 0).any(0))


@dataclass
class Quality:
    """How good an SAE is on held-out activations (module docstring)."""

    l0: float                 # mean active features per row
    variance_explained: float
    dead_fraction: float      # features never active on these rows
    density: Tensor           # (d_sae,) fraction of rows each feature is active on
    mse: float                # mean squared error per row, summed over d_in

    def to_json(self) -> dict:
        return {"l0": self.l0, "variance_explained": self.variance_explained,
                "dead_fraction": self.dead_fraction, "mse": self.mse}


@torch.no_grad()
def quality(sae: TopKSAE, x: Tensor, chunk: int = 8192) -> Quality:
    """Quality of `sae` on x (n, d_in), in chunks of `chunk` rows."""
    n = x.shape[0]
    fired = torch.zeros(sae.d_sae, dtype=torch.float64)
    err = l0 = 0.0
    for i in range(0, n, chunk):
        xb = x[i:i + chunk]
        acts = sae.encode(xb)
        on = acts > 0
        fired += on.sum(0).double().cpu()
        l0 += float(on.sum())
        err += float((xb - sae.decode(acts)).double().pow(2).sum())
    var = float((x.double() - x.double().mean(0)).pow(2).sum())
    density = (fired / max(n, 1)).float()
    return Quality(l0=l0 / max(n, 1), variance_explained=1.0 - err / var if var > 0 else
                   float("nan"), dead_fraction=float((density == 0).float().mean()),
                   density=density, mse=err / max(n, 1))


def ce_recovered(clean: float, zero: float, sae: float) -> float:
    """The fraction of the loss that zero-ablating the layer adds which the SAE's
    reconstruction takes back: (zero - sae) / (zero - clean); NaN when ablation costs nothing."""
    gap = zero - clean
    return (zero - sae) / gap if abs(gap) > 1e-9 else float("nan")


def max_cosines(learned: Tensor, truth: Tensor) -> Tensor:
    """For every row of `truth` (m, d), its largest cosine with a row of `learned` (n, d):
    how well a dictionary was recovered (their mean: the "mean max cosine")."""
    a = learned / learned.norm(dim=1, keepdim=True).clamp_min(1e-12)
    b = truth / truth.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return (b @ a.T).max(dim=1).values


def default_lr(d_sae: int) -> float:
    """Adam's learning rate for `d_sae` features: Gao et al.'s 2e-4 at 16k features scaled by
    1/sqrt(d_sae / 16384), capped at 2e-3 (small dictionaries)."""
    return min(2e-3, 2e-4 / math.sqrt(d_sae / 16384))
