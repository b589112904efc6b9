"""What every setting is: one dataclass per config section, each field on one line with its
default, one-line help and bounds (`setting(...)`). Standard library only, so the maths
(`minigpt/core/`) takes a `ModelConfig` without loading any file code; reading, overriding and
checking a config file is `load.py`'s job.

One name per setting everywhere: dataclass field = YAML key = `--set section.key` path.
docs/config.md is generated from these declarations (`python tools/docs_gen.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["HEAD_KINDS", "SECTIONS", "Config", "DataConfig", "ModelConfig", "RunConfig",
           "TokenizerConfig", "TrainConfig", "setting"]


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default, a one-line meaning and validation metadata (`choices`,
    `min`, `max`, `min_exclusive`, `max_exclusive`, `nonempty`; fields.py checks them)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


# The head kinds the training-time head scores measure (heads/timeline.py), as settings name
# them: train.stop_when_formed.
HEAD_KINDS = ("induction", "previous", "duplicate", "first")


@dataclass
class ModelConfig:
    n_layer: int = setting(4, "number of transformer blocks", min=1)
    n_head: int = setting(4, "attention heads per block; must divide n_embd", min=1)
    n_embd: int = setting(128, "residual stream width (d_model)", min=1)
    d_head: int = setting(
        0, "width of each head's queries, keys and values; 0 = n_embd / n_head", min=0)
    block_size: int = setting(128, "context length in tokens", min=2)
    vocab_size: int = setting(0, "embedding rows; 0 = take it from the tokenizer", min=0)
    pos_encoding: str = setting(
        "rope", "position information", choices=("rope", "learned", "sinusoidal", "none"))
    rope_base: float = setting(
        10000.0, "RoPE base: theta_i = rope_base^(-2i/head_dim)", min_exclusive=1.0)
    norm: str = setting(
        "layernorm", "normalisation in each block and before the output; none = no norm (a "
        "compiled program)", choices=("layernorm", "rmsnorm", "none"))
    norm_eps: float = setting(
        1e-5, "epsilon added to the variance in every norm", min_exclusive=0.0, max=1.0)
    activation: str = setting(
        "gelu", "MLP nonlinearity: gelu (exact, erf), gelu_tanh (GPT-2's tanh approximation, "
        "gelu_new), relu2 (ReLU squared) or relu", choices=("gelu", "gelu_tanh", "relu2", "relu"))
    d_mlp: int = setting(0, "MLP hidden width; 0 = 4 * n_embd", min=0)
    mlp: bool = setting(True, "include the MLP in each block; false = attention-only model")
    dropout: float = setting(
        0.0, "training dropout on the residual stream: the embeddings, each attention output and "
        "each MLP output (the fused attention kernel is untouched)", min=0.0, max_exclusive=1.0)
    attn_dropout: float = setting(
        0.0, "training dropout on the attention probabilities, inside the kernel (on CPU, SDPA "
        "then falls back to its slower math kernel)", min=0.0, max_exclusive=1.0)
    bias: bool = setting(False, "bias terms in linear layers and LayerNorm")
    tie_weights: bool = setting(True, "share the token embedding and the LM head weight")
    d_vocab_out: int = setting(
        0, "outputs of the output read (LM head); 0 = vocab_size (next-token logits); else "
        "its own width, e.g. a compiled program's output values (needs tie_weights false)",
        min=0)
    attn_impl: str = setting(
        "sdpa", "attention kernel: sdpa (fused) or explicit (softmax written out)",
        choices=("sdpa", "explicit"))
    qk_norm: bool = setting(
        False, "RMSNorm each head's query and key before RoPE (a learned gain per head dimension, "
        "one for queries and one for keys, shared by a layer's heads)")
    head_init: str = setting(
        "normal", "LM head init: normal = N(0, 0.02); zero = all zeros (needs tie_weights false)",
        choices=("normal", "zero"))
    logit_softcap: float = setting(
        0.0, "0 = off; else logits = cap * tanh(logits / cap), for the loss and for sampling",
        min=0.0)
    value_skip: bool = setting(
        False, "every layer after the first adds a learned share (from 0.5) of the first layer's "
        "values to its own (a value residual); export and analyses that start mid-model refuse it")
    mtp_weight: float = setting(
        0.0, "0 = off; else training adds this times the loss of predicting the token after next "
        "(the final stream and the next token's embedding through one extra matrix, then the final "
        "norm and LM head); sampling, inspection and export never use it", min=0.0)

    @property
    def head_dim(self) -> int:
        """Each head's width, resolved: d_head, or n_embd / n_head when that is 0."""
        return self.d_head or self.n_embd // self.n_head

    @property
    def mlp_dim(self) -> int:
        """The MLP's hidden width, resolved: d_mlp, or 4 * n_embd when that is 0."""
        return self.d_mlp or 4 * self.n_embd

    @property
    def n_out(self) -> int:
        """The output read's width, resolved: d_vocab_out, or vocab_size when that is 0."""
        return self.d_vocab_out or self.vocab_size


@dataclass
class TokenizerConfig:
    vocab_size: int = setting(
        1024, "256 = raw bytes; more = byte-level BPE trained on the corpus (at most 2**20, "
        "five times GPT-4o's)", min=256, max=2**20)
    encoding: str = setting(
        "", "'' = bytes/BPE by vocab_size; a tiktoken name (gpt2, cl100k_base) or a .tiktoken file")
    pattern: str = setting(
        "gpt4", "pre-tokenizer split pattern for BPE training", choices=("gpt4", "gpt2"))
    train_max_bytes: int = setting(0, "bytes of corpus used to train the BPE; 0 = all of it", min=0)


@dataclass
class DataConfig:
    source: str = setting(
        "text", "text = a corpus on disk; induction = random tokens repeated twice; program = "
        "a RASP program compiled by minigpt compile (not trained)",
        choices=("text", "induction", "program"))
    corpus: str = setting(
        "data/tinyshakespeare.txt", "a .txt, .jsonl (.json, .jsonl.gz, .json.gz) or .parquet file, "
        "a directory of such files, or a glob (docs/data.md)")
    text_field: str = setting(
        "text", "JSON Lines / Parquet corpora: the field (column) holding each record's text; "
        "every record is one document", nonempty=True)
    val_fraction: float = setting(
        0.1, "last fraction of the corpus bytes held out for validation (cut at a line or document "
        "start; the BPE never sees it)", min_exclusive=0.0, max_exclusive=1.0)
    invalid_utf8: str = setting(
        "error", "on bytes that are not UTF-8: error, or replace with U+FFFD",
        choices=("error", "replace"))
    cache_dir: str = setting(
        "", "token cache directory; '' = $MINIGPT_CACHE, $XDG_CACHE_HOME/minigpt or "
        "~/.cache/minigpt")
    induction_vocab: int = setting(
        64, "induction source: token ids drawn from [0, induction_vocab)", min=2)
    induction_min_period: int = setting(
        0, "induction source: 0 = [r, r] with r of block_size//2 ids; else rows of back-to-back "
        "segment pairs (s, s), segment lengths from [this, induction_max_period]", min=0)
    induction_max_period: int = setting(
        0, "induction source: longest segment of a pair; 0 = block_size//2", min=0)
    induction_distinct: bool = setting(
        False, "induction source: draw a row's new ids without replacement, so every repeated id "
        "in a row belongs to a copy (as in the induction probe)")
    induction_groups: int = setting(
        0, "induction source: 0 = off; else the ids form this many groups of consecutive ids, "
        "and each new id is drawn from the group that a fixed random map of the id two places "
        "before it picks, so the token before a position tells which group the next new id is "
        "in", min=0)
    induction_runs: float = setting(
        0.0, "induction source, pairs layout: the chance that a pair is a run, one new id "
        "written 2n times; inside it the earlier occurrence is one place back, where only the "
        "lag-1 (textbook) induction circuit predicts", min=0.0, max=1.0)


@dataclass
class TrainConfig:
    batch_size: int = setting(12, "sequences per optimizer step, summed over devices", min=1)
    micro_batch_size: int = setting(
        0, "sequences per forward pass per device; 0 = no accumulation", min=0)
    max_steps: int = setting(2000, "optimizer steps", min=1)
    learning_rate: float = setting(
        1e-3, "peak learning rate (AdamW's; Muon's is muon_lr)", min_exclusive=0.0)
    min_lr: float = setting(
        1e-4, "floor of the decay (Muon's floor: muon_lr * min_lr / learning_rate)", min=0.0)
    warmup_steps: int = setting(100, "linear warm-up steps", min=0)
    schedule: str = setting(
        "cosine", "after warm-up: cosine = cosine decay to min_lr; wsd = stable at the peak, then "
        "a linear decay to min_lr", choices=("cosine", "wsd"))
    decay_fraction: float = setting(
        0.2, "wsd: fraction of max_steps spent in the final linear decay", min=0.0, max=1.0)
    weight_decay: float = setting(0.1, "AdamW decay on matrices (not on norms, biases)", min=0.0)
    beta1: float = setting(0.9, "AdamW beta1", min=0.0, max_exclusive=1.0)
    beta2: float = setting(0.99, "AdamW beta2", min=0.0, max_exclusive=1.0)
    optimizer: str = setting(
        "adamw", "adamw = AdamW for every weight; muon = Muon for the 2-D matrices in the blocks, "
        "AdamW for embeddings, head, gains and biases", choices=("adamw", "muon"))
    muon_lr: float = setting(
        0.02, "peak Muon learning rate (optimizer muon), scheduled like learning_rate",
        min_exclusive=0.0)
    muon_momentum: float = setting(0.95, "Muon's Nesterov momentum", min=0.0, max_exclusive=1.0)
    muon_weight_decay: float = setting(
        0.0, "Muon's decoupled weight decay on the block matrices", min=0.0)
    ema: float = setting(
        0.0, "0 = off; else evaluate, sample and save (model.safetensors) an exponential moving "
        "average of the weights with this decay per step (the plain mean of all steps so far until "
        "its horizon 1/(1-ema) is reached)", min=0.0, max_exclusive=1.0)
    data_order: str = setting(
        "random", "the rows each step reads: random = windows at random offsets, drawn with "
        "replacement; epochs = every epoch a fresh shuffle of back-to-back windows at a random "
        "phase, so every training token is read once per epoch (corpus data)",
        choices=("random", "epochs"))
    distill_from: list[str] = setting(  # noqa: RUF009 - a field(default_factory=...)
        [], "run directories whose models teach this one: the loss mixes in the cross-entropy "
        "against their mean next-token probabilities (same tokenizer; saved as absolute paths)")
    distill_weight: float = setting(
        0.5, "with distill_from: the teachers' share of the loss (the rest is the usual "
        "cross-entropy against the next tokens)", min=0.0, max=1.0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = off", min=0.0)
    eval_interval: int = setting(250, "evaluate every this many steps", min=1)
    eval_batches: int = setting(20, "validation batches per evaluation", min=1)
    log_interval: int = setting(10, "log a metrics line every this many steps", min=1)
    tensorboard: bool = setting(
        False, "also write TensorBoard event files into the run's tensorboard/ directory (needs "
        "pip install 'minigpt-lab[tensorboard]')")
    checkpoint_interval: int = setting(
        500, "checkpoint every this many steps (and at the end)", min=1)
    sample_tokens: int = setting(100, "tokens sampled at each evaluation; 0 = none", min=0)
    sample_prompts: list[str] = setting(  # noqa: RUF009 - a field(default_factory=...)
        [""], "prompts sampled at each evaluation ('' = start of text)")
    precision: str = setting(
        "auto", "auto = bf16 autocast where the device computes bf16 natively (CUDA sm80+, a CPU "
        "with AVX512-BF16 or AMX), fp32 elsewhere", choices=("auto", "fp32", "bf16"))
    compile: str = setting(
        "auto", "torch.compile: auto = on for CUDA only", choices=("auto", "true", "false"))
    threads: int = setting(
        0, "CPU threads training uses (torch intra-op); 0 = automatic, torch's default "
        "(OMP_NUM_THREADS, else the cores); at most the CPUs the process may run on "
        "(docs/cli.md#threads)", min=0)
    keep_checkpoints: int = setting(
        1, "committed checkpoints kept, newest first; older ones are deleted after each save",
        min=1)
    head_scores_interval: str = setting(
        "eval", "score every head on the built-in probes every N steps (metrics.jsonl, heads.png); "
        "eval = at each evaluation, off = never")
    stop_when_formed: list[str] = setting(  # noqa: RUF009 - a field(default_factory=...)
        [], "end training at the first head-score measurement that finds, for each of these kinds "
        "(induction, previous, duplicate, first), a head scoring >= 0.9 (induction and previous "
        "together: the previous-token head in a layer below the induction head's); [] = train to "
        "max_steps",
        choices=HEAD_KINDS)

    def micro(self, world: int) -> int:
        """Sequences per forward pass on each of `world` ranks: micro_batch_size, else each
        rank's whole share of batch_size (at least 1)."""
        return self.micro_batch_size or max(1, self.batch_size // world)


@dataclass
class RunConfig:
    name: str = setting(
        "", "run name, one directory name under out_dir; '' = the config file's name")
    out_dir: str = setting("runs", "parent directory of run directories")
    seed: int = setting(1337, "seed for weights, batches and sampling", min=0, max=2**63 - 1)
    device: str = setting(
        "auto", "auto = cuda, then mps, then cpu", choices=("auto", "cpu", "cuda", "mps"))

@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on: train.batch_size rows of model.block_size."""
        return self.train.batch_size * self.model.block_size


SECTIONS: dict[str, type] = {"model": ModelConfig, "tokenizer": TokenizerConfig,
                             "data": DataConfig, "train": TrainConfig, "run": RunConfig}
