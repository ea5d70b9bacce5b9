"""Search spaces: YAML -> knobs (Optuna distributions), derived keys, constraints, memory hints.

A space file looks like::

    description: actor micro-batch or token budget, and gradient checkpointing
    fixed:                                   # set for every trial, the baseline's too (the base config + these)
      actor_rollout_ref.rollout.name: vllm
    knobs:                                   # in order: a `when` may name earlier knobs only
      actor_rollout_ref.actor.use_dynamic_bsz: {type: bool}
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu:
        type: pow2                           # int | pow2 | float | categorical | bool
        low: 1
        high: 16
        memory: increasing                   # increasing | decreasing | none (default)
        speed: increasing                    # the same values: the expected throughput (a prior)
        when: not actor_rollout_ref.actor.use_dynamic_bsz
      actor_rollout_ref.actor.strategy:
        type: categorical
        choices: [fsdp, fsdp2]
        memory: increasing
        order: [fsdp2, fsdp]                 # memory order, least hungry first (default: choices)
    derived:                                 # key: expression, or {expr: ..., when: ...}
      actor_rollout_ref.ref.log_prob_max_token_len_per_gpu: 2 * actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    constraints:
      - actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu <= data.train_batch_size

Every knob, derived key and name in an expression is a dotted key of
:class:`trainer.config.PPOConfig` (verl's keys). Expressions are parsed with :mod:`ast`
and evaluated by walking a whitelist (numbers, strings, true/false/null, dotted keys,
``+ - * / // %``, comparisons, and/or/not, ``min``/``max``); nothing is ``eval``-ed.

Semantics:

* A knob whose values are exactly the powers of two ``2**lo .. 2**hi`` (``type: pow2``, or a
  categorical list such as ``[1, 2, 4, 8]``) is suggested to Optuna as the ordered integer
  exponent ``lo .. hi`` under the param name ``log2:<dotted key>``, so TPE learns that 32
  neighbours 64; the value it stands for (``2**exponent``) is what configs, overrides, exports
  and reports hold. A power-of-two list with gaps (``[1, 2, 8]``) stays categorical: an exponent
  range would hold values the user left out on purpose, each a wasted proposal. Every mapping
  between Optuna params and knob values goes through :meth:`Space.to_params` and
  :func:`from_params` (and :func:`decode_trial` for a whole trial).
* A knob whose ``when`` is false is *inactive*: it is not an Optuna param and the
  trial keeps the base config's value.
* A constraint that names an inactive knob is vacuously true (a micro-batch rule does
  not reject dynamic-bsz configs).
* ``memory`` says how memory moves as the value grows (bool: False < True;
  categorical: ``order``). It drives the inferred-OOM rule: a candidate at least as
  memory-hungry as a known OOM on every monotone knob, and equal on the others, is not
  launched.
* ``speed`` says how throughput is expected to move as the value grows (same order). A prior,
  not a rule: local steps (tuner.search.loop) try the neighbours it favours first; nothing is skipped.
"""

from __future__ import annotations

import ast
import copy
import math
import operator
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import yaml

from trainer.config import ConfigError, PPOConfig, config_from_dict, config_to_dict, flatten, follow, unflatten

__all__ = [
    "SpaceError",
    "comparable_space",
    "Expr",
    "Knob",
    "Candidate",
    "Space",
    "load_space",
    "LOG2_PREFIX",
    "from_params",
    "decode_trial",
]

KNOB_TYPES = ("int", "pow2", "float", "categorical", "bool")
MEMORY_HINTS = ("increasing", "decreasing", "none")
_TOP_KEYS = ("name", "description", "fixed", "knobs", "derived", "constraints")
_KNOB_SPEC_KEYS = {
    "int": {"type", "low", "high", "step", "memory", "speed", "when", "help"},
    "pow2": {"type", "low", "high", "memory", "speed", "when", "help"},
    "float": {"type", "low", "high", "step", "memory", "speed", "when", "help"},
    "categorical": {"type", "choices", "order", "memory", "speed", "when", "help"},
    "bool": {"type", "memory", "speed", "when", "help"},
}
# Grid enumeration stops counting past this (``space check`` prints ">LIMIT").
GRID_LIMIT = 1_000_000
#: The Optuna param name of a power-of-two knob is this + its dotted key; its value is the exponent.
LOG2_PREFIX = "log2:"


class SpaceError(ConfigError):
    """Bad search space. ``str()`` is one line naming the file and the key (as ConfigError)."""


def _config_keys() -> frozenset[str]:
    return frozenset(flatten(config_to_dict(PPOConfig())))


CONFIG_KEYS = _config_keys()


# --------------------------------------------------------------------------- expressions
class ExprError(ValueError):
    pass


_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
# YAML spellings too, so `== false` reads like the YAML around it.
_CONSTANT_NAMES = {"true": True, "false": False, "True": True, "False": False, "null": None, "None": None}
_FUNCS = {"min": min, "max": max}

Lookup = Callable[[str], Any]


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class Expr:
    """A whitelisted arithmetic/boolean expression over dotted config keys."""

    def __init__(self, text: Any):
        if isinstance(text, bool) or not isinstance(text, (str, int, float)):
            raise ExprError(f"expected an expression string, got {type(text).__name__} {text!r}")
        self.text = str(text).strip()
        if not self.text:
            raise ExprError("empty expression")
        try:
            tree = ast.parse(self.text, mode="eval")
        except SyntaxError as e:
            raise ExprError(f"bad expression {self.text!r}: {e.msg}") from None
        self.names: set[str] = set()
        self._fn = self._compile(tree.body)

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"

    def __call__(self, lookup: Lookup) -> Any:
        try:
            return self._fn(lookup)
        except ExprError:
            raise
        except (TypeError, ZeroDivisionError, ValueError) as e:
            raise ExprError(f"{self.text!r}: {e}") from None

    def _compile(self, node: ast.AST) -> Callable[[Lookup], Any]:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (int, float, str, bool)) or node.value is None:
                value = node.value
                return lambda lk: value
            raise ExprError(f"bad expression {self.text!r}: constant {node.value!r} not allowed")
        if isinstance(node, ast.Name) and node.id in _CONSTANT_NAMES:
            value = _CONSTANT_NAMES[node.id]
            return lambda lk: value
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = _dotted(node)
            if name is None:
                raise ExprError(f"bad expression {self.text!r}: only dotted config keys may be used as names")
            self.names.add(name)
            return lambda lk: lk(name)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            op = _BINOPS[type(node.op)]
            left, right = self._compile(node.left), self._compile(node.right)
            return lambda lk: op(left(lk), right(lk))
        if isinstance(node, ast.UnaryOp):
            operand = self._compile(node.operand)
            if isinstance(node.op, ast.Not):
                return lambda lk: not operand(lk)
            if isinstance(node.op, ast.USub):
                return lambda lk: -operand(lk)
            if isinstance(node.op, ast.UAdd):
                return lambda lk: +operand(lk)
        if isinstance(node, ast.BoolOp):
            values = [self._compile(v) for v in node.values]
            if isinstance(node.op, ast.And):
                return lambda lk: all(v(lk) for v in values)
            return lambda lk: any(v(lk) for v in values)
        if isinstance(node, ast.Compare) and all(type(o) in _CMPOPS for o in node.ops):
            left = self._compile(node.left)
            ops = [_CMPOPS[type(o)] for o in node.ops]
            rights = [self._compile(c) for c in node.comparators]

            def compare(lk: Lookup) -> bool:
                a = left(lk)
                for op, r in zip(ops, rights):
                    b = r(lk)
                    if not op(a, b):
                        return False
                    a = b
                return True

            return compare
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCS
            and not node.keywords
            and node.args
        ):
            fn = _FUNCS[node.func.id]
            args = [self._compile(a) for a in node.args]
            return lambda lk: fn(*(a(lk) for a in args))
        raise ExprError(
            f"bad expression {self.text!r}: {type(node).__name__} is not allowed "
            "(numbers, dotted keys, + - * / // %, comparisons, and/or/not, min/max)"
        )


# --------------------------------------------------------------------------- knobs
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

    @property
    def exponents(self) -> Optional[tuple[int, int]]:
        """``(lo, hi)`` when the values are exactly ``2**lo .. 2**hi`` (no gap): suggested as that exponent."""
        if self.type not in ("pow2", "categorical"):
            return None
        return _pow2_exponents(self.choices)

    @property
    def param(self) -> str:
        """The Optuna param name: ``log2:<key>`` for a power-of-two knob, else the dotted key."""
        return LOG2_PREFIX + self.key if self.exponents is not None else self.key

    def encode(self, value: Any) -> Any:
        """Knob value -> Optuna param value (the exponent of a power-of-two knob)."""
        if self.exponents is None:
            return value
        if not _is_pow2(value):
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
        return text


@dataclass(frozen=True)
class Derived:
    key: str
    expr: Expr
    when: Optional[Expr] = None


@dataclass(frozen=True)
class Constraint:
    index: int
    expr: Expr

    @property
    def label(self) -> str:
        return f"constraints[{self.index}]"


@dataclass
class Candidate:
    """One point of the space, resolved against a base config."""

    params: dict  # active knob key -> value (the Optuna params)
    overrides: dict  # every dotted key the trial sets: knobs + derived keys
    effective: dict  # the full flat effective config
    violated: Optional[str] = None  # "constraints[i]: expr" if a constraint fails
    error: Optional[str] = None  # an expression that could not be evaluated


def _is_pow2(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def _pow2_exponents(values: tuple) -> Optional[tuple[int, int]]:
    if not values or not all(_is_pow2(v) for v in values):
        return None
    exps = sorted(v.bit_length() - 1 for v in values)
    return (exps[0], exps[-1]) if exps == list(range(exps[0], exps[-1] + 1)) else None


def from_params(params: dict) -> dict:
    """Optuna params -> knob values: ``log2:<key>: e`` becomes ``<key>: 2**e``; other names are the keys.

    Needs no space: the name says how a value is encoded (a study written before power-of-two
    knobs became exponents, whose params are the plain keys, reads the same)."""
    out = {}
    for name, v in params.items():
        if name.startswith(LOG2_PREFIX):
            out[name[len(LOG2_PREFIX) :]] = 1 << int(v)
        else:
            out[name] = v
    return out


def decode_trial(t: Any) -> Any:
    """A copy of an Optuna ``FrozenTrial`` whose params are knob values (:func:`from_params`); a
    power-of-two knob's distribution becomes ``IntDistribution(2**lo, 2**hi, log=True)``, which
    holds the same values in the same order (importance evaluators read it)."""
    if not any(name.startswith(LOG2_PREFIX) for name in t.params):
        return t
    from optuna.distributions import IntDistribution

    out = copy.copy(t)
    dists = {}
    for name, d in t.distributions.items():
        if name.startswith(LOG2_PREFIX):
            dists[name[len(LOG2_PREFIX) :]] = IntDistribution(1 << d.low, 1 << d.high, log=True)
        else:
            dists[name] = d
    out.params = from_params(t.params)
    out.distributions = dists
    return out


def _truthy(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ExprError(f"{where} must be true or false, got {value!r}")


class _Resolver:
    """Name lookup over a flat effective config; ``None`` "follow another key" defaults resolved."""

    def __init__(self, eff: dict):
        self.eff = eff

    def __call__(self, name: str) -> Any:
        return follow(self.eff, name)


# --------------------------------------------------------------------------- the space
@dataclass
class Space:
    knobs: list[Knob]
    derived: list[Derived] = field(default_factory=list)
    constraints: list[Constraint] = field(default_factory=list)
    #: keys set for every trial of the space, the baseline's too: applied to the base config itself
    fixed: dict = field(default_factory=dict)
    source: Optional[str] = None
    raw: dict = field(default_factory=dict)
    description: str = ""

    # ---- basic facts
    @property
    def keys(self) -> list[str]:
        return [k.key for k in self.knobs]

    def knob(self, key: str) -> Knob:
        for k in self.knobs:
            if k.key == key:
                return k
        raise KeyError(key)

    def to_dict(self) -> dict:
        """The parsed space as in the YAML (stored in the study's user attrs)."""
        return self.raw

    def _err(self, key: str, msg: str) -> SpaceError:
        return SpaceError(key, msg, source=self.source)

    # ---- one point
    def active(self, knob: Knob, eff: dict) -> bool:
        if knob.when is None:
            return True
        return _truthy(knob.when(_Resolver(eff)), f"{knob.key}.when")

    def complete(self, params: dict, base_flat: dict) -> Candidate:
        """Knob values -> overrides (with derived keys), checked against the constraints."""
        eff = dict(base_flat)
        eff.update(params)
        overrides = dict(params)
        cand = Candidate(params=dict(params), overrides=overrides, effective=eff)
        try:
            for d in self.derived:
                if d.when is not None and not _truthy(d.when(_Resolver(eff)), f"{d.key}.when"):
                    continue
                value = d.expr(_Resolver(eff))
                if isinstance(value, float) and value.is_integer() and isinstance(base_flat.get(d.key), int):
                    value = int(value)
                eff[d.key] = value
                overrides[d.key] = value
            inactive = {k.key for k in self.knobs} - set(params)
            for c in self.constraints:
                if c.expr.names & inactive:
                    continue
                if not _truthy(c.expr(_Resolver(eff)), c.label):
                    cand.violated = f"{c.label}: {c.expr.text}"
                    break
        except ExprError as e:
            cand.error = str(e)
        return cand

    def suggest(self, trial: Any, base_flat: dict, *, restrict: Optional[set] = None) -> Candidate:
        """Optuna define-by-run: suggest the active knobs in order (param names: :attr:`Knob.param`).

        ``restrict``: suggest only these knobs (dotted keys or Optuna param names; e.g. the
        baseline's in-domain knobs, or the params of the trial a ``--confirm`` re-run repeats).
        The candidate's ``params`` are knob values (``8``, not the exponent ``3``).
        """
        eff = dict(base_flat)
        params: dict = {}
        for knob in self.knobs:
            if restrict is not None and knob.key not in restrict and knob.param not in restrict:
                continue
            try:
                if not self.active(knob, eff):
                    continue
            except ExprError as e:
                return Candidate(params=params, overrides=dict(params), effective=eff, error=str(e))
            value = knob.suggest(trial)
            params[knob.key] = value
            eff[knob.key] = value
        return self.complete(params, base_flat)

    def baseline_values(self, base_flat: dict) -> dict:
        """The base config's own value of every knob active there and inside the knob's domain."""
        values = {}
        for knob in self.knobs:
            try:
                if self.active(knob, base_flat) and knob.contains(base_flat[knob.key]):
                    values[knob.key] = base_flat[knob.key]
            except ExprError:
                continue
        return values

    def baseline_params(self, base_flat: dict) -> dict:
        """:meth:`baseline_values` as Optuna params: what the study enqueues as its baseline trial."""
        return self.to_params(self.baseline_values(base_flat))

    def to_params(self, values: dict) -> dict:
        """Knob values -> Optuna params (``{key: 8}`` -> ``{"log2:key": 3}``): what ``enqueue_trial`` takes.

        The inverse is :func:`from_params`. Raises ``KeyError`` for a key that is not a knob."""
        by_key = {k.key: k for k in self.knobs}
        out = {}
        for key, v in values.items():
            if key not in by_key:
                raise KeyError(f"{key} is not a knob of this space")
            knob = by_key[key]
            out[knob.param] = knob.encode(v)
        return out

    def foreign_params(self, trials: Iterable[Any]) -> Optional[str]:
        """Why trials already in a study cannot be continued with this space's params, or None.

        A study written before power-of-two knobs were suggested as exponents holds them as
        categorical params under the plain key; asking on would leave TPE blind to those trials
        and retries of their params would land on random values. ``trials``: Optuna FrozenTrials."""
        params = {k.key: k.param for k in self.knobs} | {k.param: k.param for k in self.knobs}
        for t in trials:
            for name in t.distributions:
                want = params.get(name)
                if want is not None and want != name:
                    return (
                        f"trial {t.number} holds knob {name} as the Optuna param {name!r}; this version "
                        f"suggests it as {want!r} (a power of two as its exponent): the study was written by "
                        "an older ppotune; report and export still read it, pass --study NAME to search anew"
                    )
        return None

    def active_keys(self, eff: dict) -> frozenset[str]:
        out = set()
        for knob in self.knobs:
            try:
                if self.active(knob, eff):
                    out.add(knob.key)
            except ExprError:
                pass
        return frozenset(out)

    def at_least_as_hungry(self, eff_a: dict, eff_b: dict, *, host: bool = False) -> bool:
        """Inferred-OOM rule: is config A at least as memory-hungry as config B on every knob?

        Both are flat effective configs of this space (same base). Needs the same set of
        active knobs; monotone knobs compare by memory order, the others must be equal.
        ``host``: of the host's memory (B ran out of RAM, not of device memory): offload knobs, whose
        ``memory:`` hint is the device's, count in the opposite direction.
        """
        if self.active_keys(eff_a) != self.active_keys(eff_b):
            return False
        return all(k.at_least_as_hungry(eff_a[k.key], eff_b[k.key], host=host) for k in self.knobs)

    def identity(self, eff: dict) -> tuple:
        """What makes two trials the same config: effective values of knob and derived keys."""
        keys = sorted({k.key for k in self.knobs} | {d.key for d in self.derived})
        return tuple((k, repr(eff.get(k))) for k in keys)

    # ---- enumeration
    def _enumerate(self, knobs: list[Knob], base_flat: dict, limit: Optional[int]) -> Iterator[dict]:
        """Every assignment of ``knobs`` (respecting ``when``), as params dicts."""
        count = 0

        def rec(i: int, eff: dict, params: dict) -> Iterator[dict]:
            nonlocal count
            if limit is not None and count >= limit:
                return
            if i == len(knobs):
                count += 1
                yield dict(params)
                return
            knob = knobs[i]
            if not self.active(knob, eff):
                yield from rec(i + 1, eff, params)
                return
            for v in knob.domain():
                eff[knob.key] = v
                params[knob.key] = v
                yield from rec(i + 1, eff, params)
                del params[knob.key]
            eff[knob.key] = base_flat[knob.key]

        yield from rec(0, dict(base_flat), {})

    def grid(self, base_flat: dict, *, limit: Optional[int] = GRID_LIMIT) -> Iterator[Candidate]:
        """Every distinct config the space allows (conditions and constraints applied)."""
        for params in self._enumerate(self.knobs, base_flat, limit):
            cand = self.complete(params, base_flat)
            if cand.violated is None and cand.error is None:
                yield cand

    def _coupled(self) -> tuple[list[Knob], list[Knob]]:
        """Split knobs into those named by a condition/constraint/derived key (or conditional)
        and free ones, whose values multiply the count independently."""
        derived_names = {d.key: set(d.expr.names) | (d.when.names if d.when else set()) for d in self.derived}
        names: set[str] = set()
        for k in self.knobs:
            if k.when is not None:
                names |= k.when.names | {k.key}
        for c in self.constraints:
            names |= c.expr.names
        # names reached through derived keys
        frontier = set(names)
        while frontier:
            nxt = set()
            for n in frontier:
                for m in derived_names.get(n, ()):
                    if m not in names:
                        names.add(m)
                        nxt.add(m)
            frontier = nxt
        coupled = [k for k in self.knobs if k.key in names]
        free = [k for k in self.knobs if k.key not in names]
        return coupled, free

    def size(self, base_flat: dict, *, limit: int = GRID_LIMIT) -> int:
        """Number of distinct configs after conditions and constraints (capped at ``limit``+1)."""
        coupled, free = self._coupled()
        free_count = math.prod(k.domain_size() for k in free) if free else 1
        n = 0
        for params in self._enumerate(coupled, base_flat, None):
            cand = self.complete(params, base_flat)
            if cand.violated is None and cand.error is None:
                n += 1
                if n * free_count > limit:
                    return limit + 1
        return n * free_count

    def neighbours(self, eff: dict, base_flat: dict) -> list[Candidate]:
        """The configs one step from ``eff`` (a flat effective config of this space): one active knob moved
        one position in its ordered domain (a power of two: one exponent), or to another choice of an
        unordered categorical, the set of active knobs unchanged, the constraints kept (the configs at
        :func:`tuner.search.decide.distance` 1). For a space too large to enumerate, where random draws would
        rarely land next to a given config."""
        active = self.active_keys(eff)
        params = {k.key: eff[k.key] for k in self.knobs if k.key in active}
        out = []
        for knob in self.knobs:
            if knob.key not in active:
                continue
            domain, value = knob.domain(), params[knob.key]
            at = [j for j, v in enumerate(domain) if type(v) is type(value) and v == value]
            if not at:
                continue  # a value outside the domain (the base config's): no position to step from
            i = at[0]
            unordered = knob.type == "categorical" and knob.exponents is None
            steps = (
                [j for j in range(len(domain)) if j != i]
                if unordered
                else [j for j in (i - 1, i + 1) if 0 <= j < len(domain)]
            )
            for j in steps:
                moved = {**params, knob.key: domain[j]}
                if self.active_keys({**base_flat, **moved}) != active:
                    continue  # the step switches other knobs on or off: further than one step
                cand = self.complete(moved, base_flat)
                if cand.violated is None and cand.error is None:
                    out.append(cand)
        return out

    def expected_speed(self, eff_from: dict, eff_to: dict) -> int:
        """The knobs' ``speed`` hints on a move from one flat effective config to another: +1 for each
        knob moved the way its hint expects to be faster, -1 for each moved the other way (0: no hint, or
        a knob not ordered the same in both). A prior, not a measurement: local steps try first the
        neighbours it favours (:meth:`tuner.search.loop.Search._unmeasured_neighbour`)."""
        score = 0
        for knob in self.knobs:
            if knob.speed == "none" or knob.key not in eff_from or knob.key not in eff_to:
                continue
            try:
                a, b = knob.rank(eff_from[knob.key]), knob.rank(eff_to[knob.key])
            except KeyError:
                continue
            if a != b:
                score += 1 if (b > a) == (knob.speed == "increasing") else -1
        return score

    def sample(self, base_flat: dict, rng: random.Random, *, tries: int = 2000) -> Optional[Candidate]:
        """A uniformly drawn knob assignment that satisfies the constraints (rejection sampling)."""
        for _ in range(tries):
            eff = dict(base_flat)
            params = {}
            for knob in self.knobs:
                if not self.active(knob, eff):
                    continue
                v = rng.choice(knob.domain())
                params[knob.key] = v
                eff[knob.key] = v
            cand = self.complete(params, base_flat)
            if cand.violated is None and cand.error is None:
                return cand
        return None

    # ---- validation against a base config
    def validate(self, base_flat: dict, *, sample: int = 64, seed: int = 0) -> dict:
        """Check the space against a base config (flat, validated, world size applied).

        Raises :class:`SpaceError` (one line, naming the key) when a knob value has the
        wrong type for its key, an expression cannot be evaluated, no configuration
        satisfies the constraints, or the trainer config refuses every sampled config.
        Returns ``{"size", "sampled", "accepted", "first_refusal"}``.
        """
        for knob in self.knobs:
            for v in knob.domain() if knob.domain_size() <= 64 else [knob.low, knob.high]:
                try:
                    config_from_dict(unflatten({**base_flat, knob.key: v}), validate=False)
                except ValueError as e:
                    raise self._err(knob.key, f"value {v!r} does not fit the config key: {e}") from None
        for knob in self.knobs:
            if knob.when is not None:
                try:
                    _truthy(knob.when(_Resolver(base_flat)), "when")
                except ExprError as e:
                    raise self._err(f"{knob.key}.when", str(e)) from None
        probe = self.baseline_values(base_flat)
        for knob in self.knobs:  # fill every knob so derived/constraints see a value of each
            probe.setdefault(knob.key, knob.domain()[0] if knob.domain_size() else base_flat[knob.key])
        for d in self.derived:
            try:
                d.expr(_Resolver({**base_flat, **probe}))
            except ExprError as e:
                raise self._err(d.key, str(e)) from None
        for c in self.constraints:
            try:
                _truthy(c.expr(_Resolver({**base_flat, **probe})), c.label)
            except ExprError as e:
                raise self._err(c.label, str(e)) from None

        size = self.size(base_flat)
        if size == 0:
            raise self._err(*self._why_empty(base_flat))
        rng = random.Random(seed)
        accepted, first_refusal = 0, None
        seen = set()
        for _ in range(sample):
            cand = self.sample(base_flat, rng)
            if cand is None:
                break
            ident = self.identity(cand.effective)
            if ident in seen:
                continue
            seen.add(ident)
            try:
                config_from_dict(unflatten(cand.effective))
                accepted += 1
            except ValueError as e:
                first_refusal = first_refusal or e
        if seen and accepted == 0:
            key = getattr(first_refusal, "key", "knobs")
            raise self._err(key, f"the trainer config refuses every sampled configuration: {first_refusal}")
        return {
            "size": size,
            "sampled": len(seen),
            "accepted": accepted,
            "first_refusal": str(first_refusal) if first_refusal else None,
        }

    def _why_empty(self, base_flat: dict) -> tuple[str, str]:
        """Name the constraint that is never satisfied (alone), else all of them."""
        coupled, _ = self._coupled()
        assignments = list(self._enumerate(coupled, base_flat, 100_000))
        for c in self.constraints:
            alone = Space(knobs=self.knobs, derived=self.derived, constraints=[c], source=self.source)
            if not any(alone.complete(p, base_flat).violated is None for p in assignments):
                return c.label, f"no configuration satisfies {c.expr.text!r}"
        for p in assignments:
            cand = self.complete(p, base_flat)
            if cand.error:
                return "constraints", cand.error
        return "constraints", "no configuration satisfies all constraints together: " + "; ".join(
            c.expr.text for c in self.constraints
        )


# --------------------------------------------------------------------------- loading
def _num(spec: dict, name: str, key: str, source: Optional[str], *, kind: type = int) -> Any:
    if name not in spec:
        raise SpaceError(f"{key}.{name}", "missing", source=source)
    v = spec[name]
    ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise SpaceError(f"{key}.{name}", f"expected {kind.__name__}, got {v!r}", source=source)
    return v


def _parse_knob(key: str, spec: Any, source: Optional[str]) -> Knob:
    def err(k: str, msg: str) -> SpaceError:
        return SpaceError(k, msg, source=source)

    if key not in CONFIG_KEYS:
        raise err(key, "unknown knob key (not a key of trainer.config.PPOConfig)")
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        raise err(key, f"a knob must be a mapping with a type, got {spec!r}")
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
    when = None
    if spec.get("when") is not None:
        try:
            when = Expr(spec["when"])
        except ExprError as e:
            raise err(f"{key}.when", str(e)) from None
        for name in when.names:
            if name == key:
                raise err(f"{key}.when", "a knob's condition cannot name the knob itself")
            if name not in CONFIG_KEYS:
                raise err(f"{key}.when", f"unknown key {name!r} (not a key of trainer.config.PPOConfig)")
    kw: dict = {"key": key, "type": typ, "memory": memory, "speed": speed, "when": when}
    if typ in ("int", "float"):
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
            raise err(f"{key}.step", f"must be a positive {kind.__name__}, got {step!r}")
        if low > high:
            raise err(f"{key}.low", f"low={low} is above high={high}")
        kw.update(low=low, high=high, step=step)
    elif typ == "pow2":
        low, high = _num(spec, "low", key, source), _num(spec, "high", key, source)
        for name, v in (("low", low), ("high", high)):
            if not _is_pow2(v):
                raise err(f"{key}.{name}", f"must be a power of two, got {v}")
        if low > high:
            raise err(f"{key}.low", f"low={low} is above high={high}")
        values = []
        v = low
        while v <= high:
            values.append(v)
            v *= 2
        kw.update(low=low, high=high, choices=tuple(values), order=tuple(values))
    elif typ == "bool":
        kw.update(choices=(False, True), order=(False, True))
    else:
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise err(f"{key}.choices", "must be a non-empty list")
        for c in choices:
            if not (isinstance(c, (str, int, float, bool)) or c is None):
                raise err(f"{key}.choices", f"choices must be scalars, got {c!r}")
        if len({(type(c), c) for c in choices}) != len(choices):
            raise err(f"{key}.choices", "duplicate choice")
        order = spec.get("order", choices)
        if not isinstance(order, list) or sorted(map(repr, order)) != sorted(map(repr, choices)):
            raise err(f"{key}.order", "must list exactly the choices, least memory-hungry first")
        kw.update(choices=tuple(choices), order=tuple(order))
    return Knob(**kw)


def _decimals(step: float) -> int:
    """Decimal places of a step as written (0.2 -> 1, 0.05 -> 2, 1 -> 0)."""
    text = repr(float(step))
    return 0 if "e" in text or text.endswith(".0") else len(text.split(".")[1])


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
    def err(k: str, msg: str) -> SpaceError:
        return SpaceError(k, msg, source=source)

    if raw is None:
        raise err("knobs", "empty space: the file defines no knobs")
    if not isinstance(raw, dict):
        raise err("<root>", "a space must be a mapping with a `knobs` section")
    for k in raw:
        if k not in _TOP_KEYS:
            raise err(str(k), f"unknown section (allowed: {list(_TOP_KEYS)})")
    knobs_raw = raw.get("knobs")
    if not knobs_raw:
        raise err("knobs", "empty space: no knobs")
    if not isinstance(knobs_raw, dict):
        raise err("knobs", "must be a mapping of dotted config key -> knob spec")
    knobs: list[Knob] = []
    for key, spec in knobs_raw.items():
        knob = _parse_knob(str(key), spec, source)
        if knob.when is not None:
            later = [k for k in knobs_raw if k not in [x.key for x in knobs] and k != key]
            for name in knob.when.names:
                if name in later:
                    raise err(f"{key}.when", f"names knob {name!r}, which comes later; list it first")
        knobs.append(knob)
    knob_keys = {k.key for k in knobs}

    derived: list[Derived] = []
    derived_raw = raw.get("derived") or {}
    if not isinstance(derived_raw, dict):
        raise err("derived", "must be a mapping of dotted config key -> expression")
    for key, spec in derived_raw.items():
        key = str(key)
        if key not in CONFIG_KEYS:
            raise err(key, "unknown derived key (not a key of trainer.config.PPOConfig)")
        if key in knob_keys:
            raise err(key, "a key cannot be both a knob and derived")
        when_text = None
        if isinstance(spec, dict):
            extra = set(spec) - {"expr", "when"}
            if extra or "expr" not in spec:
                raise err(key, "a derived key is an expression or {expr: ..., when: ...}")
            when_text, spec = spec.get("when"), spec["expr"]
        try:
            expr = Expr(spec)
            when = Expr(when_text) if when_text is not None else None
        except ExprError as e:
            raise err(key, str(e)) from None
        for name in expr.names | (when.names if when else set()):
            if name not in CONFIG_KEYS:
                raise err(key, f"unknown key {name!r} in {spec!r} (not a key of trainer.config.PPOConfig)")
        derived.append(Derived(key=key, expr=expr, when=when))
    derived_keys = {d.key for d in derived}
    fixed_raw = raw.get("fixed") or {}
    if not isinstance(fixed_raw, dict):
        raise err("fixed", "must be a mapping of dotted config key -> value")
    fixed = {}
    for key, value in fixed_raw.items():
        key = str(key)
        if key not in CONFIG_KEYS:
            raise err(key, "unknown fixed key (not a key of trainer.config.PPOConfig)")
        if key in knob_keys or key in derived_keys:
            raise err(key, "a fixed key cannot also be a knob or derived")
        fixed[key] = value
    for knob in knobs:
        if knob.when is not None and knob.when.names & derived_keys:
            raise err(f"{knob.key}.when", "a condition may not name a derived key")

    constraints: list[Constraint] = []
    cons_raw = raw.get("constraints") or []
    if not isinstance(cons_raw, list):
        raise err("constraints", "must be a list of expressions")
    for i, text in enumerate(cons_raw):
        label = f"constraints[{i}]"
        try:
            expr = Expr(text)
        except ExprError as e:
            raise err(label, str(e)) from None
        for name in expr.names:
            if name not in CONFIG_KEYS:
                raise err(label, f"unknown key {name!r} in {expr.text!r} (not a key of trainer.config.PPOConfig)")
        constraints.append(Constraint(index=i, expr=expr))
    return Space(
        knobs=knobs,
        derived=derived,
        constraints=constraints,
        fixed=fixed,
        source=source,
        raw=raw,
        description=str(raw.get("description") or ""),
    )


def base_flat_config(
    base_path: Optional[str | Path], *, nproc: Optional[int] = None, extra: Optional[dict] = None
) -> tuple[dict, dict]:
    """Load and validate a base config (world size set to ``nproc``) -> (nested, flat)."""
    from trainer.config import load_config

    overrides = dict(extra or {})
    if nproc is not None:
        overrides["trainer.n_gpus_per_node"] = nproc
    cfg = load_config(base_path, overrides or None)
    nested = config_to_dict(cfg)
    return nested, flatten(nested)
