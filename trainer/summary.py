"""A run's summary from its per-step rows (torch-free: both trial engines use it)."""

from __future__ import annotations

import statistics

__all__ = ["summarize_steps"]


def _cv(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return 0.0 if xs else None
    mean = statistics.fmean(xs)
    return statistics.stdev(xs) / mean if mean else None


def summarize_steps(steps: list[dict], *, device_type: str) -> dict:
    """Median over measured (non-warm-up) steps; peaks over all steps (warm-up included: it can OOM too)."""
    measured = [s for s in steps if not s["warmup"]] or []
    thr = [s["perf/throughput"] for s in measured]
    step_s = [s["timing_s/step"] for s in measured]
    phases = sorted({k for s in measured for k in s if k.startswith("timing_s/")})
    mem_phases = sorted({k for s in steps for k in s if k.startswith("memory/")})
    peak = lambda key: max((s[key] for s in steps if s.get(key) is not None), default=None)  # noqa: E731
    mfu = [s["perf/mfu/actor"] for s in measured if s.get("perf/mfu/actor") is not None]
    if device_type == "cuda":
        peak_mem, source = peak("perf/max_memory_reserved_gb"), "torch_cuda"
    else:
        peak_mem, source = peak("perf/peak_rss_gb"), "rss"
    return {
        "num_measured_steps": len(measured),
        "throughput": statistics.median(thr) if thr else None,
        "throughput_cv": _cv(thr),
        "step_s": statistics.median(step_s) if step_s else None,
        "step_s_cv": _cv(step_s),
        "timing_s": {k.split("/", 1)[1]: statistics.median([s[k] for s in measured if k in s]) for k in phases},
        "peak_memory_gb": peak_mem,
        "peak_memory_allocated_gb": peak("perf/max_memory_allocated_gb"),
        "peak_memory_reserved_gb": peak("perf/max_memory_reserved_gb"),
        "peak_rss_gb": peak("perf/peak_rss_gb"),
        "peak_memory_by_phase_gb": {k.split("/", 1)[1].removesuffix("_gb"): peak(k) for k in mem_phases},
        "memory_source": source,
        "mfu": statistics.median(mfu) if mfu else None,
    }
