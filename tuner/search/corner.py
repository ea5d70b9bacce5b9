"""The speed hints' corner: what the search tries right after the baseline, and its walk down to a config that fits.

The per-GPU knobs' fastest config is, on every grid recorded so far, where the knobs' ``speed`` hints point (dynamic
batch size and remove-padding on, checkpointing off, the token budget high) as far as memory allows: the hints are
physics (a recomputed forward is slower than none, padding is wasted work). So before TPE's start-up trials the
search launches the **corner**, the config every hint calls fastest (:func:`hint_position` highest; ties in the
seeded grid order; a space too large to enumerate: :func:`built_corner`, knob by knob). While it, or the walk's
last config, runs out of memory (or an OOM rules it out, or the memory model refuses it), the next is one step
**strictly less memory-hungry** (:meth:`tuner.space.Space.at_least_as_hungry` one way only: a knob without a memory
order never moves), the step that gives up the least of the hints' speed first (a knob's position is normalized by
its levels: one notch down a 7-level token budget costs less than turning checkpointing on). The walk ends at the
first config besides the baseline that runs, after :data:`CORNER_LAUNCHES` launches, or where no step is left; then
TPE and the local steps take over from an incumbent that is already near the hints' best.

Stateless: the walk is read back from the study (every trial after the baseline's, until one runs; a study with no
baseline trial, from its first), so a resumed search or another process continues it rather than restarting it.
Pure: reads the study's trials and the space, launches nothing (the policy enqueues the point). Measured against
the search without it in benchmarks/README.md, "The search on grids it was never tuned on".
"""

from __future__ import annotations

from typing import Any, Optional

from trainer.contracts import Status, TrialRecord
from tuner.rules import candidates as decide
from tuner.space import Candidate, Space

__all__ = ["CORNER_LAUNCHES", "hint_position", "corner_of", "built_corner", "corner_step"]

#: launches after the baseline the walk may spend before TPE takes over (a token budget's levels down from the top)
CORNER_LAUNCHES = 6


def hint_position(space: Space, params: dict) -> float:
    """How far toward the fast end of each knob's ``speed`` hint ``params`` sit, summed over the hinted knobs among
    ``params`` (each 0 at the slow end, 1 at the fast end, linear in the knob's memory/speed order in between)."""
    total = 0.0
    for knob in space.knobs:
        if knob.speed == "none" or knob.key not in params:
            continue
        domain = knob.domain()  # ascending in the knob's order: its ends are the lowest and highest rank
        lo, hi = knob.rank(domain[0]), knob.rank(domain[-1])
        if hi == lo:
            continue
        x = (knob.rank(params[knob.key]) - lo) / (hi - lo)
        total += x if knob.speed == "increasing" else 1.0 - x
    return total


def corner_of(space: Space, grid: list) -> Optional[Candidate]:
    """The config of ``grid`` (``[(identity, Candidate)]`` in the seeded order) the hints call fastest, the first in
    that order among equals; None when no knob has a hint."""
    if all(k.speed == "none" for k in space.knobs) or not grid:
        return None
    best, top = None, -1.0
    for _, cand in grid:
        x = hint_position(space, cand.params)
        if x > top:
            best, top = cand, x
    return best


def built_corner(space: Space, trial_flat: dict) -> Optional[Candidate]:
    """The corner of a space too large to enumerate, built knob by knob in the space's order: each active knob at the
    fast end of its hint (an unhinted knob at the base config's value, else its first), the next value toward the
    slow end where a constraint refuses it; None when no knob has a hint or no value of a knob passes."""
    if all(k.speed == "none" for k in space.knobs):
        return None
    params: dict = {}
    eff = dict(trial_flat)
    for knob in space.knobs:
        if not space.active(knob, eff):
            continue
        for value in _preference(knob, trial_flat):
            cand = space.complete({**params, knob.key: value}, trial_flat)
            if cand.violated is None and cand.error is None:
                params, eff = cand.params, cand.effective
                break
        else:
            return None
    return space.complete(params, trial_flat)


def _preference(knob: Any, trial_flat: dict) -> list:
    """``knob``'s values, the fast end of its hint first (no hint: the base config's value first, then its order)."""
    domain = knob.domain()
    if knob.speed == "none":
        base = [v for v in domain if type(v) is type(trial_flat.get(knob.key)) and v == trial_flat.get(knob.key)]
        return base + [v for v in domain if v not in base]
    ordered = sorted(domain, key=knob.rank)
    return ordered[::-1] if knob.speed == "increasing" else ordered


def corner_step(policy: Any, trials: list, known: dict) -> Optional[Candidate]:
    """The walk's next config given the study's ``trials`` and ``known`` (:func:`tuner.rules.candidates.known_configs`),
    or None when the walk is over (or not yet: the baseline first; or never: no hint).
    ``policy``: the :class:`tuner.search.policy.ProposalPolicy` (its seeded grid order and cached corner)."""
    space, flat = policy.space, policy.trial_flat
    records = [TrialRecord.from_user_attrs(t.user_attrs) for t in sorted(trials, key=lambda t: t.number)]
    start = next((i for i, r in enumerate(records) if r.baseline), -1)  # a study with no baseline: from its start
    if start >= 0 and records[start].status is None:
        return None  # the baseline first
    after = [r for r in records[start + 1 :] if r.confirm_of is None]
    if any(r.status == Status.OK for r in after):
        return None
    if sum(1 for r in after if r.status is not None and r.status.launched) >= CORNER_LAUNCHES:
        return None
    here = policy.corner()
    if here is None:
        return None
    seen = decide.seen_configs(trials, space, flat)
    evidence = decide.oom_evidence(known, space, flat)
    if policy.enumerable():
        rank = policy.grid_rank()

        def order(c: Candidate) -> Any:
            return -rank.get(space.identity(c.effective), 0)
    else:  # no grid to rank by (it would be enumerated): a fixed order of the configs themselves

        def order(c: Candidate) -> Any:
            return tuple(reversed(space.identity(c.effective)))

    # each step is strictly less hungry, so the walk is at most every knob's levels long
    for _ in range(1 + sum(k.domain_size() for k in space.knobs)):
        ident = space.identity(here.effective)
        ran = known.get(ident)
        if ran is not None and TrialRecord.from_user_attrs(ran.user_attrs).status == Status.OK:
            return None  # a config on the walk fits (the baseline is the corner, say): nothing to walk down from
        if ident not in seen and not evidence.rulers(here.effective, space):
            return here
        down = [
            c
            for c in space.neighbours(here.effective, flat)
            if space.at_least_as_hungry(here.effective, c.effective)
            and not space.at_least_as_hungry(c.effective, here.effective)
        ]
        if not down:
            return None
        here = max(down, key=lambda c: (hint_position(space, c.params), order(c)))
    return None
