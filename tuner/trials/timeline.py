"""What a trial held over time, and what it held in each of a run's phase windows.

The memory sampler (:class:`tuner.trials.memory.MemorySampler`) adds one reading per sample to a :class:`Timeline`
(per lane: a GPU, or on a CPU the largest process); :func:`held_in_windows` reads it over a verl run's phase windows
(the plugin's timestamps), so that a phase's figure is what the trial's processes held while it ran (vLLM's servers
while awake) and an in-run sweep's setting gets what its own steps held.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

__all__ = ["Timeline", "held_in_windows", "TIMELINE_BUCKETS"]

#: buckets a timeline keeps: past it neighbours merge in pairs (each its time span and its lanes' maxima), so a long
#: trial keeps its whole run at a coarser grain
TIMELINE_BUCKETS = 8192


class Timeline:
    """What a trial held over time, bounded: buckets ``[first time, last time, (GB per lane)]`` in time order (a lane
    a GPU; on a CPU the one largest process). A bucket is one sample until the timeline is full; then neighbours
    merge, keeping their span and each lane's maximum, so a window reads at least what was held in it."""

    def __init__(self, cap: int = TIMELINE_BUCKETS) -> None:
        self.cap = max(2, cap)
        self.buckets: list[list] = []
        self.stride = 1  # samples a bucket holds: doubled at each merge, so every bucket spans as many
        self._in_last = 0

    def add(self, t: float, lanes: Sequence[float]) -> None:
        if self.buckets and self._in_last < self.stride:
            last = self.buckets[-1]
            last[1], last[2] = t, _lane_max(last[2], lanes)
            self._in_last += 1
            return
        self.buckets.append([t, t, tuple(lanes)])
        self._in_last = 1
        if len(self.buckets) > self.cap:
            pairs = zip(self.buckets[0::2], self.buckets[1::2])
            merged = [[a[0], b[1], _lane_max(a[2], b[2])] for a, b in pairs]
            self.buckets = merged + (self.buckets[-1:] if len(self.buckets) % 2 else [])
            self.stride *= 2
            self._in_last = self.stride

    def peak(self, start: float, end: float) -> Optional[float]:
        """The most any lane held in ``[start, end]`` (GB), over the buckets that overlap it; None: no sample there."""
        inside = [max(b[2]) for b in self.buckets if b[1] >= start and b[0] <= end and b[2]]
        return max(inside) if inside else None


def _lane_max(a: Sequence[float], b: Sequence[float]) -> tuple:
    """Each lane's maximum (a lane missing from one, a GPU NVML failed to read at that sample, counts as 0)."""
    return tuple(max(x, y) for x, y in itertools.zip_longest(a, b, fillvalue=0.0))


def held_in_windows(timeline: Optional[Timeline], windows: Sequence[dict]) -> Optional[dict]:
    """What the trial held in each of a run's phase windows (``[{"step", "phase", "start", "end"}]``: a verl
    result's ``phase_windows``), max over its GPUs: ``{"by_phase": {phase: GB}, "by_step": {step: {phase: GB,
    "step": GB}}}``; a step's ``"step"`` spans its first window's start to its last window's end. None without a
    timeline or windows; a window no sample fell in has no figure."""
    if timeline is None or not timeline.buckets or not windows:
        return None
    by_phase: dict[str, float] = {}
    by_step: dict[str, dict] = {}
    spans: dict[str, list] = {}
    for w in windows:
        step = str(w["step"])
        span = spans.setdefault(step, [w["start"], w["end"]])
        span[0], span[1] = min(span[0], w["start"]), max(span[1], w["end"])
        gb = timeline.peak(w["start"], w["end"])
        if gb is None:
            continue
        by_phase[w["phase"]] = round(max(by_phase.get(w["phase"], 0.0), gb), 3)
        mine = by_step.setdefault(step, {})
        mine[w["phase"]] = round(max(mine.get(w["phase"], 0.0), gb), 3)
    for step, (start, end) in spans.items():
        gb = timeline.peak(start, end)
        if gb is not None:
            by_step.setdefault(step, {})["step"] = round(gb, 3)
    return {"by_phase": by_phase, "by_step": by_step}
