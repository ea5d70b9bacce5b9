"""One trial's bookkeeping in the study, shared by the search loop and the after-search stages.

A trial asked from Optuna is claimed by this process (owner, heartbeat) and judged
(:func:`tuner.rules.candidates.judge_candidate`: a :class:`Proposal`); then either told at zero cost (rejected before
launch: invalid, duplicate, inferred or predicted OOM), or run by the runner (:mod:`tuner.trials.runners`) and told with
its measured or penalized values; a trial stopped by the user is marked interrupted and its params enqueued again, so
the same command resumes it.
What happens is told to an optional :class:`SearchObserver` (the console display, wandb).

:class:`TrialSession` owns nothing of *which* config comes next (:mod:`tuner.search.policy`), *when* to stop
(:mod:`tuner.search.budget`) or what the after-search stages run (:mod:`tuner.search.confirmation`,
:mod:`tuner.search.worst_case`): it is the part every one of them goes through to touch a trial.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import optuna

from trainer.contracts import Status, TrialRecord, undersized
from tuner.rules import candidates as decide
from tuner.rules.budget import counted
from tuner.search import fidelity
from tuner.space import Candidate, Space, from_params
from tuner.study import lifecycle as st
from tuner.study.storage import trial_id
from tuner.trials.runners import TrialOutcome, TrialRequest, TrialRunner

__all__ = ["TrialEvent", "SearchObserver", "Proposal", "TrialSession", "SWEEP_EVERY_S"]

SWEEP_EVERY_S = 30.0  # at most this long between two stale-trial sweeps (less with a shorter heartbeat)


@dataclass(frozen=True)
class TrialEvent:
    """A finished trial, as the observer sees it."""

    number: int
    status: Status
    record: TrialRecord
    params: dict
    counted: bool
    values: Optional[tuple]
    note: str  # baseline / confirms N / duplicate of N / the first line of the error


class SearchObserver(Protocol):
    def trial_done(self, event: TrialEvent) -> None: ...

    def message(self, text: str) -> None: ...


@dataclass
class Proposal:
    """A trial asked from Optuna and judged, before (maybe) running it."""

    trial: optuna.trial.Trial
    cand: Candidate
    verdict: decide.LaunchVerdict
    baseline: bool = False
    confirm_of: Optional[int] = None


@dataclass
class TrialSession:
    """What a search process needs to ask, run and tell trials of one study (several processes may share it)."""

    study: optuna.Study
    storage: Any
    lock: st.StudyLock
    space: Space
    trial_base: dict  # nested base of every trial: base config + world size + steps + warm-up + memory cap
    trial_flat: dict
    runner: TrialRunner
    penalty_gb: float  # the memory value of an infeasible (OOM/hang) trial
    trials_dir: Optional[Path] = None  # <out>/trials: each trial's files go to trials_dir/<number>
    observer: Optional[SearchObserver] = None
    heartbeat: Optional[st.Heartbeat] = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    heartbeat_s: float = st.HEARTBEAT_S  # how often a RUNNING trial's heartbeat is written
    grace_s: float = st.STALE_AFTER_S  # another host's RUNNING trial with no heartbeat for this long is stale
    #: proposals in a row told before launch (free): the policy proposes itself once the sampler stalls
    free_in_a_row: int = 0
    _last_sweep: float = 0.0

    # ---- the study's other workers
    def sweep(self) -> None:
        """Interrupt and re-enqueue the trials a dead tuner left RUNNING (no heartbeat for ``grace_s``)."""
        self._last_sweep = time.monotonic()
        swept = st.sweep_stale(self.study, self.storage, stale_after_s=self.grace_s)
        if swept:
            self.say(
                f"ppotune search: trial(s) {swept} were left RUNNING by a dead tuner: "
                "marked interrupted, params enqueued again"
            )

    def sweep_if_due(self) -> None:
        if time.monotonic() - self._last_sweep > min(SWEEP_EVERY_S, self.heartbeat_s):
            self.sweep()

    def say(self, text: str) -> None:
        if self.observer:
            self.observer.message(text)

    # ---- asking and judging (under the lock)
    def ask(self) -> optuna.trial.Trial:
        with warnings.catch_warnings():  # "Heartbeat ... supposed to be used with optimize": we beat ourselves
            warnings.simplefilter("ignore", UserWarning)
            return self.study.ask()

    def propose(
        self,
        trial: optuna.trial.Trial,
        known: dict,
        predict: Optional[Callable] = None,
        revisitable: frozenset = frozenset(),
        launch_anyway: frozenset = frozenset(),
    ) -> Proposal:
        """Claim ``trial`` and judge its config (``revisitable``: :func:`tuner.rules.candidates.inferred_only`;
        ``launch_anyway``: a boundary config the search proposed itself, :func:`tuner.rules.candidates.ruling_oom`); a
        trial that cannot even be prepared (e.g. enqueued params outside the space) is judged invalid, never left
        RUNNING."""
        try:
            return self._propose(trial, known, predict, revisitable, launch_anyway)
        except Exception as e:  # noqa: BLE001 - recorded as an invalid trial, at zero cost
            cand = Candidate(params=from_params(trial.params), overrides={}, effective={})
            reason = f"tuner: could not prepare the trial: {type(e).__name__}: {e}"
            confirm_of = TrialRecord.from_user_attrs(trial.user_attrs).confirm_of
            return Proposal(trial, cand, decide.LaunchVerdict(Status.INVALID, reason), confirm_of=confirm_of)

    def _propose(
        self,
        trial: optuna.trial.Trial,
        known: dict,
        predict: Optional[Callable],
        revisitable: frozenset,
        launch_anyway: frozenset,
    ) -> Proposal:
        asked = TrialRecord.from_user_attrs(trial.user_attrs)  # what was enqueued with it
        st.claim(trial)
        if self.heartbeat is not None:
            self.heartbeat.add(trial_id(self.storage, self.study, trial.number))
        cand = self._candidate(trial, asked)
        baseline = asked.baseline and asked.confirm_of is None
        for k, v in (
            TrialRecord(baseline=baseline, overrides=cand.overrides)
            .to_user_attrs(only={"baseline", "overrides"})
            .items()
        ):
            trial.set_user_attr(k, v)
        verdict = decide.judge_candidate(
            cand,
            number=trial.number,
            space=self.space,
            trial_base=self.trial_base,
            trial_flat=self.trial_flat,
            known=known,
            is_confirm=asked.confirm_of is not None,
            predict=predict,
            revisitable=revisitable,
            launch_anyway=launch_anyway,
        )
        return Proposal(trial, cand, verdict, baseline=baseline, confirm_of=asked.confirm_of)

    def _candidate(self, trial: optuna.trial.Trial, asked: TrialRecord) -> Candidate:
        """The config ``trial`` stands for: a re-run repeats its original's overrides, the baseline is the base
        config, anything else is what the space suggests."""
        if asked.confirm_of is not None:
            orig = self.study.get_trials(deepcopy=False)[asked.confirm_of]  # numbers are list positions
            self.space.suggest(trial, self.trial_flat, restrict=set(orig.params))
            overrides = dict(TrialRecord.from_user_attrs(orig.user_attrs).overrides or {})
            return Candidate(
                params=from_params(trial.params), overrides=overrides, effective={**self.trial_flat, **overrides}
            )
        if asked.baseline:
            self.space.suggest(trial, self.trial_flat, restrict=set(self.space.baseline_params(self.trial_flat)))
            return Candidate(params=from_params(trial.params), overrides={}, effective=dict(self.trial_flat))
        return self.space.suggest(trial, self.trial_flat)

    # ---- running one proposal and telling
    def process(self, prop: Proposal, slot: int) -> None:
        """Tell a rejected proposal at zero cost, or run it on ``slot`` and tell what it measured."""
        trial, verdict = prop.trial, prop.verdict
        if not verdict.launch:
            self.tell_free(prop)
            return
        if self.stop_event.is_set():
            self.interrupt_own(trial, "interrupted before launch: the tuner was stopped")
            return
        config = verdict.config
        if prop.confirm_of is None and (config.get("ppotune") or {}).get("precision"):
            # multi-fidelity: the trial may stop once a measured point beats it for sure (a confirmation
            # re-run and a --precision 0 search measure every step)
            config = fidelity.with_front(config, fidelity.front_points(self.study.get_trials(deepcopy=False)))
        request = TrialRequest(
            number=trial.number,
            config=config,
            identity=self.space.identity(prop.cand.effective),
            trial_dir=(self.trials_dir or Path("trials")) / str(trial.number),
            slot=slot,
            overrides=dict(prop.cand.overrides),
        )
        group = getattr(self.runner, "group", None)  # a runner that measures more configs in one run (TrialRunner)
        if group is not None and prop.confirm_of is None:  # a confirmation re-run is measured alone
            outcome = group(self, prop, request, self.stop_event)
        else:
            outcome = self.runner.run(request, self.stop_event)
        if outcome.status == Status.INTERRUPTED:
            self.interrupt_own(trial, outcome.record.error or "interrupted", outcome.record)
            return
        record = outcome.record
        record.status = outcome.status
        if prop.verdict.predicted is not None:  # what the memory model said before it ran (the report's check)
            record.predicted = prop.verdict.predicted.to_dict()
        values = self._values(outcome)
        if values is not None:
            record.constraint = decide.constraint(record, limit_gb=self.penalty_gb)
        self._tell(prop, record, values, free=False)

    def tell_free(self, prop: Proposal) -> None:
        """Record a candidate rejected before launch: 0 s, not counted. COMPLETE where it can be, so the
        sampler learns from it: a duplicate of a COMPLETE twin with the twin's values and constraint, an
        inferred OOM or an invalid config with penalized values and its graded constraint; else FAIL."""
        verdict = prop.verdict
        record = TrialRecord(status=verdict.status, error=verdict.reason, duration_s=0.0, constraint=verdict.constraint)
        values = None
        if verdict.status == Status.DUPLICATE:
            record.duplicate_of = verdict.source
            values = verdict.values
        elif verdict.constraint is not None:  # inferred OOM, invalid (a tuner error preparing the trial: FAIL)
            values = (0.0, self.penalty_gb)
        if verdict.status == Status.INFERRED_OOM:
            record.inferred_from = verdict.source
        if verdict.predicted is not None:
            record.predicted = verdict.predicted.to_dict()
        self._tell(prop, record, values, free=True)

    def tell_over_budget(self, trial: optuna.trial.Trial, budget: int) -> None:
        """Record ``trial`` as ``over_budget``: another worker took the budget's last slot as it was asked."""
        record = TrialRecord(
            status=Status.OVER_BUDGET,
            error=f"over budget: the study's {budget} trials were taken by other workers as this one was asked; "
            "not run",
            duration_s=0.0,
        )
        st.finish(self.study, trial, record)
        self.say(f"trial {trial.number:4d} over_budget (another worker took the last slot; not run)")

    def _tell(self, prop: Proposal, record: TrialRecord, values: Optional[tuple], *, free: bool) -> None:
        trial = prop.trial
        if values is None:
            record.constraint = None
        record.confirm_of = prop.confirm_of
        frozen = st.finish(self.study, trial, record, values=values)
        if self.heartbeat is not None:
            self.heartbeat.remove(trial_id(self.storage, self.study, trial.number))
        self.free_in_a_row = self.free_in_a_row + 1 if free else 0
        if self.observer:
            self.observer.trial_done(
                TrialEvent(
                    number=frozen.number,
                    status=record.status,
                    record=record,
                    params=from_params(frozen.params),
                    counted=counted(frozen),
                    values=tuple(frozen.values) if frozen.values else None,
                    note=_note(record, prop),
                )
            )

    def _values(self, outcome: TrialOutcome) -> Optional[tuple[float, float]]:
        """The objective values Optuna gets: measured for ok, penalized for OOM/hang and for a vLLM share too small
        to run (a bound the sampler learns), none for FAIL."""
        if outcome.status == Status.OK:
            return float(outcome.record.throughput), float(outcome.record.peak_memory_gb or 0.0)
        if outcome.status.complete or (outcome.status == Status.INVALID and undersized(outcome.record.error)):
            return 0.0, self.penalty_gb
        return None

    def interrupt_own(self, trial: optuna.trial.Trial, reason: str, measured: Optional[TrialRecord] = None) -> None:
        tid = trial_id(self.storage, self.study, trial.number)
        st.interrupt(self.study, self.storage, self.storage.get_trial(tid), reason, measured=measured)
        if self.heartbeat is not None:
            self.heartbeat.remove(tid)
        self.say(f"trial {trial.number:4d} interrupted (params enqueued again)")

    def fail_unexpected(self, trial: optuna.trial.Trial, e: Exception) -> None:
        """A tuner bug while ``trial`` was in hand: never leave it RUNNING (the caller raises the error)."""
        try:
            frozen = self.storage.get_trial(trial_id(self.storage, self.study, trial.number))
            if not frozen.state.is_finished():
                st.interrupt(self.study, self.storage, frozen, f"interrupted: tuner error {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the original error is what gets raised
            pass


def _note(record: TrialRecord, prop: Proposal) -> str:
    if record.status == Status.DUPLICATE:
        return f"same config as trial {record.duplicate_of} (not run, not counted)"
    if record.status == Status.INFERRED_OOM:
        return f"inferred from OOM trial {record.inferred_from} (not launched)"
    if record.status == Status.PREDICTED_OOM and record.predicted:
        p = record.predicted
        return f"predicted {p['peak_gb']:.3g} GB > {p['limit_gb']:.3g} GB by more than the model's error (not launched)"
    note = "baseline" if prop.baseline else f"confirms trial {prop.confirm_of}" if prop.confirm_of is not None else ""
    if record.error:
        note = (note + " | " if note else "") + str(record.error).splitlines()[0][:160]
    return note
