"""The search's decisions with no process at all: tuner.search.decide, and tuner.search.loop over a replay runner."""

from __future__ import annotations

import random
import textwrap
import time

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from support import search_over, tiny_setup
from trainer.contracts import CONSTRAINT_KEY, DIRECTIONS, PHASES, Status, TrialRecord
from tuner.search import decide
from tuner.search.loop import WAIT, Search, SearchOptions
from tuner.search.policy import Pick, build_sampler
from tuner.search.session import TrialEvent, TrialSession
from tuner.search.stall import STALL_AFTER
from tuner.space import LOG2_PREFIX, space_from_dict
from tuner.study import lifecycle as st
from tuner.trials.runners import Recorded, ReplayRunner

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
GC = "actor_rollout_ref.model.enable_gradient_checkpointing"
SPACE = textwrap.dedent(f"""
    knobs:
      {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
      {GC}: {{type: bool, memory: decreasing}}
""")


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(SPACE)


def frozen(number: int, status: str, overrides: dict, *, values=None, constraint=None, **attrs):
    complete = Status(status).complete
    t = create_trial(
        state=TrialState.COMPLETE if complete else TrialState.FAIL,
        values=(values or [1.0, 1.0]) if complete else None,
        constraints=None if constraint is None else {CONSTRAINT_KEY: constraint},
        user_attrs={"status": status, "overrides": overrides, **attrs},
    )
    t.number = number
    return t


# --------------------------------------------------------------------------- judge
def test_judge_launches_a_new_valid_config_with_its_validated_config(setup):
    space, trial_base, flat = setup
    cand = space.complete({MICRO: 4, GC: False}, flat)
    v = decide.judge(cand, number=0, space=space, trial_base=trial_base, trial_flat=flat, known={})
    assert v.launch and v.status is None
    assert v.config["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == 4
    assert v.config["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] is False


def test_judge_invalid_duplicate_and_inferred_oom(setup):
    space, trial_base, flat = setup
    # the per-GPU mini-batch of the tiny config (8 x 1 / 2 = 4) is not divisible by 8
    bad = space.complete({MICRO: 8, GC: True}, flat)
    v = decide.judge(bad, number=5, space=space, trial_base=trial_base, trial_flat=flat, known={})
    assert v.status == Status.INVALID and v.reason.startswith("config:") and MICRO in v.reason
    assert v.constraint == decide.INVALID_CONSTRAINT

    oom = frozen(1, "oom", {MICRO: 2, GC: False}, values=[0.0, 64.0], constraint=1.5, oom_phase="gen")
    ok = frozen(2, "ok", {MICRO: 1, GC: True}, values=[321.0, 2.5], constraint=-0.9)
    known = decide.known_configs([oom, ok], space, flat)
    assert len(known) == 2
    same = space.complete({MICRO: 1, GC: True}, flat)
    v = decide.judge(same, number=7, space=space, trial_base=trial_base, trial_flat=flat, known=known)
    # a duplicate of a finished trial is answered with the twin's values and constraint
    assert v.status == Status.DUPLICATE and v.source == 2 and v.values == (321.0, 2.5) and v.constraint == -0.9
    hungrier = space.complete({MICRO: 4, GC: False}, flat)  # bigger micro-batch, no checkpointing
    v = decide.judge(hungrier, number=8, space=space, trial_base=trial_base, trial_flat=flat, known=known)
    assert v.status == Status.INFERRED_OOM and v.source == 1 and v.constraint == 1.5  # its OOM's
    lighter = space.complete({MICRO: 4, GC: True}, flat)  # checkpointing on: not comparable to the OOM
    assert decide.judge(lighter, number=9, space=space, trial_base=trial_base, trial_flat=flat, known=known).launch
    # a --confirm re-run repeats a measured config on purpose
    assert decide.judge(
        same, number=10, space=space, trial_base=trial_base, trial_flat=flat, known=known, is_confirm=True
    ).launch


def test_a_duplicate_of_a_running_or_failed_twin_has_no_values(setup):
    space, trial_base, flat = setup
    running = create_trial(state=TrialState.RUNNING, user_attrs={"overrides": {MICRO: 1, GC: True}})
    running.number = 3
    crash = frozen(4, "crash", {MICRO: 2, GC: True})
    known = decide.known_configs([running, crash], space, flat)
    for values, twin in (({MICRO: 1, GC: True}, 3), ({MICRO: 2, GC: True}, 4)):
        v = decide.judge(
            space.complete(values, flat), number=9, space=space, trial_base=trial_base, trial_flat=flat, known=known
        )
        assert v.status == Status.DUPLICATE and v.source == twin and v.values is None and v.constraint is None


def test_known_configs_skip_what_is_not_a_measurement(setup):
    space, _, flat = setup
    trials = [
        frozen(0, "interrupted", {MICRO: 1}),
        frozen(1, "duplicate", {MICRO: 1}, duplicate_of=3),
        frozen(2, "ok", {MICRO: 1}, confirm_of=3),
        frozen(3, "ok", {MICRO: 1}),
        frozen(5, "inferred_oom", {MICRO: 4}, inferred_from=6),
        frozen(7, "invalid", {MICRO: 8}, duration_s=0.0),
    ]
    known = decide.known_configs(trials, space, flat)
    assert [t.number for t in known.values()] == [3]
    # ... but every config rejected before launch is in the study: the space can run out
    seen = decide.seen_configs(trials, space, flat)
    ident = {m: space.identity({**flat, MICRO: m}) for m in (1, 4, 8)}
    assert seen == set(ident.values())


# --------------------------------------------------------------------------- the graded constraint
def test_graded_constraint_orders_early_oom_over_late_oom_over_feasible():
    def c(status, **kw):
        return decide.constraint(TrialRecord(status=Status(status), **kw), limit_gb=10.0)

    setup_oom = c("oom", oom_phase="setup")
    first = c("oom", oom_phase=PHASES[0])
    gen = c("oom", oom_phase="gen")
    last = c("oom", oom_phase=PHASES[-1])
    unknown = c("oom")
    assert setup_oom > first > gen > last > unknown == 1.0 > 0.0
    assert last == pytest.approx(1 + 1 / len(PHASES)) and first == pytest.approx(2.0)
    # a measured peak far over the limit grades further than its phase says
    assert c("oom", oom_phase=PHASES[-1], peak_memory_gb=40.0) == pytest.approx(3.0)
    # measured: peak / limit - 1, never above 0 (it ran, so it fits)
    assert c("ok", peak_memory_gb=2.5) == pytest.approx(-0.75)
    assert c("ok", peak_memory_gb=9.0) > c("ok", peak_memory_gb=2.5)
    assert c("ok", peak_memory_gb=12.0) == 0.0 and c("ok") == -1.0
    # an inferred OOM takes its OOM's value, an invalid config is further over than any OOM
    assert decide.constraint(TrialRecord(status=Status.INFERRED_OOM), limit_gb=10.0, source=first) == first
    assert c("invalid") == decide.INVALID_CONSTRAINT > setup_oom
    assert c("hang") == 1.0 and c("crash") is None


def test_stop_reason():
    ok = [frozen(i, "ok", {}) for i in range(3)]
    kw = dict(elapsed_s=1.0, timeout_s=None)
    assert decide.stop_reason(ok, budget=4, **kw) is None
    assert "holds 3 counted" in decide.stop_reason(ok, budget=3, **kw)
    dup = [*ok, frozen(3, "duplicate", {}, duplicate_of=0)]
    assert decide.stop_reason(dup, budget=4, **kw) is None  # a duplicate is not counted
    assert "--timeout" in decide.stop_reason(ok, budget=9, **{**kw, "timeout_s": 0.5})
    rejected = [*ok, frozen(3, "inferred_oom", {}, inferred_from=0), frozen(4, "invalid", {}, duration_s=0.0)]
    assert decide.stop_reason(rejected, budget=4, **kw) is None  # rejected before launch: not counted
    launched_invalid = [*ok, frozen(3, "invalid", {}, duration_s=7.5, returncode=2)]
    assert "holds 4 counted" in decide.stop_reason(launched_invalid, budget=4, **kw)  # exit 2 counts


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
    assert decide.count_progress(trials) == 4 and "holds 4 counted" in search.stopped_reason
    statuses = [r.status for r in recs]
    assert statuses[:4] == [Status.OK, Status.OOM, Status.INFERRED_OOM, Status.DUPLICATE]
    assert recs[0].baseline and recs[2].inferred_from == 1 and recs[3].duplicate_of == 0
    # the inferred OOM and the duplicate cost nothing and did not count: two more grid points ran instead
    assert [decide.counted(t) for t in trials] == [True, True, False, False, True, True]
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
    assert len({space.identity({**flat, **r.overrides}) for r, t in zip(recs, trials) if decide.counted(t)}) == 4
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
    assert decide.count_progress(trials) == len(launched) <= 6  # invalid and inferred OOM are free
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
    assert runner.launched == decide.count_progress(trials) == 4
    assert sum(TrialRecord.from_user_attrs(t.user_attrs).status == Status.INVALID for t in trials) >= 150


def test_distance_counts_ordered_steps_and_incumbent_is_the_fastest(setup):
    space, _, flat = setup

    def eff(micro, gc):
        return space.complete({MICRO: micro, GC: gc}, flat).effective

    assert decide.distance(space, eff(1, False), eff(4, False)) == 2  # two powers of two apart
    assert decide.distance(space, eff(2, False), eff(2, True)) == 1
    assert decide.distance(space, eff(1, True), eff(4, False)) == 3
    known = decide.known_configs(
        [
            frozen(0, "ok", {MICRO: 1, GC: False}, throughput=100.0),
            frozen(1, "ok", {MICRO: 2, GC: True}, throughput=160.0),
            frozen(2, "oom", {MICRO: 4, GC: False}),
        ],
        space,
        flat,
    )
    assert space.identity(decide.incumbent(known, flat)) == space.identity(eff(2, True))
    assert decide.incumbent({}, flat) is None


def test_the_incumbent_is_ranked_by_the_lower_end_of_its_own_interval_not_its_luckier_median(setup):
    """The winner's curse: a challenger whose median beats the incumbent's by less than its own noise does not
    lead; one that beats it by more than its noise does; a trial without an interval is ranked by its median."""
    space, _, flat = setup

    def eff(micro, gc):
        return space.complete({MICRO: micro, GC: gc}, flat).effective

    steady = frozen(0, "ok", {MICRO: 1, GC: False}, throughput=100.0, throughput_ci=[96.0, 104.0])
    lucky = frozen(1, "ok", {MICRO: 2, GC: True}, throughput=110.0, throughput_ci=[80.0, 140.0])
    known = decide.known_configs([steady, lucky], space, flat)
    assert decide.measured_score(TrialRecord.from_user_attrs(lucky.user_attrs)) == 80.0
    assert [t.number for t in decide.ranked_measured(known)] == [0, 1]
    assert space.identity(decide.incumbent(known, flat)) == space.identity(eff(1, False))
    clear = frozen(1, "ok", {MICRO: 2, GC: True}, throughput=130.0, throughput_ci=[120.0, 140.0])
    known = decide.known_configs([steady, clear], space, flat)
    assert space.identity(decide.incumbent(known, flat)) == space.identity(eff(2, True))
    bare = frozen(1, "ok", {MICRO: 2, GC: True}, throughput=101.0)
    assert decide.measured_score(TrialRecord.from_user_attrs(bare.user_attrs)) == 101.0
    known = decide.known_configs([steady, bare], space, flat)
    assert space.identity(decide.incumbent(known, flat)) == space.identity(eff(2, True))


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
    assert explored.status == Status.OK and decide.counted(trials[6])
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


# --------------------------------------------------------------------------- the budget across workers
def _t(number, state, **ua):
    t = create_trial(state=state, values=[1.0, 1.0] if state == TrialState.COMPLETE else None, user_attrs=ua)
    t.number = number
    return t


def test_over_budget_counts_what_is_below_and_may_still_count():
    R, C, W, F = TrialState.RUNNING, TrialState.COMPLETE, TrialState.WAITING, TrialState.FAIL
    two_done = [_t(0, C, status="ok"), _t(1, C, status="ok")]
    assert not decide.over_budget([*two_done, _t(2, R)], 2, budget=3)
    # another worker's trial numbered below ours took the last slot in the same moment
    assert decide.over_budget([*two_done, _t(2, R), _t(3, R)], 3, budget=3)
    # ...but not one numbered above ours: that one is the one over the budget
    assert not decide.over_budget([*two_done, _t(2, R), _t(3, R)], 2, budget=3)
    # an enqueued retry below ours holds its slot: it counts once popped
    assert decide.over_budget([*two_done, _t(2, W, retry_of=0), _t(3, R)], 3, budget=3)
    # what can never count again does not hold a slot
    for gone in (
        _t(2, F, status="interrupted"),
        _t(2, F, status="duplicate", duplicate_of=0),
        _t(2, F, status="over_budget"),
        _t(2, C, status="ok", confirm_of=0),
        _t(2, W, confirm_of=0),
    ):
        assert not decide.over_budget([*two_done, gone, _t(3, R)], 3, budget=3), gone.user_attrs


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
    assert decide.count_progress(study.get_trials()) == 2
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
    assert decide.count_progress(trials) == 2


def test_timeout_leaves_the_confirmation_its_time():
    ok = [frozen(i, "ok", {}, duration_s=d) for i, d in enumerate((10.0, 30.0, 20.0))]
    rerun = frozen(3, "ok", {}, duration_s=500.0, confirm_of=0)  # a re-run's seconds are not the search's
    assert decide.after_search_s([*ok, rerun], runs=4, timeout_s=1000.0) == 80.0  # 4 x the median 20 s
    assert decide.after_search_s(ok, runs=40, timeout_s=1000.0) == 500.0  # at most half of the timeout
    assert decide.after_search_s(ok, runs=0, timeout_s=1000.0) == 0.0
    assert decide.after_search_s([], runs=4, timeout_s=1000.0) == 0.0  # nothing measured yet
    kw = dict(budget=9, timeout_s=100.0)
    assert decide.stop_reason(ok, elapsed_s=70.0, reserve_s=20.0, **kw) is None
    why = decide.stop_reason(ok, elapsed_s=81.0, reserve_s=20.0, **kw)
    assert why == "--timeout 100 s: ~20 s of it left for the confirmation and the probes"


def test_every_second_trial_after_the_start_up_steps_from_the_incumbent():
    """``local_every=2``: once TPE's random start-up is done, every second launched trial is an unmeasured
    config one ordered step from the fastest measured one (the incumbent at that moment)."""
    rmpad, strategy = "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.strategy"
    setup = tiny_setup(
        SPACE + f"  {rmpad}: {{type: bool, memory: decreasing}}\n"
        f"  {strategy}: {{type: categorical, choices: [fsdp, fsdp2], memory: none}}\n"
    )
    space, _, flat = setup
    table = {}
    for i, cand in enumerate(space.grid(flat)):
        p = cand.params
        thr = 100.0 * p[MICRO] * (0.8 if p[GC] else 1.0) * (1.2 if p[rmpad] else 1.0)
        thr *= 1.1 if p[strategy] == "fsdp" else 1.0
        table[space.identity(cand.effective)] = [Recorded(Status.OK, thr, 1.0, 10.0, i)]
    storage = optuna.storages.InMemoryStorage()
    sampler = build_sampler("tpe", seed=0, n_trials=14)
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), sampler=sampler)
    search_over(setup, study, storage, ReplayRunner(table), trials=14, sampler="tpe", local_every=2).run()
    launched = [t for t in study.get_trials() if TrialRecord.from_user_attrs(t.user_attrs).status == Status.OK]
    startup = sampler._n_startup_trials
    local = 0
    for k in range(startup + 1, len(launched), 2):
        known = decide.known_configs(launched[:k], space, flat)
        near = decide.incumbent(known, flat)
        here = decide.effective_of(launched[k], flat)
        if decide.distance(space, here, near) == 1.0:
            local += 1
        else:  # only once the incumbent's neighbourhood is measured: then the sampler proposes
            assert {
                space.identity(c.effective) for c in space.grid(flat) if decide.distance(space, c.effective, near) == 1
            } <= set(known), k
    assert local >= 4


def test_a_local_step_tries_first_the_neighbours_the_speed_hints_favour():
    """From any config of the recorded grid's space (benchmarks/data/grid_space.yaml: larger micro-batches and
    budgets, dynamic bsz and remove-padding expected faster, checkpointing slower), the local step is a neighbour
    the knobs' ``speed`` hints favour most; once those are measured, the others follow (nothing is skipped)."""
    from support import REPO
    from trainer.config import flatten
    from tuner.space import base_flat_config, load_space

    space = load_space(REPO / "benchmarks" / "data" / "grid_space.yaml")
    flat = flatten(base_flat_config(str(REPO / "benchmarks" / "data" / "grid_base.yaml"), nproc=1)[0])
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS))
    search = search_over((space, {}, flat), study, storage, ReplayRunner({}), trials=1, sampler="tpe")
    rank = search.policy.grid_rank()
    moved = 0
    for here in (c.effective for c in space.grid(flat)):
        steps = space.neighbours(here, flat)
        speed = {space.identity(c.effective): space.expected_speed(here, c.effective) for c in steps}
        seen = {space.identity(here)}
        order = []
        while (step := search.policy.unmeasured_neighbour(seen, here)) is not None:
            order.append(speed[space.identity(step.effective)])
            seen.add(space.identity(step.effective))
        assert order == sorted(speed.values(), reverse=True)  # favoured first, then the rest, all of them
        moved += speed[min(speed, key=rank.__getitem__)] < order[0]  # the seeded grid order alone would differ
    assert moved > space.size(flat) // 2


def test_neighbours_are_the_configs_one_step_away():
    from support import REPO
    from trainer.config import flatten
    from tuner.space import base_flat_config, load_space

    space = load_space(REPO / "benchmarks" / "data" / "grid_space.yaml")
    flat = flatten(base_flat_config(str(REPO / "benchmarks" / "data" / "grid_base.yaml"), nproc=1)[0])
    grid = [c.effective for c in space.grid(flat)]
    for here in (grid[0], grid[len(grid) // 2], grid[-1]):
        got = {space.identity(c.effective) for c in space.neighbours(here, flat)}
        one_step = {space.identity(e) for e in grid if decide.distance(space, e, here) == 1}
        assert got == one_step and got  # every config at distance 1, and nothing else


def test_local_steps_reach_the_neighbours_of_a_space_too_large_to_enumerate():
    """A token budget over 59,001 values: 200 random draws never land one token from the incumbent, the
    neighbours do."""
    from trainer.config import flatten

    budget = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    setup = tiny_setup(SPACE + f"  {budget}: {{type: int, low: 1000, high: 60000, step: 1, memory: increasing}}\n")
    space, _, flat = setup

    class Formula(ReplayRunner):
        def run(self, request, stop):
            eff = flatten(request.config)
            thr = 100.0 * eff[MICRO] * (0.8 if eff[GC] else 1.0) + eff[budget] / 1000
            self.table[request.identity] = [Recorded(Status.OK, thr, 1.0, 1.0, len(self.table))]
            return super().run(request, stop)

    assert space.size(flat, limit=200_000) > 100_000  # sampled, not enumerated
    storage = optuna.storages.InMemoryStorage()
    sampler = build_sampler("tpe", seed=0, n_trials=12)
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), sampler=sampler)
    search_over(setup, study, storage, Formula({}), trials=12, sampler="tpe", local_every=2).run()
    launched = [t for t in study.get_trials() if TrialRecord.from_user_attrs(t.user_attrs).status == Status.OK]
    startup = sampler._n_startup_trials
    turns = range(startup + 1, len(launched), 2)
    for k in turns:
        near = decide.incumbent(decide.known_configs(launched[:k], space, flat), flat)
        assert decide.distance(space, decide.effective_of(launched[k], flat), near) == 1.0, k
    assert len(turns) >= 3


# --------------------------------------------------------------------------- the proposal policy alone
def _policy(space, flat, **kw):
    from tuner.search.policy import ProposalPolicy

    return ProposalPolicy(space, flat, **{"sampler": "tpe", "seed": 0, "local_every": 2, "serialized": True, **kw})


def test_the_policy_alone_walks_the_grid_in_its_seeded_order_then_stops(setup):
    """No study, no runner: the grid sampler's next config is the first unmeasured one of the seeded order;
    once every config is in the trials, the policy says so."""
    space, _, flat = setup
    policy = _policy(space, flat, sampler="grid")
    order = [c for _, c in policy.shuffled_grid()]
    assert len(order) == space.size(flat) == 6
    trials = []
    for i, expected in enumerate(order):
        pick = policy.pick(trials, known={}, startup=0, stalled=0)
        assert pick.stop is None and pick.point.params == expected.params and pick.rule == "grid", i
        trials.append(frozen(i, "ok", expected.overrides))
    pick = policy.pick(trials, known={}, startup=0, stalled=0)
    assert pick.point is None and pick.stop == "every one of the 6 configs of the space is in the study"


def test_the_policy_takes_a_local_step_on_its_turn_and_proposes_itself_when_the_sampler_stalls(setup):
    space, _, flat = setup
    ok = [
        frozen(0, "ok", {MICRO: 1, GC: True}, values=[100.0, 1.0], throughput=100.0),
        frozen(1, "ok", {MICRO: 2, GC: True}, values=[300.0, 1.0], throughput=300.0),
    ]
    known = decide.known_configs(ok, space, flat)
    near = decide.incumbent(known, flat)
    assert near[MICRO] == 2 and near[GC] is True
    policy = _policy(space, flat)
    # 2 launched, start-up 1: (2 - 1) % 2 == 1, a local turn: one ordered step from the fastest measured config
    pick = policy.pick(ok, known=known, startup=1, stalled=0)
    assert pick.point is not None and decide.distance(space, pick.point.effective, near) == 1.0
    assert space.identity(pick.point.effective) not in known and pick.rule == "local"
    assert policy.pick(ok, known=known, startup=2, stalled=0) == Pick()  # not its turn: the sampler proposes
    # without serialized asks (no cross-process lock) there is no local step
    assert _policy(space, flat, serialized=False).pick(ok, known=known, startup=1, stalled=0) == Pick()
    # the sampler stalled (proposals rejected before launch): an unmeasured neighbour of the best measured config
    pick = policy.pick(ok, known=known, startup=2, stalled=STALL_AFTER)
    assert pick.rule == "neighbour" and decide.distance(space, pick.point.effective, near) == 1.0


def test_the_budget_alone(monkeypatch):
    from tuner.search.budget import Budget

    clock = [1000.0]
    monkeypatch.setattr("tuner.search.budget.time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    budget = Budget(trials=3, timeout_s=100.0, confirm=1, finalists=3, probe=1, started=clock[0])
    ok = [frozen(i, "ok", {}, duration_s=10.0) for i in range(2)]
    # 1 confirmation round (at most 3 finalists + the baseline) and 1 probe: 5 runs of the median 10 s kept
    assert budget.reserve_s(ok) == 50.0 and budget.stop_reason(ok) is None
    assert Budget(trials=3, timeout_s=100.0, confirm=2, finalists=1, probe=0).reserve_s(ok) == 40.0  # 2 x (1 + 1)
    clock[0] += 60.0
    assert budget.stop_reason(ok).startswith("--timeout 100 s")
    said = []
    assert not budget.past_timeout("confirm", said.append) and said == []
    clock[0] += 50.0
    assert budget.past_timeout("confirm", said.append) and said == [
        "confirm: --timeout 100 s reached; no further run started"
    ]
    assert budget.stop_reason([*ok, frozen(2, "ok", {})]) is not None
    assert not budget.taken_by_others(ok, 2, counted=False)  # a --confirm re-run is outside the budget


# --------------------------------------------------------------------------- a noisy OOM is evidence, not a verdict
REF = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
NOISY_SPACE = SPACE + f"  {REF}: {{type: pow2, low: 1, high: 4, memory: increasing}}\n"


def test_an_oom_that_a_fitted_hungrier_config_contradicts_rules_nothing_out():
    """Near the cap the same config runs out of memory once and fits the next time: once a config at least as
    hungry as the OOM's has run, the OOM infers nothing more."""
    space, trial_base, flat = tiny_setup(NOISY_SPACE)
    oom = frozen(0, "oom", {MICRO: 1, GC: False, REF: 1}, values=[0.0, 64.0], constraint=1.5, oom_phase="gen")
    best = frozen(1, "ok", {MICRO: 1, GC: True, REF: 1}, values=[500.0, 1.0], throughput=500.0)
    hungry = space.complete({MICRO: 4, GC: False, REF: 4}, flat)  # 2 + 2 steps from the incumbent
    assert (
        decide.distance(space, hungry.effective, decide.incumbent(decide.known_configs([oom, best], space, flat), flat))
        > 1
    )

    def judged(*trials):
        known = decide.known_configs(list(trials), space, flat)
        return decide.judge(hungry, number=9, space=space, trial_base=trial_base, trial_flat=flat, known=known)

    assert judged(oom, best).status == Status.INFERRED_OOM  # the OOM stands: nothing contradicts it
    fitted = frozen(2, "ok", {MICRO: 2, GC: False, REF: 1}, values=[200.0, 1.0], throughput=200.0)  # hungrier, ran
    assert judged(oom, best, fitted).launch
    # a fitted config that is not at least as hungry (checkpointing on) contradicts nothing
    lighter = frozen(3, "ok", {MICRO: 4, GC: True, REF: 4}, values=[200.0, 1.0], throughput=200.0)
    assert judged(oom, best, lighter).status == Status.INFERRED_OOM


def test_the_incumbents_neighbour_is_launched_rather_than_inferred_and_a_local_step_revisits_it():
    space, trial_base, flat = tiny_setup(NOISY_SPACE)
    best = frozen(0, "ok", {MICRO: 1, GC: False, REF: 2}, values=[500.0, 1.0], throughput=500.0)
    oom = frozen(1, "oom", {MICRO: 2, GC: False, REF: 1}, values=[0.0, 64.0], constraint=1.5, oom_phase="gen")
    trials = [best, oom]
    known = decide.known_configs(trials, space, flat)
    near = space.complete({MICRO: 2, GC: False, REF: 2}, flat)  # one step from the incumbent, hungrier than the OOM
    far = space.complete({MICRO: 4, GC: False, REF: 2}, flat)  # two steps
    args = dict(space=space, trial_base=trial_base, trial_flat=flat, known=known)
    # the first time it is proposed, the OOM rules the neighbour out like any config at least as hungry
    assert decide.judge(near, number=5, **args).status == Status.INFERRED_OOM
    inferred = frozen(2, "inferred_oom", dict(near.overrides), values=[0.0, 64.0], constraint=1.5, inferred_from=1)
    trials.append(inferred)
    revisitable = decide.inferred_only(trials, space, flat)
    assert revisitable == {space.identity(near.effective)}
    # held only as an inferred OOM, one step from the incumbent: launched when proposed again; two steps: not
    assert decide.judge(near, number=6, revisitable=revisitable, **args).launch
    assert decide.judge(far, number=7, revisitable=revisitable | {space.identity(far.effective)}, **args).status == (
        Status.INFERRED_OOM
    )
    # a local step proposes it again (the policy passes over configs held only as inferred OOMs)
    policy = _policy(space, flat)
    for turn in range(8):  # every local turn until it proposes the inferred neighbour
        pick = policy.pick(trials, known=known, startup=1, stalled=0)
        assert pick.point is not None
        if space.identity(pick.point.effective) == space.identity(near.effective):
            break
        trials.append(frozen(10 + turn, "ok", dict(pick.point.overrides), values=[1.0, 1.0], throughput=1.0))
        trials.append(frozen(20 + turn, "ok", {}, values=[1.0, 1.0], throughput=1.0))  # the sampler's turn
        known = decide.known_configs(trials, space, flat)
    else:
        raise AssertionError("no local step revisited the inferred neighbour")
    # once it ran it is a measurement: never revisited again
    trials.append(frozen(30, "oom", dict(near.overrides), values=[0.0, 64.0], constraint=1.5, oom_phase="gen"))
    assert decide.inferred_only(trials, space, flat) == set()
