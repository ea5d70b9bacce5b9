"""How long a confirmation goes on: interleaved rounds until the leader separates from the runner-up.

Pure functions (no optuna, no process). The finalists and the baseline are re-run in rounds
(:mod:`tuner.rules.finalists`: who, and what the re-runs say); after each round, over the rounds measured so far:

* every config's figure is its paired log-ratios to the same round's baseline (drift between rounds cancels);
* the **leader** is the config with the best median ratio (the baseline counts, at 1.0), the **runner-up** the next;
* the leader is **separated** when the 90% interval of its paired ratio to the runner-up (to the baseline: from 1.0,
  when no other finalist is left) excludes 1: then the rounds stop. A dominant finalist stops after one round;
* a finalist whose interval to the leader lies wholly below 1 leaves the race (it is no longer re-run), as does
  one whose re-run did not end ok (a config that ran out of memory once is no recommendation);
* a round in which a run was measured under load (:attr:`Rerun.loaded`) is marked and not claimed from: it does
  not count toward the cap ``rounds`` and is not in any figure; it is run again, at most ``rounds`` times and at
  least :data:`MIN_LOADED_RERUNS` (the stage waits for the load to pass before it does:
  :mod:`tuner.search.confirmation`); one loaded round more than that ends the race.

The interval (:func:`paired_interval`) is the mean of the log-ratios ± the wider of two half-widths: z(0.95) times
the standard error the runs' own 90% intervals imply (each run's measured noise, at least a floor, so one round
already has an interval), and Student's t(0.95) on n-1 degrees of freedom times the one the n rounds' scatter shows
(two rounds or more). The floor is the larger of :data:`RUN_NOISE_FLOOR` and the run-to-run noise the study itself
measured (:func:`repeat_noise`: each confirmed config's search trial and its re-runs, pooled, widened by t for its
few degrees of freedom): a run's steps do not show what differs from one run to the next.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from trainer.contracts import Status

__all__ = [
    "MIN_LOADED_RERUNS",
    "Z90",
    "t90",
    "RUN_NOISE_FLOOR",
    "Rerun",
    "run_noise",
    "repeat_noise",
    "paired_interval",
    "Race",
    "race",
]

#: loaded rounds run again however small the cap: with ``--confirm 1`` one stray loaded run would otherwise leave the
#: confirmation with nothing to claim
MIN_LOADED_RERUNS = 2
#: the standard normal's 95% point: a two-sided 90% interval
Z90 = 1.6449
#: the least noise (standard deviation of its log-throughput) a run is taken to have, and its noise when it has no
#: interval of its own (one measured step): a run's interval sees only its steps' scatter, not what differs from one
#: run to the next (start-up, memory placement, the machine). The family of simulated grids chose it for the stated
#: intervals' coverage (benchmarks/README.md, "The search on grids it was never tuned on")
RUN_NOISE_FLOOR = 0.045


@dataclass(frozen=True)
class Rerun:
    """One finished re-run (a trial with ``confirm_of``)."""

    number: int
    status: str  # its Status value (a re-run that did not end ok is a failed one)
    throughput: Optional[float] = None
    peak_memory_gb: Optional[float] = None
    throughput_ci: Optional[tuple] = None  # its own 90% interval over its measured steps
    loaded: bool = False  # measured under load (tuner.trials.memory: other processes busy on its CPUs or GPUs)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK and self.throughput is not None and self.throughput > 0


def run_noise(run: Rerun) -> Optional[float]:
    """The standard deviation of a run's log-throughput its own 90% interval implies (None: no interval)."""
    ci = run.throughput_ci
    if not run.ok or not ci or ci[0] is None or ci[1] is None or not 0 < ci[0] <= ci[1]:
        return None
    return math.log(ci[1] / ci[0]) / 2.0 / Z90


def t90(dof: int) -> float:
    """Student's t 95% point on ``dof`` degrees of freedom (a two-sided 90% interval from an estimated noise)."""
    if dof < 1:
        raise ValueError("dof must be >= 1")
    if dof <= len(_T90):
        return _T90[dof - 1]
    return Z90 + (Z90**3 + Z90) / (4 * dof)  # Cornish-Fisher's first term: within 0.002 of the table from 30 on


#: Student's t 95% point for 1..30 degrees of freedom (the standard table)
_T90 = (
    6.3138, 2.9200, 2.3534, 2.1318, 2.0150, 1.9432, 1.8946, 1.8595, 1.8331, 1.8125,
    1.7959, 1.7823, 1.7709, 1.7613, 1.7531, 1.7459, 1.7396, 1.7341, 1.7291, 1.7247,
    1.7207, 1.7171, 1.7139, 1.7109, 1.7081, 1.7056, 1.7033, 1.7011, 1.6991, 1.6973,
)  # fmt: skip


def _pooled(groups: Iterable[Sequence[Rerun]]) -> tuple[float, int]:
    """(sum of squares around each group's mean, degrees of freedom) of the ok, unloaded runs' log-throughput."""
    squares, dof = 0.0, 0
    for runs in groups:
        logs = [math.log(r.throughput) for r in runs if r.ok and not r.loaded]
        if len(logs) >= 2:
            mean = statistics.fmean(logs)
            squares += sum((x - mean) ** 2 for x in logs)
            dof += len(logs) - 1
    return squares, dof


def repeat_noise(groups: Iterable[Sequence[Rerun]], *, widened: bool = False) -> Optional[float]:
    """The run-to-run noise measured: the pooled standard deviation of log-throughput within ``groups`` (each one
    config's runs: its search trial and its re-runs), over the ok runs not measured under load; None when no config
    has two. A search trial picked for being fast reads high, so the estimate errs wide (the safe side).
    ``widened``: times ``t90(dof) / Z90``, so that a z interval on it is Student's t interval: after one round the
    estimate rests on a few degrees of freedom and too often reads low."""
    squares, dof = _pooled(groups)
    if not dof:
        return None
    return math.sqrt(squares / dof) * (t90(dof) / Z90 if widened else 1.0)


def paired_interval(
    pairs: Sequence[tuple[Rerun, Rerun]], *, noise_floor: float = RUN_NOISE_FLOOR
) -> Optional[tuple[float, float, float]]:
    """``(ratio, low, high)``: the geometric mean of ``a / b`` over the ``pairs`` (each a round's two runs, both ok)
    and its 90% interval (see the module docstring); None without a pair. A run's noise is its own interval's, at
    least ``noise_floor`` (also the noise of a run with no interval of its own)."""
    pairs = [(a, b) for a, b in pairs if a.ok and b.ok]
    if not pairs:
        return None
    logs = [math.log(a.throughput / b.throughput) for a, b in pairs]
    n = len(logs)

    def var(r: Rerun) -> float:
        s = run_noise(r)
        return max(noise_floor, 0.0 if s is None else s) ** 2

    measured = sum(var(a) + var(b) for a, b in pairs) / n / n  # the variance of the mean the runs' noise implies
    scatter = t90(n - 1) * math.sqrt(statistics.variance(logs) / n) if n >= 2 else 0.0
    mean, half = statistics.fmean(logs), max(Z90 * math.sqrt(measured), scatter)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@dataclass
class Race:
    """Where a confirmation stands after its finished re-runs (:func:`race`)."""

    rounds: int = 0  # complete rounds
    clean: list = field(default_factory=list)  # the complete rounds measured without load (0-based)
    loaded: list = field(default_factory=list)  # the complete rounds with a run under load: not claimed from
    active: list = field(default_factory=list)  # the finalists still re-run (the baseline always is)
    dropped: list = field(default_factory=list)  # the finalists out of the race (an interval wholly below the leader)
    leader: Optional[int] = None
    runner_up: Optional[int] = None
    separated: bool = False
    done: bool = False
    why: str = ""  # separated / the cap / every round under load
    noise: float = RUN_NOISE_FLOOR  # the floor on a run's noise the intervals took: the study's measured one or more

    def members(self, baseline: Optional[int]) -> list[int]:
        """Who runs in the next round, in its interleaved order (rotated by one each round)."""
        items = list(self.active) + ([baseline] if baseline is not None else [])
        if not items:
            return []
        r = self.rounds % len(items)
        return items[r:] + items[:r]


def _in_round(runs: Mapping[int, Sequence[Rerun]], who: int, k: int) -> Optional[Rerun]:
    got = runs.get(who) or ()
    return got[k] if k < len(got) else None


def _pairs(runs: Mapping, a: int, b: int, rounds: Sequence[int]) -> list[tuple[Rerun, Rerun]]:
    out = []
    for k in rounds:
        x, y = _in_round(runs, a, k), _in_round(runs, b, k)
        if x is not None and y is not None:
            out.append((x, y))
    return out


def race(
    runs: Mapping[int, Sequence[Rerun]],
    *,
    finalists: Sequence[int],
    baseline: Optional[int],
    rounds: int,
    noise_floor: float = RUN_NOISE_FLOOR,
    searched: Optional[Mapping[int, Rerun]] = None,
) -> Race:
    """The race after the finished re-runs ``runs`` (config number -> its re-runs in trial-number order: a config's
    k-th re-run ran in round k), for ``finalists`` against ``baseline`` (None: the finalists among themselves),
    capped at ``rounds`` clean rounds (and as many loaded ones run again, at least :data:`MIN_LOADED_RERUNS`: the
    next loaded one ends it).
    ``searched``: config number -> its search trial;
    a run's noise is at least ``noise_floor`` and the run-to-run noise they and the rounds so far show
    (:func:`repeat_noise`)."""
    state = Race(active=list(finalists), noise=noise_floor)
    if rounds <= 0 or not finalists:
        state.done, state.why = True, "nothing to confirm"
        return state
    while True:  # every complete round (a study confirmed before may hold more than the cap)
        members = state.active + ([baseline] if baseline is not None else [])
        k = state.rounds
        got = [_in_round(runs, m, k) for m in members]
        if any(r is None for r in got):
            break  # round k is not finished
        state.rounds += 1
        (state.loaded if any(r.loaded for r in got) else state.clean).append(k)
        state.noise = _floor(runs, searched or {}, [*finalists, baseline], state.rounds, noise_floor)
        _update(state, runs, baseline, state.noise)
    if state.separated:
        state.done, state.why = True, "separated"
    elif len(state.clean) >= rounds:
        state.done, state.why = True, f"not separated after {len(state.clean)} rounds"
    elif len(state.loaded) > max(rounds, MIN_LOADED_RERUNS):
        state.done, state.why = True, f"{len(state.loaded)} rounds under load"
    return state


def _floor(runs: Mapping, searched: Mapping, who: Sequence, rounds: int, noise_floor: float) -> float:
    """``noise_floor``, or the run-to-run noise of the search trials and the first ``rounds`` re-runs if larger
    (widened for its degrees of freedom: :func:`repeat_noise`)."""
    groups = [[*([searched[n]] if n in searched else []), *(runs.get(n) or ())[:rounds]] for n in who if n is not None]
    measured = repeat_noise(groups, widened=True)
    return noise_floor if measured is None else max(noise_floor, measured)


def _update(state: Race, runs: Mapping, baseline: Optional[int], noise_floor: float) -> None:
    """After a round: the leader, the runner-up, whether they separate, and who leaves the race."""
    if not state.clean:
        return
    ratio = {}
    for n in state.active:
        ref = baseline if baseline is not None else state.active[0]
        got = paired_interval(_pairs(runs, n, ref, state.clean), noise_floor=noise_floor)
        ratio[n] = got[0] if got is not None else -math.inf
    if baseline is not None:
        ratio[baseline] = 1.0
    order = sorted(ratio, key=lambda n: (-ratio[n], n != baseline, n))
    state.leader = order[0]
    state.runner_up = order[1] if len(order) > 1 else None
    for n in list(state.active):
        failed = any(not r.ok for r in (runs.get(n) or ())[: state.rounds])  # no recommendation: out of the race
        if n == state.leader and not failed:
            continue
        got = paired_interval(_pairs(runs, n, state.leader, state.clean), noise_floor=noise_floor)
        if failed or (got is not None and got[2] < 1.0):
            state.active.remove(n)
            state.dropped.append(n)
    others = [n for n in order[1:] if n in state.active or n == baseline]
    state.runner_up = others[0] if others else None
    if state.runner_up is None:
        state.separated = True
        return
    got = paired_interval(_pairs(runs, state.leader, state.runner_up, state.clean), noise_floor=noise_floor)
    state.separated = got is not None and got[1] > 1.0
