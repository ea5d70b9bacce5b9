"""Optuna params <-> knob values: the encoding a study stores.

A knob whose values are exactly the powers of two ``2**lo .. 2**hi`` is suggested to Optuna as the
integer exponent ``lo .. hi`` under the param name ``log2:<dotted key>`` (:data:`LOG2_PREFIX`); every other
knob under its dotted key, as its value. :meth:`tuner.space.Knob.encode` goes one way, :func:`from_params`
the other (:func:`decode_trial` for a whole trial).
"""

from __future__ import annotations

import copy
from typing import Any, Optional

__all__ = ["LOG2_PREFIX", "is_pow2", "pow2_exponents", "from_params", "decode_trial"]

#: The Optuna param name of a power-of-two knob is this + its dotted key; its value is the exponent.
LOG2_PREFIX = "log2:"


def is_pow2(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


def pow2_exponents(values: tuple) -> Optional[tuple[int, int]]:
    if not values or not all(is_pow2(v) for v in values):
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
