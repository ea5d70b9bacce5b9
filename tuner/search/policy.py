"""Which config the search tries next: the sampler, local steps, the grid order and exploration.

Optuna's sampler proposes by default. Before it is asked, :meth:`ProposalPolicy.pick` may put a config of its own
in the study's queue (Optuna then pops that one first):

* ``--sampler grid``: the next unmeasured config of the space, in an order the seed fixes (Optuna's GridSampler
  cannot do conditional knobs);
* a local step (TPE, every ``--local-every``-th launched trial after its random start-up): the unmeasured config
  one ordered step from the fastest measured one, the knobs' ``speed`` hints first;
* exploration, after :data:`EXPLORE_AFTER_DUPLICATES` duplicates in a row: the unmeasured config nearest the
  fastest measured one (the sampler is stuck on measured configs);

or say that there is nothing left to try. The policy never launches or tells anything: it reads the study's
trials and the space, and answers with a :class:`Pick`.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import optuna

from trainer.contracts import TrialRecord
from tuner.search import decide
from tuner.space import Candidate, Space

__all__ = [
    "SAMPLERS",
    "EXPLORE_AFTER_DUPLICATES",
    "ENUMERATE_BELOW",
    "build_sampler",
    "startup_trials",
    "Pick",
    "ProposalPolicy",
]

SAMPLERS = ("tpe", "nsga2", "random", "grid")
# Duplicates in a row after which the sampler is taken to be stuck on measured configs (TPE over a
# discrete space keeps re-proposing its best points, the more so as each duplicate is told again as
# COMPLETE): the tuner enqueues the unmeasured config nearest the fastest measured one. In a replay of
# a synthetic 104-config grid shaped like benchmarks/data/grid_space.yaml this reached 97% of the best in
# 23% of the grid's trial-seconds (median, 20 seeds) against 28% with a random unmeasured config and 31%
# with none; on bench_search.py's recorded 24-config grid it never fired before 25%.
EXPLORE_AFTER_DUPLICATES = 3
ENUMERATE_BELOW = 100_000  # spaces up to this size are explored by enumeration, larger ones by sampling


def build_sampler(
    name: str, *, seed: Optional[int], n_trials: int, startup: Optional[int] = None
) -> optuna.samplers.BaseSampler:
    """Optuna's sampler for ``--sampler name`` and a ``--trials n_trials`` search (``startup``: TPE's random
    start-up trials, when not the rule below: benchmarks/bench_search.py's ``--startup``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # Random start-up trials: a tenth of the budget, 3 to 10 (Optuna's default 10 would be the whole of a
            # short search). The local steps take over from them: replayed on the recorded grids (bench_search.py
            # --startup, one confirmation round of the best counted, 2 x 20 seeds), a tenth rather than a third took
            # the median trial-seconds to 97% of the best from 11%/11% to 6%/7% of grid 2's; on grid 1 it moved
            # within the noise (14%/15% to 16%/10%).
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
    proposes. ``explored``: the duplicate streak was answered (the caller starts counting it again)."""

    point: Optional[Candidate] = None
    stop: Optional[str] = None
    explored: bool = False


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
    ):
        self.space = space
        self.trial_flat = trial_flat
        self.sampler = sampler
        self.seed = seed
        self.local_every = local_every
        # local steps need asks serialized across workers: without a cross-process lock (the gRPC proxy, MySQL)
        # two workers could enqueue the same neighbour at once and both run it
        self.serialized = serialized
        self._rng = random.Random(seed)
        self._grid: Optional[list] = None
        self._rank: Optional[dict] = None  # identity -> position in the shuffled grid (local steps break ties by it)
        self._size: Optional[int] = None

    def pick(self, trials: list, *, known: dict, startup: int, duplicates: int) -> Pick:
        """The policy's move given the study's ``trials`` (none WAITING), ``known`` (:func:`decide.known_configs`),
        TPE's ``startup`` trials and the ``duplicates`` told in a row."""
        seen = decide.seen_configs(trials, self.space, self.trial_flat)
        if self.exhausted(seen):
            return Pick(stop=f"every one of the {self.space_size()} configs of the space is in the study")
        if self.sampler == "grid":
            point = self.unmeasured(seen)
            return Pick(point=point) if point is not None else Pick(stop="no unmeasured config left")
        if self.local_turn(trials, startup):
            # an inferred OOM one step from the incumbent is revisited: launched once (decide.ruling_oom)
            held = seen - decide.inferred_only(trials, self.space, self.trial_flat)
            return Pick(point=self.unmeasured_neighbour(held, decide.incumbent(known, self.trial_flat)))
        if duplicates >= EXPLORE_AFTER_DUPLICATES:
            return Pick(point=self.unmeasured(seen, near=decide.incumbent(known, self.trial_flat)), explored=True)
        return Pick()

    def space_size(self) -> int:
        if self._size is None:
            self._size = self.space.size(self.trial_flat, limit=ENUMERATE_BELOW)
        return self._size

    def local_turn(self, trials: list, startup: int) -> bool:
        """Is this proposal a local step (the incumbent's nearest unmeasured neighbour) rather than the
        sampler's? Every ``local_every``-th launched trial once TPE's random start-up is done.

        TPE models "good" vs "bad" regions from noisy single measurements and, multi-objective, spreads its
        proposals over the whole Pareto front; the per-GPU knobs' landscape is mostly monotone in each
        knob's order, so one notch from the fastest config is often faster still. On the recorded grid
        (benchmarks/bench_search.py) alternating the two took the median trial-seconds to 97 % of the
        grid's best from 28 % of the grid's trial-seconds to 16 % (every trial local: 18 %), and taking first
        the steps the knobs' ``speed`` hints favour to 12 %."""
        every = self.local_every
        if every <= 0 or self.sampler != "tpe" or not self.serialized:
            return False
        records = (TrialRecord.from_user_attrs(t.user_attrs) for t in trials)
        launched = sum(1 for r in records if r.status is not None and r.status.launched)
        return launched >= startup and (launched - startup) % every == every - 1

    def unmeasured_neighbour(self, seen: set, near: Optional[dict]) -> Optional[Candidate]:
        """A config one step from ``near`` (:meth:`tuner.space.Space.neighbours`: distance 1) not yet in the
        study: first those the knobs' ``speed`` hints expect to be faster (:meth:`tuner.space.Space.expected_speed`),
        among them the first in the seeded grid order (a space too large to enumerate: drawn at random among them);
        None when there is none (or no ``near``). Generated from ``near``,
        never by scanning the grid: a local turn runs under the study lock, and a scan of a 100k-config grid
        for each one took seconds there (benchmarks/bench_storage.py)."""
        if near is None:
            return None
        steps = self.space.neighbours(near, self.trial_flat)
        steps = [c for c in steps if self.space.identity(c.effective) not in seen]
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

    def unmeasured(self, seen: set, *, near: Optional[dict] = None) -> Optional[Candidate]:
        """A config not yet in the study (the shuffled grid when it is small, else sampling): a random one,
        or with ``near`` (a flat effective config) the nearest to it (:func:`tuner.search.decide.distance`).
        ``seen``: :func:`tuner.search.decide.seen_configs` (rejected configs count as seen)."""
        if self.space_size() <= ENUMERATE_BELOW:
            pool = (c for ident, c in self.shuffled_grid() if ident not in seen)
        else:  # too large to enumerate: random draws, and the neighbours of ``near`` (draws rarely land there)
            drawn = (self.space.sample(self.trial_flat, self._rng) for _ in range(200))
            steps = self.space.neighbours(near, self.trial_flat) if near is not None else []
            pool = (c for c in chain(steps, drawn) if c is not None and self.space.identity(c.effective) not in seen)
        if near is None:
            return next(pool, None)
        return min(pool, key=lambda c: decide.distance(self.space, c.effective, near), default=None)

    def exhausted(self, seen: set) -> bool:
        """Is every config of the space in the study (measured, running, or rejected before launch)?"""
        size = self.space_size()
        if len(seen) < size:
            return False
        # seen may hold configs a space constraint refused (they are not in the grid): check the grid itself
        return size > ENUMERATE_BELOW or self.unmeasured(seen) is None
