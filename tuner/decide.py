"""What to do with a proposed config, decided without launching anything.

Pure functions over a :class:`tuner.space.Space`, the trial base config and the trials
already in the study (Optuna ``FrozenTrial`` records; tests build them with
``optuna.trial.create_trial``). Nothing here starts a process, opens a storage or asks a
sampler: :mod:`tuner.loop` does that and calls these.

* :func:`known_configs` -- which configs the study already holds, and the trial that measured each;
* :func:`judge` -- launch it, or record it at zero cost as ``invalid`` (space constraint or
  config validation), ``duplicate`` (already measured) or ``inferred_oom`` (at least as
  memory-hungry as a known OOM on every monotone knob);
* :func:`stop_reason` -- the budget: when a search process stops asking;
* :func:`over_budget` -- after an ``ask()`` taken without a cross-process lock: was the
  trial asked past the budget by a race with another worker?
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from optuna.trial import FrozenTrial, TrialState

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict
from trainer.contracts import Status, TrialRecord
from tuner.space import Candidate, Space

__all__ = ["Verdict", "known_configs", "judge", "counted", "count_progress", "stop_reason", "over_budget"]

_IN_STUDY = (TrialState.COMPLETE, TrialState.FAIL, TrialState.RUNNING)


@dataclass(frozen=True)
class Verdict:
    """The decision on one candidate. ``status`` None means: launch it."""

    status: Optional[Status] = None  # INVALID | DUPLICATE | INFERRED_OOM, or None to launch
    reason: Optional[str] = None  # one line, stored as the trial's ``error``
    source: Optional[int] = None  # DUPLICATE: the trial holding the measurement; INFERRED_OOM: the OOM
    config: Optional[dict] = None  # launch: the validated nested config the trial runs (parsed once, here)

    @property
    def launch(self) -> bool:
        return self.status is None


# --------------------------------------------------------------------------- the budget
def counted(t: FrozenTrial) -> bool:
    """Does this trial count toward ``--trials``? Finished or running trials, except interrupted
    ones (their retry counts), duplicates (never run) and ``--confirm`` re-runs."""
    return t.state in _IN_STUDY and TrialRecord.from_user_attrs(t.user_attrs).counted


def count_progress(trials: Iterable[FrozenTrial]) -> int:
    return sum(1 for t in trials if counted(t))


def stop_reason(
    trials: list[FrozenTrial],
    *,
    budget: int,
    elapsed_s: float,
    timeout_s: Optional[float],
    free_in_a_row: int,
    max_free_in_a_row: int,
) -> Optional[str]:
    """Why this search process should ask no more trials (None: go on)."""
    if count_progress(trials) >= budget:
        return f"the study holds {budget} counted trials"
    if timeout_s is not None and elapsed_s > timeout_s:
        return f"--timeout {timeout_s:g} s reached"
    if free_in_a_row >= max_free_in_a_row:
        return f"the sampler proposed {max_free_in_a_row} already-measured configs in a row"
    return None


def over_budget(trials: Iterable[FrozenTrial], number: int, *, budget: int) -> bool:
    """Was trial ``number`` (just asked, RUNNING) asked past ``budget`` by a race with another worker?

    For storages with no cross-process lock (the gRPC proxy, MySQL). The storage numbers trials
    in creation order under its own lock (a row lock on the study in an RDB), so the trials
    numbered below ours existed when ours was made. Ours is over the budget when ``budget`` of
    them count or may still count: counted ones (running or finished) and waiting ones that
    will count once popped (an enqueued retry holds its slot). A trial that was uncounted at
    the check (interrupted, duplicate, over budget, a ``--confirm`` re-run) never counts later;
    a waiting one does, and it is included. So every counted trial saw fewer than ``budget``
    counted-or-reserved trials below it: the counted total never exceeds ``budget``.
    """
    below = 0
    for t in trials:
        if t.number >= number:
            continue
        if counted(t) or (t.state == TrialState.WAITING and TrialRecord.from_user_attrs(t.user_attrs).counted):
            below += 1
    return below >= budget


# --------------------------------------------------------------------------- the study's configs
def effective_of(t: FrozenTrial, trial_flat: dict) -> Optional[dict]:
    """The flat effective config a trial ran (the trial base + its recorded overrides)."""
    overrides = TrialRecord.from_user_attrs(t.user_attrs).overrides
    return None if not isinstance(overrides, dict) else {**trial_flat, **overrides}


def known_configs(trials: Iterable[FrozenTrial], space: Space, trial_flat: dict) -> dict[tuple, FrozenTrial]:
    """Config identity -> the trial that measured it (a finished one first, else a running one).

    Interrupted trials, duplicates and ``--confirm`` re-runs are not measurements of their own."""
    known: dict[tuple, FrozenTrial] = {}
    for t in trials:
        if not counted(t):
            continue
        eff = effective_of(t, trial_flat)
        if eff is None:
            continue
        ident = space.identity(eff)
        prev = known.get(ident)
        if prev is None or (prev.state == TrialState.RUNNING and t.state != TrialState.RUNNING):
            known[ident] = t
    return known


# --------------------------------------------------------------------------- one candidate
def judge(
    cand: Candidate,
    *,
    number: int,
    space: Space,
    trial_base: dict,
    trial_flat: dict,
    known: dict[tuple, FrozenTrial],
    is_confirm: bool = False,
) -> Verdict:
    """Launch ``cand`` (trial ``number``) or record it at zero cost; see the module docstring.

    A ``--confirm`` re-run is checked for validity only: it repeats a measured config on purpose.
    """
    if cand.error:
        return Verdict(Status.INVALID, f"space: {cand.error}")
    if cand.violated:
        return Verdict(Status.INVALID, f"space: constraint not satisfied: {cand.violated}")
    try:
        config = config_to_dict(config_from_dict(apply_overrides(trial_base, cand.overrides)))
    except ConfigError as e:
        return Verdict(Status.INVALID, f"config: {e}")
    if is_confirm:
        return Verdict(config=config)
    prev = known.get(space.identity(cand.effective))
    if prev is not None and prev.number != number:
        rec = TrialRecord.from_user_attrs(prev.user_attrs)
        what = rec.status or prev.state.name.lower()
        return Verdict(
            Status.DUPLICATE,
            f"duplicate: the sampler proposed the config of trial {prev.number} ({what}); not run",
            source=prev.number,
        )
    for t in known.values():
        if t.state != TrialState.COMPLETE or TrialRecord.from_user_attrs(t.user_attrs).status != Status.OOM:
            continue
        eff = effective_of(t, trial_flat)
        if eff is not None and space.at_least_as_hungry(cand.effective, eff):
            return Verdict(
                Status.INFERRED_OOM,
                f"inferred OOM: at least as memory-hungry as trial {t.number} "
                "(an OOM) on every monotone knob; not launched",
                source=t.number,
            )
    return Verdict(config=config)
