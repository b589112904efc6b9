"""Typed settings: the machinery that turns YAML or `section.key=value` text into checked
values of a settings field's type (settings.py declares the fields).

A field is declared on one line, `n_layer: int = setting(4, "number of transformer blocks",
min=1)`;
`choices` / `min` / `max` / `min_exclusive` / `max_exclusive` / `nonempty` metadata drive
validation, so adding a setting never means adding a validation branch. Every failure is one
ConfigError naming where the value came from. No torch, nothing heavy.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Iterable
from typing import Any

from minigpt.errors import ConfigError
from minigpt.files import parse_yaml, shown


def field_type(cls: type, name: str) -> Any:
    return _type_hints(cls)[name]


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A settings class's field types, resolved once (the annotations are strings: resolving
    them compiles each one, and a config load asks for every field's type)."""
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return "a list of strings"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]


_BAD = object()  # what a converter returns for a value of the wrong type


def _to_list(value: Any, where: str) -> Any:
    if isinstance(value, str):  # one string is a list of one
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and
                                              not isinstance(v, bool) for v in value):
        return _BAD
    return [str(v) for v in value]


def _to_bool(value: Any, where: str) -> Any:
    return value if isinstance(value, bool) else _BAD


def _to_int(value: Any, where: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)  # YAML's 1e3
    return _BAD


def _to_float(value: Any, where: str) -> Any:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            value = float(value)
        except ValueError:
            return _BAD
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return _BAD
    if not math.isfinite(value):
        raise ConfigError(f"{where}: must be a finite number, got {value}")
    return float(value)


def _to_str(value: Any, where: str) -> Any:
    if isinstance(value, bool):  # `compile: true` -> "true"
        return "true" if value else "false"
    if value is None:
        return ""
    return str(value) if isinstance(value, (int, float, str)) else _BAD


_CONVERTERS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML value to the field type `tp`, or raise a ConfigError naming `where`."""
    convert = _to_list if typing.get_origin(tp) is list else _CONVERTERS.get(tp)
    out = _BAD if convert is None else convert(value, where)
    if out is _BAD:
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {shown(repr(value))}")
    return out


def check_meta(value: Any, meta: dict, where: str) -> None:
    """The field's bounds and choices; for a list, the choices of each item."""
    if isinstance(value, list):
        for item in value:
            check_meta(item, meta, where)
        return
    if meta.get("nonempty") and not str(value).strip():
        raise ConfigError(f"{where}: must not be empty")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        dym = f" (did you mean '{hint[0]}'?)" if hint else ""
        raise ConfigError(f"{where}: {shown(repr(value))} is not one of {', '.join(choices)}{dym}")
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{where}: must be >= {meta['min']}, got {shown(repr(value))}")
    if "min_exclusive" in meta and value <= meta["min_exclusive"]:
        raise ConfigError(f"{where}: must be > {meta['min_exclusive']}, got {shown(repr(value))}")
    if "max_exclusive" in meta and value >= meta["max_exclusive"]:
        raise ConfigError(f"{where}: must be < {meta['max_exclusive']}, got {shown(repr(value))}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{where}: must be <= {meta['max']}, got {shown(repr(value))}")


def unknown(name: str, known: list[str], what: str) -> ConfigError:
    """`what` reads like "key in section 'model'" or "section"."""
    hint = difflib.get_close_matches(name, known, n=1)
    dym = f"did you mean '{hint[0]}'? " if hint else ""
    kind, _, rest = what.partition(" ")
    rest = f" {rest}" if rest else ""
    return ConfigError(f"unknown {kind} {name!r}{rest}: {dym}valid: {', '.join(known)}")



def build_section(cls: type, section: str, body: dict, source: str) -> Any:
    """An instance of the dataclass `cls` from a YAML mapping (missing keys keep defaults)."""
    fields = {fl.name: fl for fl in dataclasses.fields(cls)}
    values = {}
    for key, value in body.items():
        if not isinstance(key, str) or key not in fields:
            err = unknown(str(key), list(fields), f"key in section '{section}'")
            raise ConfigError(f"{source}: {err}")
        where = f"{source}: {section}.{key}"
        value = coerce(value, field_type(cls, key), where)
        check_meta(value, fields[key].metadata, where)
        values[key] = value
    return cls(**values)



def comma_list(values: str | Iterable[str]) -> list[str]:
    """The items of one or more comma-separated values, stripped, in order: `a, b` -> [a, b];
    ["a,b", "c"] -> [a, b, c]. The one parser of every comma-separated list a user types (a
    `--set` list, --format, --qk, --qk-pairs, --suite, --seq-lens). A blank item is kept, for
    the caller to refuse by name."""
    values = [values] if isinstance(values, str) else values
    return [item.strip() for value in values for item in value.split(",")]


def parse_value(cls: type, key: str, raw: str, where: str) -> Any:
    """The text after `=` in `--set section.key=value`, typed and checked like the field
    `cls.key`: strings verbatim, lists comma-separated (`a,b`, or YAML's `[a, b]`), everything
    else read as YAML (with yes/no/on/off accepted for booleans, as people type them)."""
    tp = field_type(cls, key)
    if tp is str:
        value: Any = raw
    elif typing.get_origin(tp) is list:
        items = raw.strip()
        if items.startswith("[") and items.endswith("]"):
            items = items[1:-1]
        value = comma_list(items) if items.strip() else []
    else:
        value = parse_yaml(raw, where) if raw.strip() else None
        if tp is bool and isinstance(value, str) and value.lower() in ("yes", "no", "on", "off"):
            value = value.lower() in ("yes", "on")
    meta = {fl.name: fl.metadata for fl in dataclasses.fields(cls)}[key]
    value = coerce(value, tp, where)
    check_meta(value, meta, where)
    return value


def describe(sections: dict[str, type]) -> list[tuple[str, str, Any, str]]:
    """(section.key, type, default, help) for every field of every section."""
    rows = []
    for section, cls in sections.items():
        hints = typing.get_type_hints(cls)
        for fl in dataclasses.fields(cls):
            default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()
            tp = hints[fl.name]
            tname = "list" if typing.get_origin(tp) is list else tp.__name__
            rows.append((f"{section}.{fl.name}", tname, default, fl.metadata["help"]))
    return rows
