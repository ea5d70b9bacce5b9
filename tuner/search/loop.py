"""The search loop: ask Optuna -> decide (tuner.rules.candidates) -> run (a TrialRunner) -> tell, then the stages.

:class:`Search` is one search process over one study (several processes may share the study). It composes
collaborators that each do one job and can be used alone:

* :class:`tuner.search.session.TrialSession` -- a trial's bookkeeping in the study (claim, heartbeat, judge, run,
  tell, interrupt); the loop and the after-search stages both go through it;
* :class:`tuner.search.policy.ProposalPolicy` -- which config comes next (the sampler, local steps, grid order,
  exploration);
* :class:`tuner.search.budget.Budget` -- when to stop (``--trials`` over every worker, ``--timeout``), and
  :class:`tuner.rules.budget.FailureRule` -- when to stop because the search cannot work (the baseline failed, or
  the same error ``--max-failures-in-a-row`` times): :attr:`Search.halt` says why, the trials in flight are
  interrupted (they run again on resume) and the after-search stages do not run;
* :class:`tuner.search.gate.MemoryGate` -- the study's memory model judging candidates before launch;
* the after-search stages :class:`tuner.search.confirmation.ConfirmationStage` (``--confirm``) and
  :class:`tuner.search.worst_case.WorstCaseStage` (``--probe``).

A candidate rejected before launch (invalid, duplicate, inferred OOM) is told to Optuna at zero cost, outside
``--trials``, and the sampler is asked again inside the same :meth:`Search.ask`. How a trial is measured is the
runner's business (:mod:`tuner.trials.runners`): the real subprocess runner in ``ppotune search``, a replay
runner in benchmarks and tests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import optuna
from optuna.trial import TrialState

from trainer.contracts import TrialRecord
from tuner.rules import candidates as decide
from tuner.rules.budget import MAX_FAILURES_IN_A_ROW, FailureRule, Halt
from tuner.rules.finalists import DEFAULT_FINALISTS
from tuner.search.budget import Budget
from tuner.search.confirmation import DEFAULT_LOAD_WAIT_S, ConfirmationStage
from tuner.search.gate import MemoryGate
from tuner.search.policy import SAMPLERS, ProposalPolicy, startup_trials
from tuner.search.session import Proposal, SearchObserver, TrialEvent, TrialSession
from tuner.search.worst_case import WorstCaseStage
from tuner.study import lifecycle as st
from tuner.study.selection import Selection

__all__ = ["SearchOptions", "Search", "WAIT"]

WAIT_POLL_S = 2.0  # a worker waiting for other workers' last trials looks again after this long


@dataclass(frozen=True)
class SearchOptions:
    """How one search process runs (``ppotune search`` flags, typed)."""

    trials: int  # stop when the study holds this many counted trials (all processes together)
    sampler: str = "tpe"  # one of SAMPLERS
    seed: Optional[int] = None  # this process's sampler / exploration seed
    timeout_s: Optional[float] = None  # start no new trial after this long
    parallel: int = 1  # trials at once in this process
    confirm: int = 0  # after the search, rounds of finalists re-run interleaved with the baseline
    finalists: int = DEFAULT_FINALISTS  # at most this many finalists confirmed
    confirm_wait_s: float = DEFAULT_LOAD_WAIT_S  # the confirmation waits at most this long, in all, for load to pass
    command: tuple = ()  # the search's own command line (after ``ppotune``): the one that confirms later repeats it
    fitted: dict = field(default_factory=dict)  # --from-fit: the fit's knob values (a finalist when measured)
    probe: int = 0  # then the worst-case probe (tuner.trials.probe) of this many configs export would recommend
    predict_oom: bool = True  # skip candidates the study's memory model puts over the limit beyond its error
    local_every: int = 2  # after the sampler's start-up, every N-th proposal is the incumbent's nearest neighbour
    corner: bool = True  # right after the baseline, the speed hints' corner and its walk down (tuner.search.corner)
    heartbeat_s: float = st.HEARTBEAT_S  # how often a RUNNING trial's heartbeat is written
    grace_s: float = st.STALE_AFTER_S  # another host's RUNNING trial with no heartbeat for this long is stale
    max_failures_in_a_row: int = MAX_FAILURES_IN_A_ROW  # launched trials failing alike before the search stops (0: off)
    selection: Selection = field(default_factory=Selection)  # the pick and headroom the stages confirm and probe for

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError("--trials must be >= 1")
        if self.parallel < 1:
            raise ValueError("--parallel must be >= 1")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        if self.confirm < 0:
            raise ValueError("--confirm must be >= 0")
        if self.confirm_wait_s < 0:
            raise ValueError("the confirmation's wait for load must be >= 0 seconds")
        if self.finalists < 1:
            raise ValueError("--finalists must be >= 1")
        if self.probe < 0:
            raise ValueError("--probe must be >= 0")
        if self.local_every < 0:
            raise ValueError("--local-every must be >= 0")
        if self.heartbeat_s <= 0 or self.grace_s <= self.heartbeat_s:
            raise ValueError("--heartbeat must be > 0 and --grace longer than --heartbeat")
        if self.max_failures_in_a_row < 0:
            raise ValueError("--max-failures-in-a-row must be >= 0 (0: never stop on repeated failures)")


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


#: what :meth:`Search.ask` returns when the budget is taken but other workers' trials still run
WAIT = _Wait()


@dataclass
class Search:
    """One search process over one study (several may share the study): the ask/tell loop over a
    :class:`TrialSession` (what it needs to ask, run and tell a trial), wired here to the loop's options."""

    options: SearchOptions
    session: TrialSession
    stopped_reason: Optional[str] = None
    #: set when the search stopped because it cannot work (FailureRule): the reason and the exit code
    halt: Optional[Halt] = None

    def __post_init__(self) -> None:
        o, s = self.options, self.session
        self.failures = FailureRule(o.max_failures_in_a_row)
        s.heartbeat_s, s.grace_s = o.heartbeat_s, o.grace_s
        s.observer = _Watched(s.observer, self._watch)
        self.policy = ProposalPolicy(
            self.session.space,
            self.session.trial_flat,
            sampler=o.sampler,
            seed=o.seed,
            local_every=o.local_every,
            corner=o.corner,
            serialized=self.session.lock.exact or isinstance(self.session.storage, optuna.storages.InMemoryStorage),
        )
        self.budget = Budget(
            trials=o.trials, timeout_s=o.timeout_s, confirm=o.confirm, finalists=o.finalists, probe=o.probe
        )
        self.gate = MemoryGate(self.session.study, limit_gb=s.penalty_gb, enabled=o.predict_oom)

    def _watch(self, e: TrialEvent) -> None:
        """Every trial this process finished: a search that cannot work stops now (:class:`FailureRule`)."""
        if e.record.confirm_of is not None or self.halt is not None:
            return
        rec = e.record
        launched = bool(rec.duration_s) or (rec.status is not None and rec.status.launched)
        baseline = False
        if launched:
            t = self.session.study.get_trials(deepcopy=False)[e.number]  # numbers are list positions
            baseline = TrialRecord.from_user_attrs(t.user_attrs).baseline
        halt = self.failures.seen(
            number=e.number, status=e.status, error=rec.error, launched=launched, baseline=baseline
        )
        if halt is not None:
            self.halt = halt
            self.stopped_reason = halt.reason
            self.session.stop_event.set()  # no further trial; one in flight is interrupted (and runs again on resume)

    # ---- running
    def run(self) -> None:
        """Run ``options.parallel`` workers until the budget is reached, then ``--confirm`` and ``--probe``.
        Re-raises the first unexpected error of a worker (the others stop). Raises ``ValueError``
        before any trial for a study whose params this space would suggest differently
        (:meth:`tuner.space.Space.foreign_params`: one written before power-of-two knobs were exponents)."""
        foreign = self.session.space.foreign_params(self.session.study.get_trials(deepcopy=False))
        if foreign:
            raise ValueError(f"study {self.session.study.study_name!r}: {foreign}")
        errors: list[BaseException] = []

        def guarded(slot: int) -> None:
            try:
                self.worker(slot)
            except BaseException as e:  # noqa: BLE001 - reported below, the other workers stop
                errors.append(e)
                self.session.stop_event.set()

        self.session.sweep()
        workers = [
            threading.Thread(target=guarded, args=(i,), name=f"trial-slot-{i}", daemon=True)
            for i in range(self.options.parallel)
        ]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            for w in workers:
                w.join(timeout=0.2)
        if errors:
            raise errors[0]
        if self.options.confirm and not self.session.stop_event.is_set():
            ConfirmationStage(
                self.session,
                budget=self.budget,
                selection=self.options.selection,
                load_wait_s=self.options.confirm_wait_s,
                command=self.options.command,
                seeds=self._seeds(),
            ).run(self.options.confirm, finalists=self.options.finalists)
        if self.options.probe and not self.session.stop_event.is_set():
            WorstCaseStage(self.session, budget=self.budget, selection=self.options.selection).run(self.options.probe)

    def _seeds(self) -> list[dict]:
        """The configs the confirmation re-runs whatever their one trial said: the fit's largest sizes, and the
        hints' corner when the search went there first."""
        seeds = [self.options.fitted] if self.options.fitted else []
        corner = self.policy.corner() if self.options.corner else None
        return seeds + ([dict(corner.params)] if corner is not None else [])

    def worker(self, slot: int) -> None:
        while not self.session.stop_event.is_set():
            prop = self.ask()
            if prop is None:
                return
            if prop is WAIT:
                self.session.stop_event.wait(min(WAIT_POLL_S, self.options.heartbeat_s))
                continue
            try:
                self.session.process(prop, slot)
            except Exception as e:  # a bug here must not leave the trial RUNNING forever
                self.session.fail_unexpected(prop.trial, e)
                raise

    # ---- asking (under the lock)
    def ask(self) -> "Proposal | _Wait | None":
        """The next proposal to launch; ``None``: stop; :data:`WAIT`: the budget is taken, but trials
        of other workers still run (one may die and be re-enqueued): ask again a little later.

        A candidate rejected before launch (invalid, duplicate, inferred OOM) is told here, under the
        lock (no other worker ever counts it as running), and the sampler is asked again: it costs
        nothing and does not count toward ``--trials``. When the sampler stalls on such proposals the search
        proposes itself (:mod:`tuner.search.stall`) until every config is measured or ruled out."""
        with self.session.lock():
            while True:
                got = self._ask_once()
                if not isinstance(got, Proposal) or got.verdict.launch:
                    return got
                try:
                    self.session.tell_free(got)
                except Exception as e:  # a bug here must not leave the trial RUNNING forever
                    self.session.fail_unexpected(got.trial, e)
                    raise

    def _ask_once(self) -> "Proposal | _Wait | None":
        self.session.sweep_if_due()
        trials = self.session.study.get_trials(deepcopy=False)
        stopping = self.session.stop_event.is_set()
        reason = "interrupted" if stopping else self.budget.stop_reason(trials)
        if reason and not stopping and self.budget.others_still_running(trials):
            return WAIT
        if reason:
            self.stopped_reason = self.stopped_reason or reason
            return None
        space, flat = self.session.space, self.session.trial_flat
        known = decide.known_configs(trials, space, flat)
        anyway: frozenset = frozenset()
        if not any(t.state == TrialState.WAITING for t in trials):
            pick = self.policy.pick(
                trials,
                known=known,
                startup=startup_trials(self.session.study.sampler),
                stalled=self.session.free_in_a_row,
            )
            if pick.stop:
                self.stopped_reason = pick.stop
                return None
            if pick.point is not None:  # Optuna pops the enqueued config first: the sampler sees it as its own
                self.session.study.enqueue_trial(space.to_params(pick.point.params), skip_if_exists=False)
                if pick.launch_anyway:
                    anyway = frozenset({space.identity(pick.point.effective)})
        trial = self.session.ask()
        if self.asked_over_budget(trial):
            return WAIT
        revisitable = decide.inferred_only(trials, space, flat)
        return self.session.propose(
            trial, known, predict=self.gate.predictor(trials), revisitable=revisitable, launch_anyway=anyway
        )

    def asked_over_budget(self, trial: optuna.trial.Trial) -> bool:
        """Record ``trial`` as ``over_budget`` if another worker took the budget's last slot in the
        same moment (possible only without a cross-process lock: the gRPC proxy, MySQL)."""
        counted = TrialRecord.from_user_attrs(trial.user_attrs).counted
        if not self.budget.taken_by_others(
            self.session.study.get_trials(deepcopy=False), trial.number, counted=counted
        ):
            return False
        self.session.tell_over_budget(trial, self.options.trials)
        return True


@dataclass
class _Watched:
    """The search's observer (or none) with the failure watch in front of it."""

    inner: Optional[SearchObserver]
    watch: Any

    def trial_done(self, event: TrialEvent) -> None:
        if self.inner is not None:
            self.inner.trial_done(event)
        self.watch(event)

    def message(self, text: str) -> None:
        if self.inner is not None:
            self.inner.message(text)
