"""Configuration: one dataclass per section, loaded from strict YAML, overridden by `--set`.

One name per setting everywhere: dataclass field = YAML key = `--set section.key` path.
Every field carries its default, one-line help and bounds on one line (`setting(...)`, see
fields.py, which also does the typing and checking); constraints between fields are in
`_validate_cross`.

This module imports neither torch nor anything else heavy: the CLI can validate a config and
print it before any model code loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from minigpt.errors import ArgumentError, ConfigError, MinigptError
from minigpt.fields import build_section, describe, parse_value, setting, unknown
from minigpt.files import parse_yaml, read_text
from minigpt.paths import CONFIGS_DIR, resolve_path

__all__ = ["Config", "ConfigError", "DataConfig", "MinigptError", "ModelConfig", "RunConfig",
           "TokenizerConfig", "TrainConfig", "apply_overrides", "config_from", "describe_fields",
           "from_dict", "load_config", "model_hash", "parse_override", "parse_yaml", "read_config",
           "to_dict", "to_yaml"]


# The head kinds the training-time head scores measure (heads/timeline.py), as settings name
# them: train.stop_when_formed.
HEAD_KINDS = ("induction", "previous", "duplicate", "first")


# --------------------------------------------------------------------------------------------
# The sections. Keep each field's help to one line: docs/config.md is generated from these
# declarations (`python tools/docs_gen.py`, through `describe_fields`).


@dataclass
class ModelConfig:
    n_layer: int = setting(4, "number of transformer blocks", min=1)
    n_head: int = setting(4, "attention heads per block; must divide n_embd", min=1)
    n_embd: int = setting(128, "residual stream width (d_model)", min=1)
    block_size: int = setting(128, "context length in tokens", min=2)
    vocab_size: int = setting(0, "embedding rows; 0 = take it from the tokenizer", min=0)
    pos_encoding: str = setting(
        "rope", "position information", choices=("rope", "learned", "sinusoidal", "none")
    )
    rope_base: float = setting(10000.0, "RoPE base: theta_i = rope_base^(-2i/head_dim)", min_exclusive=1.0)
    norm: str = setting("layernorm", "normalisation in each block", choices=("layernorm", "rmsnorm"))
    norm_eps: float = setting(1e-5, "epsilon added to the variance in every norm", min_exclusive=0.0,
                        max=1.0)
    activation: str = setting("gelu", "MLP nonlinearity: gelu (exact, erf), gelu_tanh (GPT-2's tanh "
                        "approximation, gelu_new) or relu2 (ReLU squared)",
                        choices=("gelu", "gelu_tanh", "relu2"))
    mlp: bool = setting(True, "include the MLP in each block; false = attention-only model")
    dropout: float = setting(0.0, "training dropout on the residual stream: the embeddings, each attention output and each MLP output (the fused attention kernel is untouched)", min=0.0, max_exclusive=1.0)
    attn_dropout: float = setting(0.0, "training dropout on the attention probabilities, inside the kernel (on CPU, SDPA then falls back to its slower math kernel)", min=0.0, max_exclusive=1.0)
    bias: bool = setting(False, "bias terms in linear layers and LayerNorm")
    tie_weights: bool = setting(True, "share the token embedding and the LM head weight")
    attn_impl: str = setting(
        "sdpa", "attention kernel: sdpa (fused) or explicit (softmax written out)",
        choices=("sdpa", "explicit"),
    )
    qk_norm: bool = setting(False, "RMSNorm each head's query and key before RoPE (a learned gain per "
                      "head dimension, one for queries and one for keys, shared by a layer's heads)")
    head_init: str = setting("normal", "LM head init: normal = N(0, 0.02); zero = all zeros (needs "
                       "tie_weights false)", choices=("normal", "zero"))
    logit_softcap: float = setting(0.0, "0 = off; else logits = cap * tanh(logits / cap), for the loss "
                             "and for sampling", min=0.0)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass
class TokenizerConfig:
    vocab_size: int = setting(1024, "256 = raw bytes; more = byte-level BPE trained on the corpus", min=256)
    encoding: str = setting(
        "", "'' = bytes/BPE by vocab_size; a tiktoken name (gpt2, cl100k_base) or a .tiktoken file"
    )
    pattern: str = setting("gpt4", "pre-tokenizer split pattern for BPE training", choices=("gpt4", "gpt2"))
    train_max_bytes: int = setting(0, "bytes of corpus used to train the BPE; 0 = all of it", min=0)


@dataclass
class DataConfig:
    source: str = setting("text", "text = a corpus on disk; induction = random tokens repeated twice",
                    choices=("text", "induction"))
    corpus: str = setting("data/tinyshakespeare.txt", "a .txt, .jsonl (.json, .jsonl.gz, .json.gz) or .parquet file, a directory of such files, or a glob (docs/data.md)")
    text_field: str = setting("text", "JSON Lines / Parquet corpora: the field (column) holding each record's text; every record is one document", nonempty=True)
    val_fraction: float = setting(0.1, "last fraction of the corpus bytes held out for validation (cut at a line or document start; the BPE never sees it)", min_exclusive=0.0, max_exclusive=1.0)
    invalid_utf8: str = setting("error", "on bytes that are not UTF-8: error, or replace with U+FFFD",
                          choices=("error", "replace"))
    cache_dir: str = setting("", "token cache directory; '' = $MINIGPT_CACHE, $XDG_CACHE_HOME/minigpt or ~/.cache/minigpt")
    induction_vocab: int = setting(64, "induction source: token ids drawn from [0, induction_vocab)", min=2)
    induction_min_period: int = setting(
        0, "induction source: 0 = [r, r] with r of block_size//2 ids; else rows of back-to-back "
        "segment pairs (s, s), segment lengths from [this, induction_max_period]", min=0)
    induction_max_period: int = setting(
        0, "induction source: longest segment of a pair; 0 = block_size//2", min=0)
    induction_distinct: bool = setting(
        False, "induction source: draw a row's new ids without replacement, so every repeated "
        "id in a row belongs to a copy (as in the induction probe)")
    induction_groups: int = setting(0, "induction source: 0 = off; else the ids form this many groups of consecutive ids, and each new id is drawn from the group that a fixed random map of the id two places before it picks, so the token before a position tells which group the next new id is in", min=0)


@dataclass
class TrainConfig:
    batch_size: int = setting(12, "sequences per optimizer step, summed over devices", min=1)
    micro_batch_size: int = setting(0, "sequences per forward pass per device; 0 = no accumulation",
                              min=0)
    max_steps: int = setting(2000, "optimizer steps", min=1)
    learning_rate: float = setting(1e-3, "peak learning rate (AdamW's; Muon's is muon_lr)",
                             min_exclusive=0.0)
    min_lr: float = setting(1e-4, "floor of the decay (Muon's floor: muon_lr * min_lr / learning_rate)",
                      min=0.0)
    warmup_steps: int = setting(100, "linear warm-up steps", min=0)
    schedule: str = setting("cosine", "after warm-up: cosine = cosine decay to min_lr; wsd = stable at "
                      "the peak, then a linear decay to min_lr", choices=("cosine", "wsd"))
    decay_fraction: float = setting(0.2, "wsd: fraction of max_steps spent in the final linear decay",
                              min=0.0, max=1.0)
    weight_decay: float = setting(0.1, "AdamW decay on matrices (not on norms, biases)", min=0.0)
    beta1: float = setting(0.9, "AdamW beta1", min=0.0, max_exclusive=1.0)
    beta2: float = setting(0.99, "AdamW beta2", min=0.0, max_exclusive=1.0)
    optimizer: str = setting("adamw", "adamw = AdamW for every weight; muon = Muon for the 2-D matrices "
                       "in the blocks, AdamW for embeddings, head, gains and biases",
                       choices=("adamw", "muon"))
    muon_lr: float = setting(0.02, "peak Muon learning rate (optimizer muon), scheduled like "
                       "learning_rate", min_exclusive=0.0)
    muon_momentum: float = setting(0.95, "Muon's Nesterov momentum", min=0.0, max_exclusive=1.0)
    muon_weight_decay: float = setting(0.0, "Muon's decoupled weight decay on the block matrices",
                                 min=0.0)
    ema: float = setting(0.0, "0 = off; else evaluate, sample and save (model.safetensors) an exponential moving average of the weights with this decay per step (the plain mean of all steps so far until its horizon 1/(1-ema) is reached)", min=0.0, max_exclusive=1.0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 = off", min=0.0)
    eval_interval: int = setting(250, "evaluate every this many steps", min=1)
    eval_batches: int = setting(20, "validation batches per evaluation", min=1)
    log_interval: int = setting(10, "log a metrics line every this many steps", min=1)
    tensorboard: bool = setting(False, "also write TensorBoard event files into the run's "
                          "tensorboard/ directory (needs pip install 'minigpt-lab[tensorboard]')")
    checkpoint_interval: int = setting(500, "checkpoint every this many steps (and at the end)", min=1)
    sample_tokens: int = setting(100, "tokens sampled at each evaluation; 0 = none", min=0)
    sample_prompts: list[str] = setting([""], "prompts sampled at each evaluation ('' = start of text)")  # noqa: RUF009 - setting() returns a field(default_factory=...)
    precision: str = setting("auto", "auto = bf16 autocast on CUDA, fp32 elsewhere",
                       choices=("auto", "fp32", "bf16"))
    compile: str = setting("auto", "torch.compile: auto = on for CUDA only", choices=("auto", "true", "false"))
    threads: int = setting(0, "CPU threads training uses (torch intra-op); 0 = torch's default (OMP_NUM_THREADS, else the cores); on a machine busy with other work, 1 (docs/cli.md#threads)", min=0)
    keep_checkpoints: int = setting(1, "committed checkpoints kept, newest first; older ones are deleted after each save", min=1)
    head_scores_interval: str = setting("eval", "score every head on the built-in probes every N steps (metrics.jsonl, heads.png); eval = at each evaluation, off = never")
    stop_when_formed: list[str] = setting([], "end training at the first head-score measurement that finds, for each of these kinds (induction, previous, duplicate, first), a head scoring >= 0.9; [] = train to max_steps", choices=HEAD_KINDS)  # noqa: RUF009 - setting() returns a field(default_factory=...)


@dataclass
class RunConfig:
    name: str = setting("", "run name, one directory name under out_dir; '' = the config file's name")
    out_dir: str = setting("runs", "parent directory of run directories")
    seed: int = setting(1337, "seed for weights, batches and sampling", min=0, max=2**63 - 1)
    device: str = setting("auto", "auto = cuda, then mps, then cpu", choices=("auto", "cpu", "cuda", "mps"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)


SECTIONS: dict[str, type] = {"model": ModelConfig, "tokenizer": TokenizerConfig, "data": DataConfig,
            "train": TrainConfig, "run": RunConfig}


def check_run_name(name: str) -> None:
    """run.name names one directory inside run.out_dir: not '.' or '..', no path separator,
    no control character (NUL, newline, terminal escapes), at most 255 bytes. ConfigError."""
    bad = next((c for c in name if c in "/\\" or ord(c) < 32 or ord(c) == 127), None)
    if name in (".", "..") or bad is not None:
        why = f"holds {bad!r}" if bad is not None else "is not a directory name"
        raise ConfigError(f"run.name: {name!r} {why}; a run name is one directory name inside "
                          "run.out_dir (to put a run elsewhere, use --out or run.out_dir)")
    if len(name.encode("utf-8", "surrogateescape")) > 255:
        raise ConfigError(f"run.name: {len(name.encode('utf-8', 'surrogateescape'))} bytes is "
                          "longer than a directory name may be (255); shorten it")


def _validate_cross(cfg: Config) -> None:
    """Constraints between fields (single-field ranges are in the metadata)."""
    check_run_name(cfg.run.name)
    _check_model(cfg.model)
    _check_train(cfg.train, cfg.model)
    _check_induction(cfg)


def _check_model(m: ModelConfig) -> None:
    if m.n_embd % m.n_head:
        divisors = [h for h in range(1, m.n_embd + 1) if m.n_embd % h == 0 and h <= 64]
        raise ConfigError(
            f"model.n_head: {m.n_head} does not divide model.n_embd={m.n_embd}; "
            f"use one of {divisors[:12]}")
    if m.pos_encoding == "rope" and m.head_dim % 2:
        raise ConfigError(
            f"model.n_embd/model.n_head = {m.head_dim} is odd: RoPE rotates pairs of dimensions, "
            "so the head dimension must be even")
    if m.head_init == "zero" and m.tie_weights:
        raise ConfigError(
            "model.head_init: zero needs model.tie_weights: false (a tied LM head is the token "
            "embedding, which must not start at zero); untie it or use head_init: normal")


def _check_train(t: TrainConfig, m: ModelConfig) -> None:
    if t.min_lr > t.learning_rate:
        raise ConfigError(
            f"train.min_lr: {t.min_lr} exceeds train.learning_rate={t.learning_rate}; "
            "the floor must be <= the peak")
    if t.micro_batch_size and t.batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size: {t.micro_batch_size} does not divide "
            f"train.batch_size={t.batch_size}")
    head_scores_every(t)  # 'eval', 'off' or a positive integer
    if t.head_scores_interval != "off" and m.block_size < MIN_PROBE_TOKENS:
        raise ConfigError(
            f"train.head_scores_interval: the head-score probes need model.block_size >= "
            f"{MIN_PROBE_TOKENS}, got {m.block_size}; set train.head_scores_interval: off")
    if t.stop_when_formed and head_scores_every(t) == 0:
        raise ConfigError(
            f"train.stop_when_formed: {', '.join(t.stop_when_formed)} needs head scores during "
            "training, but train.head_scores_interval is off; set it to a number of steps")


def _check_induction(cfg: Config) -> None:
    """The synthetic induction data: its ids, segment lengths and tokenizer."""
    m, d, tc = cfg.model, cfg.data, cfg.tokenizer
    if m.vocab_size and d.source == "induction" and m.vocab_size < d.induction_vocab:
        raise ConfigError(
            f"data.induction_vocab: {d.induction_vocab} exceeds model.vocab_size="
            f"{m.vocab_size}")
    half = max(1, m.block_size // 2)
    if d.induction_max_period > half:
        raise ConfigError(
            f"data.induction_max_period: {d.induction_max_period} exceeds model.block_size//2="
            f"{half} (a segment and its copy must fit in a row); lower it or use 0")
    if d.induction_min_period > (d.induction_max_period or half):
        raise ConfigError(
            f"data.induction_min_period: {d.induction_min_period} exceeds the longest segment "
            f"({d.induction_max_period or half}: data.induction_max_period, or "
            f"model.block_size//2 when that is 0); lower it or use 0")
    fresh = (m.block_size + 4) // 2  # most new ids a row needs: its segments and a short tail
    if d.induction_distinct and d.induction_vocab < fresh:
        raise ConfigError(
            f"data.induction_distinct: a row of model.block_size={m.block_size} needs up to "
            f"{fresh} distinct ids but data.induction_vocab is {d.induction_vocab}; raise "
            "data.induction_vocab or set data.induction_distinct to false")
    if d.source == "induction" and not tc.encoding:  # (a named encoding is checked in data.py)
        if tc.vocab_size != 256:
            raise ConfigError(
                f"tokenizer.vocab_size: {tc.vocab_size} would train a BPE on the corpus, but "
                "data.source is induction (synthetic ids); set tokenizer.vocab_size: 256")
        if d.induction_vocab > tc.vocab_size:
            raise ConfigError(
                f"data.induction_vocab: {d.induction_vocab} exceeds tokenizer.vocab_size="
                f"{tc.vocab_size}; induction tokens must be tokenizer ids")


MIN_PROBE_TOKENS = 4  # the shortest induction probe: two tokens, repeated


def head_scores_every(t: TrainConfig) -> int:
    """Steps between head-score measurements during training: `train.head_scores_interval`
    as a number (0 = never; 'eval' = train.eval_interval). ConfigError for anything else."""
    v = t.head_scores_interval.strip().lower()
    if v == "off":
        return 0
    if v == "eval":
        return t.eval_interval
    if not v.isdigit() or int(v) < 1:
        raise ConfigError(f"train.head_scores_interval: {t.head_scores_interval!r} is not a "
                          "positive number of steps, 'eval' or 'off'")
    return int(v)


def from_dict(raw: Any, source: str = "<config>") -> Config:
    """Build and validate a Config from a parsed YAML mapping (missing keys keep defaults)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(f"{source}: a config must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got a YAML {kind}")
    sections = {}
    for name, body in raw.items():
        if not isinstance(name, str) or name not in SECTIONS:
            raise ConfigError(f"{source}: " + str(unknown(str(name), list(SECTIONS), "section")))
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section '{name}' must be a mapping of keys, "
                              f"got {type(body).__name__}")
        sections[name] = build_section(SECTIONS[name], name, body, source)
    cfg = Config(**sections)
    try:
        _validate_cross(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def model_hash(model_cfg: ModelConfig) -> str:
    """A short hash of every model setting (stored with weights to catch mismatches)."""
    blob = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# `--set section.key=value` overrides.


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one `section.key=value`; the value is coerced and validated like a YAML value."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set model.n_layer=6")
    path, raw = text.split("=", 1)
    path = path.strip()
    if path.count(".") != 1:
        raise ConfigError(f"--set {text!r}: the key must be section.key, e.g. train.max_steps")
    section, key = path.split(".")
    if section not in SECTIONS:
        raise ConfigError(f"--set {text!r}: " + str(unknown(section, list(SECTIONS), "section")))
    names = [fl.name for fl in dataclasses.fields(SECTIONS[section])]
    if key not in names:
        raise ConfigError(f"--set {text!r}: "
                          + str(unknown(key, names, f"key in section '{section}'")))
    return section, key, parse_value(SECTIONS[section], key, raw, f"--set {path}")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Return a copy of the raw YAML mapping with the `--set` overrides merged in."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    for text in overrides:
        section, key, value = parse_override(text)
        body = merged.setdefault(section, {})
        if not isinstance(body, dict):
            body = merged[section] = {}
        body[key] = value
    return merged


def find_config(path: str | None) -> Path:
    """The config file for `path`: None = configs/default.yaml; a bare name = configs/NAME.yaml."""
    if path is None:
        return CONFIGS_DIR / "default.yaml"
    p = resolve_path(path)
    if not p.exists() and "/" not in path and not path.endswith((".yaml", ".yml")):
        p = CONFIGS_DIR / f"{path}.yaml"
    if not p.exists():
        names = sorted(q.stem for q in CONFIGS_DIR.glob("*.yaml"))
        raise ConfigError(f"config file not found: {path}; give a path or one of the bundled "
                          f"names: {', '.join(names)}")
    if p.is_dir():
        raise ConfigError(f"config path is a directory: {path}; give a .yaml file")
    return p


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                ) -> Config:
    """Load, override and validate a config. `path=None` loads configs/default.yaml.

    The run name defaults to the config file's stem. Raises ConfigError (one line)."""
    return config_from(*read_config(path), overrides)


def read_config(path: str | Path | None = None) -> tuple[Path, dict]:
    """The config file for `path` (`find_config`) and its parsed mapping ({} for an empty
    file), not yet validated as a Config. Raises ConfigError (one line)."""
    p = find_config(str(path) if path is not None else None)
    try:
        text = read_text(p, "config")
    except ArgumentError as e:
        problem = e.problem.split(";")[0].replace("not UTF-8 text", "not a UTF-8 text file")
        raise ConfigError(f"{p}: {problem}; a config must be YAML text") from None
    raw = parse_yaml(text, str(p))
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{p}: a config must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got a YAML {type(raw).__name__}")
    return p, raw or {}


def config_from(path: Path, raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated Config of the mapping `raw` read from the file `path` (`read_config`)
    with the `--set` overrides applied in order; run.name defaults to the file's stem."""
    cfg = from_dict(apply_overrides(raw, list(overrides)), str(path))
    if not cfg.run.name:
        cfg.run.name = path.stem
        try:
            check_run_name(cfg.run.name)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e} (the name comes from the config file's name; set "
                              "run.name)") from None
    return cfg


def describe_fields() -> list[tuple[str, str, Any, str]]:
    """(path, type, default, help) for every setting: the source of docs/config.md."""
    return describe(SECTIONS)
