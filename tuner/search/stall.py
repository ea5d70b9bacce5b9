"""When the sampler stalls: the configs the search proposes itself, and when nothing is left to propose.

TPE over a discrete space keeps proposing configs that are rejected before launch (measured already, inferred OOM,
invalid); a search that gave up after a run of them stopped with budget left and configs that fit never run. So
after :data:`STALL_AFTER` proposals in a row rejected before launch (or once every config is in the study), the
search proposes itself (:func:`propose_itself`), in this order:

1. ``neighbour``: an unmeasured neighbour (one ordered step, :meth:`tuner.space.Space.neighbours`) of the best
   measured configs, best first (:func:`tuner.rules.candidates.ranked_measured`); among one config's neighbours those
   the knobs' ``speed`` hints favour first, then the seeded grid order; a config an OOM rules out is skipped;
2. ``boundary``: a config at the learned memory boundary whose only evidence is one OOM: never launched, ruled out
   by exactly one OOM (:func:`tuner.rules.candidates.oom_evidence`), one step from a config that ran. It is launched
   (``launch_anyway``): near the cap an OOM is noisy, and if it fits, the OOM is contradicted;
3. ``seeded``: any other config not yet in the study and not ruled out, in the seeded grid order (a space too large
   to enumerate: random draws).

When none is left, every config of the space is measured or ruled out by evidence the search trusts (an OOM it
does not doubt, a refusal, a memory-model prediction beyond its error): the search stops and its stop line says so.
Pure: reads the study's trials and the space, launches nothing (the loop enqueues the point with Optuna's
``enqueue_trial``, so the sampler sees it as one of its own trials).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from trainer.contracts import Status
from tuner.rules import candidates as decide
from tuner.space import Candidate

__all__ = ["STALL_AFTER", "SelfProposal", "propose_itself"]

#: proposals in a row rejected before launch after which the search proposes itself instead of the sampler (a
#: duplicate streak of this length was the old exploration trigger; the family of simulated grids chose it:
#: benchmarks/README.md, "The search on grids it was never tuned on")
STALL_AFTER = 3


@dataclass(frozen=True)
class SelfProposal:
    """A config the search proposes itself (``rule``: neighbour, boundary or seeded), or why nothing is left."""

    point: Optional[Candidate] = None
    rule: Optional[str] = None
    launch_anyway: bool = False  # a boundary config: launched although one OOM rules it out
    stop: Optional[str] = None


def propose_itself(policy: Any, trials: list, known: dict) -> SelfProposal:
    """The next config the search proposes itself (see the module docstring). ``policy``: the
    :class:`tuner.search.policy.ProposalPolicy` whose orders (speed hints, seeded grid) break ties."""
    space, flat = policy.space, policy.trial_flat
    held: dict[tuple, set] = {}
    for ident, status in decide.held_configs(trials, space, flat):
        held.setdefault(ident, set()).add(status)
    evidence = decide.oom_evidence(known, space, flat)

    def open_(cand: Candidate) -> bool:
        """Never launched, not refused (an inference whose OOM a measurement has contradicted since is no refusal),
        and no OOM rules it out now."""
        ident = space.identity(cand.effective)
        if ident in known or not held.get(ident, set()) <= {Status.INFERRED_OOM}:
            return False
        return not evidence.rulers(cand.effective, space)

    ranked = [decide.effective_of(t, flat) for t in decide.ranked_measured(known)]
    for near in ranked:
        point = policy.unmeasured_neighbour(set(), near, allowed=open_)
        if point is not None:
            return SelfProposal(point, "neighbour")
    point = _boundary(policy, ranked, known, held, evidence)
    if point is not None:
        return SelfProposal(point, "boundary", launch_anyway=True)
    point = policy.unmeasured(set(), allowed=open_)
    if point is not None:
        return SelfProposal(point, "seeded")
    return SelfProposal(stop=_nothing_left(policy, known, held))


def _boundary(policy: Any, ranked: list, known: dict, held: dict, evidence: decide.OomEvidence) -> Optional[Candidate]:
    """A never-launched config one step from a config that ran (best first), ruled out by exactly one OOM."""
    space = policy.space

    def doubtful(cand: Candidate) -> bool:
        ident = space.identity(cand.effective)
        if ident in known or held.get(ident, {Status.INFERRED_OOM}) != {Status.INFERRED_OOM}:
            return False  # launched, or refused for another reason than an OOM
        return len(evidence.rulers(cand.effective, space)) == 1

    for near in ranked:
        point = policy.unmeasured_neighbour(set(), near, allowed=doubtful)
        if point is not None:
            return point
    return None


def _nothing_left(policy: Any, known: dict, held: dict) -> str:
    """The stop line when the search has nothing left to propose: what decided each config of the space."""
    if not policy.enumerable():
        return (
            f"no config outside the study found in random draws of a space too large to enumerate "
            f"({len(known)} launched)"
        )
    counts = {"launched": 0, "ruled out by an OOM": 0, "predicted OOM": 0, "invalid": 0}
    for ident, _ in policy.shuffled_grid():
        statuses = held.get(ident, set())
        if ident in known:
            counts["launched"] += 1
        elif Status.PREDICTED_OOM in statuses:
            counts["predicted OOM"] += 1
        elif Status.INVALID in statuses:
            counts["invalid"] += 1
        else:  # held as an inferred OOM, or never proposed: an OOM rules it out
            counts["ruled out by an OOM"] += 1
    parts = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    return f"every config of the space is measured or ruled out ({parts})"
