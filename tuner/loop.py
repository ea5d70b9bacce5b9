"""The search loop: ask Optuna -> decide (tuner.decide) -> run (a TrialRunner) -> tell.

:class:`Search` owns the study bookkeeping around each trial (ownership, heartbeat,
interrupt and resume, exploration when the sampler keeps proposing measured configs,
``--confirm`` re-runs). What to do with a candidate is decided by the pure functions of
:mod:`tuner.decide`; how a trial is measured is the runner's business
(:mod:`tuner.runners`): the real subprocess runner in ``ppotune search``, a replay
runner in benchmarks and tests. What happens is told to an optional
:class:`SearchObserver` (the console display, wandb).
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import optuna
from optuna.trial import TrialState

from trainer.contracts import Status, TrialRecord
from tuner import decide
from tuner import study as st
from tuner.runners import TrialOutcome, TrialRequest, TrialRunner
from tuner.space import Candidate, Space
from tuner.storage import trial_id

__all__ = ["SearchOptions", "SearchObserver", "TrialEvent", "Search", "build_sampler", "SAMPLERS", "WAIT"]

SAMPLERS = ("tpe", "nsga2", "random", "grid")
MAX_CONSECUTIVE_FREE = 100  # duplicate proposals in a row before this process gives up
EXPLORE_AFTER_DUPLICATES = 3  # then the next trial is an unmeasured config picked at random
SWEEP_EVERY_S = 30.0  # at most this long between two stale-trial sweeps (less with a shorter heartbeat)
WAIT_POLL_S = 2.0  # a worker waiting for other workers' last trials looks again after this long
ENUMERATE_BELOW = 100_000  # spaces up to this size are explored by enumeration, larger ones by sampling


@dataclass(frozen=True)
class SearchOptions:
    """How one search process runs (``ppotune search`` flags, typed)."""

    trials: int  # stop when the study holds this many counted trials (all processes together)
    sampler: str = "tpe"  # one of SAMPLERS
    seed: Optional[int] = None  # this process's sampler / exploration seed
    timeout_s: Optional[float] = None  # start no new trial after this long
    parallel: int = 1  # trials at once in this process
    confirm: int = 0  # after the search, re-run the K fastest Pareto configs
    heartbeat_s: float = st.HEARTBEAT_S  # how often a RUNNING trial's heartbeat is written
    grace_s: float = st.STALE_AFTER_S  # another host's RUNNING trial with no heartbeat for this long is stale

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError("--trials must be >= 1")
        if self.parallel < 1:
            raise ValueError("--parallel must be >= 1")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"--sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        if self.confirm < 0:
            raise ValueError("--confirm must be >= 0")
        if self.heartbeat_s <= 0 or self.grace_s <= self.heartbeat_s:
            raise ValueError("--heartbeat must be > 0 and --grace longer than --heartbeat")


def build_sampler(name: str, *, seed: Optional[int], n_trials: int) -> optuna.samplers.BaseSampler:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            # The default 10 random start-up trials would be the whole budget of a short search.
            return optuna.samplers.TPESampler(
                seed=seed,
                n_startup_trials=max(3, min(10, n_trials // 3)),
                multivariate=True,
                group=True,
                constant_liar=True,
            )
        if name == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(50, n_trials // 3)))
        # grid: the tuner enqueues grid points itself (GridSampler cannot do conditional knobs)
        return optuna.samplers.RandomSampler(seed=seed)


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


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


#: what :meth:`Search.ask` returns when the budget is taken but other workers' trials still run
WAIT = _Wait()


@dataclass
class Proposal:
    """A trial asked from Optuna and judged, before (maybe) running it."""

    trial: optuna.trial.Trial
    cand: Candidate
    verdict: decide.Verdict
    baseline: bool = False
    confirm_of: Optional[int] = None


@dataclass
class Search:
    """One search process over one study (several may share the study)."""

    options: SearchOptions
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
    stopped_reason: Optional[str] = None
    _rng: random.Random = field(default_factory=random.Random)
    _last_sweep: float = 0.0
    _free_in_a_row: int = 0
    _dup_in_a_row: int = 0
    _started: float = field(default_factory=time.monotonic)
    _grid: Optional[list] = None
    _size: Optional[int] = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.options.seed)

    # ---- running
    def run(self) -> None:
        """Run ``options.parallel`` workers until the budget is reached, then ``--confirm``.
        Re-raises the first unexpected error of a worker (the others stop)."""
        errors: list[BaseException] = []

        def guarded(slot: int) -> None:
            try:
                self.worker(slot)
            except BaseException as e:  # noqa: BLE001 - reported below, the other workers stop
                errors.append(e)
                self.stop_event.set()

        self.sweep()
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
        if self.options.confirm and not self.stop_event.is_set():
            self.confirm(self.options.confirm)

    def worker(self, slot: int) -> None:
        while not self.stop_event.is_set():
            prop = self.ask()
            if prop is None:
                return
            if prop is WAIT:
                self.stop_event.wait(min(WAIT_POLL_S, self.options.heartbeat_s))
                continue
            try:
                self.process(prop, slot)
            except Exception as e:  # a bug here must not leave the trial RUNNING forever
                self._fail_unexpected(prop.trial, e)
                raise

    # ---- asking (under the lock)
    def ask(self) -> "Proposal | _Wait | None":
        """The next proposal; ``None``: stop; :data:`WAIT`: the budget is taken, but trials of
        other workers still run (one may die and be re-enqueued): ask again a little later."""
        with self.lock():
            if time.monotonic() - self._last_sweep > min(SWEEP_EVERY_S, self.options.heartbeat_s):
                self.sweep()
            trials = self.study.get_trials(deepcopy=False)
            elapsed = time.monotonic() - self._started
            reason = (
                "interrupted"
                if self.stop_event.is_set()
                else decide.stop_reason(
                    trials,
                    budget=self.options.trials,
                    elapsed_s=elapsed,
                    timeout_s=self.options.timeout_s,
                    free_in_a_row=self._free_in_a_row,
                    max_free_in_a_row=MAX_CONSECUTIVE_FREE,
                )
            )
            if reason and self._others_still_running(trials, elapsed):
                return WAIT
            if reason:
                self.stopped_reason = self.stopped_reason or reason
                return None
            known = decide.known_configs(trials, self.space, self.trial_flat)
            if not any(t.state == TrialState.WAITING for t in trials):
                size = self._space_size()
                measured = sum(
                    1 for t in known.values() if TrialRecord.from_user_attrs(t.user_attrs).status != Status.INVALID
                )
                if measured >= size:
                    self.stopped_reason = f"every one of the {size} configs of the space is in the study"
                    return None
                if self.options.sampler == "grid" or self._dup_in_a_row >= EXPLORE_AFTER_DUPLICATES:
                    # grid: our own enumeration (GridSampler cannot do conditional knobs);
                    # otherwise the sampler keeps proposing measured configs: explore instead.
                    point = self._unmeasured(known)
                    if point is None:
                        self.stopped_reason = "no unmeasured config left"
                        return None
                    self.study.enqueue_trial(point.params, skip_if_exists=False)
                    self._dup_in_a_row = 0
            with warnings.catch_warnings():  # "Heartbeat ... supposed to be used with optimize": we beat ourselves
                warnings.simplefilter("ignore", UserWarning)
                trial = self.study.ask()
            if self._asked_over_budget(trial):
                return WAIT
            try:
                return self._propose(trial, known)
            except Exception as e:  # noqa: BLE001 - e.g. enqueued params outside the space
                cand = Candidate(params=dict(trial.params), overrides={}, effective={})
                return Proposal(
                    trial,
                    cand,
                    decide.Verdict(Status.INVALID, f"tuner: could not prepare the trial: {type(e).__name__}: {e}"),
                )

    def _others_still_running(self, trials: list, elapsed_s: float) -> bool:
        """The budget is reached counting trials other workers still run: wait for them (if one's
        worker dies, its trial is swept and re-enqueued, and this worker runs the retry)."""
        if self.stop_event.is_set() or decide.count_progress(trials) < self.options.trials:
            return False
        if self.options.timeout_s is not None and elapsed_s > self.options.timeout_s:
            return False
        return any(t.state == TrialState.RUNNING and decide.counted(t) and not st.owned_here(t) for t in trials)

    def _asked_over_budget(self, trial: optuna.trial.Trial) -> bool:
        """Record ``trial`` as ``over_budget`` if another worker took the budget's last slot in the
        same moment (possible only without a cross-process lock: the gRPC proxy, MySQL; checked
        always, so workers on one study may mix storages)."""
        if not TrialRecord.from_user_attrs(trial.user_attrs).counted:
            return False  # a --confirm re-run: outside the budget
        if not decide.over_budget(self.study.get_trials(deepcopy=False), trial.number, budget=self.options.trials):
            return False
        record = TrialRecord(
            status=Status.OVER_BUDGET,
            error=f"over budget: the study's {self.options.trials} trials were taken by other workers as this one "
            "was asked; not run",
            duration_s=0.0,
        )
        st.finish(self.study, trial, record)
        if self.observer:
            self.observer.message(f"trial {trial.number:4d} over_budget (another worker took the last slot; not run)")
        return True

    def _propose(self, trial: optuna.trial.Trial, known: dict) -> Proposal:
        asked = TrialRecord.from_user_attrs(trial.user_attrs)  # what was enqueued with it
        st.claim(trial)
        if self.heartbeat is not None:
            self.heartbeat.add(trial_id(self.storage, self.study, trial.number))
        if asked.confirm_of is not None:
            orig = self.study.get_trials(deepcopy=False)[asked.confirm_of]  # numbers are list positions
            self.space.suggest(trial, self.trial_flat, restrict=set(orig.params))
            overrides = dict(TrialRecord.from_user_attrs(orig.user_attrs).overrides or {})
            cand = Candidate(params=dict(trial.params), overrides=overrides, effective={**self.trial_flat, **overrides})
        elif asked.baseline:
            self.space.suggest(trial, self.trial_flat, restrict=set(self.space.baseline_params(self.trial_flat)))
            cand = Candidate(params=dict(trial.params), overrides={}, effective=dict(self.trial_flat))
        else:
            cand = self.space.suggest(trial, self.trial_flat)
        baseline = asked.baseline and asked.confirm_of is None
        for k, v in (
            TrialRecord(baseline=baseline, overrides=cand.overrides)
            .to_user_attrs(only={"baseline", "overrides"})
            .items()
        ):
            trial.set_user_attr(k, v)
        verdict = decide.judge(
            cand,
            number=trial.number,
            space=self.space,
            trial_base=self.trial_base,
            trial_flat=self.trial_flat,
            known=known,
            is_confirm=asked.confirm_of is not None,
        )
        return Proposal(trial, cand, verdict, baseline=baseline, confirm_of=asked.confirm_of)

    def _space_size(self) -> int:
        if self._size is None:
            self._size = self.space.size(self.trial_flat, limit=ENUMERATE_BELOW)
        return self._size

    def _unmeasured(self, known: dict) -> Optional[Candidate]:
        """A random config not yet in the study (the shuffled grid when it is small, else sampling)."""
        if self._space_size() <= ENUMERATE_BELOW:
            if self._grid is None:
                self._grid = list(self.space.grid(self.trial_flat))
                random.Random(self.options.seed).shuffle(self._grid)
            return next((c for c in self._grid if self.space.identity(c.effective) not in known), None)
        for _ in range(200):
            cand = self.space.sample(self.trial_flat, self._rng)
            if cand is not None and self.space.identity(cand.effective) not in known:
                return cand
        return None

    def sweep(self) -> None:
        self._last_sweep = time.monotonic()
        swept = st.sweep_stale(self.study, self.storage, stale_after_s=self.options.grace_s)
        if swept and self.observer:
            self.observer.message(
                f"ppotune search: trial(s) {swept} were left RUNNING by a dead tuner: "
                "marked interrupted, params enqueued again"
            )

    # ---- running one proposal and telling
    def process(self, prop: Proposal, slot: int) -> None:
        trial, verdict = prop.trial, prop.verdict
        if self.stop_event.is_set() and verdict.launch:
            self._interrupt_own(trial, "interrupted before launch: the tuner was stopped")
            return
        values = None
        if verdict.launch:
            outcome = self.runner.run(
                TrialRequest(
                    number=trial.number,
                    config=verdict.config,
                    identity=self.space.identity(prop.cand.effective),
                    trial_dir=(self.trials_dir or Path("trials")) / str(trial.number),
                    slot=slot,
                    overrides=dict(prop.cand.overrides),
                ),
                self.stop_event,
            )
            if outcome.status == Status.INTERRUPTED:
                self._interrupt_own(trial, outcome.record.error or "interrupted", outcome.record)
                return
            record = outcome.record
            record.status = outcome.status
            values = self._values(outcome)
        else:
            record = TrialRecord(status=verdict.status, error=verdict.reason, duration_s=0.0)
            if verdict.status == Status.DUPLICATE:
                record.duplicate_of = verdict.source
            elif verdict.status == Status.INFERRED_OOM:
                record.inferred_from = verdict.source
                values = (0.0, self.penalty_gb)
        record.confirm_of = prop.confirm_of
        frozen = st.finish(self.study, trial, record, values=values)
        if self.heartbeat is not None:
            self.heartbeat.remove(trial_id(self.storage, self.study, trial.number))
        free = record.status == Status.DUPLICATE
        self._free_in_a_row = self._free_in_a_row + 1 if free else 0
        self._dup_in_a_row = self._dup_in_a_row + 1 if free else 0
        if self.observer:
            self.observer.trial_done(
                TrialEvent(
                    number=frozen.number,
                    status=record.status,
                    record=record,
                    params=dict(frozen.params),
                    counted=decide.counted(frozen),
                    values=tuple(frozen.values) if frozen.values else None,
                    note=_note(record, prop),
                )
            )

    def _values(self, outcome: TrialOutcome) -> Optional[tuple[float, float]]:
        """The objective values Optuna gets: measured for ok, penalized for OOM/hang, none for FAIL."""
        if outcome.status == Status.OK:
            return float(outcome.record.throughput), float(outcome.record.peak_memory_gb or 0.0)
        if outcome.status.complete:
            return 0.0, self.penalty_gb
        return None

    def _interrupt_own(self, trial: optuna.trial.Trial, reason: str, measured: Optional[TrialRecord] = None) -> None:
        tid = trial_id(self.storage, self.study, trial.number)
        st.interrupt(self.study, self.storage, self.storage.get_trial(tid), reason, measured=measured)
        if self.heartbeat is not None:
            self.heartbeat.remove(tid)
        if self.observer:
            self.observer.message(f"trial {trial.number:4d} interrupted (params enqueued again)")

    def _fail_unexpected(self, trial: optuna.trial.Trial, e: Exception) -> None:
        try:
            frozen = self.storage.get_trial(trial_id(self.storage, self.study, trial.number))
            if not frozen.state.is_finished():
                st.interrupt(self.study, self.storage, frozen, f"interrupted: tuner error {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the original error is what gets raised
            pass

    # ---- --confirm
    def confirm(self, k: int) -> None:
        """Re-run the ``k`` fastest Pareto configs once each, as new trials (``confirm_of``)."""
        from tuner.results.view import trials_frame

        with self.lock():
            df = trials_frame(self.study)
            if df.empty:
                return
            already = set(df.loc[df["confirm_of"].notna() & (df["status"] != Status.INTERRUPTED), "confirm_of"])
            front = df[df["pareto"] & df["confirm_of"].isna()].sort_values("throughput", ascending=False)
            todo = [int(n) for n in front["number"][:k] if int(n) not in already]
        trials = {t.number: t for t in self.study.get_trials(deepcopy=False)}
        for number in todo:
            if self.stop_event.is_set():
                return
            with self.lock():
                self.study.enqueue_trial(
                    dict(trials[number].params),
                    user_attrs=TrialRecord(confirm_of=number).to_user_attrs(only={"confirm_of"}),
                    skip_if_exists=False,
                )
                prop = self._propose(self.study.ask(), {})
            self.process(prop, 0)


def _note(record: TrialRecord, prop: Proposal) -> str:
    if record.status == Status.DUPLICATE:
        return f"same config as trial {record.duplicate_of} (not run, not counted)"
    if record.status == Status.INFERRED_OOM:
        return f"inferred from OOM trial {record.inferred_from} (not launched)"
    note = "baseline" if prop.baseline else f"confirms trial {prop.confirm_of}" if prop.confirm_of is not None else ""
    if record.error:
        note = (note + " | " if note else "") + str(record.error).splitlines()[0][:160]
    return note
