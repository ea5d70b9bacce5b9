"""A space from its YAML: :func:`load_space` (a file), :func:`space_from_dict` (its parsed dict: every section
checked, one line naming the key of the first fault), :func:`comparable_space` (what must match for a study to resume
under a space) and :func:`base_flat_config` (the base config a space is checked and run against).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config import config_to_dict, flatten, load_config
from tuner.space.expr import Expr, ExprError
from tuner.space.keys import CONFIG_KEYS, SpaceError
from tuner.space.knob import ALGORITHM_REFUSAL, Knob, parse_knob
from tuner.space.model import Space
from tuner.space.parts import Constraint, Derived
from tuner.space.registry import is_execution_knob

__all__ = ["load_space", "space_from_dict", "ADVISORY_KNOB_KEYS", "comparable_space", "base_flat_config"]

_TOP_KEYS = ("name", "description", "fixed", "knobs", "derived", "constraints")


def load_space(path: str | Path) -> Space:
    """Parse and check a space file (structure, keys, expressions). See :meth:`Space.validate`
    for the checks that need a base config."""
    source = str(path)
    p = Path(path)
    if not p.is_file():
        raise SpaceError("space", "file not found", source=source)
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "?"
        problem = getattr(e, "problem", None) or "syntax error"
        raise SpaceError("space", f"malformed YAML at {where}: {problem}", source=source) from None
    return space_from_dict(raw, source=source)


#: knob fields that steer the search but change no config of the space: a study resumes across them
ADVISORY_KNOB_KEYS = ("speed", "help")


def comparable_space(raw: dict) -> dict:
    """A space file's dict without its knobs' advisory fields (:data:`ADVISORY_KNOB_KEYS`): two spaces with
    the same comparable dict hold the same configs, so a study of one resumes under the other."""
    out = dict(raw)
    knobs = raw.get("knobs")
    if isinstance(knobs, dict):
        out["knobs"] = {
            k: {f: v for f, v in spec.items() if f not in ADVISORY_KNOB_KEYS} if isinstance(spec, dict) else spec
            for k, spec in knobs.items()
        }
    return out


def space_from_dict(raw: Any, *, source: Optional[str] = None) -> Space:
    """A space file's parsed YAML -> :class:`Space`, its sections checked in this order: the sections, knobs, derived
    keys, fixed keys, conditions against derived keys, constraints (the first fault raises :class:`SpaceError`)."""
    _check_sections(raw, source)
    knobs = _parse_knobs(raw.get("knobs"), source)
    knob_keys = {k.key for k in knobs}
    derived = _parse_derived(raw.get("derived") or {}, knob_keys, source)
    derived_keys = {d.key for d in derived}
    fixed = _parse_fixed(raw.get("fixed") or {}, knob_keys, derived_keys, source)
    for knob in knobs:
        if knob.when is not None and knob.when.names & derived_keys:
            raise SpaceError(f"{knob.key}.when", "a condition may not name a derived key", source=source)
    constraints = _parse_constraints(raw.get("constraints") or [], source)
    return Space(
        knobs=knobs,
        derived=derived,
        constraints=constraints,
        fixed=fixed,
        source=source,
        raw=raw,
        description=str(raw.get("description") or ""),
    )


def _check_sections(raw: Any, source: Optional[str]) -> None:
    if raw is None:
        raise SpaceError("knobs", "empty space: the file defines no knobs", source=source)
    if not isinstance(raw, dict):
        raise SpaceError("<root>", "a space must be a mapping with a `knobs` section", source=source)
    for k in raw:
        if k not in _TOP_KEYS:
            raise SpaceError(str(k), f"unknown section (allowed: {list(_TOP_KEYS)})", source=source)


def _parse_knobs(knobs_raw: Any, source: Optional[str]) -> list[Knob]:
    """The ``knobs`` section, in order: a knob's ``when`` may name earlier knobs only."""
    if not knobs_raw:
        raise SpaceError("knobs", "empty space: no knobs", source=source)
    if not isinstance(knobs_raw, dict):
        raise SpaceError("knobs", "must be a mapping of dotted config key -> knob spec", source=source)
    knobs: list[Knob] = []
    for key, spec in knobs_raw.items():
        knob = parse_knob(str(key), spec, source)
        if knob.when is not None:
            later = [k for k in knobs_raw if k not in [x.key for x in knobs] and k != key]
            for name in knob.when.names:
                if name in later:
                    raise SpaceError(
                        f"{key}.when", f"names knob {name!r}, which comes later; list it first", source=source
                    )
        knobs.append(knob)
    return knobs


def _parse_derived(derived_raw: Any, knob_keys: set[str], source: Optional[str]) -> list[Derived]:
    """The ``derived`` section: key -> expression, or ``{expr: ..., when: ...}``; a derived key varies, so it is an
    execution knob of :mod:`tuner.space.registry` unless marked ``algorithm: true``."""

    def err(k: str, msg: str) -> SpaceError:
        return SpaceError(k, msg, source=source)

    if not isinstance(derived_raw, dict):
        raise err("derived", "must be a mapping of dotted config key -> expression")
    derived: list[Derived] = []
    for key, spec in derived_raw.items():
        key = str(key)
        if key not in CONFIG_KEYS:
            raise err(key, "unknown derived key (not a key of trainer.config.PPOConfig)")
        if key in knob_keys:
            raise err(key, "a key cannot be both a knob and derived")
        when_text, algorithm = None, False
        if isinstance(spec, dict):
            extra = set(spec) - {"expr", "when", "algorithm"}
            if extra or "expr" not in spec:
                raise err(key, "a derived key is an expression or {expr: ..., when: ..., algorithm: ...}")
            algorithm = spec.get("algorithm", False)
            if not isinstance(algorithm, bool):
                raise err(f"{key}.algorithm", f"must be true or false, got {algorithm!r}")
            when_text, spec = spec.get("when"), spec["expr"]
        if not algorithm and not is_execution_knob(key):
            raise err(key, ALGORITHM_REFUSAL)
        try:
            expr = Expr(spec)
            when = Expr(when_text) if when_text is not None else None
        except ExprError as e:
            raise err(key, str(e)) from None
        for name in expr.names | (when.names if when else set()):
            if name not in CONFIG_KEYS:
                raise err(key, f"unknown key {name!r} in {spec!r} (not a key of trainer.config.PPOConfig)")
        derived.append(Derived(key=key, expr=expr, when=when))
    return derived


def _parse_fixed(fixed_raw: Any, knob_keys: set[str], derived_keys: set[str], source: Optional[str]) -> dict:
    """The ``fixed`` section: key -> value, set for every trial and the baseline; neither a knob nor derived."""
    if not isinstance(fixed_raw, dict):
        raise SpaceError("fixed", "must be a mapping of dotted config key -> value", source=source)
    fixed = {}
    for key, value in fixed_raw.items():
        key = str(key)
        if key not in CONFIG_KEYS:
            raise SpaceError(key, "unknown fixed key (not a key of trainer.config.PPOConfig)", source=source)
        if key in knob_keys or key in derived_keys:
            raise SpaceError(key, "a fixed key cannot also be a knob or derived", source=source)
        fixed[key] = value
    return fixed


def _parse_constraints(cons_raw: Any, source: Optional[str]) -> list[Constraint]:
    """The ``constraints`` section: a list of boolean expressions, labelled ``constraints[i]``."""
    if not isinstance(cons_raw, list):
        raise SpaceError("constraints", "must be a list of expressions", source=source)
    constraints: list[Constraint] = []
    for i, text in enumerate(cons_raw):
        label = f"constraints[{i}]"
        try:
            expr = Expr(text)
        except ExprError as e:
            raise SpaceError(label, str(e), source=source) from None
        for name in expr.names:
            if name not in CONFIG_KEYS:
                raise SpaceError(
                    label,
                    f"unknown key {name!r} in {expr.text!r} (not a key of trainer.config.PPOConfig)",
                    source=source,
                )
        constraints.append(Constraint(index=i, expr=expr))
    return constraints


def base_flat_config(
    base_path: Optional[str | Path], *, nproc: Optional[int] = None, extra: Optional[dict] = None
) -> tuple[dict, dict]:
    """Load and validate a base config (world size set to ``nproc``) -> (nested, flat)."""
    overrides = dict(extra or {})
    if nproc is not None:
        overrides["trainer.n_gpus_per_node"] = nproc
    cfg = load_config(base_path, overrides or None)
    nested = config_to_dict(cfg)
    return nested, flatten(nested)
