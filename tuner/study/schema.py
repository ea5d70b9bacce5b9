"""What is read back from a study, checked against its schema before it is used: the study is data.

A study may have been written by another ppotune version, another worker, a person with a SQL prompt, or anyone
who reaches an open storage proxy. Whatever comes back is checked here before a report, an export, a validation
or a resumed search uses it (docs/security.md):

* the study's name (:func:`name_problem`): a string of at most :data:`MAX_NAME` characters, no control characters
  (a newline in a name written into a script's comment line would start a command);
* its attributes (:func:`read_study_attrs`): each known attribute has a type and a range (docs/contracts.md
  section 3); one that does not fit is dropped, as if absent, with a note;
* each trial (:func:`read_trial`): its user attributes (``TrialRecord``'s fields, typed), its objective values
  and constraints (finite), its overrides (dotted keys of the study's space, scalar values); a trial that does
  not fit is skipped with a note; a status this version does not know is skipped too. Free text (an error, a
  log tail) is kept, clipped to :data:`MAX_TEXT` characters; it is escaped wherever it is written.

:func:`comment_safe` is the escaping for a value written into a script's or a config's comment line.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Iterable, Mapping, Optional

from trainer.contracts import Status
from tuner.study.selection import PICKS

__all__ = [
    "MAX_NAME",
    "MAX_LINE",
    "MAX_TEXT",
    "name_problem",
    "comment_safe",
    "read_study_attrs",
    "read_trial",
    "override_keys_of",
    "notes_summary",
]

MAX_NAME = 256  # a study name, a knob key
MAX_LINE = 4096  # a path, a one-line value
MAX_TEXT = 65536  # an error, a log tail: longer is clipped
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
_OVERRIDE_KEY = re.compile(r"^[+~]{0,2}[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")

Check = Callable[[Any], Optional[str]]  # why a value does not fit, or None


# --------------------------------------------------------------------------- values
def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def name_problem(name: Any, *, what: str = "name", max_len: int = MAX_NAME) -> Optional[str]:
    """Why ``name`` cannot be used as a name or a path written into files (None: it can)."""
    if not isinstance(name, str):
        return f"{what} is not a string ({type(name).__name__})"
    if not name:
        return f"{what} is empty"
    if len(name) > max_len:
        return f"{what} is {len(name):,} characters long (at most {max_len:,})"
    if _CONTROL.search(name):
        return f"{what} {_show(name)} holds control characters"
    return None


def comment_safe(text: Any) -> str:
    """``text`` for one comment line of a script or a YAML file: control characters (a newline would end the
    comment and start a command) shown as ``\\xNN`` escapes, at most :data:`MAX_LINE` characters."""
    s = _CONTROL.sub(
        lambda m: "\\x%02x" % ord(m.group()) if ord(m.group()) < 256 else "\\u%04x" % ord(m.group()), str(text)
    )
    return s if len(s) <= MAX_LINE else s[: MAX_LINE - 3] + "..."


def _opt(check: Check) -> Check:
    return lambda v: None if v is None else check(v)


def _int(lo: Optional[int] = None) -> Check:
    def check(v: Any) -> Optional[str]:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{_show(v)} is not an integer"
        return f"{v} is below {lo}" if lo is not None and v < lo else None

    return check


def _num(lo: Optional[float] = None, hi: Optional[float] = None, *, above: bool = False) -> Check:
    """A finite number, ``>= lo`` (``> lo`` with ``above``) and ``<= hi``."""

    def check(v: Any) -> Optional[str]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"{_show(v)} is not a number"
        if not math.isfinite(v):
            return f"{v!r} is not finite"
        if lo is not None and (v <= lo if above else v < lo):
            return f"{v!r} is {'not above' if above else 'below'} {lo:g}"
        return f"{v!r} is above {hi:g}" if hi is not None and v > hi else None

    return check


def _bool(v: Any) -> Optional[str]:
    return None if isinstance(v, bool) else f"{_show(v)} is not true/false"


def _one_of(*values: Any) -> Check:
    return lambda v: (
        None if any(type(v) is type(x) and v == x for x in values) else f"{_show(v)} is not one of {list(values)}"
    )


def _line(max_len: int = MAX_LINE) -> Check:
    return lambda v: name_problem(v, what="the value", max_len=max_len)


def _text(v: Any) -> Optional[str]:
    return None if isinstance(v, str) else f"{_show(v)} is not text"


def _list(item: Check, max_len: int = 100_000) -> Check:
    def check(v: Any) -> Optional[str]:
        if not isinstance(v, list):
            return f"{_show(v)} is not a list"
        if len(v) > max_len:
            return f"a list of {len(v):,} items (at most {max_len:,})"
        for i, x in enumerate(v):
            why = item(x)
            if why:
                return f"[{i}]: {why}"
        return None

    return check


def _pair(v: Any) -> Optional[str]:
    return _list(_opt(_num()), 2)(v) or (None if len(v) == 2 else f"{_show(v)} is not a pair")


def _dict(value: Check, key: Check = _line(MAX_NAME)) -> Check:
    def check(v: Any) -> Optional[str]:
        if not isinstance(v, dict):
            return f"{_show(v)} is not a mapping"
        for k, x in v.items():
            why = key(k) or value(x)
            if why:
                return f"{comment_safe(k)[:80]}: {why}"
        return None

    return check


def _record(fields: Mapping[str, Check], required: tuple[str, ...] = ()) -> Check:
    """A mapping whose known fields fit their checks (others are left alone: a newer writer)."""

    def check(v: Any) -> Optional[str]:
        if not isinstance(v, dict):
            return f"{_show(v)} is not a mapping"
        for k in required:
            if k not in v:
                return f"no {k}"
        for k, c in fields.items():
            if k in v:
                why = c(v[k])
                if why:
                    return f"{k}: {why}"
        return None

    return check


def _data(v: Any, depth: int = 0, *, finite: bool = True) -> Optional[str]:
    """JSON-like data: numbers (finite unless ``finite`` is False), strings, booleans, null, lists and string-keyed
    mappings, 12 levels deep."""
    if depth > 12:
        return "nested too deep"
    if v is None or isinstance(v, (bool, str)):
        return None
    if isinstance(v, (int, float)):
        return None if math.isfinite(v) or not finite else f"{v!r} is not finite"
    if isinstance(v, list):
        return next((f"[{i}]: {w}" for i, x in enumerate(v) if (w := _data(x, depth + 1, finite=finite))), None)
    if isinstance(v, dict):
        for k, x in v.items():
            why = (None if isinstance(k, str) else f"key {_show(k)} is not text") or _data(x, depth + 1, finite=finite)
            if why:
                return f"{comment_safe(k)[:80]}: {why}"
        return None
    return f"{type(v).__name__} is not data"


def _scalar(v: Any) -> Optional[str]:
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return _num()(v)
    if isinstance(v, str):
        return _line()(v) if v else None
    return f"{_show(v)} is not a scalar"


def _dotted(v: Any) -> Optional[str]:
    return name_problem(v, what="key") or (None if _DOTTED.match(v) else f"{_show(v)} is not a dotted config key")


def _override_line(v: Any) -> Optional[str]:
    why = _line()(v)
    if why:
        return why
    key = v.split("=", 1)[0]
    return None if "=" in v and _OVERRIDE_KEY.match(key) else f"{_show(v)} is not key=value"


def _base_config(v: Any) -> Optional[str]:
    """A complete typed config: what trainer.config reads (types only; paths may not exist on this machine)."""
    from trainer.config import config_from_dict

    if not isinstance(v, dict):
        return f"{_show(v)} is not a mapping"
    try:
        config_from_dict(v, validate=False)
    except (ValueError, TypeError) as e:
        return f"not a config ({comment_safe(e)[:200]})"
    return None


# --------------------------------------------------------------------------- the study's attributes
_STATUSES = tuple(s.value for s in Status)
_CONFIRMED = _record(
    {
        "number": _int(0),
        "ratio": _opt(_num(0)),
        "ratio_ci": _opt(_pair),
        "ratios": _list(_opt(_num(0))),
        "throughput": _opt(_num(0)),
        "throughput_ci": _opt(_pair),
        "peak_memory_gb": _opt(_num(0)),
        "trials": _list(_int(0)),
        "failed": _int(0),
        "statuses": _list(_line(MAX_NAME)),
        "rounds": _int(0),
    },
    required=("number",),
)
_PROBE = _record(
    {
        "status": _one_of(*_STATUSES),
        "peak_memory_gb": _opt(_num(0)),
        "peak_memory_by_phase_gb": _dict(_opt(_num(0))),
        "memory_source": _opt(_line(MAX_NAME)),
        "oom_phase": _opt(_line(MAX_NAME)),
        "duration_s": _num(0),
        "prompt_length": _opt(_int(0)),
        "response_length": _opt(_int(0)),
        "lengths": _data,
        "device": _opt(_line(MAX_NAME)),
        "device_name": _opt(_line()),
        "world_size": _opt(_int(1)),
        "memory_limit_gb": _opt(_num(0)),
        "notes": _list(_text),
        "error": _opt(_text),
        "result_path": _opt(_line()),
        "log_path": _opt(_line()),
    },
    required=("status",),
)
#: docs/contracts.md section 3: the study attributes and what each must be
STUDY_ATTRS: dict[str, Check] = {
    "ppotune_schema": _int(0),
    "engine": _one_of("ppotune", "verl"),
    "engine_python": _opt(_line()),
    "engine_overrides": _opt(_list(_override_line)),
    "base_config": _base_config,
    "base_config_path": _opt(_line()),
    "space_path": _opt(_line()),
    "space": _record({"knobs": _dict(_data), "derived": _dict(_data), "fixed": _dict(_data), "constraints": _data}),
    "nproc": _int(1),
    "target": _opt(
        _record(
            {
                "nnodes": _int(1),
                "n_gpus_per_node": _int(1),
                "world": _int(1),
                "trial_world": _int(1),
                "sizes": _dict(_list(_int(0), 2)),
            },
            required=("nnodes", "n_gpus_per_node", "trial_world"),
        )
    ),
    "steps": _int(1),
    "warmup": _int(0),
    "precision": _opt(_num(0, 1)),
    "device": _record(
        {"kind": _one_of("cpu", "cuda"), "name": _opt(_line()), "memory_total_gb": _opt(_num(0, above=True))}
    ),
    "memory_limit_gb": _opt(_num(0, above=True)),
    "penalty_memory_gb": _opt(_num(0, above=True)),
    "sampler": _opt(_line(MAX_NAME)),
    "seed": _opt(_int()),
    "confirmation": _opt(
        _record(
            {
                "baseline": _opt(_int(0)),
                "rounds": _int(0),
                "headroom": _num(0, 1),
                "complete": _bool,
                "finalists": _list(_CONFIRMED),
                "baseline_result": _opt(_CONFIRMED),
            }
        )
    ),
    # what the search confirmed and probed for (ppotune search --pick --memory-headroom), export's defaults
    "selection": _opt(
        _record({"pick": _one_of(*PICKS), "memory_headroom": _num(0, 1)}, required=("pick", "memory_headroom"))
    ),
    "worst_case": _opt(_dict(_PROBE, key=lambda k: None if isinstance(k, str) and k.isdigit() else "not a number")),
    # the search's own bookkeeping, written and never read back (a leave-one-out error may be inf)
    "memory_model": _opt(lambda v: _data(v, finite=False)),
}


def read_study_attrs(attrs: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """(the attributes that fit :data:`STUDY_ATTRS`, notes on those dropped). Unknown attributes are kept when
    they are data (a newer writer's), dropped otherwise."""
    out, notes = {}, []
    for k, v in attrs.items():
        why = STUDY_ATTRS[k](v) if k in STUDY_ATTRS else name_problem(k, what="its name") or _data(v)
        if why:
            notes.append(f"study attribute {comment_safe(k)[:80]!s} ignored: {why}")
        else:
            out[k] = v
    return out, notes


# --------------------------------------------------------------------------- a trial
_METRIC = _opt(_num())
#: TrialRecord's fields (trainer/contracts.py) and what each must be
TRIAL_ATTRS: dict[str, Check] = {
    "status": _one_of(*_STATUSES),
    "baseline": _bool,
    "overrides": _dict(_scalar, key=_dotted),
    "throughput": _opt(_num(0)),
    "throughput_cv": _opt(_num(0)),
    "step_s": _opt(_num(0)),
    "throughput_ci": _opt(_pair),
    "measured_steps": _opt(_int(0)),
    "pruned": _opt(_text),
    "lengths": _dict(_dict(_METRIC)),
    "constraint": _METRIC,
    "peak_memory_gb": _opt(_num(0)),
    "memory_source": _opt(_line(MAX_NAME)),
    "memory": _dict(lambda v: _scalar(v) if not isinstance(v, (dict, list)) else _data(v)),
    "timing_s": _dict(_METRIC),
    "model_shape": _opt(_dict(_data)),
    "notes": _list(_text),
    "error": _opt(_text),
    "log_tail": _opt(_text),
    "log_path": _opt(_line()),
    "result_path": _opt(_line()),
    "config_path": _opt(_line()),
    "duration_s": _opt(_num(0)),
    "returncode": _opt(_int()),
    "oom_phase": _opt(_line(MAX_NAME)),
    "oom_kind": _opt(_line(MAX_NAME)),
    "gpus": _opt(_list(_int(0))),
    "engine": _opt(_line(MAX_NAME)),
    "inferred_from": _opt(_int(0)),
    "predicted": _opt(_dict(_METRIC)),
    "duplicate_of": _opt(_int(0)),
    "confirm_of": _opt(_int(0)),
    "retry_of": _opt(_int(0)),
    "owner": _opt(_record({"host": _line(MAX_NAME), "pid": _int(0), "started": _opt(_num())})),
    "heartbeat": _opt(_num()),
}
_CLIPPED = ("error", "log_tail", "pruned")


def override_keys_of(space_attr: Any) -> frozenset[str]:
    """The keys a trial of a study may override: the execution knobs (:mod:`tuner.space.registry`) and its space's
    own knobs and derived keys (those marked ``algorithm: true`` included). Anything else (a data path, a
    checkpoint directory, the model) is the base config's, never a trial's."""
    from tuner.space.registry import EXECUTION_KNOBS

    keys = set(EXECUTION_KNOBS)
    if isinstance(space_attr, dict):
        for section in ("knobs", "derived"):
            if isinstance(space_attr.get(section), dict):
                keys |= {str(k) for k in space_attr[section]}
    return frozenset(keys)


def read_trial(t: Any, *, override_keys: Optional[Iterable[str]] = None) -> tuple[Optional[dict], Optional[str]]:
    """(the trial's user attributes, checked and with long text clipped, None) or (None, why it is skipped).
    ``t``: an Optuna FrozenTrial; ``override_keys``: the keys its overrides may name (:func:`override_keys_of`;
    None: any dotted key)."""
    attrs = dict(t.user_attrs)
    for k, check in TRIAL_ATTRS.items():
        if k in attrs and attrs[k] is not None:
            why = check(attrs[k])
            if why:
                return None, f"{k}: {why}"
    for k in set(attrs) - set(TRIAL_ATTRS):
        why = name_problem(k, what="an attribute's name") or _data(attrs[k])
        if why:
            return None, f"{comment_safe(k)[:80]}: {why}"
    allowed = None if override_keys is None else set(override_keys)
    if allowed is not None and isinstance(attrs.get("overrides"), dict):
        outside = sorted(set(attrs["overrides"]) - allowed)
        if outside:
            return None, f"overrides: {comment_safe(outside[0])[:80]} is not a key of the study's space"
    for name, v in t.params.items():
        why = name_problem(name, what="param name") or _scalar(v) or _log2_problem(name, v, t.distributions.get(name))
        if why:
            return None, f"params: {why}"
    for what, values in (("values", t.values or []), ("constraints", list((t.constraints or {}).values()))):
        bad = [v for v in values if not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            return None, f"{what}: {bad[0]!r} is not finite"
    for k in _CLIPPED:
        if isinstance(attrs.get(k), str) and len(attrs[k]) > MAX_TEXT:
            attrs[k] = attrs[k][:MAX_TEXT] + f"... ({len(attrs[k]) - MAX_TEXT:,} characters clipped)"
    if isinstance(attrs.get("notes"), list):
        attrs["notes"] = [n if len(n) <= MAX_LINE else n[:MAX_LINE] + "..." for n in attrs["notes"]]
    return attrs, None


def _log2_problem(name: str, v: Any, dist: Any) -> Optional[str]:
    """A power-of-two knob's exponent (``log2:<key>``, tuner.space.params) and its range: 0..62 (2**62 is far past
    any batch; a larger exponent would make a number of millions of digits)."""
    if not name.startswith("log2:"):
        return None
    bounds = [v, getattr(dist, "low", 0), getattr(dist, "high", 0)]
    if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 62 for b in bounds):
        return f"{comment_safe(name)[:80]}: exponent {_show(v)} (range {_show(bounds[1:])}) is not in 0..62"
    return None


def notes_summary(notes: list[str], *, at_most: int = 5) -> list[str]:
    """At most ``at_most`` notes, then how many more: what a command prints about a study it read."""
    out = notes[:at_most]
    if len(notes) > at_most:
        out.append(f"... and {len(notes) - at_most} more")
    return out
