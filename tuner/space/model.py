"""The :class:`Space`: knobs, derived keys, constraints and fixed keys, and what it answers about configs.

One point: is a knob active (``active``), knob values -> a :class:`~tuner.space.parts.Candidate` with derived keys
and constraints applied (``complete``), Optuna define-by-run (``suggest``), the baseline's values and params,
Optuna params (``to_params``, ``foreign_params``). Two configs: the inferred-OOM rule (``at_least_as_hungry``), what
makes two trials the same (``identity``), the ``speed`` prior of a move (``expected_speed``). Against a base config:
``validate``. The enumeration (``grid``, ``size``, ``neighbours``, ``sample``) is :mod:`tuner.space.grid`'s.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from trainer.config import config_from_dict, unflatten
from trainer.config.keys import absent_role
from tuner.space.expr import ExprError, Resolver, truthy
from tuner.space.grid import Enumeration
from tuner.space.keys import SpaceError
from tuner.space.knob import Knob
from tuner.space.parts import Candidate, Constraint, Derived
from tuner.space.registry import EXECUTION_KNOBS, longest_sequence, range_problem

__all__ = ["Space"]


@dataclass
class Space(Enumeration):
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
        """Whether ``knob`` is searched at ``eff``: its role is built (a critic knob drops out of a config with
        no critic, a reference-model knob out of one with no KL: :meth:`dropped`) and its ``when`` holds."""
        if absent_role(eff, knob.key) is not None:
            return False
        if knob.when is None:
            return True
        return truthy(knob.when(Resolver(eff)), f"{knob.key}.when")

    def dropped(self, base_flat: dict) -> list[tuple[str, str]]:
        """(knob, why) for each knob that acts on nothing with this base config: its role is not built."""
        found = [(k.key, absent_role(base_flat, k.key)) for k in self.knobs]
        return [(key, why) for key, why in found if why is not None]

    def complete(self, params: dict, base_flat: dict) -> Candidate:
        """Knob values -> overrides (with derived keys), checked against the constraints."""
        eff = dict(base_flat)
        eff.update(params)
        overrides = dict(params)
        cand = Candidate(params=dict(params), overrides=overrides, effective=eff)
        try:
            for d in self.derived:
                if d.when is not None and not truthy(d.when(Resolver(eff)), f"{d.key}.when"):
                    continue
                value = d.expr(Resolver(eff))
                if isinstance(value, float) and value.is_integer() and isinstance(base_flat.get(d.key), int):
                    value = int(value)
                eff[d.key] = value
                overrides[d.key] = value
            inactive = {k.key for k in self.knobs} - set(params)
            for c in self.constraints:
                if c.expr.names & inactive:
                    continue
                if not truthy(c.expr(Resolver(eff)), c.label):
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

    # ---- validation against a base config
    def validate(self, base_flat: dict, *, sample: int = 64, seed: int = 0) -> dict:
        """Check the space against a base config (flat, validated, world size applied).

        Raises :class:`SpaceError` (one line, naming the key) when a knob value has the
        wrong type for its key, a token budget the space may run is below the longest sequence the data
        admits, an expression cannot be evaluated, no configuration satisfies the constraints, or the
        trainer config refuses every sampled config.
        Returns ``{"size", "sampled", "accepted", "first_refusal"}``.
        """
        self._check_token_budgets(base_flat)
        for knob in self.knobs:
            for v in knob.domain() if knob.domain_size() <= 64 else [knob.low, knob.high]:
                try:
                    config_from_dict(unflatten({**base_flat, knob.key: v}), validate=False)
                except ValueError as e:
                    raise self._err(knob.key, f"value {v!r} does not fit the config key: {e}") from None
        for knob in self.knobs:
            if knob.when is not None:
                try:
                    truthy(knob.when(Resolver(base_flat)), "when")
                except ExprError as e:
                    raise self._err(f"{knob.key}.when", str(e)) from None
        probe = self.baseline_values(base_flat)
        for knob in self.knobs:  # fill every knob so derived/constraints see a value of each
            probe.setdefault(knob.key, knob.domain()[0] if knob.domain_size() else base_flat[knob.key])
        for d in self.derived:
            try:
                d.expr(Resolver({**base_flat, **probe}))
            except ExprError as e:
                raise self._err(d.key, str(e)) from None
        for c in self.constraints:
            try:
                truthy(c.expr(Resolver({**base_flat, **probe})), c.label)
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

    def _check_token_budgets(self, base_flat: dict) -> None:
        """A token-budget knob's values below the longest sequence the data admits must be ruled out by the space
        itself (a constraint over the knob and base-config keys only, as the shipped spaces have); else verl
        asserts on the first long batch: refused here, naming the knob."""
        longest = longest_sequence(base_flat)
        if longest is None:
            return
        others = {k.key for k in self.knobs} | {d.key for d in self.derived}
        for knob in self.knobs:
            if getattr(EXECUTION_KNOBS.get(knob.key), "kind", None) != "token_budget" or absent_role(
                base_flat, knob.key
            ):
                continue
            values = knob.domain() if knob.domain_size() <= 4096 else [knob.low]
            numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
            for v in (v for v in numbers if v < longest):
                eff = {**base_flat, knob.key: v}
                alone = [c for c in self.constraints if not c.expr.names & (others - {knob.key})]
                if not any(self._violated(c, eff) for c in alone):
                    raise self._err(
                        f"{knob.key}.low",
                        f"{range_problem(knob.key, v, longest=longest)}; raise low to {longest} or more, or add the "
                        f"constraint `{knob.key} >= data.max_prompt_length + data.max_response_length`",
                    )

    @staticmethod
    def _violated(c: Constraint, eff: dict) -> bool:
        try:
            return not truthy(c.expr(Resolver(eff)), c.label)
        except ExprError:
            return False  # validate() names the constraint that cannot be evaluated

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
