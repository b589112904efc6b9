"""Configuration files: a config read from strict YAML, overridden by `--set`, checked, and
written back. What each setting is (the dataclasses, one line per field) lives in settings.py,
which the maths imports without this file's loaders; the package re-exports both, so
`from minigpt.config import Config, load_config` is the one import a caller needs.

One name per setting everywhere: dataclass field = YAML key = `--set section.key` path. A
single field's type and bounds are checked from its metadata (fields.py); constraints between
fields are in `_validate_cross`.

This module imports neither torch nor anything else heavy: the CLI can validate a config and
print it before any model code loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from minigpt.config.fields import build_section, describe, parse_value, unknown
from minigpt.config.settings import SECTIONS, Config, ModelConfig, TrainConfig
from minigpt.errors import ArgumentError, ConfigError, MinigptError
from minigpt.files import parse_yaml, read_text
from minigpt.paths import CONFIGS_DIR, resolve_path

__all__ = ["ConfigError", "MinigptError", "apply_overrides", "check_run_name", "config_from",
           "describe_fields", "find_config", "from_dict", "head_scores_every", "load_config",
           "model_hash", "model_hashes", "parse_override", "parse_yaml", "read_config", "to_dict",
           "to_yaml"]


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
    if m.n_embd % m.n_head and not m.d_head:
        divisors = [h for h in range(1, m.n_embd + 1) if m.n_embd % h == 0 and h <= 64]
        raise ConfigError(
            f"model.n_head: {m.n_head} does not divide model.n_embd={m.n_embd}; "
            f"use one of {divisors[:12]}")
    if m.pos_encoding == "rope" and m.head_dim % 2:
        raise ConfigError(
            f"the head width (model.d_head, or model.n_embd/model.n_head) = {m.head_dim} is "
            "odd: RoPE rotates pairs of dimensions, so the head dimension must be even")
    if m.head_init == "zero" and m.tie_weights:
        raise ConfigError(
            "model.head_init: zero needs model.tie_weights: false (a tied LM head is the token "
            "embedding, which must not start at zero); untie it or use head_init: normal")
    if m.d_vocab_out and m.tie_weights and m.d_vocab_out != m.vocab_size:
        raise ConfigError(
            f"model.d_vocab_out: {m.d_vocab_out} outputs cannot share the token embedding "
            "(model.tie_weights: true ties the output read to the vocab_size embedding rows); "
            "set model.tie_weights: false or model.d_vocab_out: 0")


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
    if d.source == "induction" and cfg.train.data_order == "epochs":
        raise ConfigError("train.data_order: epochs reads a corpus epoch by epoch, but "
                          "data.source induction draws every row fresh; set train.data_order "
                          "random")
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
    if d.induction_groups > d.induction_vocab:
        raise ConfigError(
            f"data.induction_groups: {d.induction_groups} exceeds data.induction_vocab="
            f"{d.induction_vocab} (every group needs an id of its own); lower it")
    if d.induction_runs and not d.induction_min_period:
        raise ConfigError(
            f"data.induction_runs: {d.induction_runs} needs the pairs layout (runs are pairs); "
            "set data.induction_min_period above 0 or data.induction_runs to 0")
    fresh = (m.block_size + 4) // 2  # most new ids a row needs: its segments and a short tail
    if d.induction_distinct and d.induction_vocab < fresh:
        raise ConfigError(
            f"data.induction_distinct: a row of model.block_size={m.block_size} needs up to "
            f"{fresh} distinct ids but data.induction_vocab is {d.induction_vocab}; raise "
            "data.induction_vocab or set data.induction_distinct to false")
    if d.source == "induction" and not tc.encoding:  # (a named encoding: data/cache.py)
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


# Model settings added after runs were saved, in the order they came, each with the value
# that reproduces the model those runs are. At that value a setting is left out of the hash
# minigpt writes, so a run saved before the setting existed still loads (the hash is over the
# settings the weights depend on, as they were then).
LATER_SETTINGS: list[dict] = [
    {"d_head": 0, "d_mlp": 0, "d_vocab_out": 0},   # issue 55 (compile)
    {"value_skip": False, "mtp_weight": 0.0},      # issue 59
]


def model_hash(model_cfg: ModelConfig, *, since: int = 0) -> str:
    """A short hash of every model setting (stored with weights to catch mismatches); a
    setting of LATER_SETTINGS[since:] at its old-model value is left out (`since` > 0: the
    hash as minigpt wrote it while only the earlier ones were left out: `model_hashes`)."""
    later = {k: v for gen in LATER_SETTINGS[since:] for k, v in gen.items()}
    fields = {k: v for k, v in dataclasses.asdict(model_cfg).items()
              if k not in later or v != later[k]}
    blob = json.dumps(fields, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_hashes(model_cfg: ModelConfig) -> set[str]:
    """The hashes weights saved for this model may carry: `model_hash` (what is written), and
    those of runs saved while a generation of LATER_SETTINGS was hashed at every value (each
    settings' arrival until this rule)."""
    return {model_hash(model_cfg, since=g) for g in range(len(LATER_SETTINGS) + 1)}


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
        near = difflib.get_close_matches(Path(path).stem, names, n=1)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise ConfigError(f"config file not found: {path}; {hint}give a path or one of the "
                          f"bundled names: {', '.join(names)}")
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
    source = str(path)
    if overrides:  # the value at fault may be the file's or a --set's: name both
        sets = ", ".join(f"--set {o}" for o in overrides)
        source += f" with {sets if len(sets) <= 200 else sets[:200] + '...'}"
    cfg = from_dict(apply_overrides(raw, list(overrides)), source)
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
