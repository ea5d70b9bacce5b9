"""What the report and why.md say about memory beyond the measured peaks: the study's calibrated memory
model (predicted vs measured, its error), the pick projected from the trials' world to the production's,
and the pick's typical vs worst-case peak (pure over a :class:`~tuner.results.view.StudyView`; no torch).

The model is calibrated here from the study's measured trials (:mod:`tuner.memory_model`), the same way the
search calibrates it, so a report of a study written before the model existed shows it too. "Predicted" for
a trial is its leave-one-out prediction: the model fitted on the other trials, never on itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from trainer.config import flatten
from trainer.contracts import Status
from tuner.results.view import StudyView
from tuner.rules.world import WorldPlan
from tuner.trials.probe import WORST_CASE_ATTR, ProbeResult

__all__ = ["MemoryFindings", "memory_findings", "findings_md", "projection_text"]


@dataclass
class MemoryFindings:
    num_samples: int = 0  # measured trials with per-phase peaks the model was fitted on
    error: Optional[dict] = None  # leave-one-out error of the peak: {"median", "max", "n"} (relative)
    rows: list = field(default_factory=list)  # [{"number", "measured_gb", "predicted_gb", "error"}] held out
    predicted_oom: int = 0  # candidates the search did not launch on the model's word
    pick: Optional[dict] = None  # the pick: measured at the trial world, projected to the target's
    worst_case: list = field(default_factory=list)  # [{"number", "typical_gb", "worst": ProbeResult}] probed configs
    why_not: Optional[str] = None  # why there is no model (too few trials with per-phase peaks, ...)


def memory_findings(view: StudyView, chosen: Optional[int] = None) -> MemoryFindings:
    from tuner.memory_model import MIN_LOO_SAMPLES, MemoryModel, samples_from_trials

    df = view.trials
    out = MemoryFindings(predicted_oom=int((df["status"] == Status.PREDICTED_OOM).sum()) if not df.empty else 0)
    for n, d in sorted((view.attrs.get(WORST_CASE_ATTR) or {}).items(), key=lambda kv: int(kv[0])):
        rec = view.record(int(n)) if int(n) in set(df["number"]) else None
        typical = rec.peak_memory_gb if rec is not None else None
        out.worst_case.append({"number": int(n), "typical_gb": typical, "worst": ProbeResult.from_dict(d)})
    base = view.attrs.get("base_config") or {}
    samples = samples_from_trials(view.sound_trials(), base)
    out.num_samples = len(samples)
    if len(samples) < MIN_LOO_SAMPLES:
        out.why_not = (
            f"{len(samples)} measured trial(s) with per-phase peaks; the model needs {MIN_LOO_SAMPLES} to state "
            "its error (studies written before per-phase peaks were recorded have none)"
        )
        return out
    device_gb = (view.attrs.get("device") or {}).get("memory_total_gb")
    try:
        model = MemoryModel.calibrate(samples, device_memory_gb=device_gb)
    except ValueError as e:
        out.why_not = f"the model could not be fitted: {e}"
        return out
    out.error = (model.error or {}).get("peak")
    out.rows = [
        {**r, "error": abs(r["predicted_gb"] - r["measured_gb"]) / r["measured_gb"] if r["measured_gb"] else None}
        for r in model.loo
    ]
    if chosen is not None and chosen in set(df["number"]):
        out.pick = _projection(view, model, chosen, flatten(base))
    return out


def _projection(view: StudyView, model: Any, number: int, base_flat: dict) -> Optional[dict]:
    """The pick's measured peak at the trial world and projected to the production world: the measured
    peak plus the model's change in the sharded state (the per-GPU batch is the production's already)."""
    rec = view.record(number)
    if rec.peak_memory_gb is None:
        return None
    config = {**base_flat, **(rec.overrides or {})}
    target = view.attrs.get("target")
    plan = WorldPlan.from_dict(target) if target else None
    trial_world = plan.trial_world if plan else None
    try:
        at_trial = model.predict(config, world=trial_world)
        at_target = model.predict(config, world=plan.target_world) if plan and plan.scaled else at_trial
    except (KeyError, ValueError, TypeError):
        return None
    delta = at_target.peak_gb - at_trial.peak_gb
    return {
        "number": number,
        "measured_gb": float(rec.peak_memory_gb),
        "trial_world": at_trial.world,
        "target_world": at_target.world,
        "state_trial_gb": max(at_trial.state_gb.values()),
        "state_target_gb": max(at_target.state_gb.values()),
        "projected_gb": float(rec.peak_memory_gb) + delta,
        "scaled": bool(plan and plan.scaled),
    }


def projection_text(p: dict) -> str:
    """One sentence: the pick's peak measured at the trial world and projected to the production's."""
    return (
        f"trial #{p['number']}: peak {p['measured_gb']:.3g} GB measured on {p['trial_world']} GPUs running the "
        f"production's per-GPU batch; projected to the {p['target_world']}-GPU job: {p['projected_gb']:.3g} GB "
        f"(the sharded state per GPU {p['state_trial_gb']:.3g} -> {p['state_target_gb']:.3g} GB, by the model)"
    )


def findings_md(f: MemoryFindings, *, limit_gb: Optional[float] = None) -> list[str]:
    """The findings as Markdown lines (why.md, summary.md)."""
    out = []
    if f.error:
        out.append(
            f"- memory model: fitted on {f.num_samples} measured trials; leave-one-out error of the peak: "
            f"median {f.error['median']:.1%}, max {f.error['max']:.1%}; {f.predicted_oom} candidate(s) predicted "
            "over the limit beyond that error were not launched"
        )
    elif f.why_not:
        out.append(f"- memory model: none ({f.why_not})")
    if f.pick is not None and f.pick["scaled"]:
        out.append(f"- {projection_text(f.pick)}")
    for w in f.worst_case:
        probe: ProbeResult = w["worst"]
        typical = f"{w['typical_gb']:.3g} GB" if w["typical_gb"] is not None else "?"
        if probe.status == Status.OOM:
            worst = f"OUT OF MEMORY in {probe.oom_phase or '?'}"
        elif probe.fits:
            worst = f"{probe.peak_memory_gb:.3g} GB" + (
                " (over the limit)" if limit_gb is not None and (probe.peak_memory_gb or 0) > limit_gb else ""
            )
        else:
            worst = f"not measured ({probe.status.value})"
        out.append(
            f"- trial #{w['number']}: typical peak {typical}, worst case {worst} (prompts {probe.prompt_length} + "
            f"responses {probe.response_length} tokens)"
        )
    return out
