"""Building a config: YAML file <- dotted ``key=value`` overrides -> a typed, validated :class:`PPOConfig`.

Types are checked against the dataclasses' annotations (ints widen to floats, nothing else converts); unknown
and retired keys are refused by name. :func:`effective_config` is the config a run uses, follow-keys filled in.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config.errors import ConfigError
from trainer.config.keys import RETIRED, config_to_dict, flatten, resolve_follows, unflatten
from trainer.config.rules import validate_config
from trainer.config.schema import PPOConfig

__all__ = [
    "load_config",
    "read_yaml_mapping",
    "parse_override",
    "apply_overrides",
    "config_from_dict",
    "effective_config",
    "COMMAND_LINE",
    "config_keys",
    "did_you_mean",
    "check_override_keys",
    "blame_command_line",
]

#: where a ``-o KEY=VALUE`` (or positional ``key=value``) override came from, as an error names it
COMMAND_LINE = "the command line (-o)"


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, source: Optional[str]) -> Any:
    """Check ``value`` against the annotated type; ints widen to floats, nothing else converts."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0], source)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    else:  # pragma: no cover - internal invariant
        raise AssertionError(f"unsupported field type {tp} for {key}")
    raise ConfigError(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}", source=source)


@functools.lru_cache(maxsize=None)
def _type_hints(cls: type) -> dict:
    """The config dataclass's resolved field types (resolving them is most of building a config: the tuner
    builds one per candidate)."""
    return typing.get_type_hints(cls)


def _build(cls: type, data: Any, prefix: str, source: Optional[str]) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(
            prefix.rstrip(".") or "<root>", f"expected a mapping, got {type(data).__name__}", source=source
        )
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}", RETIRED.get(k) or _unknown(f"{prefix}{k}"), source=source)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], key + ".", source)
        else:
            kwargs[f.name] = _coerce(key, data[f.name], tp, source)
    return cls(**kwargs)


@functools.lru_cache(maxsize=None)
def config_keys(cls: type = PPOConfig, prefix: str = "") -> frozenset:
    """Every dotted key of the config: its leaves and its sections."""
    out: set[str] = set()
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.add(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out |= config_keys(hints[f.name], key + ".")
    return frozenset(out)


def did_you_mean(word: str, choices, *, cutoff: float = 0.6) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to ``word``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f" (did you mean {match[0]}?)" if match else ""


def _unknown(key: str) -> str:
    """``unknown key``, with the closest real key: same section first, then the same name elsewhere."""
    keys = config_keys()
    section, _, name = key.rpartition(".")
    near = difflib.get_close_matches(name, [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section], 1)
    moved = sorted(k for k in keys if k.rpartition(".")[2] == name)
    if near:
        return f"unknown key (did you mean {section + '.' if section else ''}{near[0]}?)"
    return "unknown key" + (f" (did you mean {moved[0]}?)" if moved else did_you_mean(key, keys, cutoff=0.8))


def check_override_keys(keys, *, over: Optional[str] = None) -> None:
    """Refuse an override whose key is no config key (a section or a leaf), naming the command line it came from
    (and the file ``over`` it)."""
    known = config_keys()
    for key in keys:
        if key not in known:
            why = RETIRED.get(key.rpartition(".")[2]) or _unknown(key)
            raise ConfigError(key, why, source=f"{COMMAND_LINE} over {over}" if over else COMMAND_LINE)


def blame_command_line(e: ConfigError, keys, *, over: Optional[str] = None) -> ConfigError:
    """``e`` naming the command line (and the file ``over`` it, when there is one) when its key, or a section
    above it, came from an override there."""
    hit = any(e.key == k or e.key.startswith(k + ".") for k in keys)
    source = f"{COMMAND_LINE} over {over}" if over else COMMAND_LINE
    return ConfigError(e.key, e.message, source=source) if hit and not (e.source or "").startswith(COMMAND_LINE) else e


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=3"`` -> ``("a.b", 3)``; values are parsed as YAML scalars (true, 1e-3, null, [1,2])."""
    if "=" not in text:
        raise ConfigError(text, "override must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: dict) -> dict:
    """Dotted overrides onto a nested dict (the result is a new dict)."""
    return _deep_merge(data, unflatten(overrides))


def config_from_dict(data: dict, *, source: Optional[str] = None, validate: bool = True) -> PPOConfig:
    cfg = _build(PPOConfig, data or {}, "", source)
    if validate:
        validate_config(cfg, source=source)
    return cfg


def read_yaml_mapping(path: str | Path, *, what: str = "the config") -> dict:
    """A YAML file that must hold a mapping; ConfigError (naming the file) when missing or malformed."""
    source = str(path)
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", "file not found", source=source)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        raise ConfigError("config", f"malformed YAML at {where}", source=source) from None
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"{what} must be a mapping", source=source)
    return data


def load_config(
    path: Optional[str | Path] = None,
    overrides: Optional[list[str] | dict] = None,
    *,
    validate: bool = True,
) -> PPOConfig:
    """YAML file (optional) + dotted overrides -> a validated :class:`PPOConfig`.

    Overrides given as ``key=value`` text came from the command line: an error on one of their keys names the
    command line (:data:`COMMAND_LINE`), not the file."""
    source = str(path) if path is not None else None
    data = read_yaml_mapping(path) if path is not None else {}
    typed = []
    if overrides:
        if isinstance(overrides, dict):
            flat = dict(overrides)
        else:
            flat = dict(parse_override(o) for o in overrides)
            typed = list(flat)
            check_override_keys(typed, over=source)
        data = apply_overrides(data, flat)
    try:
        return config_from_dict(data, source=source, validate=validate)
    except ConfigError as e:
        raise blame_command_line(e, typed, over=source) from None


def effective_config(cfg: PPOConfig) -> PPOConfig:
    """The typed config a run actually uses: every null follow-key filled in (``cfg`` is unchanged)."""
    return config_from_dict(unflatten(resolve_follows(flatten(config_to_dict(cfg)))), validate=False)
