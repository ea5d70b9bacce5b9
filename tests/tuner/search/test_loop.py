"""tuner.search.loop over a replay runner, with no process: the budget, rejections, duplicates, over-budget
trials, a dead worker's retry."""

from __future__ import annotations

import random
import time

import optuna
import pytest
from optuna.trial import TrialState

from support import search_over
from tests.tuner.rules.test_candidates import GC, MICRO
from trainer.contracts import CONSTRAINT_KEY, DIRECTIONS, PHASES, Status, TrialRecord
from tuner.rules import candidates as decide
from tuner.rules.budget import count_progress, counted
from tuner.search.loop import WAIT, Search, SearchOptions
from tuner.search.policy import build_sampler
from tuner.search.session import TrialEvent, TrialSession
from tuner.space import LOG2_PREFIX, space_from_dict
from tuner.study import lifecycle as st
from tuner.trials.runners import Recorded, ReplayRunner


# --------------------------------------------------------------------------- the loop over a replay runner
def _replay_table(space, flat):
    """Measurements of every config of the space (as a recording would hold them): checkpointing
    costs 20% throughput, micro-batch 4 without checkpointing runs out of memory."""
    table = {}
    for i, cand in enumerate(space.grid(flat)):
        micro, gc = cand.params[MICRO], cand.params[GC]
        if micro == 4 and not gc:
            entry = Recorded(Status.OOM, None, None, 3.0, i)
        else:
            entry = Recorded(Status.OK, 100.0 * micro * (0.8 if gc else 1.0), 1.0 + micro, 10.0, i)
        table[space.identity(cand.effective)] = [entry]
    return table


class Events:
    """A SearchObserver that keeps what it is told."""

    def __init__(self):
        self.events: list[TrialEvent] = []
        self.messages: list[str] = []

    def trial_done(self, event: TrialEvent) -> None:
        self.events.append(event)

    def message(self, text: str) -> None:
        self.messages.append(text)


def _search(setup, study, storage, runner, *, trials, sampler="grid", observer=None):
    return search_over(setup, study, storage, runner, trials=trials, sampler=sampler, observer=observer)


def test_search_loop_over_a_replay_runner(setup):
    """The real loop (ask -> judge -> run -> tell) with every launch answered from a recording."""
    space, trial_base, flat = setup
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(
        storage=storage, directions=list(DIRECTIONS), sampler=build_sampler("grid", seed=0, n_trials=6)
    )
    study.enqueue_trial(space.baseline_params(flat), user_attrs={"baseline": True})
    study.enqueue_trial(space.to_params({MICRO: 4, GC: True}))
    study.enqueue_trial(space.to_params({MICRO: 4, GC: False}))  # hungrier than an OOM: never launched
    study.enqueue_trial(space.baseline_params(flat))  # the sampler repeats the baseline: a duplicate
    table = _replay_table(space, flat)
    # in this recording "micro-batch 4 with checkpointing" ran out of memory, in its first phase (the baseline,
    # micro-batch 2 without, fits: not at least as hungry, it does not contradict the OOM: decide.ruling_oom)
    table[space.identity(space.complete({MICRO: 4, GC: True}, flat).effective)] = [
        Recorded(Status.OOM, None, None, 3.0, 99, PHASES[0])
    ]
    runner = ReplayRunner(table, rng=random.Random(0))
    events = Events()
    search = _search(setup, study, storage, runner, trials=4, observer=events)
    search.run()

    trials = study.get_trials()
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in trials]
    assert count_progress(trials) == 4 and "holds 4 counted" in search.stopped_reason
    statuses = [r.status for r in recs]
    assert statuses[:4] == [Status.OK, Status.OOM, Status.INFERRED_OOM, Status.DUPLICATE]
    assert recs[0].baseline and recs[2].inferred_from == 1 and recs[3].duplicate_of == 0
    # the inferred OOM and the duplicate cost nothing and did not count: two more grid points ran instead
    assert [counted(t) for t in trials] == [True, True, False, False, True, True]
    assert runner.launched == statuses.count(Status.OK) + statuses.count(Status.OOM) == 4
    assert all(r.engine == "replay" for r, s in zip(recs, statuses) if s in (Status.OK, Status.OOM))
    ok = [t for t, r in zip(trials, recs) if r.status == Status.OK]
    assert all(t.values[0] == TrialRecord.from_user_attrs(t.user_attrs).throughput for t in ok)
    # the OOM's constraint is graded by its phase; the inferred OOM takes it over
    assert trials[1].values == [0.0, 64.0] and trials[1].constraints[CONSTRAINT_KEY] == pytest.approx(2.0)
    assert trials[2].values == [0.0, 64.0] and trials[2].constraints == trials[1].constraints
    assert recs[1].constraint == recs[2].constraint == pytest.approx(2.0)
    # the duplicate: COMPLETE with its twin's values and constraint (TPE sees it), not run, not counted
    assert trials[3].state == TrialState.COMPLETE and trials[3].values == trials[0].values
    assert trials[3].constraints == trials[0].constraints and trials[0].constraints[CONSTRAINT_KEY] < 0
    assert recs[0].constraint == pytest.approx(recs[0].peak_memory_gb / 64.0 - 1)
    assert len({space.identity({**flat, **r.overrides}) for r, t in zip(recs, trials) if counted(t)}) == 4
    # Optuna holds the micro-batch as its exponent; the trials' overrides and the observer see the values
    assert trials[1].params == {LOG2_PREFIX + MICRO: 2, GC: True} and recs[1].overrides[MICRO] == 4
    assert [e.params for e in events.events][:3] == [
        {MICRO: 2, GC: False},
        {MICRO: 4, GC: True},
        {MICRO: 4, GC: False},
    ]
    assert [e.counted for e in events.events] == [True, True, False, False, True, True]


def _wide(space):
    """The test space with micro-batch 8 too, which the tiny config refuses (4 per GPU does not divide by 8)."""
    return space_from_dict(
        {"knobs": {MICRO: {"type": "pow2", "low": 1, "high": 8, "memory": "increasing"}, GC: {"type": "bool"}}}
    )


def test_rejected_configs_never_consume_the_budget_and_the_space_runs_out(setup):
    """A budget larger than the space: every launchable config is measured once, each invalid and
    inferred-OOM config recorded at 0 s outside the budget, then the search stops: the space is used up."""
    space, trial_base, flat = setup
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(
        storage=storage, directions=list(DIRECTIONS), sampler=build_sampler("tpe", seed=0, n_trials=20)
    )
    table = _replay_table(space, flat)
    wide = _wide(space)
    search = _search((wide, trial_base, flat), study, storage, ReplayRunner(table), trials=20, sampler="tpe")
    search.run()
    trials = study.get_trials()
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in trials]
    assert search.stopped_reason.startswith("every config of the space is measured or ruled out (")
    launched = [r for r in recs if r.status in (Status.OK, Status.OOM)]
    # micro-batch 8 is refused by the config (the per-GPU mini-batch of 4 does not divide by 8)
    invalid = [t for t, r in zip(trials, recs) if r.status == Status.INVALID]
    assert invalid and all(r.overrides[MICRO] == 8 for r in recs if r.status == Status.INVALID)
    assert all(t.state == TrialState.COMPLETE and t.values == [0.0, 64.0] for t in invalid)
    assert all(t.constraints[CONSTRAINT_KEY] == decide.INVALID_CONSTRAINT for t in invalid)
    assert count_progress(trials) == len(launched) <= 6  # invalid and inferred OOM are free
    assert len({space.identity({**flat, **r.overrides}) for r in launched}) == len(launched)
    assert {r.status for r in recs} <= {Status.OK, Status.OOM, Status.INFERRED_OOM, Status.INVALID, Status.DUPLICATE}


def test_rejections_in_a_row_never_stop_the_search(setup):
    """A sampler that keeps proposing refused configs (here: 150 enqueued copies of an invalid one) does not stop
    the search: each costs nothing, and once they are told the search goes on to its budget."""
    space, trial_base, flat = setup
    wide = _wide(space)
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS))
    for _ in range(150):
        study.enqueue_trial(wide.to_params({MICRO: 8, GC: True}))
    runner = ReplayRunner(_replay_table(space, flat))
    search = _search((wide, trial_base, flat), study, storage, runner, trials=4, sampler="random")
    search.run()
    trials = study.get_trials()
    assert "holds 4 counted" in search.stopped_reason
    assert runner.launched == count_progress(trials) == 4
    assert sum(TrialRecord.from_user_attrs(t.user_attrs).status == Status.INVALID for t in trials) >= 150


def test_after_three_duplicates_in_a_row_the_search_proposes_a_neighbour_of_the_best(setup):
    """The sampler stalled on measured configs: after 3 rejections in a row the search proposes itself an
    unmeasured neighbour of the best measured config (here one step from micro-batch 2 with checkpointing)."""
    space, _, flat = setup
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), sampler=optuna.samplers.RandomSampler(0))
    for micro, gc in [(1, False), (2, True), (1, True), (2, True), (2, True), (2, True)]:
        study.enqueue_trial(space.to_params({MICRO: micro, GC: gc}))
    search = _search(setup, study, storage, ReplayRunner(_replay_table(space, flat)), trials=4, sampler="random")
    search.run()
    trials = study.get_trials()
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in trials]
    assert [r.status for r in recs][:6] == [Status.OK] * 3 + [Status.DUPLICATE] * 3
    explored = recs[6]
    assert explored.status == Status.OK and counted(trials[6])
    best = space.complete({MICRO: 2, GC: True}, flat).effective
    assert decide.distance(space, {**flat, **explored.overrides}, best) == 1
    assert "holds 4 counted" in search.stopped_reason and len(trials) == 7


def test_a_study_from_before_exponents_is_refused_before_any_trial(setup):
    space, _, flat = setup
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS))
    old = study.ask()
    old.suggest_categorical(MICRO, [1, 2, 4])  # how the study was written before: the plain key, categorical
    study.tell(old, [1.0, 1.0])
    runner = ReplayRunner(_replay_table(space, flat))
    with pytest.raises(ValueError, match="log2:") as e:
        _search(setup, study, storage, runner, trials=3, sampler="random").run()
    assert "--study NAME" in str(e.value) and runner.launched == 0 and len(study.get_trials()) == 1


def _worker(setup, study, storage, trials: int):
    space, trial_base, flat = setup
    return Search(
        options=SearchOptions(trials=trials, sampler="random", seed=0, heartbeat_s=0.2, grace_s=1.0),
        session=TrialSession(
            study=study,
            storage=storage,
            lock=st.StudyLock(None),  # no cross-process lock: the gRPC proxy's case
            space=space,
            trial_base=trial_base,
            trial_flat=flat,
            runner=ReplayRunner(_replay_table(space, flat), rng=random.Random(0)),
            penalty_gb=64.0,
        ),
    )


def test_a_trial_asked_past_the_budget_is_recorded_over_budget_and_not_run(setup):
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS))
    search = _worker(setup, study, storage, trials=2)
    first = study.ask()  # another worker's RUNNING trial...
    first.set_user_attr("owner", {"host": "elsewhere", "pid": 1, "started": 1.0})
    first.set_user_attr("heartbeat", 1e12)
    second = study.ask()  # ...and another: the budget of 2 is taken below ours
    second.set_user_attr("owner", {"host": "elsewhere", "pid": 2, "started": 1.0})
    second.set_user_attr("heartbeat", 1e12)
    mine = study.ask()
    assert search.asked_over_budget(mine)
    rec = TrialRecord.from_user_attrs(study.get_trials()[mine.number].user_attrs)
    assert rec.status == Status.OVER_BUDGET and study.get_trials()[mine.number].state == TrialState.FAIL
    assert count_progress(study.get_trials()) == 2
    # the budget is taken by trials that still run elsewhere: this worker waits instead of leaving
    assert search.ask() is WAIT
    for t in (first, second):
        study.tell(t, state=TrialState.FAIL)  # (no status: counted, as a crash would be)
    assert search.ask() is None and "holds 2 counted" in search.stopped_reason


def test_a_waiting_worker_runs_the_retry_of_a_dead_workers_trial(setup):
    """The budget is reached counting a trial of another host; that host stops beating: after the
    grace period the waiting worker sweeps it, and runs its retry. The total stays exact."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS))
    space, _, flat = setup
    search = _worker(setup, study, storage, trials=2)
    study.enqueue_trial(space.to_params({MICRO: 1, GC: False}))
    study.enqueue_trial(space.to_params({MICRO: 2, GC: False}))  # runs ok in the replay table (4 would OOM)
    done = study.ask()
    space.suggest(done, flat)
    study.tell(done, [1.0, 1.0])
    dead = study.ask()
    space.suggest(dead, flat)
    dead.set_user_attr("owner", {"host": "elsewhere", "pid": 1, "started": 1.0})
    dead.set_user_attr("heartbeat", time.time())  # fresh now, then never again
    assert search.ask() is WAIT
    t0 = time.monotonic()
    search.run()  # waits, sweeps the dead trial after grace_s, runs its retry, stops
    assert 0.8 <= time.monotonic() - t0 < 10
    trials = study.get_trials()
    recs = {t.number: TrialRecord.from_user_attrs(t.user_attrs) for t in trials}
    assert recs[dead.number].status == Status.INTERRUPTED
    (retry,) = [n for n, r in recs.items() if r.retry_of == dead.number]
    assert recs[retry].status == Status.OK and trials[retry].params == dead.params
    assert count_progress(trials) == 2
