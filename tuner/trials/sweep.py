"""In-run sweeps of a verl search: configs that differ only in verl's per-step knobs run as one verl run.

verl reads a pass's micro-batching per call (:mod:`trainer.verl_engine.schedule`), so one start-up of verl (most of
a short trial: model load, Ray, the rollout engine) can measure several settings of those knobs, a few steps each.
When the search launches a config, :class:`SweepRunner` takes up to ``settings - 1`` more configs of the space that
differ from it only in per-step knobs and that the study does not hold yet, runs them all in one verl run in the
order of rising memory (an OOM ends the run), and records each setting as its own trial of the study: the asked
one as usual, the others as trials added with their params, records and statuses (``ok``, ``oom``, ``hang``, a
crash), so the sampler, the report and export read them like any other. A setting the run never reached is an
inferred OOM where it is at least as hungry as the one that ran out of memory on every monotone knob, else left to
the sampler (the asked config is then interrupted: its params are enqueued again).

Each setting's figures are its own steps' (its first step after the change unmeasured). Its memory is what the
trial's processes held over its own steps (the sampler's timeline over each step's window: generation, weight sync
and the passes, vLLM's servers counted while awake: ``memory["external_by_step_gb"]``, tuner.trials.runners), or
its largest per-pass peak where that is higher (a spike between two samples), on the same basis as a trial run alone.
Without a timeline (a result without phase windows) it falls back to the largest per-pass peak of its steps plus what
the run held beside the passes (the run's peak over the largest per-pass peak of all its steps: one offset for every
setting, which under-reports a lighter setting by the difference of the passes); the record's notes say which. Its
duration is the run's, shared evenly among the settings that ran.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import optuna

from trainer.contracts import CONSTRAINT_KEY, Status, TrialRecord
from trainer.verl_engine.run_file import DEFAULT_SWEEP_SETTINGS
from trainer.verl_engine.schedule import is_per_step
from tuner.rules import candidates as decide
from tuner.space import Candidate, Space
from tuner.trials.runners import SubprocessRunner, TrialOutcome, TrialRequest

__all__ = ["SweepRunner", "group_for", "split_outcome", "record_setting"]


_SCAN = 20_000  # configs of the space looked at for a group


def _fixed_part(space: Space, eff: dict) -> tuple:
    """The identity of a config less its per-step knobs: what the configs of one run share."""
    return tuple((k, v) for k, v in space.identity(eff) if not is_per_step(k))


def _hunger(space: Space, eff: dict) -> float:
    """A total order consistent with the knobs' memory hints: the sum of each active monotone per-step knob's
    position in its domain (0..1; reversed for a knob whose memory decreases)."""
    total = 0.0
    for knob in space.knobs:
        if not is_per_step(knob.key) or knob.memory not in ("increasing", "decreasing") or knob.key not in eff:
            continue
        domain = knob.domain()
        try:
            pos = domain.index(eff[knob.key]) / max(1, len(domain) - 1)
        except ValueError:
            continue
        total += pos if knob.memory == "increasing" else 1 - pos
    return total


def group_for(space: Space, cand: Candidate, trial_flat: dict, *, held: set, settings: int, seed: int) -> list:
    """``cand`` and up to ``settings - 1`` configs that differ from it only in per-step knobs, are valid in the
    space and not ``held`` by the study, picked at random (``seed``), all in the order of rising memory."""
    if settings <= 1 or not any(is_per_step(k.key) for k in space.knobs):
        return [cand]
    fixed, own = _fixed_part(space, cand.effective), space.identity(cand.effective)
    others = []
    for c in space.grid(trial_flat, limit=_SCAN):
        if c.error or c.violated:
            continue
        ident = space.identity(c.effective)
        if ident != own and ident not in held and _fixed_part(space, c.effective) == fixed:
            others.append(c)
    picked = random.Random(seed).sample(others, min(len(others), settings - 1))
    return sorted([cand, *picked], key=lambda c: _hunger(space, c.effective))


@dataclass
class SweepRunner:
    """A verl :class:`SubprocessRunner` whose launches measure a group of settings in one verl run (the search's
    session calls :meth:`group`; everything else runs as the inner runner runs it)."""

    inner: SubprocessRunner
    settings: int = DEFAULT_SWEEP_SETTINGS
    name: str = "verl"

    def run(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        return self.inner.run(request, stop)

    def group(self, session: Any, prop: Any, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        """Run ``prop`` (a launched proposal of ``session``) with its group; record the other settings as trials of
        the study; return the asked trial's outcome."""
        trials = session.study.get_trials(deepcopy=False)
        held = decide.seen_configs(trials, session.space, session.trial_flat)
        group = group_for(
            session.space, prop.cand, session.trial_flat, held=held, settings=self.settings, seed=request.number
        )
        if len(group) == 1:
            return self.inner.run(request, stop)
        judged = [(c, _judge(session, c, trials)) for c in group]
        group = [(c, v) for c, v in judged if c is prop.cand or v.launch]  # a sibling the study rules out: not run
        # every setting names every per-step key of the space (the base's value where it leaves one alone): the
        # run's own config is the first setting's, and a key a setting left out would keep the one before it
        keys = [k for k, _ in session.space.identity(prop.cand.effective) if is_per_step(k)]
        per_step = [{k: c.effective[k] for k in keys if c.effective.get(k) is not None} for c, _ in group]
        mine = next(i for i, (c, _) in enumerate(group) if c is prop.cand)
        fixed = {k: v for k, v in prop.cand.overrides.items() if not is_per_step(k)}
        run = dataclasses.replace(request, overrides={**fixed, **per_step[0]}, sweep=tuple(per_step))
        inner = self.inner  # --trial-timeout bounds a trial: a run of several gets it once per setting
        if inner.timeout_s is not None:
            inner = dataclasses.replace(inner, timeout_s=inner.timeout_s * len(group))
        whole = inner.run(run, stop)
        outcomes = split_outcome(whole, [c for c, _ in group], session.space)
        for i, (c, _) in enumerate(group):
            if i != mine and outcomes[i] is not None:
                record_setting(session, c, outcomes[i])
        if outcomes[mine] is None:
            return TrialOutcome(Status.INTERRUPTED, TrialRecord(error="the in-run sweep ended before this setting"))
        return outcomes[mine]


def _judge(session: Any, cand: Candidate, trials: list) -> Any:
    known = decide.known_configs(trials, session.space, session.trial_flat)
    return decide.judge_candidate(
        cand, number=-1, space=session.space, trial_base=session.trial_base, trial_flat=session.trial_flat, known=known
    )


def split_outcome(whole: TrialOutcome, cands: list, space: Space) -> list[Optional[TrialOutcome]]:
    """The outcome of each setting of one run (None: not reached and not ruled out by the run's OOM)."""
    rec = whole.record
    try:
        result = json.loads(Path(rec.result_path).read_text()) if rec.result_path else {}
    except (OSError, ValueError):
        result = {}
    settings = result.get("settings") or []
    if len(settings) != len(cands):  # no per-setting result (verl never started): the run's outcome for all
        return [TrialOutcome(whole.status, dataclasses.replace(rec)) for _ in cands]
    offset = _beside_passes(settings, rec.peak_memory_gb)
    ran = [s for s in settings if s["status"] != "not_run"]
    out: list[Optional[TrialOutcome]] = []
    oom = None
    for cand, s in zip(cands, settings):
        if s["status"] == "not_run":
            inferred = oom is not None and space.at_least_as_hungry(cand.effective, oom.effective)
            why = "inferred OOM: at least as hungry as the setting that ran out of memory in the same verl run"
            out.append(TrialOutcome(Status.INFERRED_OOM, TrialRecord(duration_s=0.0, error=why)) if inferred else None)
            continue
        failed = whole.status if whole.status != Status.OK else Status.CRASH  # the run's own verdict: hang, crash
        status = {"ok": Status.OK, "oom": Status.OOM}.get(s["status"], failed)
        if status == Status.OOM:
            oom = cand
        out.append(TrialOutcome(status, _setting_record(rec, s, offset, len(ran))))
    return out


def _beside_passes(settings: list[dict], run_peak: Optional[float]) -> Optional[float]:
    """What the run held beside its passes: its peak over the largest per-pass peak of all its steps."""
    passes = [v for s in settings for v in (s["summary"].get("peak_memory_by_phase_gb") or {}).values() if v]
    if run_peak is None or not passes:
        return None
    return max(0.0, run_peak - max(passes))


def _held_over_steps(rec: TrialRecord, setting: dict) -> Optional[dict]:
    """What the trial's processes held over the setting's own steps (the run's timeline, per step: every phase's
    window and the step's whole span), or None where the run kept no timeline of them."""
    by_step = (rec.memory or {}).get("external_by_step_gb") or {}
    mine = {str(r["step"]): by_step[str(r["step"])] for r in setting["steps"] if str(r["step"]) in by_step}
    spans = [v["step"] for v in mine.values() if v.get("step") is not None]
    if not spans:
        return None
    by_phase: dict[str, float] = {}
    for phases in mine.values():
        for p, v in phases.items():
            if p != "step":
                by_phase[p] = max(by_phase.get(p, 0.0), v)
    return {"external_peak_gb": max(spans), "external_by_phase_gb": by_phase, "external_by_step_gb": mine}


def _setting_record(rec: TrialRecord, setting: dict, offset: Optional[float], ran: int) -> TrialRecord:
    summary = setting["summary"]
    by_phase = {p: v for p, v in (summary.get("peak_memory_by_phase_gb") or {}).items() if v}
    held = _held_over_steps(rec, setting)
    memory = {**(rec.memory or {}), "by_phase_gb": by_phase, "samples": None}
    if held is not None:
        peak = max([held["external_peak_gb"], *by_phase.values()])
        memory.update(held)
        how = "its memory is what the trial held over its own steps (the memory timeline over their phase windows)"
    else:
        peak = max(by_phase.values()) + offset if by_phase and offset is not None else rec.peak_memory_gb
        memory.pop("external_by_phase_gb", None)
        how = (
            "no memory timeline of its steps: its memory is its largest per-pass peak plus the one offset the run"
            " held beside its passes (the same for every setting)"
        )
    return dataclasses.replace(
        rec,
        throughput=summary.get("throughput"),
        throughput_cv=summary.get("throughput_cv"),
        step_s=summary.get("step_s"),
        throughput_ci=summary.get("throughput_ci"),
        measured_steps=summary.get("num_measured_steps"),
        lengths=summary.get("lengths") or {},
        peak_memory_gb=peak,
        memory=memory,
        timing_s=summary.get("timing_s") or {},
        error=setting.get("error") or (rec.error if setting["status"] != "ok" else None),
        duration_s=(rec.duration_s or 0.0) / max(1, ran),
        notes=[*(rec.notes or []), f"measured in an in-run sweep of {ran} settings (one verl start-up); {how}"],
    )


def record_setting(session: Any, cand: Candidate, outcome: TrialOutcome) -> None:
    """A setting measured in another trial's verl run, recorded as a trial of its own (params, record, values and
    graded constraint, as :meth:`tuner.search.session.TrialSession.process` tells a trial it ran)."""
    tmp = optuna.create_study(directions=["maximize", "minimize"])
    tmp.enqueue_trial(session.space.to_params(cand.params))
    trial = tmp.ask()
    session.space.suggest(trial, session.trial_flat)  # the params' distributions, as the search's trials have them
    record = outcome.record
    record.status, record.overrides, record.baseline = outcome.status, dict(cand.overrides), False
    values = session._values(outcome)
    constraint = None
    if values is not None:
        record.constraint = decide.constraint(record, limit_gb=session.penalty_gb)
        graded = record.constraint if record.constraint is not None else -1.0 if outcome.status.feasible else 1.0
        constraint = {CONSTRAINT_KEY: float(graded)}
    frozen = optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE if values is not None else optuna.trial.TrialState.FAIL,
        values=list(values) if values is not None else None,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs={k: v for k, v in record.to_user_attrs().items() if v is not None},
        constraints=constraint,
    )
    session.study.add_trial(frozen)
    session.say(f"trial (in-run sweep) {outcome.status.value}: {cand.params}")
