"""The GPT: a decoder-only transformer whose attention is the lecture's (see `attention.py`).

Read top-down like nanoGPT: CausalSelfAttention, MLP, Block, GPT, flops_per_token.

Notebook API (stable; inspect-heads and export use it):

    from minigpt.config import load_config
    from minigpt.model import GPT
    cfg = load_config("default", ["model.vocab_size=256"])
    model = GPT.from_config(cfg, seed=0).eval()          # Config or ModelConfig
    idx = torch.tensor([[72, 101, 108, 108, 111]])        # (B, T) token ids
    logits, _ = model(idx)                                # (B, T, vocab_size) float32
    logits, loss = model(idx[:, :-1], targets=idx[:, 1:]) # mean cross-entropy
    logits, probs = model.forward_with_attention(idx)     # probs: n_layer x (B, n_head, T, T)
    cache = model.new_kv_cache(batch_size=1)              # incremental decoding, see KVCache
    model.num_params()                                    # {"total": ..., ...}

`from minigpt.model import attention, GPT, KVCache, flops_per_token` is the public surface.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minigpt.attention import (
    INSPECT,
    AttnSpec,
    KVCache,
    QKNorm,
    Rotary,
    apply_rope,
    attention,
    sinusoidal_table,
)
from minigpt.config import Config, ModelConfig

__all__ = ["GPT", "KVCache", "attention", "flops_per_token"]


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    """Fused QKV projection -> split -> heads -> attention -> merge -> W_O (the blog's order)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # W_Q | W_K | W_V
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # W_O
        self.c_proj.residual_proj = True  # scaled init, see GPT._init_weights
        self.attn_dropout, self.resid_dropout = cfg.attn_dropout, cfg.dropout
        self.qk_norm = QKNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, *, rope: tuple[Tensor, Tensor, Tensor] | None,
                cache: KVCache | None, layer: int, spec: AttnSpec) -> tuple[Tensor, Tensor | None]:
        B, T, C = x.shape
        # Head i of Q uses columns [i*head_dim, (i+1)*head_dim) of Q's C columns (likewise K, V);
        # one permute puts every head's q, k and v in the `[batch, head, position, d_head]` layout.
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim)  # (B, T, 3C) -> (B, T, 3, H, D)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, D), a view
        if rope is None and self.qk_norm is None:
            q, k, v = qkv.unbind(0)  # 3 x (B, H, T, D)
        else:  # q and k are normalised and rotated together (one op each); v is left alone
            # split, not slicing: its backward is one cat instead of zero-fill + copy per slice
            qk, v = qkv.split([2, 1])  # (2, B, H, T, D), (1, B, H, T, D)
            if self.qk_norm is not None:  # before RoPE: the rotation keeps the norm
                qk = self.qk_norm(qk)
            if rope is not None:  # positions live in q and k only; v stays position-free
                qk = apply_rope(qk, *rope)  # tables (T, D/2) broadcast over (2, B, H)
            q, k = qk.unbind(0)  # 2 x (B, H, T, D)
            v = v.squeeze(0)  # (B, H, T, D)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(layer, k, v)  # (B, H, past + T, D)
            if k.dtype != q.dtype:  # the cache is in the weights' dtype; q is autocast's
                k, v = k.to(q.dtype), v.to(q.dtype)
        # Dropout inside the kernel (attn_dropout) sends CPU SDPA to its math fallback; the
        # residual dropout below (model.dropout) leaves the fused kernel alone.
        drop = self.attn_dropout if self.training else 0.0
        z, probs = attention(q, k, v, scale=spec.scale, causal=spec.causal, past_length=past,
                             impl=spec.impl, return_probs=spec.return_probs,
                             dropout_p=drop)  # z: every head's output, (B, H, T, D)
        if spec.head_hook is not None:  # the one place to read or change a single head
            z = spec.head_hook(layer, z)
        y = self.c_proj(z.transpose(1, 2).reshape(B, T, C))  # merge heads: (B, T, H*D) -> (B, T, C)
        return (F.dropout(y, self.resid_dropout) if self.training and self.resid_dropout
                else y), probs


def relu2(x: Tensor) -> Tensor:
    """ReLU squared, max(x, 0)^2 (So et al., Primer, 2021)."""
    return F.relu(x).square()


# model.activation -> the function; elementwise, so any shape in, the same shape out
ACTIVATIONS = {
    "gelu": F.gelu,  # x * Phi(x), Phi the normal CDF (erf)
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's gelu_new
    "relu2": relu2,
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_proj = True
        self.dropout = cfg.dropout
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.c_fc(x))  # (B, T, C) -> (B, T, 4C)
        y = self.c_proj(h)  # (B, T, 4C) -> (B, T, C)
        return F.dropout(y, self.dropout) if self.training and self.dropout else y


class Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)) (no MLP when cfg.mlp is false)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg) if cfg.mlp else None
        self.mlp = MLP(cfg) if cfg.mlp else None

    def forward(self, x: Tensor, *, rope, cache: KVCache | None, layer: int,
                spec: AttnSpec) -> tuple[Tensor, Tensor | None]:
        a, probs = self.attn(self.ln_1(x), rope=rope, cache=cache, layer=layer, spec=spec)
        x = x + a
        if self.mlp is not None:
            x = x + self.mlp(self.ln_2(x))
        return x, probs


class GPT(nn.Module):
    """Token embedding (+ learned/sinusoidal positions) -> n_layer Blocks -> norm -> LM head.

    `cfg.pos_encoding`: rope (inside every attention layer), learned (GPT-2 table added at the
    input; more than block_size positions is a ValueError), sinusoidal (fixed table added at
    the input), none. The LM head shares the embedding matrix when `cfg.tie_weights`; with
    `cfg.head_init` zero (untied only) it starts at zero, so the first predictions are uniform.
    `cfg.logit_softcap` > 0 squashes every logit into (-cap, cap): cap * tanh(logit / cap).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # The config refuses all of these with a one-line error; here they are broken invariants.
        if cfg.vocab_size <= 0:
            raise ValueError("vocab_size is 0: set it to the tokenizer's n_vocab before building "
                             "the model (GPT.from_config(cfg, vocab_size=...))")
        if cfg.n_embd % cfg.n_head or (cfg.pos_encoding == "rope" and cfg.head_dim % 2):
            raise ValueError(f"n_head={cfg.n_head} must divide n_embd={cfg.n_embd} into an "
                             "(even, for RoPE) head dimension")
        self.cfg = cfg
        self._spec = AttnSpec(cfg.attn_impl)  # how forward() attends unless told otherwise
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)  # E[y_i]: (V, C)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos_encoding == "learned" \
            else None
        self.rotary = Rotary(cfg.head_dim, cfg.block_size, cfg.rope_base) \
            if cfg.pos_encoding == "rope" else None
        if cfg.pos_encoding == "sinusoidal":
            self.register_buffer("pe", sinusoidal_table(cfg.block_size, cfg.n_embd),
                                 persistent=False)  # (P, C), grown on demand
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)  # (V, C)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight  # one Parameter, two uses
        self.apply(self._init_weights)
        if cfg.head_init == "zero":  # after the normal init, so every other weight is unchanged
            nn.init.zeros_(self.lm_head.weight)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2: N(0, 0.02) everywhere; projections into the residual stream (attention W_O,
        MLP c_proj) get 0.02/sqrt(2*n_layer) because 2*n_layer of them add up in the stream."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_proj",
                                                                    False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @classmethod
    def from_config(cls, cfg: Config | ModelConfig, *, vocab_size: int | None = None,
                    seed: int | None = None) -> GPT:
        """Build from a Config (its `.model`) or a ModelConfig, not mutating it. `vocab_size`
        overrides the config's (required when that is 0); `seed` makes the init reproducible
        without touching the global RNG."""
        mcfg = cfg.model if isinstance(cfg, Config) else cfg
        if vocab_size is not None:
            mcfg = dataclasses.replace(mcfg, vocab_size=vocab_size)
        else:
            mcfg = dataclasses.replace(mcfg)
        if seed is None:
            return cls(mcfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return cls(mcfg)

    # ----------------------------------------------------------------------------------------

    def _embed(self, idx: Tensor, start: int) -> Tensor:
        """Token (+ absolute position) embeddings for positions [start, start + T): (B, T, C)."""
        T = idx.shape[1]
        x = self.wte(idx)  # (B, T) -> (B, T, C)
        if self.wpe is not None:
            if start + T > self.cfg.block_size:  # callers crop (sample.py, inspect-heads)
                raise ValueError(
                    f"sequence reaches position {start + T - 1} but model.block_size="
                    f"{self.cfg.block_size} with pos_encoding 'learned' has no embedding past "
                    f"position {self.cfg.block_size - 1}; crop the context to the last "
                    f"{self.cfg.block_size} tokens")
            x = x + self.wpe.weight[start:start + T]  # (T, C) broadcast over B
        elif self.cfg.pos_encoding == "sinusoidal":
            if start + T > self.pe.shape[0]:  # generation past block_size: grow the fixed table
                self.pe = sinusoidal_table(max(start + T, 2 * self.pe.shape[0]),
                                           self.cfg.n_embd).to(self.pe.device)
            x = x + self.pe[start:start + T]
        return F.dropout(x, self.cfg.dropout) if self.training and self.cfg.dropout else x

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                kv_cache: KVCache | None = None, *, attn: AttnSpec | None = None,
                ) -> tuple[Tensor, Tensor | None]:
        """THE forward pass. idx (B, T) long -> logits (B, T, vocab_size) float32 and, with
        targets (B, T), the mean cross-entropy (targets of -1 are ignored).

        `attn` says how attention is computed (default: `cfg.attn_impl`) and is where a head's
        output can be read or changed (`AttnSpec.head_hook`). With `kv_cache`, idx continues
        the cached sequence (see KVCache for the contract); one token at a time this is the
        decode step of generation, where the one query sees every cached key and no mask is
        built. Training, sampling, inspection and imported models all run this pass."""
        logits, _ = self._run(idx, kv_cache, attn or self._spec)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    def forward_with_attention(self, idx: Tensor, scale: float | None = None,
                               causal: bool = True, head_hook=None) -> tuple[Tensor, list[Tensor]]:
        """The explicit path: logits (B, T, V) and n_layer attention-probability tensors
        (B, n_head, T, T) (`[batch, head, query, key]`, rows sum to 1). `scale` defaults to
        1/sqrt(head_dim); `causal=False` lifts the mask (the permutation demonstration only:
        the model is trained causal); `head_hook` as in AttnSpec."""
        spec = INSPECT if scale is None and causal and head_hook is None else AttnSpec(
            "explicit", scale=scale, return_probs=True, causal=causal, head_hook=head_hook)
        return self._run(idx, None, spec)

    def _run(self, idx: Tensor, kv_cache: KVCache | None, spec: AttnSpec
             ) -> tuple[Tensor, list[Tensor]]:
        """Embed -> blocks -> final norm -> LM head: logits (B, T, V) float32 and, when
        `spec.return_probs`, each layer's attention probabilities."""
        B, T = idx.shape
        start = 0
        if kv_cache is not None:
            start = kv_cache.length
            if T > kv_cache.remaining or B != kv_cache.batch_size:  # callers crop and reset
                raise ValueError(f"{B} x {T} new tokens do not fit the KV cache ({kv_cache.length}"
                                 f" of {kv_cache.max_len} positions used, batch "
                                 f"{kv_cache.batch_size}); crop, reset() and prefill again")
        x = self._embed(idx, start)  # (B, T, C)
        rope = self.rotary.tables(start, T) if self.rotary is not None else None
        all_probs = []
        for i, block in enumerate(self.blocks):
            x, probs = block(x, rope=rope, cache=kv_cache, layer=i, spec=spec)
            if probs is not None:
                all_probs.append(probs)
        if kv_cache is not None:
            kv_cache.advance(T)
        logits = self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, V)
        return self._softcap(logits.float()), all_probs

    def _softcap(self, logits: Tensor) -> Tensor:
        """cap * tanh(logits / cap) with cap = cfg.logit_softcap (0 = logits unchanged)."""
        cap = self.cfg.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache on the model's device/dtype; max_len defaults to block_size."""
        p = self.wte.weight
        return KVCache(self.cfg.n_layer, batch_size, self.cfg.n_head,
                       max_len or self.cfg.block_size, self.cfg.head_dim,
                       device=p.device, dtype=p.dtype)

    def num_params(self) -> dict[str, int]:
        """Parameter counts. `total` counts every distinct Parameter once (a tied LM head is the
        embedding matrix, counted in `embedding`; `lm_head` is then 0). `position` is the
        learned table (0 otherwise; rope/sinusoidal have no parameters). `non_embedding` =
        total - embedding - position (Kaplan et al.'s N). `matmul` = weights used in matrix
        multiplies per token (blocks + LM head), the N of flops_per_token."""
        count = lambda ps: sum(p.numel() for p in ps)
        attn = count(p for b in self.blocks for p in b.attn.parameters())
        mlp = count(p for b in self.blocks if b.mlp is not None for p in b.mlp.parameters())
        total = count(self.parameters())  # Module.parameters() yields a shared Parameter once
        emb = self.wte.weight.numel()
        pos = self.wpe.weight.numel() if self.wpe is not None else 0
        head = 0 if self.cfg.tie_weights else self.lm_head.weight.numel()
        norm = total - attn - mlp - emb - pos - head
        matmul = sum(m.weight.numel() for m in self.blocks.modules() if isinstance(m, nn.Linear))
        return {"total": total, "embedding": emb, "position": pos, "lm_head": head,
                "attention": attn, "mlp": mlp, "norm": norm, "non_embedding": total - emb - pos,
                "matmul": matmul + self.lm_head.weight.numel()}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, PaLM appendix B convention:
    6 * N + 12 * n_layer * n_embd * seq_len, where N = matmul weights per token
    (n_layer * (4 C^2 attention + 8 C^2 MLP if cfg.mlp) + V * C for the LM head, tied or not;
    biases, norms, softmax and the embedding lookup are not counted). The attention term counts
    Q K^T and A V over all seq_len keys (2 * 2 * C * T per layer forward, x3 for backward);
    the causal half is not discounted. MFU = flops_per_token * tokens/s / peak."""
    C = cfg.n_embd
    per_layer = 4 * C * C + (8 * C * C if cfg.mlp else 0)  # c_attn 3C^2 + c_proj C^2 (+ MLP)
    n = cfg.n_layer * per_layer + cfg.vocab_size * C
    return 6.0 * n + 12.0 * cfg.n_layer * C * seq_len
