"""verl's per-step metrics (its file logger's JSONL: ``{"step": N, "data": {...}}`` per line) read as ppotune's
step rows (``trainer/result_schema.json``), the token lengths they saw, and whether a running verl has measured
enough. Torch-free."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

from trainer.summary import measuring_done, summarize_steps
from trainer.verl_engine.schedule import WINDOW_METRIC, Schedule

_PLUGIN_MEMORY = "ppotune/memory/"

__all__ = ["steps_from_jsonl", "lengths_of", "windows_of", "Enough"]


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def steps_from_jsonl(text: str, *, warmup: int, device: str, schedule: Optional[Schedule] = None) -> list[dict]:
    """verl's file-logger lines (``{"step": N, "data": {...}}``) -> our per-step rows (result schema). What ppotune's
    plugin adds to a row (trainer.verl_engine.plugin) becomes ours: ``ppotune/memory/<pass>_gb`` the pass's peak
    (``memory/<pass>_gb``, as our trainer's rows), ``ppotune/setting`` the in-run sweep's setting (``setting``; its
    first step a warm-up: ``schedule``)."""
    rows = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        data = rec.get("data") if isinstance(rec, dict) else None
        if not isinstance(data, dict) or "perf/throughput" not in data:
            continue  # validation-only lines
        # verl's step metrics, numbers only; nested timings (agent_loop/..., profiler marks) are not phases
        row = {
            k: v
            for k, v in data.items()
            if _num(v) is not None and not (k.startswith("timing_s/") and ("/" in k[9:] or k.endswith("_profile")))
        }
        step = int(rec.get("step", len(rows) + 1))
        at = schedule.at(step) if schedule is not None else None
        for key, value in list(row.items()):
            if key.startswith(_PLUGIN_MEMORY):
                row[f"memory/{key[len(_PLUGIN_MEMORY) :]}"] = value
        if at is not None:
            row["setting"] = at[0]
        row.update(
            {
                "step": step,
                "warmup": step <= warmup if at is None else not at[1],
                "timing_s/step": float(data["timing_s/step"]),
                "perf/throughput": float(data["perf/throughput"]),
                "perf/total_num_tokens": int(data["perf/total_num_tokens"]),
            }
        )
        if device == "cuda":  # verl logs allocator peaks per role; there is no global key
            for kind in ("allocated", "reserved"):
                peaks = [_num(data.get(f"{role}/perf/max_memory_{kind}_gb")) for role in ("actor", "critic")]
                peaks = [p for p in peaks if p is not None]
                row[f"perf/max_memory_{kind}_gb"] = max(peaks) if peaks else None
        rows.append(row)
    return rows


def lengths_of(rows: list[dict]) -> dict:
    """The token lengths verl's steps saw (its ``prompt_length/{min,mean,max}``, ``response_length/...``):
    ``{"prompt": {"min", "mean", "max"}, "response": {...}}``, with the percentiles p10/p50/p90 (the median over the
    steps) where ppotune's plugin measured them (``ppotune/lengths/<part>/p<q>``: verl logs none), or where every
    sequence had one length (min == max, e.g. the worst-case probe), which makes them exact."""
    out = {}
    for part in ("prompt", "response"):
        mins = [r[f"{part}_length/min"] for r in rows if f"{part}_length/min" in r]
        maxs = [r[f"{part}_length/max"] for r in rows if f"{part}_length/max" in r]
        means = [r[f"{part}_length/mean"] for r in rows if f"{part}_length/mean" in r]
        if not (mins and maxs and means):
            continue
        fig = {"min": float(min(mins)), "mean": float(sum(means) / len(means)), "max": float(max(maxs))}
        if fig["min"] == fig["max"]:
            fig.update({q: fig["max"] for q in ("p10", "p50", "p90")})
        for q in ("p10", "p50", "p90"):
            measured = [r[f"ppotune/lengths/{part}/{q}"] for r in rows if f"ppotune/lengths/{part}/{q}" in r]
            if measured and q not in fig:
                fig[q] = float(statistics.median(measured))
        out[part] = fig
    return out


def windows_of(rows: list[dict]) -> list[dict]:
    """The phases' wall-clock windows the plugin put in each row (``ppotune/window/<phase>/<k>/start|end``), taken out
    of the rows: ``[{"step", "phase", "start", "end"}, ...]`` in step order."""
    out = []
    for row in rows:
        found: dict[tuple, dict] = {}
        for key in [k for k in row if k.startswith(WINDOW_METRIC)]:
            phase, k, edge = key[len(WINDOW_METRIC) :].rsplit("/", 2)
            found.setdefault((phase, int(k)), {})[edge] = row.pop(key)
        for (phase, _), w in sorted(found.items()):
            if "start" in w and "end" in w:
                out.append({"step": row["step"], "phase": phase, "start": w["start"], "end": w["end"]})
    return out


class Enough:
    """Whether a running verl has measured enough (``precision``, ``front``: :func:`trainer.summary.measuring_done`),
    read from its file logger's JSONL as it grows. ``stopped``: why it was ended, with the step."""

    def __init__(self, spec, metrics: Path, device: str):
        self.spec, self.metrics, self.device = spec, metrics, device
        # an in-run sweep measures every setting for its steps: its settings are separate trials
        self.active = (spec.precision is not None or bool(spec.front)) and not spec.sweep
        self.size = 0
        self.stopped: Optional[str] = None

    def __call__(self) -> Optional[str]:
        if not self.active or self.stopped:
            return None
        try:
            size = self.metrics.stat().st_size
        except OSError:
            return None
        if size == self.size:
            return None
        self.size = size
        rows = steps_from_jsonl(self.metrics.read_text(), warmup=self.spec.warmup, device=self.device)
        if not rows or rows[-1]["step"] >= self.spec.steps:
            return None  # the last step: verl ends by itself
        summary = summarize_steps(rows, device_type=self.device)
        why = measuring_done(
            [r["perf/throughput"] for r in rows if not r["warmup"]],
            peak_memory_gb=summary["peak_memory_gb"],
            precision=self.spec.precision,
            min_steps=self.spec.min_measured_steps,
            front=self.spec.front,
        )
        if why:
            self.stopped = f"{why} (after step {rows[-1]['step']} of {self.spec.steps})"
        return self.stopped
