"""What a space holds besides its knobs, and one point of it: :class:`Derived` (a key set by an expression),
:class:`Constraint` (an expression every trial's config satisfies) and :class:`Candidate` (knob values resolved
against a base config: the overrides a trial sets, its effective config, the constraint it breaks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tuner.space.expr import Expr

__all__ = ["Derived", "Constraint", "Candidate"]


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
