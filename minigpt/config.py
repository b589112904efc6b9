"""Configuration: one dataclass per section, loaded from strict YAML, overridden by `--set`.

One name per setting everywhere: dataclass field = YAML key = `--set section.key` path.
Every field carries a default and a one-line `help`; `choices` / `min` / `max` metadata drive
validation, so adding a field never means adding a validation branch elsewhere.

This module imports neither torch nor anything else heavy: the CLI can validate a config and
print it before any model code loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class MinigptError(Exception):
    """A user-facing error: the CLI prints `str(err)` as one line and exits with code 2."""


class ConfigError(MinigptError):
    """A configuration file or `--set` override is invalid."""


# --------------------------------------------------------------------------------------------
# Where bundled files live. The project root holds configs/ and data/ next to the package; an
# editable install (`pip install -e .`) keeps `minigpt/` inside that root. A wheel install
# puts copies under <prefix>/share/minigpt-lab/ (pyproject's data-files). Either way both are
# found from any working directory.
PACKAGE_DIR = Path(__file__).resolve().parent
_SHARE_DIR = Path(sys.prefix) / "share" / "minigpt-lab"
PROJECT_ROOT = (PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "configs").is_dir()
                or not (_SHARE_DIR / "configs").is_dir() else _SHARE_DIR)
CONFIGS_DIR = PROJECT_ROOT / "configs"
DATA_DIR = PROJECT_ROOT / "data"


def resolve_path(value: str | Path) -> Path:
    """Resolve a user path (file, directory or glob): relative to the working directory when
    that matches something, else relative to the project root, so the bundled
    `data/tinyshakespeare.txt` and `configs/*.yaml` are found from any directory. When neither
    matches, the working-directory path is returned so errors name what the user typed."""
    p = Path(value).expanduser()
    if p.is_absolute():
        return p
    for base in (Path.cwd(), PROJECT_ROOT):
        candidate = base / p
        if candidate.exists() or (_is_glob(str(p)) and any(base.glob(str(p)))):
            return candidate
    return Path.cwd() / p


def _is_glob(s: str) -> bool:
    return any(ch in s for ch in "*?[")


def f(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field with a default, a one-line meaning and validation metadata."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


# --------------------------------------------------------------------------------------------
# The sections. Keep each field's help to one line: the README's config reference is built
# from it (`minigpt config-reference`-style tables come from `describe_fields`).


@dataclass
class ModelConfig:
    n_layer: int = f(4, "number of transformer blocks", min=1)
    n_head: int = f(4, "attention heads per block; must divide n_embd", min=1)
    n_embd: int = f(128, "residual stream width (d_model)", min=1)
    block_size: int = f(128, "context length in tokens", min=2)
    vocab_size: int = f(0, "embedding rows; 0 = take it from the tokenizer", min=0)
    pos_encoding: str = f(
        "rope", "position information", choices=("rope", "learned", "sinusoidal", "none")
    )
    rope_base: float = f(10000.0, "RoPE base: theta_i = rope_base^(-2i/head_dim)", min_exclusive=1.0)
    norm: str = f("layernorm", "normalisation in each block", choices=("layernorm", "rmsnorm"))
    mlp: bool = f(True, "include the MLP in each block; false = attention-only model")
    dropout: float = f(0.0, "dropout probability in [0, 1)", min=0.0, max_exclusive=1.0)
    bias: bool = f(False, "bias terms in linear layers and LayerNorm")
    tie_weights: bool = f(True, "share the token embedding and the LM head weight")
    attn_impl: str = f(
        "sdpa", "attention kernel: sdpa (fused) or explicit (softmax written out)",
        choices=("sdpa", "explicit"),
    )

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass
class TokenizerConfig:
    vocab_size: int = f(1024, "256 = raw bytes; more = byte-level BPE trained on the corpus", min=256)
    encoding: str = f(
        "", "'' = bytes/BPE by vocab_size; a tiktoken name (gpt2, cl100k_base) or a .tiktoken file"
    )
    pattern: str = f("gpt4", "pre-tokenizer split pattern for BPE training", choices=("gpt4", "gpt2"))
    train_max_bytes: int = f(0, "bytes of corpus used to train the BPE; 0 = all of it", min=0)


@dataclass
class DataConfig:
    source: str = f("text", "text = a corpus on disk; induction = random tokens repeated twice",
                    choices=("text", "induction"))
    corpus: str = f("data/tinyshakespeare.txt", "a .txt file, a directory of .txt files, or a glob")
    val_fraction: float = f(0.1, "last fraction of tokens held out for validation",
                            min_exclusive=0.0, max_exclusive=1.0)
    invalid_utf8: str = f("error", "on bytes that are not UTF-8: error, or replace with U+FFFD",
                          choices=("error", "replace"))
    cache_dir: str = f("", "token cache directory; '' = $MINIGPT_CACHE or ~/.cache/minigpt")
    induction_vocab: int = f(64, "induction source: token ids drawn from [0, induction_vocab)", min=2)
    induction_min_period: int = f(
        0, "induction source: 0 = [r, r] with r of block_size//2 ids; else rows of back-to-back "
        "segment pairs (s, s), segment lengths from [this, induction_max_period]", min=0)
    induction_max_period: int = f(
        0, "induction source: longest segment of a pair; 0 = block_size//2", min=0)
    induction_distinct: bool = f(
        False, "induction source: draw a row's new ids without replacement, so every repeated "
        "id in a row belongs to a copy (as in the induction probe)")


@dataclass
class TrainConfig:
    batch_size: int = f(12, "sequences per optimizer step, summed over devices", min=1)
    micro_batch_size: int = f(0, "sequences per forward pass per device; 0 = no accumulation",
                              min=0)
    max_steps: int = f(2000, "optimizer steps", min=1)
    learning_rate: float = f(1e-3, "peak learning rate", min_exclusive=0.0)
    min_lr: float = f(1e-4, "floor of the cosine decay", min=0.0)
    warmup_steps: int = f(100, "linear warm-up steps", min=0)
    weight_decay: float = f(0.1, "AdamW decay on matrices (not on norms, biases)", min=0.0)
    beta1: float = f(0.9, "AdamW beta1", min=0.0, max_exclusive=1.0)
    beta2: float = f(0.99, "AdamW beta2", min=0.0, max_exclusive=1.0)
    grad_clip: float = f(1.0, "clip the global gradient norm to this; 0 = off", min=0.0)
    eval_interval: int = f(250, "evaluate every this many steps", min=1)
    eval_batches: int = f(20, "validation batches per evaluation", min=1)
    log_interval: int = f(10, "log a metrics line every this many steps", min=1)
    checkpoint_interval: int = f(500, "checkpoint every this many steps (and at the end)", min=1)
    sample_tokens: int = f(100, "tokens sampled at each evaluation; 0 = none", min=0)
    sample_prompts: list[str] = f([""], "prompts sampled at each evaluation ('' = start of text)")  # noqa: RUF009 - f() returns a field(default_factory=...)
    precision: str = f("auto", "auto = bf16 autocast on CUDA, fp32 elsewhere",
                       choices=("auto", "fp32", "bf16"))
    compile: str = f("auto", "torch.compile: auto = on for CUDA only", choices=("auto", "true", "false"))


@dataclass
class RunConfig:
    name: str = f("", "run name; '' = the config file's name")
    out_dir: str = f("runs", "parent directory of run directories")
    seed: int = f(1337, "seed for weights, batches and sampling", min=0, max=2**63 - 1)
    device: str = f("auto", "auto = cuda, then mps, then cpu", choices=("auto", "cpu", "cuda", "mps"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)


SECTIONS: dict[str, type] = {"model": ModelConfig, "tokenizer": TokenizerConfig, "data": DataConfig,
            "train": TrainConfig, "run": RunConfig}


# --------------------------------------------------------------------------------------------
# Strict YAML: YAML 1.2-style scalars (no `yes`/`on` booleans, no octal `0123`, `1e-3` is a
# float) and duplicate keys rejected, because PyYAML's YAML 1.1 defaults silently do otherwise.


class _StrictLoader(yaml.SafeLoader):
    pass


_StrictLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag not in (
        "tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9][0-9_]*$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+"
               r"|[-+]?[0-9][0-9_]*\.[0-9_]*"
               r"|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise ConfigError(
                f"duplicate key {key!r} at line {key_node.start_mark.line + 1}: "
                "each key may appear once; delete one of them")
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
# Decimal integers only: PyYAML would read `0123` as octal 83.
_StrictLoader.add_constructor(
    "tag:yaml.org,2002:int",
    lambda loader, node: int(loader.construct_scalar(node).replace("_", ""), 10))


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML text strictly; errors become one-line ConfigErrors naming `source` and line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = " ".join((e.problem or e.context or "invalid YAML").split())
        raise ConfigError(f"{source}: invalid YAML at {where}: {problem}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None


# --------------------------------------------------------------------------------------------
# Coercion by field type and validation by metadata.


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return "a list of strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML value to the field type `tp`, or raise a ConfigError naming `where`."""
    bad = ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and
                                                  not isinstance(v, bool) for v in value):
            raise bad
        return [str(v) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if isinstance(value, (int, float)):
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{where}: must be a finite number, got {value}")
            return value
        raise bad
    if tp is str:
        if isinstance(value, bool):  # `compile: true` -> "true"
            return "true" if value else "false"
        if value is None:
            return ""
        if isinstance(value, (int, float)):
            return str(value)
        if isinstance(value, str):
            return value
        raise bad
    raise bad


def _check_meta(value: Any, meta: dict, where: str) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        dym = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(choices)}{dym}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{where}: must be >= {meta['min']}, got {value}")
    if "min_exclusive" in meta and value <= meta["min_exclusive"]:
        raise ConfigError(f"{where}: must be > {meta['min_exclusive']}, got {value}")
    if "max_exclusive" in meta and value >= meta["max_exclusive"]:
        raise ConfigError(f"{where}: must be < {meta['max_exclusive']}, got {value}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{where}: must be <= {meta['max']}, got {value}")


def _unknown(name: str, known: list[str], what: str) -> ConfigError:
    """`what` reads like "key in section 'model'" or "section"."""
    hint = difflib.get_close_matches(name, known, n=1)
    dym = f"did you mean '{hint[0]}'? " if hint else ""
    kind, _, rest = what.partition(" ")
    rest = f" {rest}" if rest else ""
    return ConfigError(f"unknown {kind} {name!r}{rest}: {dym}valid: {', '.join(known)}")


def _validate_cross(cfg: Config) -> None:
    """Constraints between fields (single-field ranges are in the metadata)."""
    m, t = cfg.model, cfg.train
    if m.n_embd % m.n_head:
        divisors = [h for h in range(1, m.n_embd + 1) if m.n_embd % h == 0 and h <= 64]
        raise ConfigError(
            f"model.n_head: {m.n_head} does not divide model.n_embd={m.n_embd}; "
            f"use one of {divisors[:12]}")
    if m.pos_encoding == "rope" and m.head_dim % 2:
        raise ConfigError(
            f"model.n_embd/model.n_head = {m.head_dim} is odd: RoPE rotates pairs of dimensions, "
            "so the head dimension must be even")
    if t.min_lr > t.learning_rate:
        raise ConfigError(
            f"train.min_lr: {t.min_lr} exceeds train.learning_rate={t.learning_rate}; "
            "the floor must be <= the peak")
    if t.micro_batch_size and t.batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size: {t.micro_batch_size} does not divide "
            f"train.batch_size={t.batch_size}")
    if m.vocab_size and cfg.data.source == "induction" and m.vocab_size < cfg.data.induction_vocab:
        raise ConfigError(
            f"data.induction_vocab: {cfg.data.induction_vocab} exceeds model.vocab_size="
            f"{m.vocab_size}")
    d, half = cfg.data, max(1, m.block_size // 2)
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
    if cfg.data.source == "induction" and cfg.data.induction_vocab > cfg.tokenizer.vocab_size:
        raise ConfigError(
            f"data.induction_vocab: {cfg.data.induction_vocab} exceeds tokenizer.vocab_size="
            f"{cfg.tokenizer.vocab_size}; induction tokens must be tokenizer ids")


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
            raise ConfigError(f"{source}: " + str(_unknown(str(name), list(SECTIONS), "section")))
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section '{name}' must be a mapping of keys, "
                              f"got {type(body).__name__}")
        sections[name] = _build_section(SECTIONS[name], name, body, source)
    cfg = Config(**sections)
    try:
        _validate_cross(cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    return cfg


def _build_section(cls: type, section: str, body: dict, source: str) -> Any:
    fields = {fl.name: fl for fl in dataclasses.fields(cls)}
    values = {}
    for key, value in body.items():
        if not isinstance(key, str) or key not in fields:
            err = _unknown(str(key), list(fields), f"key in section '{section}'")
            raise ConfigError(f"{source}: {err}")
        where = f"{source}: {section}.{key}"
        value = coerce(value, _field_type(cls, key), where)
        _check_meta(value, fields[key].metadata, where)
        values[key] = value
    return cls(**values)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def model_hash(model_cfg: ModelConfig) -> str:
    """A short hash of the model's shape settings (stored with weights to catch mismatches)."""
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
        raise ConfigError(f"--set {text!r}: " + str(_unknown(section, list(SECTIONS), "section")))
    cls = SECTIONS[section]
    names = [fl.name for fl in dataclasses.fields(cls)]
    if key not in names:
        raise ConfigError(f"--set {text!r}: "
                          + str(_unknown(key, names, f"key in section '{section}'")))
    tp = _field_type(cls, key)
    if tp is str:
        value: Any = raw
    elif typing.get_origin(tp) is list:
        value = [] if raw.strip() == "" else [v.strip() for v in raw.split(",")]
    else:
        value = parse_yaml(raw, f"--set {path}") if raw.strip() else None
        if tp is bool and isinstance(value, str) and value.lower() in ("yes", "no", "on", "off"):
            value = value.lower() in ("yes", "on")
    meta = {fl.name: fl.metadata for fl in dataclasses.fields(cls)}[key]
    value = coerce(value, tp, f"--set {path}")
    _check_meta(value, meta, f"--set {path}")
    return section, key, value


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
    p = find_config(str(path) if path is not None else None)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file (invalid byte at offset {e.start}); "
                          "a config must be YAML text") from None
    if "\x00" in text:
        raise ConfigError(f"{p}: contains NUL bytes; a config must be YAML text")
    raw = parse_yaml(text, str(p))
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{p}: a config must be a mapping of sections "
                          f"({', '.join(SECTIONS)}), got a YAML {type(raw).__name__}")
    raw = apply_overrides(raw or {}, list(overrides))
    cfg = from_dict(raw, str(p))
    if not cfg.run.name:
        cfg.run.name = p.stem
    return cfg


def describe_fields() -> list[tuple[str, str, Any, str]]:
    """(path, type, default, help) for every setting: the source of the README's reference."""
    rows = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for fl in dataclasses.fields(cls):
            default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
            tp = hints[fl.name]
            tname = "list" if typing.get_origin(tp) is list else tp.__name__
            rows.append((f"{section}.{fl.name}", tname, default, fl.metadata["help"]))
    return rows
