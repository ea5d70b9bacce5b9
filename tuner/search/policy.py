"""Which config the search tries next: the sampler, local steps, the grid order, and the search's own proposals.

Optuna's sampler proposes by default. Before it is asked, :meth:`ProposalPolicy.pick` may put a config of its own
in the study's queue (Optuna then pops that one first):

* ``--sampler grid``: the next unmeasured config of the space, in an order the seed fixes (Optuna's GridSampler
  cannot do conditional knobs);
* the speed hints' corner (TPE, right after the baseline): the config every knob's hint calls fastest, then down
  its memory-hungry knobs while it runs out of memory (:func:`tuner.search.corner.corner_step`);
* a local step (TPE, every ``--local-every``-th launched trial after its random start-up): the unmeasured config
  one ordered step from the best measured one, the knobs' ``speed`` hints first;
* a config it proposes itself once the sampler stalls (:data:`tuner.search.stall.STALL_AFTER` proposals in a row
  rejected before launch, or every config in the study): :func:`tuner.search.stall.propose_itself`;

or say that there is nothing left to try (every config measured or ruled out). The policy never launches or tells
anything: it reads the study's trials and the space, and answers with a :class:`Pick`.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import optuna

from trainer.contracts import TrialRecord
from tuner.rules import candidates as decide
from tuner.search.corner import built_corner, corner_of, corner_step
from tuner.search.stall import STALL_AFTER, propose_itself
from tuner.space import Candidate, Space

__all__ = [
    "SAMPLERS",
    "ENUMERATE_BELOW",
    "build_sampler",
    "startup_trials",
    "Pick",
    "ProposalPolicy",
]

SAMPLERS = ("tpe", "nsga2", "random", "grid")
ENUMERATE_BELOW = 100_000  # spaces up to this size are explored by enumeration, larger ones by sampling
RANDOM_DRAWS = 200  # a space too large to enumerate: draws per look for a config outside the study


def build_sampler(
    name: str, *, seed: Optional[int], n_trials: int, startup: Optional[int] = None
) -> optuna.samplers.BaseSampler:
    """Optuna's sampler for ``--sampler name`` and a ``--trials n_trials`` search (``startup``: TPE's random
    start-up trials, when not the rule below: benchmarks/bench_search.py's ``--startup``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # Random start-up trials: a tenth of the budget, 3 to 10 (Optuna's default 10 would be the whole of a
            # short search). The local steps take over from them sooner (see docs/decisions.md#tpe-startup).
            return optuna.samplers.TPESampler(
                seed=seed,
                n_startup_trials=max(3, min(10, n_trials // 10)) if startup is None else startup,
                multivariate=True,
                group=True,
                constant_liar=True,
            )
        if name == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(50, n_trials // 3)))
        # grid: the tuner enqueues grid points itself (GridSampler cannot do conditional knobs)
        return optuna.samplers.RandomSampler(seed=seed)


def startup_trials(sampler: optuna.samplers.BaseSampler) -> int:
    """TPE's random start-up trials (0 for any other sampler). TPE has no public getter for it."""
    return getattr(sampler, "_n_startup_trials", 0)


@dataclass(frozen=True)
class Pick:
    """What to do before the sampler is asked: enqueue ``point``, or stop for ``stop``; neither: the sampler
    proposes. ``rule``: which rule chose the point (corner, local, neighbour, boundary, seeded, grid);
    ``launch_anyway``: a boundary config the judge launches although one OOM rules it out
    (:func:`tuner.rules.candidates.ruling_oom`)."""

    point: Optional[Candidate] = None
    stop: Optional[str] = None
    rule: Optional[str] = None
    launch_anyway: bool = False


class ProposalPolicy:
    """The proposal rules of one search process over one space (its grid order and draws fixed by ``seed``)."""

    def __init__(
        self,
        space: Space,
        trial_flat: dict,
        *,
        sampler: str,
        seed: Optional[int],
        local_every: int,
        serialized: bool,
        corner: bool = True,
    ):
        self.space = space
        self.trial_flat = trial_flat
        self.sampler = sampler
        self.seed = seed
        self.local_every = local_every
        self.corner_first = corner
        # local steps need asks serialized across workers: without a cross-process lock (the gRPC proxy, MySQL)
        # two workers could enqueue the same neighbour at once and both run it
        self.serialized = serialized
        self._rng = random.Random(seed)
        self._grid: Optional[list] = None
        self._rank: Optional[dict] = None  # identity -> position in the shuffled grid (local steps break ties by it)
        self._size: Optional[int] = None
        self._corner: Optional[list] = None  # [the corner] once computed (None inside: no hint, or no grid)

    def pick(self, trials: list, *, known: dict, startup: int, stalled: int) -> Pick:
        """The policy's move given the study's ``trials`` (none WAITING), ``known`` (:func:`decide.known_configs`),
        TPE's ``startup`` trials and the proposals ``stalled`` in a row (rejected before launch)."""
        seen = decide.seen_configs(trials, self.space, self.trial_flat)
        if self.sampler == "grid":
            point = self.unmeasured(seen)
            if point is None:
                return Pick(stop=f"every one of the {self.space_size()} configs of the space is in the study")
            return Pick(point=point, rule="grid")
        if self.corner_first and self.steps_locally():
            point = corner_step(self, trials, known)
            if point is not None:
                return Pick(point=point, rule="corner")
        if self.local_turn(trials, startup):
            # an inferred OOM one step from the incumbent is revisited: launched once (decide.ruling_oom)
            held = seen - decide.inferred_only(trials, self.space, self.trial_flat)
            point = self.unmeasured_neighbour(held, decide.incumbent(known, self.trial_flat))
            if point is not None:
                return Pick(point=point, rule="local")
        if stalled >= STALL_AFTER or self.exhausted(seen):
            got = propose_itself(self, trials, known)
            return Pick(point=got.point, stop=got.stop, rule=got.rule, launch_anyway=got.launch_anyway)
        return Pick()

    def enumerable(self) -> bool:
        return self.space_size() <= ENUMERATE_BELOW

    def space_size(self) -> int:
        if self._size is None:
            self._size = self.space.size(self.trial_flat, limit=ENUMERATE_BELOW)
        return self._size

    def local_turn(self, trials: list, startup: int) -> bool:
        """Is this proposal a local step (the incumbent's nearest unmeasured neighbour) rather than the
        sampler's? Every ``local_every``-th launched trial once TPE's random start-up is done.

        TPE models "good" vs "bad" regions from noisy single measurements and, multi-objective, spreads its
        proposals over the whole Pareto front; the per-GPU knobs' landscape is mostly monotone in each
        knob's order, so one notch from the fastest config is often faster still; alternating the two, the
        ``speed`` hints' steps first, reaches the best sooner (see docs/decisions.md#local-steps)."""
        every = self.local_every
        if every <= 0 or not self.steps_locally():
            return False
        records = (TrialRecord.from_user_attrs(t.user_attrs) for t in trials)
        launched = sum(1 for r in records if r.status is not None and r.status.launched)
        return launched >= startup and (launched - startup) % every == every - 1

    def steps_locally(self) -> bool:
        """Do the search's own steps (the corner's walk, local steps) run here? TPE only, and only where asks are
        serialized across workers: without a cross-process lock (the gRPC proxy, MySQL) two workers could enqueue
        the same config at once and both run it."""
        return self.sampler == "tpe" and self.serialized

    def corner(self) -> Optional[Candidate]:
        """The config the knobs' speed hints call fastest (:func:`tuner.search.corner.corner_of` over the seeded grid;
        a space too large to enumerate: :func:`tuner.search.corner.built_corner`; once); None when no knob has a
        hint."""
        if self._corner is None:
            grid = self.enumerable()
            corner = corner_of(self.space, self.shuffled_grid()) if grid else built_corner(self.space, self.trial_flat)
            self._corner = [corner]
        return self._corner[0]

    def unmeasured_neighbour(
        self, seen: set, near: Optional[dict], *, allowed: Optional[Callable[[Candidate], bool]] = None
    ) -> Optional[Candidate]:
        """A config one step from ``near`` (:meth:`tuner.space.Space.neighbours`: distance 1) not yet in the
        study: first those the knobs' ``speed`` hints expect to be faster (:meth:`tuner.space.Space.expected_speed`),
        among them the first in the seeded grid order (a space too large to enumerate: drawn at random among them);
        None when there is none (or no ``near``); ``allowed``: a further filter. Generated from ``near``,
        never by scanning the grid: a local turn runs under the study lock, and a scan of a 100k-config grid
        for each one took seconds there (benchmarks/bench_storage.py)."""
        if near is None:
            return None
        steps = self.space.neighbours(near, self.trial_flat)
        steps = [c for c in steps if self.space.identity(c.effective) not in seen and (allowed is None or allowed(c))]
        if not steps:
            return None
        # the knobs' speed hints first (a step the space expects to be faster), then the seeded grid order
        speed = {id(c): self.space.expected_speed(near, c.effective) for c in steps}
        if self.space_size() <= ENUMERATE_BELOW:
            rank = self.grid_rank()
            return min(steps, key=lambda c: (-speed[id(c)], rank.get(self.space.identity(c.effective), len(rank))))
        best = max(speed.values())
        return self._rng.choice([c for c in steps if speed[id(c)] == best])

    def shuffled_grid(self) -> list:
        """``[(identity, Candidate)]``: the space's configs in an order fixed by the seed (built once)."""
        if self._grid is None:
            grid = list(self.space.grid(self.trial_flat))
            random.Random(self.seed).shuffle(grid)
            self._grid = [(self.space.identity(c.effective), c) for c in grid]
        return self._grid

    def grid_rank(self) -> dict:
        if self._rank is None:
            self._rank = {ident: i for i, (ident, _) in enumerate(self.shuffled_grid())}
        return self._rank

    def unmeasured(self, seen: set, *, allowed: Optional[Callable[[Candidate], bool]] = None) -> Optional[Candidate]:
        """The first config not yet in the study in the seeded grid order (a space too large to enumerate: random
        draws). ``seen``: :func:`tuner.rules.candidates.seen_configs` (rejected configs count as seen); ``allowed``: a
        further filter."""
        if self.enumerable():
            pool = (c for ident, c in self.shuffled_grid() if ident not in seen)
        else:
            drawn = (self.space.sample(self.trial_flat, self._rng) for _ in range(RANDOM_DRAWS))
            pool = (c for c in drawn if c is not None and self.space.identity(c.effective) not in seen)
        return next((c for c in pool if allowed is None or allowed(c)), None)

    def exhausted(self, seen: set) -> bool:
        """Is every config of the space in the study (measured, running, or rejected before launch)?"""
        size = self.space_size()
        if len(seen) < size:
            return False
        # seen may hold configs a space constraint refused (they are not in the grid): check the grid itself
        return size > ENUMERATE_BELOW or self.unmeasured(seen) is None
