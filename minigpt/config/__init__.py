"""The typed config, one room: what each setting is (`settings.py`: the dataclasses, standard
library only, so the maths imports them without any file code), how a field's text becomes a
checked value (`fields.py`), and the config file read from strict YAML, overridden by `--set`,
checked and written back (`load.py`).

`from minigpt.config import Config, load_config` is the one import a caller needs: the settings
dataclasses are here at once, the loader's names (`load_config`, `from_dict`, `to_yaml`, ...)
are imported from load.py when first asked for, so importing `minigpt.config.settings` (as
core/ does) loads neither YAML nor the file door.
"""

from minigpt.config.settings import (
    HEAD_KINDS,
    SECTIONS,
    Config,
    DataConfig,
    ModelConfig,
    RunConfig,
    TokenizerConfig,
    TrainConfig,
)

_LOADER = ("ConfigError", "MinigptError", "apply_overrides", "check_run_name", "config_from",
           "describe_fields", "find_config", "from_dict", "head_scores_every", "load_config",
           "model_hash", "model_hashes", "parse_override", "parse_yaml", "read_config", "to_dict",
           "to_yaml")
__all__ = ["HEAD_KINDS", "SECTIONS", "Config", "ConfigError", "DataConfig", "MinigptError",
           "ModelConfig", "RunConfig", "TokenizerConfig", "TrainConfig", "apply_overrides",
           "check_run_name", "config_from", "describe_fields", "find_config", "from_dict",
           "head_scores_every", "load_config", "model_hash", "model_hashes", "parse_override",
           "parse_yaml", "read_config", "to_dict", "to_yaml"]


def __getattr__(name: str):
    if name in _LOADER:
        from minigpt.config import load

        return getattr(load, name)
    raise AttributeError(f"module 'minigpt.config' has no attribute {name!r}")
