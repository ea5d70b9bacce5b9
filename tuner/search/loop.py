"""The search loop: ask Optuna -> decide (tuner.search.decide) -> run (a TrialRunner) -> tell.

:class:`Search` owns the study bookkeeping around each trial (ownership, heartbeat,
interrupt and resume, ``--confirm`` re-runs). A candidate rejected before launch (invalid, duplicate, inferred OOM)
is told to Optuna at zero cost, outside ``--trials``, and the sampler is asked again inside the
same :meth:`Search.ask`. With TPE, every ``--local-every``-th launched trial after the sampler's start-up is a
local step instead: the unmeasured config one notch from the fastest measured one. What to do with a
candidate is decided by the pure functions of :mod:`tuner.search.decide`; how a trial is measured is the
runner's business
(:mod:`tuner.trials.runners`): the real subprocess runner in ``ppotune search``, a replay
runner in benchmarks and tests. What happens is told to an optional
:class:`SearchObserver` (the console display, wandb).
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Optional, Protocol

import optuna
from optuna.trial import TrialState

from trainer.config import apply_overrides, config_from_dict, config_to_dict
from trainer.contracts import DEFAULT_HEADROOM, Status, TrialRecord
from tuner.search import decide, fidelity
from tuner.space import Candidate, Space, from_params
from tuner.stages import confirm as confirm_mod
from tuner.study import lifecycle as st
from tuner.study.storage import trial_id
from tuner.trials.runners import TrialOutcome, TrialRequest, TrialRunner

__all__ = ["SearchOptions", "SearchObserver", "TrialEvent", "Search", "build_sampler", "SAMPLERS", "WAIT"]

SAMPLERS = ("tpe", "nsga2", "random", "grid")
MAX_CONSECUTIVE_FREE = 100  # proposals in a row rejected before launch (free) before this process gives up
# Duplicates in a row after which the sampler is taken to be stuck on measured configs (TPE over a
# discrete space keeps re-proposing its best points, the more so as each duplicate is told again as
# COMPLETE): the tuner enqueues the unmeasured config nearest the fastest measured one. In a replay of
# a synthetic 104-config grid shaped like benchmarks/data/grid_space.yaml this reached 97% of the best in
# 23% of the grid's trial-seconds (median, 20 seeds) against 28% with a random unmeasured config and 31%
# with none; on bench_search.py's recorded 24-config grid it never fired before 25%.
EXPLORE_AFTER_DUPLICATES = 3
SWEEP_EVERY_S = 30.0  # at most this long between two stale-trial sweeps (less with a shorter heartbeat)
#: The study user attribute holding the calibrated memory model (``tuner.memory_model.MemoryModel.to_dict``).
MEMORY_MODEL_ATTR = "memory_model"
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
    confirm: int = (
        0  # after the search, rounds of finalists re-run interleaved with the baseline (tuner.stages.confirm)
    )
    probe: int = 0  # then the worst-case probe (tuner.stages.probe) of this many configs export would recommend
    predict_oom: bool = True  # skip candidates the study's memory model puts over the limit beyond its error
    local_every: int = 2  # after the sampler's start-up, every N-th proposal is the incumbent's nearest neighbour
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
        if self.probe < 0:
            raise ValueError("--probe must be >= 0")
        if self.local_every < 0:
            raise ValueError("--local-every must be >= 0")
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
    _rank: Optional[dict] = None  # identity -> position in the shuffled grid (local steps break ties by it)
    _size: Optional[int] = None
    _model: Any = None  # the study's memory model (tuner.memory_model), refitted when a measured trial is added
    _model_key: tuple = ()

    def __post_init__(self) -> None:
        self._rng = random.Random(self.options.seed)

    # ---- running
    def run(self) -> None:
        """Run ``options.parallel`` workers until the budget is reached, then ``--confirm``.
        Re-raises the first unexpected error of a worker (the others stop). Raises ``ValueError``
        before any trial for a study whose params this space would suggest differently
        (:meth:`tuner.space.Space.foreign_params`: one written before power-of-two knobs were exponents)."""
        foreign = self.space.foreign_params(self.study.get_trials(deepcopy=False))
        if foreign:
            raise ValueError(f"study {self.study.study_name!r}: {foreign}")
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
        if self.options.probe and not self.stop_event.is_set():
            self.probe_worst_case(self.options.probe)

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
        """The next proposal to launch; ``None``: stop; :data:`WAIT`: the budget is taken, but trials
        of other workers still run (one may die and be re-enqueued): ask again a little later.

        A candidate rejected before launch (invalid, duplicate, inferred OOM) is told here, under the
        lock (no other worker ever counts it as running), and the sampler is asked again: it costs
        nothing and does not count toward ``--trials``. :data:`MAX_CONSECUTIVE_FREE` of them in a row
        stop this process."""
        with self.lock():
            while True:
                got = self._ask_once()
                if not isinstance(got, Proposal) or got.verdict.launch:
                    return got
                try:
                    self._tell_free(got)
                except Exception as e:  # a bug here must not leave the trial RUNNING forever
                    self._fail_unexpected(got.trial, e)
                    raise

    def _ask_once(self) -> "Proposal | _Wait | None":
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
                reserve_s=self._after_search_reserve(trials),
            )
        )
        if reason and self._others_still_running(trials, elapsed):
            return WAIT
        if reason:
            self.stopped_reason = self.stopped_reason or reason
            return None
        known = decide.known_configs(trials, self.space, self.trial_flat)
        if not any(t.state == TrialState.WAITING for t in trials):
            seen = decide.seen_configs(trials, self.space, self.trial_flat)
            if self._exhausted(seen):
                self.stopped_reason = f"every one of the {self._space_size()} configs of the space is in the study"
                return None
            # grid: our own enumeration (GridSampler cannot do conditional knobs)
            if self.options.sampler == "grid":
                point = self._unmeasured(seen)
                if point is None:
                    self.stopped_reason = "no unmeasured config left"
                    return None
                self.study.enqueue_trial(self.space.to_params(point.params), skip_if_exists=False)
            elif self._local_turn(trials):
                point = self._unmeasured_neighbour(seen, decide.incumbent(known, self.trial_flat))
                if point is not None:
                    self.study.enqueue_trial(self.space.to_params(point.params), skip_if_exists=False)
            elif self._dup_in_a_row >= EXPLORE_AFTER_DUPLICATES:
                point = self._unmeasured(seen, near=decide.incumbent(known, self.trial_flat))
                if point is not None:
                    self.study.enqueue_trial(self.space.to_params(point.params), skip_if_exists=False)
                self._dup_in_a_row = 0
        with warnings.catch_warnings():  # "Heartbeat ... supposed to be used with optimize": we beat ourselves
            warnings.simplefilter("ignore", UserWarning)
            trial = self.study.ask()
        if self._asked_over_budget(trial):
            return WAIT
        try:
            return self._propose(trial, known, predict=self._predictor(trials))
        except Exception as e:  # noqa: BLE001 - e.g. enqueued params outside the space
            cand = Candidate(params=from_params(trial.params), overrides={}, effective={})
            return Proposal(
                trial,
                cand,
                decide.Verdict(Status.INVALID, f"tuner: could not prepare the trial: {type(e).__name__}: {e}"),
            )

    def _after_search_reserve(self, trials: list) -> float:
        """Seconds of ``--timeout`` kept for the confirmation's re-runs and the worst-case probes."""
        if self.options.timeout_s is None:
            return 0.0
        reruns = self.options.confirm * (confirm_mod.MAX_FINALISTS + 1)
        return decide.after_search_s(trials, runs=reruns + self.options.probe, timeout_s=self.options.timeout_s)

    def _over_timeout(self, elapsed_s: float) -> bool:
        return self.options.timeout_s is not None and elapsed_s > self.options.timeout_s

    def _past_timeout(self, what: str) -> bool:
        """True (and said once) when ``--timeout`` has passed: ``what`` starts no further run."""
        if not self._over_timeout(time.monotonic() - self._started):
            return False
        if self.observer:
            self.observer.message(f"{what}: --timeout {self.options.timeout_s:g} s reached; no further run started")
        return True

    def _others_still_running(self, trials: list, elapsed_s: float) -> bool:
        """The budget is reached counting trials other workers still run: wait for them (if one's
        worker dies, its trial is swept and re-enqueued, and this worker runs the retry)."""
        if self.stop_event.is_set() or decide.count_progress(trials) < self.options.trials:
            return False
        if self._over_timeout(elapsed_s):
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

    def _predictor(self, trials: list):
        """The memory model's judgement of a candidate's flat config (``decide.Prediction``), or None while
        the study has no calibrated model (fewer than ``MIN_LOO_SAMPLES`` measured trials with per-phase
        peaks: no stated error, so no gate). Refitted when a measured trial is added, and stored in the study
        attribute ``memory_model`` (the report's predicted-vs-measured section reads it)."""
        if not self.options.predict_oom:
            return None
        from tuner import memory_model as mm

        key = tuple(
            t.number
            for t in trials
            if t.state == TrialState.COMPLETE and TrialRecord.from_user_attrs(t.user_attrs).status == Status.OK
        )
        if key != self._model_key:
            self._model_key = key
            measured = set(key)
            samples = mm.samples_from_trials(
                [t for t in trials if t.number in measured], self.study.user_attrs.get("base_config") or {}
            )
            device_gb = (self.study.user_attrs.get("device") or {}).get("memory_total_gb")
            try:
                self._model = mm.MemoryModel.calibrate(samples, device_memory_gb=device_gb) if samples else None
            except ValueError:  # a shape or config the model cannot read: no gate, as before it existed
                self._model = None
            if self._model is not None and self._model.gate_error is not None:
                self.study.set_user_attr(MEMORY_MODEL_ATTR, self._model.to_dict())
        model = self._model
        if model is None or model.gate_error is None:
            return None
        limit = self.penalty_gb

        def predict(flat: dict) -> Optional[decide.Prediction]:
            try:
                pred = model.predict(flat)
            except (KeyError, ValueError, TypeError):  # a config the model has no terms for: launch it
                return None
            return decide.Prediction(
                peak_gb=pred.peak_gb, limit_gb=limit, error=model.gate_error, trials=model.num_samples
            )

        return predict

    def _propose(self, trial: optuna.trial.Trial, known: dict, predict=None) -> Proposal:
        asked = TrialRecord.from_user_attrs(trial.user_attrs)  # what was enqueued with it
        st.claim(trial)
        if self.heartbeat is not None:
            self.heartbeat.add(trial_id(self.storage, self.study, trial.number))
        if asked.confirm_of is not None:
            orig = self.study.get_trials(deepcopy=False)[asked.confirm_of]  # numbers are list positions
            self.space.suggest(trial, self.trial_flat, restrict=set(orig.params))
            overrides = dict(TrialRecord.from_user_attrs(orig.user_attrs).overrides or {})
            cand = Candidate(
                params=from_params(trial.params), overrides=overrides, effective={**self.trial_flat, **overrides}
            )
        elif asked.baseline:
            self.space.suggest(trial, self.trial_flat, restrict=set(self.space.baseline_params(self.trial_flat)))
            cand = Candidate(params=from_params(trial.params), overrides={}, effective=dict(self.trial_flat))
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
            predict=predict,
        )
        return Proposal(trial, cand, verdict, baseline=baseline, confirm_of=asked.confirm_of)

    def _space_size(self) -> int:
        if self._size is None:
            self._size = self.space.size(self.trial_flat, limit=ENUMERATE_BELOW)
        return self._size

    def _local_turn(self, trials: list) -> bool:
        """Is this proposal a local step (the incumbent's nearest unmeasured neighbour) rather than the
        sampler's? Every ``local_every``-th launched trial once TPE's random start-up is done.

        TPE models "good" vs "bad" regions from noisy single measurements and, multi-objective, spreads its
        proposals over the whole Pareto front; the per-GPU knobs' landscape is mostly monotone in each
        knob's order, so one notch from the fastest config is often faster still. On the recorded grid
        (benchmarks/bench_search.py) alternating the two took the median trial-seconds to 97 % of the
        grid's best from 28 % of the grid's trial-seconds to 16 % (every trial local: 18 %), and taking first
        the steps the knobs' ``speed`` hints favour to 12 %."""
        every = self.options.local_every
        if every <= 0 or self.options.sampler != "tpe":
            return False
        if not (self.lock.exact or isinstance(self.storage, optuna.storages.InMemoryStorage)):
            # no cross-process lock (the gRPC proxy, MySQL): two workers could enqueue the same neighbour at
            # once and both run it, so local steps are left to workers that can serialize their asks
            return False
        records = (TrialRecord.from_user_attrs(t.user_attrs) for t in trials)
        launched = sum(1 for r in records if r.status is not None and r.status.launched)
        startup = getattr(self.study.sampler, "_n_startup_trials", 0)  # TPE's random start-up (no public getter)
        return launched >= startup and (launched - startup) % every == every - 1

    def _unmeasured_neighbour(self, seen: set, near: Optional[dict]) -> Optional[Candidate]:
        """A config one step from ``near`` (:meth:`tuner.space.Space.neighbours`: distance 1) not yet in the
        study: first those the knobs' ``speed`` hints expect to be faster (:meth:`tuner.space.Space.expected_speed`),
        among them the first in the seeded grid order (a space too large to enumerate: drawn at random among them);
        None when there is none (or no ``near``). Generated from ``near``,
        never by scanning the grid: a local turn runs under the study lock, and a scan of a 100k-config grid
        for each one took seconds there (benchmarks/bench_storage.py)."""
        if near is None:
            return None
        steps = self.space.neighbours(near, self.trial_flat)
        steps = [c for c in steps if self.space.identity(c.effective) not in seen]
        if not steps:
            return None
        # the knobs' speed hints first (a step the space expects to be faster), then the seeded grid order
        speed = {id(c): self.space.expected_speed(near, c.effective) for c in steps}
        if self._space_size() <= ENUMERATE_BELOW:
            rank = self._grid_rank()
            return min(steps, key=lambda c: (-speed[id(c)], rank.get(self.space.identity(c.effective), len(rank))))
        best = max(speed.values())
        return self._rng.choice([c for c in steps if speed[id(c)] == best])

    def _shuffled_grid(self) -> list:
        """``[(identity, Candidate)]``: the space's configs in an order fixed by the seed (built once)."""
        if self._grid is None:
            grid = list(self.space.grid(self.trial_flat))
            random.Random(self.options.seed).shuffle(grid)
            self._grid = [(self.space.identity(c.effective), c) for c in grid]
        return self._grid

    def _grid_rank(self) -> dict:
        if self._rank is None:
            self._rank = {ident: i for i, (ident, _) in enumerate(self._shuffled_grid())}
        return self._rank

    def _unmeasured(self, seen: set, *, near: Optional[dict] = None) -> Optional[Candidate]:
        """A config not yet in the study (the shuffled grid when it is small, else sampling): a random one,
        or with ``near`` (a flat effective config) the nearest to it (:func:`tuner.search.decide.distance`).
        ``seen``: :func:`tuner.search.decide.seen_configs` (rejected configs count as seen)."""
        if self._space_size() <= ENUMERATE_BELOW:
            pool = (c for ident, c in self._shuffled_grid() if ident not in seen)
        else:  # too large to enumerate: random draws, and the neighbours of ``near`` (draws rarely land there)
            drawn = (self.space.sample(self.trial_flat, self._rng) for _ in range(200))
            steps = self.space.neighbours(near, self.trial_flat) if near is not None else []
            pool = (c for c in chain(steps, drawn) if c is not None and self.space.identity(c.effective) not in seen)
        if near is None:
            return next(pool, None)
        return min(pool, key=lambda c: decide.distance(self.space, c.effective, near), default=None)

    def _exhausted(self, seen: set) -> bool:
        """Is every config of the space in the study (measured, running, or rejected before launch)?"""
        size = self._space_size()
        if len(seen) < size:
            return False
        # seen may hold configs a space constraint refused (they are not in the grid): check the grid itself
        return size > ENUMERATE_BELOW or self._unmeasured(seen) is None

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
        if not verdict.launch:
            self._tell_free(prop)
            return
        if self.stop_event.is_set():
            self._interrupt_own(trial, "interrupted before launch: the tuner was stopped")
            return
        config = verdict.config
        if prop.confirm_of is None and (config.get("ppotune") or {}).get("precision"):
            # multi-fidelity: the trial may stop once a measured point beats it for sure (a confirmation
            # re-run and a --precision 0 search measure every step)
            config = fidelity.with_front(config, fidelity.front_points(self.study.get_trials(deepcopy=False)))
        outcome = self.runner.run(
            TrialRequest(
                number=trial.number,
                config=config,
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
        if prop.verdict.predicted is not None:  # what the memory model said before it ran (the report's check)
            record.predicted = prop.verdict.predicted.to_dict()
        values = self._values(outcome)
        if values is not None:
            record.constraint = decide.constraint(record, limit_gb=self.penalty_gb)
        self._tell(prop, record, values, free=False)

    def _tell_free(self, prop: Proposal) -> None:
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

    def _tell(self, prop: Proposal, record: TrialRecord, values: Optional[tuple], *, free: bool) -> None:
        trial = prop.trial
        if values is None:
            record.constraint = None
        record.confirm_of = prop.confirm_of
        frozen = st.finish(self.study, trial, record, values=values)
        if self.heartbeat is not None:
            self.heartbeat.remove(trial_id(self.storage, self.study, trial.number))
        self._free_in_a_row = self._free_in_a_row + 1 if free else 0
        self._dup_in_a_row = self._dup_in_a_row + 1 if record.status == Status.DUPLICATE else 0
        if self.observer:
            self.observer.trial_done(
                TrialEvent(
                    number=frozen.number,
                    status=record.status,
                    record=record,
                    params=from_params(frozen.params),
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
    def confirm(self, rounds: int) -> None:
        """Confirm the finalists side by side (:mod:`tuner.stages.confirm`): re-run them interleaved with the
        baseline for ``rounds`` rounds, then store the aggregate in the study attribute ``confirmation``.

        Each re-run is a trial of its own (``confirm_of`` = the finalist's or the baseline's number)
        launched by ``self.runner`` exactly like a search trial, one at a time (two at once would skew
        the pair). Nothing done is redone: the slots already taken (re-runs finished, or running in
        another worker) are counted, so a resumed search or a second worker runs only the rest, and an
        interrupted re-run, enqueued again by the interruption, is run first."""
        with self.lock():
            plan = self._confirm_plan(rounds)
        if plan is None:
            return
        finalists, baseline, order = plan
        if self.observer:
            base = f" against the baseline #{baseline}" if baseline is not None else " (no baseline to pair with)"
            self.observer.message(
                f"confirm: finalists {', '.join(f'#{n}' for n in finalists)}{base}, {rounds} interleaved round(s)"
            )
        last_round = -1
        while not self.stop_event.is_set() and not self._past_timeout("confirm"):
            with self.lock():
                got = self._confirm_next(order)
            if got is None:
                break
            r, prop = got
            if self.observer and r is not None and r != last_round:
                last_round = r
                self.observer.message(f"confirm round {r + 1}/{rounds}: " + " ".join(f"#{n}" for n in order[r]))
            self.process(prop, 0)
        with self.lock():
            self._confirm_record(finalists, baseline, rounds)

    def _confirm_plan(self, rounds: int) -> Optional[tuple[list[int], Optional[int], list[list[int]]]]:
        """(finalists, baseline number or None, the interleaved schedule), or None: nothing to confirm.

        Finalists come from the search's own trials (re-runs left out), under export's headroom filter,
        so a resumed search finds the same ones."""
        from tuner.study.frame import headroom_filter, measured_feasible, missing, pareto_mask, trials_frame

        df = trials_frame(self.study)
        if df.empty:
            return None
        fit = headroom_filter(df, self.study.user_attrs, DEFAULT_HEADROOM)
        front = pareto_mask(df, among=fit.mask)
        cands = [
            confirm_mod.Candidate(
                number=int(row["number"]),
                throughput=float(row["throughput"]),
                throughput_ci=None
                if missing(row["throughput_ci_low"]) or missing(row["throughput_ci_high"])
                else (float(row["throughput_ci_low"]), float(row["throughput_ci_high"])),
                pareto=bool(front[i]),
            )
            for i, row in df.loc[fit.mask].iterrows()
        ]
        base = df.loc[df["baseline"] & measured_feasible(df), "number"]
        baseline = int(base.iloc[0]) if len(base) else None
        finalists = confirm_mod.pick_finalists(cands, exclude=[baseline] if baseline is not None else [])
        if not finalists:
            if self.observer:
                self.observer.message("confirm: no finalist besides the baseline fits the memory limit; nothing to do")
            return None
        return finalists, baseline, confirm_mod.schedule(finalists, baseline, rounds)

    def _confirm_next(self, order: list[list[int]]) -> Optional[tuple[Optional[int], Proposal]]:
        """The next re-run to launch (its round, or None for an interrupted trial run again), under the lock."""
        if time.monotonic() - self._last_sweep > min(SWEEP_EVERY_S, self.options.heartbeat_s):
            self.sweep()
        trials = self.study.get_trials(deepcopy=False)
        r = None
        if not any(t.state == TrialState.WAITING for t in trials):
            slot = confirm_mod.next_slot(order, _confirm_taken(trials))
            if slot is None:
                return None
            r, number = slot
            self.study.enqueue_trial(
                dict(trials[number].params),  # numbers are list positions
                user_attrs=TrialRecord(confirm_of=number).to_user_attrs(only={"confirm_of"}),
                skip_if_exists=False,
            )
        # else: an interrupted trial enqueued again (Optuna pops the oldest waiting one first): run it now
        with warnings.catch_warnings():  # "Heartbeat ... supposed to be used with optimize": we beat ourselves
            warnings.simplefilter("ignore", UserWarning)
            trial = self.study.ask()
        try:
            return r, self._propose(trial, decide.known_configs(trials, self.space, self.trial_flat))
        except Exception as e:  # noqa: BLE001 - as in ask(): recorded invalid, never left RUNNING
            cand = Candidate(params=dict(trial.params), overrides={}, effective={})
            reason = f"tuner: could not prepare the trial: {type(e).__name__}: {e}"
            confirm_of = TrialRecord.from_user_attrs(trial.user_attrs).confirm_of
            return r, Proposal(trial, cand, decide.Verdict(Status.INVALID, reason), confirm_of=confirm_of)

    def _confirm_record(self, finalists: list[int], baseline: Optional[int], rounds: int) -> None:
        """Aggregate every finished re-run of the plan's configs into the study attribute ``confirmation``."""
        members = set(finalists) | ({baseline} if baseline is not None else set())
        runs: dict[int, list] = {n: [] for n in members}
        for t in sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number):
            rec = TrialRecord.from_user_attrs(t.user_attrs)
            if rec.confirm_of in members and t.state.is_finished() and rec.status not in (None, Status.INTERRUPTED):
                runs[rec.confirm_of].append(
                    confirm_mod.Rerun(t.number, rec.status.value, rec.throughput, rec.peak_memory_gb)
                )
        self.study.set_user_attr(
            confirm_mod.CONFIRMATION_ATTR,
            confirm_mod.aggregate(
                baseline=baseline, finalists=finalists, rounds=rounds, headroom=DEFAULT_HEADROOM, runs=runs
            ),
        )

    # ---- the worst-case probe
    def probe_worst_case(self, count: int) -> None:
        """Probe the worst case (:mod:`tuner.stages.probe`: one step with every prompt and response at its maximum
        length) of the ``count`` configs export would take first -- the confirmed finalists by their
        confirmed ratio, else the fastest measured trials under the headroom -- and store each result in
        the study attribute ``worst_case`` (``{trial number: ProbeResult.to_dict()}``; export refuses a pick
        whose worst case breaks the headroom and takes the next). A config already probed is not run again
        (a resumed search, another worker)."""
        from tuner.stages.probe import WORST_CASE_ATTR, ProbeResult, probe

        with self.lock():
            numbers = self._probe_plan(count)
        for n in numbers:
            if self.stop_event.is_set() or self._past_timeout("worst case"):
                return
            with self.lock():
                if str(n) in (self.study.user_attrs.get(WORST_CASE_ATTR) or {}):
                    continue
            trial = self.study.get_trials(deepcopy=False)[n]  # numbers are list positions
            over = dict(TrialRecord.from_user_attrs(trial.user_attrs).overrides or {})
            if self.observer:
                self.observer.message(f"worst case: probing trial #{n} (every prompt and response at its maximum)")
            try:
                config = config_to_dict(config_from_dict(apply_overrides(self.trial_base, over)))
            except ValueError as e:  # the trial ran this config, so it validated; say so if it no longer does
                result = ProbeResult(Status.INVALID, error=f"config: {e}")
            else:
                trial_dir = (self.trials_dir or Path("trials")) / f"probe-{n}"
                result = probe(config, runner=self.runner, trial_dir=trial_dir, number=n, stop=self.stop_event)
            if result.status == Status.INTERRUPTED:
                return
            with self.lock():
                done = dict(self.study.user_attrs.get(WORST_CASE_ATTR) or {})
                done[str(n)] = result.to_dict()
                self.study.set_user_attr(WORST_CASE_ATTR, done)
            if self.observer:
                self.observer.message(f"worst case of trial #{n}: " + result.lines()[-1])

    def _probe_plan(self, count: int) -> list[int]:
        """The configs export would take first: the confirmed finalists ranked by their confirmed ratio under
        the headroom, then the fastest measured feasible trials under it (re-runs and duplicates left out)."""
        from tuner.study.frame import headroom_filter, trials_frame

        df = trials_frame(self.study)
        if df.empty:
            return []
        fit = headroom_filter(df, self.study.user_attrs, DEFAULT_HEADROOM)
        fastest = df.loc[fit.mask].sort_values(["throughput", "number"], ascending=[False, True])["number"]
        eligible = [int(n) for n in fastest]
        conf = self.study.user_attrs.get(confirm_mod.CONFIRMATION_ATTR)
        confirmed = []
        if conf:
            ranked, _ = confirm_mod.rank_confirmed(conf, eligible=eligible, limit_gb=fit.limit_gb)
            confirmed = [e["number"] for e in ranked]
        ordered = list(dict.fromkeys([*confirmed, *eligible]))
        return ordered[:count]


def _confirm_taken(trials: list) -> dict[int, int]:
    """Re-runs per config that hold a slot of the schedule: finished, running or waiting, not interrupted."""
    taken: dict[int, int] = {}
    for t in trials:
        rec = TrialRecord.from_user_attrs(t.user_attrs)
        if rec.confirm_of is not None and rec.status != Status.INTERRUPTED:
            taken[rec.confirm_of] = taken.get(rec.confirm_of, 0) + 1
    return taken


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
