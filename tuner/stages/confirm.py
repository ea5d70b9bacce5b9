"""Finalists confirmed side by side: which configs to re-run, in which order, and what the re-runs say.

Pure functions (no optuna, no process, no pandas). :meth:`tuner.search.loop.Search.confirm` runs the
schedule through the search's own runner and stores :func:`aggregate` in the study attribute
``confirmation`` (docs/contracts.md section 3); ``ppotune export``, the report, the search's summary
and ``ppotune validate`` read it.

Why: a search trial's throughput is the median of a few steps measured once. Taking the maximum over
a study picks the luckiest sample (the winner's curse), and the machine's load drifts during a search
(the baseline runs first, perhaps on a quieter machine). So the finalists and the baseline are run
again, interleaved -- round 1: A B C base, round 2: B C base A, round 3: C base A B -- so every round
sees the same conditions and no config always runs first after a pause; a finalist's figure is the
median over rounds of its throughput divided by the *same round's* baseline throughput (a paired
ratio: the drift between rounds cancels).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Hashable, Mapping, Optional, Sequence, TypeVar

from trainer.contracts import Status
from trainer.summary import interval

__all__ = [
    "CONFIRMATION_ATTR",
    "DEFAULT_ROUNDS",
    "MAX_FINALISTS",
    "DEFAULT_FINALISTS",
    "Candidate",
    "Rerun",
    "within_noise",
    "pick_finalists",
    "schedule",
    "next_slot",
    "paired_ratios",
    "log_interval",
    "summarize",
    "aggregate",
    "rank_confirmed",
    "entry_of",
    "describe",
]

#: the study user attribute holding :func:`aggregate`'s result
CONFIRMATION_ATTR = "confirmation"
#: ``ppotune search --confirm R`` default: interleaved rounds (0 turns confirmation off). One round of the two
#: best and the baseline (R1 F2) is what the recorded grids favour (benchmarks/README.md, "Samplers"): 3 rounds of 3
#: finalists cost 12 re-runs, 8-10% of a grid's trial-seconds, and reached 97% of the best later (24% and 18% of
#: grids 1 and 2, against 14% and 7%); one finalist cannot change the pick. More rounds give an interval
#: (``--confirm 3``); one round gives a paired ratio.
DEFAULT_ROUNDS = 1
#: the configs export would take first that the worst-case probe runs by default (``--probe``), and the
#: finalists' cap a caller of :func:`pick_finalists` gets unless it says otherwise
MAX_FINALISTS = 3
#: ``ppotune search --finalists F`` default: at most this many finalists are re-run (each costs ``rounds`` trials,
#: plus the baseline's)
DEFAULT_FINALISTS = 2

T = TypeVar("T", bound=Hashable)


# --------------------------------------------------------------------------- who
@dataclass(frozen=True)
class Candidate:
    """A measured feasible trial under the export headroom (a search trial, not a re-run)."""

    number: int
    throughput: float  # tokens/s/GPU, the trial's median
    throughput_ci: Optional[tuple[float, float]]  # its 90% interval; None: unknown
    pareto: bool  # on the Pareto front of the trials under the headroom


def within_noise(best: Candidate, other: Candidate) -> bool:
    """Could ``other`` be as fast as ``best``? Their 90% intervals overlap (``other``'s upper end reaches
    ``best``'s lower end). An unknown interval on either side says nothing: False."""
    if best.throughput_ci is None or other.throughput_ci is None:
        return False
    return other.throughput_ci[1] >= best.throughput_ci[0]


def pick_finalists(cands: Sequence[Candidate], *, exclude: Sequence[int] = (), cap: int = MAX_FINALISTS) -> list[int]:
    """The configs to confirm: the Pareto points among ``cands`` plus any trial within noise of the fastest
    (:func:`within_noise`), fastest first, at most ``cap``.

    ``exclude`` (the baseline: it is re-run in every round anyway) is never a finalist, but it still
    defines the fastest when it is. Ties in throughput: the lower trial number first."""
    if not cands:
        return []
    best = max(cands, key=lambda c: (c.throughput, -c.number))
    chosen = [c for c in cands if c.number not in exclude and (c.pareto or within_noise(best, c))]
    chosen.sort(key=lambda c: (-c.throughput, c.number))
    return [c.number for c in chosen[: max(0, cap)]]


# --------------------------------------------------------------------------- when
def schedule(finalists: Sequence[T], baseline: Optional[T], rounds: int) -> list[list[T]]:
    """``rounds`` rounds of the finalists then the baseline, rotated by one each round:
    ``[[A, B, C, base], [B, C, base, A], [C, base, A, B], [base, A, B, C], [A, ...], ...]``."""
    items = list(finalists) + ([baseline] if baseline is not None else [])
    if not items:
        return []
    return [items[r % len(items) :] + items[: r % len(items)] for r in range(max(0, rounds))]


def next_slot(plan: Sequence[Sequence[T]], taken: Mapping[T, int]) -> Optional[tuple[int, T]]:
    """The first ``(round, item)`` of ``plan`` not yet taken, or None when all are.

    An item appears once per round, so its ``r``-th slot (0-based) is taken once ``taken[item] > r``
    re-runs of it exist (finished, or running in another worker): a resumed search continues the rounds
    instead of restarting them, and two workers never take the same slot."""
    for r, items in enumerate(plan):
        for item in items:
            if taken.get(item, 0) <= r:
                return r, item
    return None


# --------------------------------------------------------------------------- what the re-runs say
@dataclass(frozen=True)
class Rerun:
    """One finished re-run (a trial with ``confirm_of``)."""

    number: int
    status: str  # its Status value (a re-run that did not end ok is a failed one)
    throughput: Optional[float] = None
    peak_memory_gb: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.status == Status.OK and self.throughput is not None and self.throughput > 0


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


def summarize(number: int, runs: Sequence[Rerun], base_runs: Optional[Sequence[Rerun]] = None) -> dict:
    """One config's confirmed figures (an entry of :func:`aggregate`; ``base_runs`` None: no baseline).

    ``ratio``/``ratio_ci``: median and 90% interval of the paired ratios (:func:`log_interval`);
    ``throughput``/``throughput_ci``: the same over its ok re-runs' throughputs; ``peak_memory_gb``: the
    largest peak over its re-runs; ``trials``: the re-runs' numbers; ``failed``: re-runs that did not end
    ok; ``rounds``: the figures the median is over (paired rounds, or ok re-runs without a baseline)."""
    ok = [r for r in runs if r.ok]
    thr, thr_ci = log_interval([r.throughput for r in ok])
    peaks = [r.peak_memory_gb for r in runs if r.peak_memory_gb is not None]
    ratios = paired_ratios(runs, base_runs) if base_runs is not None else []
    ratio, ratio_ci = log_interval(ratios)
    return {
        "number": int(number),
        "ratio": _round(ratio),
        "ratio_ci": None if ratio_ci is None else [_round(ratio_ci[0]), _round(ratio_ci[1])],
        "ratios": [_round(x) for x in ratios],
        "throughput": _round(thr, 3),
        "throughput_ci": None if thr_ci is None else [_round(thr_ci[0], 3), _round(thr_ci[1], 3)],
        "peak_memory_gb": _round(max(peaks), 4) if peaks else None,
        "trials": [int(r.number) for r in runs],
        "failed": sum(1 for r in runs if not r.ok),
        "statuses": sorted({r.status for r in runs if not r.ok}),
        "rounds": len(ratios) if base_runs is not None else len(ok),
    }


def aggregate(
    *,
    baseline: Optional[int],
    finalists: Sequence[int],
    rounds: int,
    headroom: float,
    runs: Mapping[int, Sequence[Rerun]],
) -> dict:
    """The study attribute ``confirmation`` (docs/contracts.md section 3) from the finished re-runs.

    ``runs``: config number -> its re-runs in trial-number order. ``complete``: every config of the
    plan has at least ``rounds`` finished re-runs (False after an interruption: a resumed search runs
    the rest)."""
    base_runs = list(runs.get(baseline, ())) if baseline is not None else None
    members = list(finalists) + ([baseline] if baseline is not None else [])
    base_entry = None
    if baseline is not None:
        base_entry = summarize(baseline, base_runs or [])
        if base_entry["throughput"] is not None:
            base_entry.update(ratio=1.0, ratio_ci=None, ratios=[], rounds=len([r for r in base_runs if r.ok]))
    return {
        "baseline": baseline,
        "rounds": int(rounds),
        "headroom": float(headroom),
        "complete": all(len(runs.get(n, ())) >= rounds for n in members),
        "finalists": [summarize(n, runs.get(n, ()), base_runs) for n in finalists],
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

    Ranked by the median paired ratio to the baseline (the baseline itself is 1.0), ties by less memory;
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


def _rounds(n: int) -> str:
    return f"{n} interleaved round{'s' if n != 1 else ''}"


def describe(entry: Mapping, *, baseline: str = "the baseline") -> str:
    """One line: ``1.42x the baseline (90% interval 1.31–1.55, 3 interleaved rounds)``; without a paired
    ratio, the median confirmed throughput with its interval."""
    n = int(entry.get("rounds") or 0)
    ratio, ci = entry.get("ratio"), entry.get("ratio_ci")
    if ratio is not None:
        if not entry.get("ratios"):  # the baseline: 1 by definition
            return f"{baseline} itself (1.00x; {_rounds(n)})"
        inner = f"90% interval {ci[0]:.2f}–{ci[1]:.2f}, " if ci else "no interval from one round, " if n == 1 else ""
        return f"{ratio:.2f}x {baseline} ({inner}{_rounds(n)})"
    thr, tci = entry.get("throughput"), entry.get("throughput_ci")
    if thr is None:
        return "not confirmed (no re-run measured)"
    inner = f"90% interval {tci[0]:.1f}–{tci[1]:.1f}, " if tci else ""
    return f"{thr:.1f} tokens/s/GPU ({inner}median of {_rounds(n)}; no baseline to pair with)"
