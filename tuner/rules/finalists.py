"""Finalists confirmed side by side: which configs to re-run, in which order, and what the re-runs say.

Pure functions (no optuna, no process, no pandas). :class:`tuner.search.confirmation.ConfirmationStage` runs the
rounds through the search's own runner, as long as :func:`tuner.rules.race.race` says (until the leader separates
from the runner-up, at most ``--confirm R`` rounds), and stores :func:`aggregate` in the study attribute
``confirmation`` (docs/contracts.md section 3); ``ppotune export``, the report, the search's summary
and ``ppotune validate`` read it.

Why: a search trial's throughput is the median of a few steps measured once. Taking the maximum over
a study picks the luckiest sample (the winner's curse), and the machine's load drifts during a search
(the baseline runs first, perhaps on a quieter machine). So the finalists and the baseline are run
again, interleaved -- round 1: A B C base, round 2: B C base A, round 3: C base A B -- so every round
sees the same conditions and no config always runs first after a pause; a finalist's figure is the
geometric mean over rounds of its throughput divided by the *same round's* baseline throughput (a paired
ratio: the drift between rounds cancels), with a 90% interval (:func:`tuner.rules.race.paired_interval`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence, TypeVar

from trainer.summary import interval
from tuner.rules.race import RUN_NOISE_FLOOR, Rerun, paired_interval, race

__all__ = [
    "CONFIRMATION_ATTR",
    "DEFAULT_ROUNDS",
    "MAX_FINALISTS",
    "DEFAULT_FINALISTS",
    "Contender",
    "within_noise",
    "pick_finalists",
    "schedule",
    "paired_ratios",
    "log_interval",
    "summarize",
    "aggregate",
    "rank_confirmed",
    "entry_of",
    "describe",
    "rounds_text",
    "SUSPECT_RATIO",
    "MAX_ROUNDS",
    "Suspicion",
    "suspicion",
    "widen",
]

#: the study user attribute holding :func:`aggregate`'s result
CONFIRMATION_ATTR = "confirmation"
#: ``ppotune search --confirm R`` default: at most this many interleaved rounds (0 turns confirmation off). The rounds
#: stop as soon as the leader separates from the runner-up (:mod:`tuner.rules.race`): a dominant finalist costs one
#: round. The family of simulated grids chose the cap: more rounds cost more than they gained in the pick there
#: (benchmarks/README.md, "The search on grids it was never tuned on"); a larger R narrows the claim's interval.
DEFAULT_ROUNDS = 1
#: the configs export would take first that the worst-case probe runs by default (``--probe``), and the
#: finalists' cap a caller of :func:`pick_finalists` gets unless it says otherwise
MAX_FINALISTS = 3
#: ``ppotune search --finalists F`` default: at most this many finalists are re-run (each costs ``rounds`` trials,
#: plus the baseline's)
DEFAULT_FINALISTS = 2

#: the single trials are suspect when the first round measured without load contradicts them by more than this
#: factor, either way: the baseline's re-run against its own search trial, or a finalist's paired ratio against the
#: ratio of its single trial to the baseline's (:func:`suspicion`): beyond what a short trial's own scatter explains
#: (see docs/decisions.md#confirm-suspect-and-load-wait)
SUSPECT_RATIO = 1.2
#: the most rounds a confirmation runs however its budget stands (see docs/decisions.md#confirm-suspect-and-load-wait)
MAX_ROUNDS = 10

T = TypeVar("T", bound=Hashable)


# --------------------------------------------------------------------------- who
@dataclass(frozen=True)
class Contender:
    """A measured feasible trial under the export headroom (a search trial, not a re-run)."""

    number: int
    throughput: float  # tokens/s/GPU, the trial's median
    throughput_ci: Optional[tuple[float, float]]  # its 90% interval; None: unknown
    pareto: bool  # on the Pareto front of the trials under the headroom

    @property
    def score(self) -> float:
        """What finalists are ranked by: the lower end of its interval when known (the search's incumbent rule,
        :func:`tuner.rules.candidates.measured_score`), else its throughput."""
        ci = self.throughput_ci
        if ci is not None and ci[0] is not None and 0 < ci[0] <= self.throughput:
            return float(ci[0])
        return float(self.throughput)


def within_noise(best: Contender, other: Contender) -> bool:
    """Could ``other`` be as fast as ``best``? Their 90% intervals overlap (``other``'s upper end reaches
    ``best``'s lower end). An unknown interval on either side says nothing: False."""
    if best.throughput_ci is None or other.throughput_ci is None:
        return False
    return other.throughput_ci[1] >= best.throughput_ci[0]


def pick_finalists(cands: Sequence[Contender], *, exclude: Sequence[int] = (), cap: int = MAX_FINALISTS) -> list[int]:
    """The configs to confirm: the Pareto points among ``cands`` plus any trial within noise of the best
    (:func:`within_noise`), best first by :attr:`Contender.score`, at most ``cap``.

    ``exclude`` (the baseline: it is re-run in every round anyway) is never a finalist, but it still
    defines the best when it is. Ties: the lower trial number first."""
    if not cands:
        return []
    best = max(cands, key=lambda c: (c.score, -c.number))
    chosen = [c for c in cands if c.number not in exclude and (c.pareto or within_noise(best, c))]
    chosen.sort(key=lambda c: (-c.score, c.number))
    return [c.number for c in chosen[: max(0, cap)]]


@dataclass(frozen=True)
class Suspicion:
    """The first clean round contradicts the single trials (:func:`suspicion`)."""

    why: str  # what contradicts what, in a sentence's words
    spread: float  # the largest factor between a figure and what the single trials said (>= SUSPECT_RATIO)


def suspicion(
    runs: Mapping[int, Sequence[Rerun]],
    searched: Mapping[int, Rerun],
    *,
    finalists: Sequence[int],
    baseline: Optional[int],
    round_k: int,
    ratio: float = SUSPECT_RATIO,
) -> Optional[Suspicion]:
    """Do the re-runs of round ``round_k`` (measured without load) contradict the single trials ``searched``?

    Yes when the baseline's re-run is more than ``ratio`` away from its own search trial, either way, or a
    finalist's paired ratio to the baseline is more than ``ratio`` away from its single trial's ratio to the
    baseline's: the single trials then ranked the noise of one short run each, and configs they put behind the
    finalists may be as fast (:func:`widen`). None without a baseline, or when the figures agree."""
    if baseline is None:
        return None
    b_run, b_trial = _kth(runs, baseline, round_k), searched.get(baseline)
    if b_run is None or b_trial is None or not (b_run.ok and b_trial.ok):
        return None
    whys, spread = [], 1.0
    drift = b_run.throughput / b_trial.throughput
    if max(drift, 1.0 / drift) > ratio:
        whys.append(f"the baseline's re-run measured {drift:.2f}x its own search trial")
        spread = max(drift, 1.0 / drift)
    for n in finalists:
        run, trial = _kth(runs, n, round_k), searched.get(n)
        if run is None or trial is None or not (run.ok and trial.ok):
            continue
        single, paired = trial.throughput / b_trial.throughput, run.throughput / b_run.throughput
        off = single / paired
        if max(off, 1.0 / off) > ratio:
            whys.append(f"#{n} measured {paired:.2f}x the baseline where the single trials said {single:.2f}x")
            spread = max(spread, off, 1.0 / off)
    return Suspicion("; ".join(whys), round(spread, 6)) if whys else None


def _kth(runs: Mapping[int, Sequence[Rerun]], n: int, k: int) -> Optional[Rerun]:
    got = runs.get(n) or ()
    return got[k] if k < len(got) else None


def widen(
    cands: Sequence[Contender], finalists: Sequence[int], *, spread: float, exclude: Sequence[int] = (), cap: int
) -> list[int]:
    """The finalists once the single trials are suspect: ``finalists`` first, then every other candidate whose single
    trial is within ``spread`` (the factor the confirmation showed the single trials to be off by) of a finalist's,
    fastest first, at most ``cap`` in all. ``exclude``: the baseline (re-run in every round anyway)."""
    thr = {c.number: c.throughput for c in cands}
    floor = min((thr[n] for n in finalists if n in thr), default=None)
    if floor is None:
        return list(finalists)[: max(0, cap)]
    taken = {*finalists, *exclude}
    near = [c for c in cands if c.number not in taken and c.throughput * spread >= floor]
    near.sort(key=lambda c: (-c.throughput, c.number))
    return [*finalists, *(c.number for c in near)][: max(0, cap)]


# --------------------------------------------------------------------------- when
def schedule(finalists: Sequence[T], baseline: Optional[T], rounds: int) -> list[list[T]]:
    """``rounds`` rounds of the finalists then the baseline, rotated by one each round:
    ``[[A, B, C, base], [B, C, base, A], [C, base, A, B], [base, A, B, C], [A, ...], ...]``."""
    items = list(finalists) + ([baseline] if baseline is not None else [])
    if not items:
        return []
    return [items[r % len(items) :] + items[: r % len(items)] for r in range(max(0, rounds))]


# --------------------------------------------------------------------------- what the re-runs say
def paired_ratios(runs: Sequence[Rerun], base_runs: Sequence[Rerun]) -> list[float]:
    """``runs[k].throughput / base_runs[k].throughput`` for every round ``k`` both measured.

    Both lists are in trial-number order; each config runs once per round, so the ``k``-th re-run of a
    finalist and the ``k``-th of the baseline ran in the same round."""
    return [a.throughput / b.throughput for a, b in zip(runs, base_runs) if a.ok and b.ok]


def log_interval(values: Sequence[float]) -> tuple[Optional[float], Optional[tuple[float, float]]]:
    """The median of positive ``values`` and a 90% interval: Student's t on their logarithms (median ±
    t(0.95, n-1)·s/√n, :func:`trainer.summary.interval`), mapped back with exp.

    Honest about what it is: ratios and throughputs are multiplicative, so the interval is symmetric in
    log space; it assumes roughly log-normal round-to-round noise and is an interval for the typical
    (geometric) value around the median, not a distribution-free interval for the median. With 3
    rounds (``--confirm 3``) t(0.95, 2) = 2.92, so it is wide on purpose; one value (the default one round) has no
    interval (None)."""
    xs = [float(v) for v in values if v is not None and v > 0]
    if not xs:
        return None, None
    ci = interval([math.log(v) for v in xs])
    return statistics.median(xs), (None if ci is None else (math.exp(ci[0]), math.exp(ci[1])))


def _round(v: Optional[float], digits: int = 6) -> Optional[float]:
    return None if v is None else round(float(v), digits)


def summarize(
    number: int,
    runs: Sequence[Rerun],
    base_runs: Optional[Sequence[Rerun]] = None,
    *,
    claimed: Optional[Sequence[int]] = None,
    noise_floor: float = RUN_NOISE_FLOOR,
) -> dict:
    """One config's confirmed figures (an entry of :func:`aggregate`; ``base_runs`` None: no baseline).

    ``claimed``: the rounds the figures come from (None: all; the rounds measured under load are left out by the
    caller: ``loaded_rounds`` counts this config's runs in them). ``ratio``/``ratio_ci``: the geometric mean and 90%
    interval of the paired ratios (:func:`tuner.rules.race.paired_interval`; one round has one too, from the runs'
    own noise); ``throughput``/``throughput_ci``: the median and Student's t interval over its ok re-runs'
    throughputs (:func:`log_interval`); ``peak_memory_gb``: the largest peak over its re-runs; ``trials``: the
    re-runs' numbers; ``failed``: re-runs that did not end ok; ``rounds``: the figures the ratio is over (paired
    rounds, or ok re-runs without a baseline)."""
    idx = list(range(len(runs))) if claimed is None else [k for k in claimed if k < len(runs)]
    used = [runs[k] for k in idx]
    ok = [r for r in used if r.ok]
    thr, thr_ci = log_interval([r.throughput for r in ok])
    peaks = [r.peak_memory_gb for r in runs if r.peak_memory_gb is not None]
    pairs = [(runs[k], base_runs[k]) for k in idx if k < len(base_runs)] if base_runs is not None else []
    got = paired_interval(pairs, noise_floor=noise_floor)
    return {
        "number": int(number),
        "ratio": None if got is None else _round(got[0]),
        "ratio_ci": None if got is None else [_round(got[1]), _round(got[2])],
        "ratios": [_round(a.throughput / b.throughput) for a, b in pairs if a.ok and b.ok],
        "throughput": _round(thr, 3),
        "throughput_ci": None if thr_ci is None else [_round(thr_ci[0], 3), _round(thr_ci[1], 3)],
        "peak_memory_gb": _round(max(peaks), 4) if peaks else None,
        "trials": [int(r.number) for r in runs],
        "failed": sum(1 for r in runs if not r.ok),
        "statuses": sorted({r.status for r in runs if not r.ok}),
        "rounds": sum(1 for a, b in pairs if a.ok and b.ok) if base_runs is not None else len(ok),
        "loaded_rounds": len(runs) - len(idx),
    }


def aggregate(
    *,
    baseline: Optional[int],
    finalists: Sequence[int],
    rounds: int,
    headroom: float,
    runs: Mapping[int, Sequence[Rerun]],
    noise_floor: float = RUN_NOISE_FLOOR,
    searched: Optional[Mapping[int, Rerun]] = None,
) -> dict:
    """The study attribute ``confirmation`` (docs/contracts.md section 3) from the finished re-runs.

    ``runs``: config number -> its re-runs in trial-number order (its k-th ran in round k); ``rounds``: the cap;
    ``searched``: config number -> its search trial. The race (:func:`tuner.rules.race.race`) says which rounds are
    claimed from (those measured without load), the leader, its runner-up, whether they separated and the floor on
    a run's noise (``run_noise``: ``noise_floor`` or the run-to-run noise measured, if larger); ``complete``: the
    race is over (False after an interruption: a resumed search runs the rest)."""
    state = race(
        runs, finalists=finalists, baseline=baseline, rounds=rounds, noise_floor=noise_floor, searched=searched
    )
    base_runs = list(runs.get(baseline, ())) if baseline is not None else None
    kw = dict(claimed=state.clean, noise_floor=state.noise)
    entries = [summarize(n, runs.get(n, ()), base_runs, **kw) for n in finalists]
    base_entry = None
    if baseline is not None:
        base_entry = summarize(baseline, base_runs or [], **kw)
        if base_entry["throughput"] is not None:
            ok = sum(1 for k in state.clean if k < len(base_runs) and base_runs[k].ok)
            base_entry.update(ratio=1.0, ratio_ci=None, ratios=[], rounds=ok)
    for e in [*entries, base_entry]:
        if e is not None and e["number"] == state.leader and state.rounds:
            up = state.runner_up
            e["separated"] = state.separated
            e["not_separated_from"] = (
                None if state.separated or up is None else "the baseline" if up == baseline else f"#{up}"
            )
    return {
        "baseline": baseline,
        "rounds": int(rounds),
        "rounds_run": state.rounds,
        "loaded_rounds": len(state.loaded),
        "headroom": float(headroom),
        "complete": state.done,
        "leader": state.leader,
        "runner_up": state.runner_up,
        "separated": state.separated,
        "dropped": list(state.dropped),
        "run_noise": _round(state.noise),
        "finalists": entries,
        "baseline_result": base_entry,
    }


# --------------------------------------------------------------------------- the pick
def entry_of(confirmation: Optional[Mapping], number: int) -> Optional[dict]:
    """The confirmed figures of trial ``number`` (a finalist or the baseline), or None."""
    if not confirmation:
        return None
    for e in list(confirmation.get("finalists") or []) + [confirmation.get("baseline_result")]:
        if e and e.get("number") == number:
            return dict(e)
    return None


def rank_confirmed(
    confirmation: Mapping, *, eligible: Sequence[int], limit_gb: Optional[float]
) -> tuple[list[dict], list[tuple[int, str]]]:
    """The confirmed configs a pick may take, best first, and the ones left out with why.

    Ranked by the paired ratio to the baseline (the baseline itself is 1.0), ties by less memory;
    without a baseline measured in the re-runs, by the median confirmed throughput. Left out: not in
    ``eligible`` (export's headroom filter on the original trial), a re-run that did not end ok (a config
    that once ran out of memory or crashed is no recommendation), a confirmed peak over ``limit_gb``, no
    figure at all."""
    entries = [e for e in list(confirmation.get("finalists") or []) + [confirmation.get("baseline_result")] if e]
    paired = any(e.get("ratio") is not None for e in confirmation.get("finalists") or []) or bool(
        (confirmation.get("baseline_result") or {}).get("throughput")
    )
    key = "ratio" if paired else "throughput"
    allowed = set(int(n) for n in eligible)
    ranked, left_out = [], []
    for e in entries:
        n = int(e["number"])
        if n not in allowed:
            left_out.append((n, "not a feasible trial under the memory limit"))
        elif e.get("failed"):
            left_out.append((n, f"{e['failed']} of its re-runs did not end ok ({', '.join(e.get('statuses') or [])})"))
        elif limit_gb is not None and e.get("peak_memory_gb") is not None and e["peak_memory_gb"] > limit_gb + 1e-9:
            left_out.append((n, f"its re-runs peaked at {e['peak_memory_gb']:.2f} GB, over the {limit_gb:.2f} GB"))
        elif e.get(key) is None:
            left_out.append((n, "no paired round measured" if key == "ratio" else "no re-run measured"))
        else:
            ranked.append(dict(e))
    ranked.sort(key=lambda e: (-e[key], e.get("peak_memory_gb") or 0.0, e["number"]))
    return ranked, left_out


def rounds_text(conf: Mapping) -> str:
    """How a confirmation's rounds ended: ``2 of at most 3 rounds, 1 under load: the leader separated``, or past the
    cap (:class:`tuner.search.confirmation.ConfirmationStage` goes on while the leader has not separated and its
    budget allows) ``5 rounds (3 asked, ...)`` (a study confirmed before the rounds were adaptive: ``3 rounds``)."""
    run, cap = conf.get("rounds_run"), conf.get("rounds")
    if run is None:
        return f"{cap} rounds"
    loaded = f", {conf['loaded_rounds']} under load (not claimed from)" if conf.get("loaded_rounds") else ""
    how = "the leader separated" if conf.get("separated") else "the leader did not separate"
    if cap is not None and run > cap:  # past --confirm: rounds under load run again, or more within the budget
        clean = run - int(conf.get("loaded_rounds") or 0) > cap
        more = "more while the leader had not separated" if clean else "the ones under load run again"
        return f"{run} rounds ({cap} asked, {more}){loaded}: {how}"
    return f"{run} of at most {cap} rounds{loaded}: {how}"


def _rounds(n: int) -> str:
    return f"{n} interleaved round{'s' if n != 1 else ''}"


def describe(entry: Mapping, *, baseline: str = "the baseline") -> str:
    """One line: ``1.42x the baseline (90% interval 1.31–1.55, 2 interleaved rounds)``, or for a leader the rounds
    did not separate from its runner-up ``1.03x the baseline (90% interval 0.96–1.10, 3 interleaved rounds; not
    separated from #7 after 3 rounds)``, and the rounds measured under load that nothing was claimed from; without a
    paired ratio, the median confirmed throughput with its interval."""
    n = int(entry.get("rounds") or 0)
    ratio, ci = entry.get("ratio"), entry.get("ratio_ci")
    loaded = int(entry.get("loaded_rounds") or 0)
    tail = f"; {loaded} round{'s' if loaded != 1 else ''} under load, not claimed from" if loaded else ""
    if entry.get("separated") is False and entry.get("not_separated_from"):
        tail = f"; not separated from {entry['not_separated_from']} after {_rounds(n)}" + tail
    if ratio is not None:
        if not entry.get("ratios"):  # the baseline: 1 by definition
            return f"{baseline} itself (1.00x; {_rounds(n)}{tail})"
        inner = f"90% interval {ci[0]:.2f}–{ci[1]:.2f}, " if ci else "no interval from one round, " if n == 1 else ""
        return f"{ratio:.2f}x {baseline} ({inner}{_rounds(n)}{tail})"
    thr, tci = entry.get("throughput"), entry.get("throughput_ci")
    if thr is None:
        return f"not confirmed (no re-run measured{' without load' if loaded else ''}{tail})"
    inner = f"90% interval {tci[0]:.1f}–{tci[1]:.1f}, " if tci else ""
    return f"{thr:.1f} tokens/s/GPU ({inner}median of {_rounds(n)}; no baseline to pair with{tail})"
