"""A space's enumeration: every config it allows (``grid``), how many (``size``), the configs one step from a
given one (``neighbours``) and a random one (``sample``).

:class:`Enumeration` is mixed into :class:`tuner.space.model.Space`: its methods read the space's ``knobs``,
``derived`` and ``constraints`` and call its one-point methods (``active``, ``active_keys``, ``complete``).
"""

from __future__ import annotations

import math
import random
from typing import Iterator, Optional

from tuner.space.knob import Knob
from tuner.space.parts import Candidate

__all__ = ["GRID_LIMIT", "Enumeration"]

# Grid enumeration stops counting past this (``space check`` prints ">LIMIT").
GRID_LIMIT = 1_000_000


class Enumeration:
    """The enumeration methods of :class:`tuner.space.model.Space` (a mixin; see the module docstring)."""

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
        :func:`tuner.rules.candidates.distance` 1). For a space too large to enumerate, where random draws would
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
