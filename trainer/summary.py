"""A run's summary from its per-step rows, and when a trial has measured enough (torch-free: both
trial engines and the tuner use it).

A trial measures until its throughput estimate is tight: the 90% interval of the per-step
throughput (Student's t on the per-step values: ``mean ± t(0.95, n-1)·s/√n``, placed around the
median) within ``± precision`` of the median, after at least ``min_steps`` measured steps; or until
it cannot reach the Pareto front any more (a measured point has more throughput for sure, at no more
memory); or at its last step.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

__all__ = ["summarize_steps", "interval", "percentiles", "measuring_done", "first_step_outlier", "MIN_MEASURED_STEPS"]

#: the fewest measured steps an interval is computed from (two give a t-factor of 6.3)
MIN_MEASURED_STEPS = 3
# two-sided 90% Student t quantiles t(0.95, df), df = 1..30; beyond 30 the normal 1.645 is within 2%
_T90 = (
    (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753)
    + (1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
)  # fmt: skip


def interval(xs: Sequence[float]) -> Optional[tuple[float, float]]:
    """The 90% interval of a per-step figure: median ± t(0.95, n-1)·s/√n; None below 2 values."""
    if len(xs) < 2:
        return None
    half = (_T90[len(xs) - 2] if len(xs) - 1 <= len(_T90) else 1.645) * statistics.stdev(xs) / math.sqrt(len(xs))
    mid = statistics.median(xs)
    return mid - half, mid + half


#: a later trial of a warm job measures its first step unless that step took more than this times the median of
#: the next ones (then it is the warm-up it skipped): a later trial's first step is a measured step in all but
#: name (see docs/decisions.md#first-step-outlier).
FIRST_STEP_OUTLIER = 1.5


def first_step_outlier(step_seconds: Sequence[float], factor: float = FIRST_STEP_OUTLIER) -> Optional[bool]:
    """Whether the first of ``step_seconds`` is a warm-up after all: slower than ``factor`` times the median of
    the others; None until two others are known."""
    if len(step_seconds) < 3:
        return None
    return step_seconds[0] > factor * statistics.median(step_seconds[1:])


def percentiles(xs: Sequence[float], qs: Sequence[int] = (10, 50, 90)) -> dict:
    """``{"p10": .., "p50": .., "p90": .., "max": ..}`` (nearest rank); empty for no values."""
    if not xs:
        return {}
    v = sorted(xs)
    out = {f"p{q}": float(v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]) for q in qs}
    out["max"] = float(v[-1])
    return out


def measuring_done(
    throughputs: Sequence[float],
    *,
    peak_memory_gb: Optional[float],
    precision: Optional[float],
    min_steps: int = MIN_MEASURED_STEPS,
    front: Sequence[Sequence[float]] = (),
) -> Optional[str]:
    """Why a trial may stop measuring now (None: measure another step).

    ``throughputs``: the measured (post-warm-up) steps so far; ``front``: ``[trial, throughput low,
    peak GB]`` points the study has measured. Pruned: a point beats this trial's upper bound at no more
    memory than this trial already used, so it can be on neither end of the front. Tight: the interval's
    half-width is within ``precision`` of the median.
    """
    if len(throughputs) < max(min_steps, 2):
        return None
    lo, hi = interval(throughputs)
    mid = statistics.median(throughputs)
    if peak_memory_gb is not None:
        for number, thr_low, mem in front:
            if mem <= peak_memory_gb and thr_low > hi:
                return (
                    f"pruned: trial {int(number)} measured at least {thr_low:.1f} tokens/s/GPU at {mem:.2f} GB; "
                    f"this one at most {hi:.1f} at {peak_memory_gb:.2f} GB"
                )
    if precision is not None and mid > 0 and (hi - lo) / 2 <= precision * mid:
        return f"tight: 90% interval within ±{100 * (hi - lo) / 2 / mid:.1f}% of the median"
    return None


def _cv(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return 0.0 if xs else None
    mean = statistics.fmean(xs)
    return statistics.stdev(xs) / mean if mean else None


def summarize_steps(steps: list[dict], *, device_type: str, lengths: Optional[dict] = None) -> dict:
    """Median over measured (non-warm-up) steps; peaks over all steps (warm-up included: it can OOM too).

    ``lengths``: ``{"prompt": [tokens, ...], "response": [...]}`` of the sequences the run saw."""
    measured = [s for s in steps if not s["warmup"]] or []
    thr = [s["perf/throughput"] for s in measured]
    ci = interval(thr)
    seen = {part: percentiles(xs) for part, xs in (lengths or {}).items()}
    step_s = [s["timing_s/step"] for s in measured]
    phases = sorted({k for s in measured for k in s if k.startswith("timing_s/")})
    mem_phases = sorted({k for s in steps for k in s if k.startswith("memory/")})
    above_phases = sorted({k for s in steps for k in s if k.startswith("memory_above_start/")})
    peak = lambda key: max((s[key] for s in steps if s.get(key) is not None), default=None)  # noqa: E731
    mfu = [s["perf/mfu/actor"] for s in measured if s.get("perf/mfu/actor") is not None]
    if device_type == "cuda":
        peak_mem, source = peak("perf/max_memory_reserved_gb"), "torch_cuda"
    elif peak("perf/peak_rss_above_start_gb") is not None:
        # what the knobs change: the resident memory a rank gained after torch and the process group
        # were up (the same level the CPU cap counts from); the absolute RSS is kept beside it
        peak_mem, source = peak("perf/peak_rss_above_start_gb"), "rss_above_start"
    else:
        peak_mem, source = peak("perf/peak_rss_gb"), "rss"
    return {
        "num_measured_steps": len(measured),
        "throughput": statistics.median(thr) if thr else None,
        "throughput_cv": _cv(thr),
        "throughput_ci": list(ci) if ci else None,
        "lengths": {k: v for k, v in seen.items() if v},
        "step_s": statistics.median(step_s) if step_s else None,
        "step_s_cv": _cv(step_s),
        "timing_s": {k.split("/", 1)[1]: statistics.median([s[k] for s in measured if k in s]) for k in phases},
        "peak_memory_gb": peak_mem,
        "peak_memory_allocated_gb": peak("perf/max_memory_allocated_gb"),
        "peak_memory_reserved_gb": peak("perf/max_memory_reserved_gb"),
        "peak_rss_gb": peak("perf/peak_rss_gb"),
        "rss_start_gb": peak("perf/rss_start_gb"),
        "peak_memory_by_phase_gb": {k.split("/", 1)[1].removesuffix("_gb"): peak(k) for k in mem_phases},
        # CPU: the same above each rank's post-start level (the memory objective's basis), max over ranks
        "peak_memory_by_phase_above_start_gb": {k.split("/", 1)[1].removesuffix("_gb"): peak(k) for k in above_phases},
        "memory_source": source,
        "mfu": statistics.median(mfu) if mfu else None,
    }
