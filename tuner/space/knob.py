"""One knob of a space: its spec parsed and checked (:func:`parse_knob`), its values (``domain``, ``contains``),
how Optuna suggests it (``param``, ``encode``, ``suggest``: a power of two as its exponent, :mod:`tuner.space.params`)
and its hints: ``memory`` (how memory moves as the value grows; the inferred-OOM rule) and ``speed`` (how throughput
is expected to move; a prior for local steps).

A knob is an execution knob of :mod:`tuner.space.registry` (anything else changes the algorithm and is refused, unless
the spec says ``algorithm: true``), and its values are in that knob's range (a micro-batch >= 1, a fraction in
(0, 1], ...): both checked here, at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from tuner.space.expr import Expr, ExprError
from tuner.space.keys import CONFIG_KEYS, SpaceError
from tuner.space.params import LOG2_PREFIX, is_pow2, pow2_exponents
from tuner.space.registry import is_execution_knob, range_problem

__all__ = ["KNOB_TYPES", "MEMORY_HINTS", "Knob", "parse_knob"]

KNOB_TYPES = ("int", "pow2", "float", "categorical", "bool")
MEMORY_HINTS = ("increasing", "decreasing", "none")
_COMMON_SPEC_KEYS = {"type", "memory", "speed", "when", "help", "algorithm"}
_KNOB_SPEC_KEYS = {
    "int": _COMMON_SPEC_KEYS | {"low", "high", "step"},
    "pow2": _COMMON_SPEC_KEYS | {"low", "high"},
    "float": _COMMON_SPEC_KEYS | {"low", "high", "step"},
    "categorical": _COMMON_SPEC_KEYS | {"choices", "order"},
    "bool": _COMMON_SPEC_KEYS,
}
#: how many of a knob's values the range check looks at one by one (beyond: its low and high)
_RANGE_CHECK_VALUES = 4096


@dataclass(frozen=True)
class Knob:
    key: str
    type: str
    memory: str = "none"
    speed: str = "none"  # the expected direction of throughput along the domain (a prior for local steps)
    when: Optional[Expr] = None
    low: Any = None
    high: Any = None
    step: Any = None
    choices: tuple = ()
    order: tuple = ()  # memory order (least hungry first) for pow2/categorical/bool
    algorithm: bool = False  # marked on purpose: not an execution knob, the trials run different algorithms

    @property
    def exponents(self) -> Optional[tuple[int, int]]:
        """``(lo, hi)`` when the values are exactly ``2**lo .. 2**hi`` (no gap): suggested as that exponent."""
        if self.type not in ("pow2", "categorical"):
            return None
        return pow2_exponents(self.choices)

    @property
    def param(self) -> str:
        """The Optuna param name: ``log2:<key>`` for a power-of-two knob, else the dotted key."""
        return LOG2_PREFIX + self.key if self.exponents is not None else self.key

    def encode(self, value: Any) -> Any:
        """Knob value -> Optuna param value (the exponent of a power-of-two knob)."""
        if self.exponents is None:
            return value
        if not is_pow2(value):
            raise ValueError(f"{self.key}: {value!r} is not a power of two")
        return value.bit_length() - 1

    def domain(self) -> list:
        """Every value, in ascending (memory) order."""
        if self.type == "int":
            return list(range(self.low, self.high + 1, self.step))
        if self.type == "float":
            n = int(math.floor((self.high - self.low) / self.step + 1e-9))
            return [round(self.low + i * self.step, 12) for i in range(n + 1)]
        return list(self.order)

    def domain_size(self) -> int:
        if self.type == "int":
            return (self.high - self.low) // self.step + 1
        if self.type == "float":
            return int(math.floor((self.high - self.low) / self.step + 1e-9)) + 1
        return len(self.order)

    def contains(self, value: Any) -> bool:
        if self.type == "int":
            return (
                isinstance(value, int)
                and not isinstance(value, bool)
                and self.low <= value <= self.high
                and (value - self.low) % self.step == 0
            )
        if self.type == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return False
            k = (value - self.low) / self.step
            return self.low - 1e-9 <= value <= self.high + 1e-9 and abs(k - round(k)) < 1e-6
        return any(type(value) is type(c) and value == c for c in self.choices)

    def suggest(self, trial: Any) -> Any:
        """Optuna define-by-run under :attr:`param`; returns the knob value (``2**exponent`` for pow2)."""
        if self.exponents is not None:
            lo, hi = self.exponents
            return 1 << trial.suggest_int(self.param, lo, hi)
        if self.type == "int":
            return trial.suggest_int(self.key, self.low, self.high, step=self.step)
        if self.type == "float":
            value = trial.suggest_float(self.key, self.low, self.high, step=self.step)
            # a stepped float on the step's grid, as written (0.6, not Optuna's 0.6000000000000001)
            return value if self.step is None else round(value, _decimals(self.step))
        return trial.suggest_categorical(self.key, list(self.choices))

    def rank(self, value: Any) -> float:
        if self.type in ("int", "float"):
            return float(value)
        for i, c in enumerate(self.order):
            if type(value) is type(c) and value == c:
                return float(i)
        raise KeyError(value)

    def at_least_as_hungry(self, a: Any, b: Any, *, host: bool = False) -> bool:
        """Would value ``a`` use at least as much memory as ``b``? ``host``: the host's memory (RAM) rather
        than the device's: an offload knob moves state from the device to the host, so its direction flips."""
        if self.memory == "none":
            return a == b and type(a) is type(b)
        try:
            ra, rb = self.rank(a), self.rank(b)
        except KeyError:
            return False
        increasing = self.memory == "increasing"
        if host and "offload" in self.key:
            increasing = not increasing
        return ra >= rb if increasing else ra <= rb

    def describe(self) -> str:
        if self.type in ("int", "float"):
            dom = f"[{self.low}..{self.high} step {self.step}]"
        else:
            dom = "{" + ", ".join(str(c) for c in self.choices) + "}"
        text = f"{self.key}: {self.type} {dom} memory={self.memory}"
        if self.speed != "none":
            text += f" speed={self.speed}"
        if self.memory != "none" and self.type == "categorical":
            text += " order=" + "<".join(str(c) for c in self.order)
        if self.exponents is not None:
            lo, hi = self.exponents
            text += f" (Optuna param {self.param}: {lo}..{hi})"
        if self.when is not None:
            text += f" when {self.when.text}"
        if self.algorithm:
            text += " [algorithm knob: the trials run different algorithms]"
        return text


def _decimals(step: float) -> int:
    """Decimal places of a step as written (0.2 -> 1, 0.05 -> 2, 1 -> 0)."""
    text = repr(float(step))
    return 0 if "e" in text or text.endswith(".0") else len(text.split(".")[1])


def _num(spec: dict, name: str, key: str, source: Optional[str], *, kind: type = int) -> Any:
    if name not in spec:
        raise SpaceError(f"{key}.{name}", "missing", source=source)
    v = spec[name]
    ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise SpaceError(f"{key}.{name}", f"expected {kind.__name__}, got {v!r}", source=source)
    return v


def parse_knob(key: str, spec: Any, source: Optional[str]) -> Knob:
    """One entry of a space's ``knobs`` section (a mapping, or a bare type name) -> a checked :class:`Knob`."""

    def err(k: str, msg: str) -> SpaceError:
        return SpaceError(k, msg, source=source)

    if key not in CONFIG_KEYS:
        raise err(key, "unknown knob key (not a key of trainer.config.PPOConfig)")
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        raise err(key, f"a knob must be a mapping with a type, got {spec!r}")
    algorithm = spec.get("algorithm", False)
    if not isinstance(algorithm, bool):
        raise err(f"{key}.algorithm", f"must be true or false, got {algorithm!r}")
    if not algorithm and not is_execution_knob(key):
        raise err(key, ALGORITHM_REFUSAL)
    typ = spec.get("type")
    if typ not in KNOB_TYPES:
        raise err(f"{key}.type", f"must be one of {list(KNOB_TYPES)}, got {typ!r}")
    for k in spec:
        if k not in _KNOB_SPEC_KEYS[typ]:
            raise err(f"{key}.{k}", f"unknown field for a {typ} knob (allowed: {sorted(_KNOB_SPEC_KEYS[typ])})")
    memory = spec.get("memory", "none")
    if memory not in MEMORY_HINTS:
        raise err(f"{key}.memory", f"must be one of {list(MEMORY_HINTS)}, got {memory!r}")
    speed = spec.get("speed", "none")
    if speed not in MEMORY_HINTS:
        raise err(f"{key}.speed", f"must be one of {list(MEMORY_HINTS)}, got {speed!r}")
    when = _parse_when(key, spec["when"], source) if spec.get("when") is not None else None
    kw: dict = {"key": key, "type": typ, "memory": memory, "speed": speed, "when": when, "algorithm": algorithm}
    kw.update(_parse_domain(key, typ, spec, source))
    knob = Knob(**kw)
    _check_range(knob, source)
    return knob


#: why a key outside :mod:`tuner.space.registry` is refused (one line, after the file and the key)
ALGORITHM_REFUSAL = (
    "not a per-GPU execution knob: varying it changes the algorithm; set it in the base config "
    "(the keys a space may vary: tuner/space/registry.py; `algorithm: true` on the knob compares algorithms on purpose)"
)


def _check_range(knob: Knob, source: Optional[str]) -> None:
    """Every value of an execution knob in its kind's range (tuner.space.registry.range_problem)."""
    if knob.type in ("int", "float") and knob.domain_size() > _RANGE_CHECK_VALUES:
        values = [knob.low, knob.high]
    else:
        values = knob.domain()
    for v in values:
        why = range_problem(knob.key, v)
        if why:
            if knob.type not in ("int", "float", "pow2"):
                field = "choices"
            else:
                field = "low" if v == knob.low else "high" if v == knob.high else "step"
            raise SpaceError(f"{knob.key}.{field}", why, source=source)


def _parse_when(key: str, text: Any, source: Optional[str]) -> Expr:
    """A knob's condition: an expression over config keys other than the knob's own."""
    try:
        when = Expr(text)
    except ExprError as e:
        raise SpaceError(f"{key}.when", str(e), source=source) from None
    for name in when.names:
        if name == key:
            raise SpaceError(f"{key}.when", "a knob's condition cannot name the knob itself", source=source)
        if name not in CONFIG_KEYS:
            raise SpaceError(
                f"{key}.when", f"unknown key {name!r} (not a key of trainer.config.PPOConfig)", source=source
            )
    return when


def _parse_domain(key: str, typ: str, spec: dict, source: Optional[str]) -> dict:
    """The :class:`Knob` fields that hold a knob's values: ``low``/``high``/``step`` and ``choices``/``order``."""
    if typ in ("int", "float"):
        return _parse_range(key, typ, spec, source)
    if typ == "pow2":
        return _parse_pow2(key, spec, source)
    if typ == "bool":
        return {"choices": (False, True), "order": (False, True)}
    return _parse_choices(key, spec, source)


def _parse_range(key: str, typ: str, spec: dict, source: Optional[str]) -> dict:
    kind = int if typ == "int" else float
    low, high = _num(spec, "low", key, source, kind=kind), _num(spec, "high", key, source, kind=kind)
    if typ == "int":
        step = spec.get("step", 1)
    else:
        step = _num(spec, "step", key, source, kind=float)  # discrete on purpose: grid, dedupe
    if (
        isinstance(step, bool)
        or not isinstance(step, (int, float))
        or (typ == "int" and not isinstance(step, int))
        or step <= 0
    ):
        raise SpaceError(f"{key}.step", f"must be a positive {kind.__name__}, got {step!r}", source=source)
    if low > high:
        raise SpaceError(f"{key}.low", f"low={low} is above high={high}", source=source)
    return {"low": low, "high": high, "step": step}


def _parse_pow2(key: str, spec: dict, source: Optional[str]) -> dict:
    low, high = _num(spec, "low", key, source), _num(spec, "high", key, source)
    for name, v in (("low", low), ("high", high)):
        if not is_pow2(v):
            raise SpaceError(f"{key}.{name}", f"must be a power of two, got {v}", source=source)
    if low > high:
        raise SpaceError(f"{key}.low", f"low={low} is above high={high}", source=source)
    values = []
    v = low
    while v <= high:
        values.append(v)
        v *= 2
    return {"low": low, "high": high, "choices": tuple(values), "order": tuple(values)}


def _parse_choices(key: str, spec: dict, source: Optional[str]) -> dict:
    choices = spec.get("choices")
    if not isinstance(choices, list) or not choices:
        raise SpaceError(f"{key}.choices", "must be a non-empty list", source=source)
    for c in choices:
        if not (isinstance(c, (str, int, float, bool)) or c is None):
            raise SpaceError(f"{key}.choices", f"choices must be scalars, got {c!r}", source=source)
    if len({(type(c), c) for c in choices}) != len(choices):
        raise SpaceError(f"{key}.choices", "duplicate choice", source=source)
    order = spec.get("order", choices)
    if not isinstance(order, list) or sorted(map(repr, order)) != sorted(map(repr, choices)):
        raise SpaceError(f"{key}.order", "must list exactly the choices, least memory-hungry first", source=source)
    return {"choices": tuple(choices), "order": tuple(order)}
