"""Multi-fidelity: what a trial is told about the study so it can stop measuring early.

A trial screens itself: after ``ppotune.min_measured_steps`` it stops once its throughput interval
is tight (``ppotune.precision``) or once a point the study already measured beats it for sure at no
more memory (``ppotune.front``; the rule is :func:`trainer.summary.measuring_done`). Only candidates
that can still be on the Pareto front are measured to the end. This module picks those points:
pure functions over the study's finished trials.
"""

from __future__ import annotations

import copy
from typing import Iterable

from optuna.trial import FrozenTrial, TrialState

from trainer.contracts import Status, TrialRecord

__all__ = ["front_points", "with_front"]


def front_points(trials: Iterable[FrozenTrial]) -> list[list[float]]:
    """``[trial, throughput low, peak GB]`` of the measured, feasible trials no other one beats.

    "Low" is the lower end of the trial's 90% interval (its median when it has none): a trial is
    pruned only by a point that is better for sure, not by one lucky step."""
    points = []
    for t in trials:
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if t.state != TrialState.COMPLETE or rec.status != Status.OK or rec.throughput is None:
            continue
        if rec.peak_memory_gb is None or (rec.constraint is not None and rec.constraint > 0):
            continue
        low = rec.throughput_ci[0] if rec.throughput_ci else rec.throughput
        points.append([t.number, float(low), float(rec.peak_memory_gb)])
    front = []
    for p in points:
        beaten = any(q is not p and q[1] >= p[1] and q[2] <= p[2] and (q[1], q[2]) != (p[1], p[2]) for q in points)
        if not beaten:
            front.append(p)
    return sorted(front, key=lambda p: -p[1])


def with_front(config: dict, front: list) -> dict:
    """The nested trial config with ``ppotune.front`` set (a copy)."""
    out = copy.deepcopy(config)
    out.setdefault("ppotune", {})["front"] = [list(p) for p in front]
    return out
