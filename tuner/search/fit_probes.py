"""``ppotune fit``'s effects: the study its probes are trials of, each probe run and told, the state kept.

Every probe is a trial of an Optuna study (``--storage``, as for a search; ``ppotune report`` and optuna-dashboard
read it): asked with the knobs' values as its params, claimed and beaten like a search's trial, run by the search's
own runner and told through :class:`tuner.search.session.TrialSession` (OOM, hang, crash are statuses; values
(throughput, peak) with the graded memory constraint). The decisions (:mod:`tuner.fit.boundary`) are kept in the
study attribute :data:`FIT_ATTR` after each probe, with the probes they have read: the same command again resumes,
reading any probe that finished after the last save, and asks nothing a finished fit does not need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import optuna

from trainer.config import apply_overrides
from trainer.contracts import Status, TrialRecord
from tuner.fit.boundary import FitState, KnobFit, ProbeOutcome, ProbePlan, judge_probe, next_probe
from tuner.fit.inputs import FitInputs
from tuner.fit.propose import knob_values, model_predictor, proposals
from tuner.memory_model import MIN_LOO_SAMPLES, MemoryModel, sample_from_attrs
from tuner.rules import candidates as decide
from tuner.search.session import Proposal, TrialSession
from tuner.study import lifecycle as st
from tuner.study.storage import trial_id

__all__ = ["FIT_ATTR", "UNSTATED_ERROR", "FitRun", "fit_attr", "state_of"]

#: The study attribute holding the fit: its inputs' summary, the decisions' state, the probes read.
FIT_ATTR = "fit"
#: How far the memory model is trusted before it states an error (under MIN_LOO_SAMPLES probes): an OOM it put
#: over the limit by more than this is expected, not a noisy boundary (docs/fit.md, "the repeat")
UNSTATED_ERROR = 0.25


def fit_attr(inputs: FitInputs, state: FitState, judged: list[int]) -> dict:
    """The study attribute: what the fit is (knobs, memory, limit), where it stands, which probes it has read."""
    return {
        "engine": inputs.engine,
        "memory_gb": inputs.memory_gb,
        "headroom": inputs.headroom,
        "limit_gb": inputs.limit_gb,
        "knobs": [k.to_dict() for k in inputs.knobs],
        "state": state.to_dict(),
        "judged": sorted(judged),
        "done": state.done,
    }


def state_of(attr: Optional[dict], inputs: FitInputs) -> tuple[FitState, list[int]]:
    """The saved state, or a fresh one; ValueError when the study's fit was of other knobs or another memory."""
    if not attr:
        return FitState([KnobFit(k) for k in inputs.knobs]), []
    mine = fit_attr(inputs, FitState([]), [])
    for key in ("engine", "knobs", "memory_gb", "headroom"):
        if attr.get(key) != mine[key]:
            raise ValueError(f"the study holds a fit with a different {key}; pass --study NAME to start another")
    return FitState.from_dict(attr["state"]), list(attr.get("judged") or [])


@dataclass
class FitRun:
    """One fit over an opened study (``session``: its study, lock, runner, trial base, ladder space)."""

    inputs: FitInputs
    session: TrialSession
    say: Callable[[str], None] = print
    state: FitState = field(init=False)
    judged: list = field(init=False)
    model: Optional[MemoryModel] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.state, self.judged = state_of(self.session.study.user_attrs.get(FIT_ATTR), self.inputs)
        self._catch_up()

    # ---- the loop
    def run(self) -> FitState:
        """Probe until the fit is done or stopped (``session.stop_event``); raises FitBlocked when no size fits."""
        s = self.session
        while not s.stop_event.is_set():
            props, predicted = self._propose()
            plan = next_probe(self.state, start=self.inputs.start, proposals=props)
            if plan is None:
                break
            frozen = self._probe(plan)
            rec = TrialRecord.from_user_attrs(frozen.user_attrs)
            if rec.status in (None, Status.INTERRUPTED):
                break
            self._judge(frozen.number, plan, rec, predicted(plan.rungs) if predicted else None)
        self._save()
        return self.state

    def _judge(self, number: int, plan: ProbePlan, rec: TrialRecord, predicted: Optional[dict]) -> None:
        outcome = ProbeOutcome(
            rec.status,
            peak_gb=rec.peak_memory_gb,
            by_phase_gb=(rec.memory or {}).get("by_phase_gb") or {},
            oom_phase=rec.oom_phase,
            error=rec.error,
        )
        error = (self.model.gate_error if self.model is not None else None) or UNSTATED_ERROR
        try:
            made = judge_probe(
                self.state,
                plan.rungs,
                outcome,
                limit_gb=self.inputs.limit_gb,
                tested=list(plan.why),
                probe=number,
                predicted=predicted,
                error=error,
            )
        finally:
            self.judged.append(number)
            self._save()
        for key, obs in made:
            if key in plan.why:
                knob = self.state.fit(key).knob
                self.say(f"  {knob.role} {knob.ladder[obs.rung]}: {obs.verdict}")

    # ---- the model (ppotune's engine)
    def _propose(self) -> tuple[Optional[dict], Optional[Callable]]:
        """(the model's proposals, a function giving its figure for each knob's passes at some rungs), or (None,
        None) without a model. Rungs it rules out are recorded here."""
        if self.inputs.engine != "ppotune":
            return None, None
        s = self.session
        base = s.trial_flat
        samples = [sample_from_attrs(t.user_attrs, base, number=t.number) for t in self._probes()]
        samples = [x for x in samples if x is not None]
        if not samples:
            return None, None
        self.model = MemoryModel.calibrate(samples, device_memory_gb=self.inputs.device.get("memory_total_gb"))
        predict = model_predictor(self.model, base, list(self.inputs.knobs))
        error = self.model.gate_error if len(samples) >= MIN_LOO_SAMPLES else None
        props, ruled = proposals(
            self.state, predict, start=self.inputs.start, limit_gb=self.inputs.limit_gb, error=error
        )
        for key, obs in ruled:
            self.state.fit(key).record(obs)
            knob = self.state.fit(key).knob
            self.say(
                f"  {knob.role} {knob.ladder[obs.rung]}: predicted over the limit "
                f"({obs.predicted_gb:.3f} GB, error {obs.error:.0%}): not probed"
            )

        def figures(rungs: dict) -> dict:
            by_phase = predict(rungs)
            return {f.key: max((by_phase.get(p, 0.0) for p in f.knob.phases), default=0.0) for f in self.state.fits}

        return props, figures

    # ---- one probe as a study trial
    def _probes(self) -> list:
        """The study's finished probe trials."""
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        return [t for t in self.session.study.get_trials(deepcopy=False) if t.state in done]

    def _probe(self, plan: ProbePlan) -> optuna.trial.FrozenTrial:
        s = self.session
        values = knob_values(list(self.inputs.knobs), plan.rungs)
        with s.lock():
            s.study.enqueue_trial(s.space.to_params(values), skip_if_exists=False)
            while True:  # a probe enqueued again by an interrupted run is asked first: it is not this one
                trial = s.ask()
                cand = s.space.suggest(trial, s.trial_flat)
                if cand.params == values:
                    break
                gone = TrialRecord(status=Status.INTERRUPTED, error="superseded: the fit asks another probe")
                st.finish(s.study, trial, gone)
            st.claim(trial)
            if s.heartbeat is not None:
                s.heartbeat.add(trial_id(s.storage, s.study, trial.number))
            for k, v in TrialRecord(overrides=cand.overrides).to_user_attrs(only={"overrides"}).items():
                trial.set_user_attr(k, v)
        roles = {k.key: k.role for k in self.inputs.knobs}
        tested = ", ".join(f"{roles[k]} {values[k]} ({why})" for k, why in plan.why.items())
        self.say(f"ppotune fit: probe #{trial.number}: {tested}")
        config = apply_overrides(s.trial_base, cand.overrides)
        s.process(Proposal(trial, cand, decide.LaunchVerdict(config=config)), slot=0)
        return s.study.get_trials(deepcopy=False)[trial.number]  # numbers are list positions

    # ---- resume
    def _catch_up(self) -> None:
        """Read the probes that finished after the state was last saved (a fit killed between the two)."""
        for t in self._probes():
            rec = TrialRecord.from_user_attrs(t.user_attrs)
            if t.number in self.judged or rec.status in (None, Status.INTERRUPTED):
                continue
            values = dict(rec.overrides or {})
            rungs = {k.key: k.rung(values.get(k.key)) for k in self.inputs.knobs}
            if any(r is None for r in rungs.values()):
                self.judged.append(t.number)
                continue
            self._judge(t.number, ProbePlan(rungs, {}), rec, None)

    def _save(self) -> None:
        s = self.session
        with s.lock():
            s.study.set_user_attr(FIT_ATTR, fit_attr(self.inputs, self.state, self.judged))
