"""The search's decisions with no process at all: tuner.decide, and tuner.loop over a replay runner."""

from __future__ import annotations

import random
import textwrap
import time

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from support import TINY_BASE
from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner import decide
from tuner import study as st
from tuner.loop import WAIT, Search, SearchOptions, build_sampler
from tuner.runners import Recorded, ReplayRunner
from tuner.space import base_flat_config, space_from_dict

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
GC = "actor_rollout_ref.model.enable_gradient_checkpointing"
SPACE = textwrap.dedent(f"""
    knobs:
      {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
      {GC}: {{type: bool, memory: decreasing}}
""")


@pytest.fixture(scope="module")
def setup():
    import yaml

    space = space_from_dict(yaml.safe_load(SPACE), source="space.yaml")
    nested, _ = base_flat_config(TINY_BASE, nproc=2)
    trial_base = config_to_dict(
        config_from_dict(apply_overrides(nested, {"trainer.total_training_steps": 2, "ppotune.warmup_steps": 1}))
    )
    return space, trial_base, flatten(trial_base)


def frozen(number: int, status: str, overrides: dict, **attrs) -> optuna.trial.FrozenTrial:
    complete = Status(status).complete
    t = create_trial(
        state=TrialState.COMPLETE if complete else TrialState.FAIL,
        values=[1.0, 1.0] if complete else None,
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

    oom = frozen(1, "oom", {MICRO: 2, GC: False})
    ok = frozen(2, "ok", {MICRO: 1, GC: True})
    known = decide.known_configs([oom, ok], space, flat)
    assert len(known) == 2
    same = space.complete({MICRO: 1, GC: True}, flat)
    v = decide.judge(same, number=7, space=space, trial_base=trial_base, trial_flat=flat, known=known)
    assert v.status == Status.DUPLICATE and v.source == 2
    hungrier = space.complete({MICRO: 4, GC: False}, flat)  # bigger micro-batch, no checkpointing
    v = decide.judge(hungrier, number=8, space=space, trial_base=trial_base, trial_flat=flat, known=known)
    assert v.status == Status.INFERRED_OOM and v.source == 1
    lighter = space.complete({MICRO: 4, GC: True}, flat)  # checkpointing on: not comparable to the OOM
    assert decide.judge(lighter, number=9, space=space, trial_base=trial_base, trial_flat=flat, known=known).launch
    # a --confirm re-run repeats a measured config on purpose
    assert decide.judge(
        same, number=10, space=space, trial_base=trial_base, trial_flat=flat, known=known, is_confirm=True
    ).launch


def test_known_configs_skip_what_is_not_a_measurement(setup):
    space, _, flat = setup
    trials = [
        frozen(0, "interrupted", {MICRO: 1}),
        frozen(1, "duplicate", {MICRO: 1}, duplicate_of=3),
        frozen(2, "ok", {MICRO: 1}, confirm_of=3),
        frozen(3, "ok", {MICRO: 1}),
    ]
    known = decide.known_configs(trials, space, flat)
    assert [t.number for t in known.values()] == [3]


def test_stop_reason():
    ok = [frozen(i, "ok", {}) for i in range(3)]
    kw = dict(elapsed_s=1.0, timeout_s=None, free_in_a_row=0, max_free_in_a_row=100)
    assert decide.stop_reason(ok, budget=4, **kw) is None
    assert "holds 3 counted" in decide.stop_reason(ok, budget=3, **kw)
    dup = [*ok, frozen(3, "duplicate", {}, duplicate_of=0)]
    assert decide.stop_reason(dup, budget=4, **kw) is None  # a duplicate is not counted
    assert "--timeout" in decide.stop_reason(ok, budget=9, **{**kw, "timeout_s": 0.5})
    assert "in a row" in decide.stop_reason(ok, budget=9, **{**kw, "free_in_a_row": 100})


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


def test_search_loop_over_a_replay_runner(setup):
    """The real loop (ask -> judge -> run -> tell) with every launch answered from a recording."""
    space, trial_base, flat = setup
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(
        storage=storage, directions=list(DIRECTIONS), sampler=build_sampler("grid", seed=0, n_trials=6)
    )
    study.enqueue_trial(space.baseline_params(flat), user_attrs={"baseline": True})
    study.enqueue_trial({MICRO: 1, GC: False})
    study.enqueue_trial({MICRO: 4, GC: False})  # hungrier than an OOM: never launched
    study.enqueue_trial(space.baseline_params(flat))  # the sampler repeats the baseline: a duplicate
    table = _replay_table(space, flat)
    # in this recording "micro-batch 1 without checkpointing" ran out of memory
    table[space.identity(space.complete({MICRO: 1, GC: False}, flat).effective)] = [
        Recorded(Status.OOM, None, None, 3.0, 99)
    ]
    runner = ReplayRunner(table, rng=random.Random(0))
    search = Search(
        options=SearchOptions(trials=5, sampler="grid", seed=0),
        study=study,
        storage=storage,
        lock=st.StudyLock(None),
        space=space,
        trial_base=trial_base,
        trial_flat=flat,
        runner=runner,
        penalty_gb=64.0,
    )
    search.run()

    trials = study.get_trials()
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in trials]
    assert decide.count_progress(trials) == 5 and "holds 5 counted" in search.stopped_reason
    statuses = [r.status for r in recs]
    assert statuses[:4] == [Status.OK, Status.OOM, Status.INFERRED_OOM, Status.DUPLICATE]
    assert recs[0].baseline and recs[2].inferred_from == 1 and recs[3].duplicate_of == 0
    # only launched trials reached the runner: baseline, the OOM and the two grid points after them
    assert runner.launched == statuses.count(Status.OK) + statuses.count(Status.OOM) == 4
    assert all(r.engine == "replay" for r, s in zip(recs, statuses) if s in (Status.OK, Status.OOM))
    ok = [t for t, r in zip(trials, recs) if r.status == Status.OK]
    assert all(t.values[0] == TrialRecord.from_user_attrs(t.user_attrs).throughput for t in ok)
    assert trials[1].values == [0.0, 64.0] and trials[2].values == [0.0, 64.0]
    assert trials[3].state == TrialState.FAIL  # the duplicate: recorded, not run, not counted
    assert (
        len({space.identity({**flat, **r.overrides}) for r, t in zip(recs, trials) if decide.counted(t)}) == 5
    )  # five distinct configs


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
        study=study,
        storage=storage,
        lock=st.StudyLock(None),  # no cross-process lock: the gRPC proxy's case
        space=space,
        trial_base=trial_base,
        trial_flat=flat,
        runner=ReplayRunner(_replay_table(space, flat), rng=random.Random(0)),
        penalty_gb=64.0,
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
    assert search._asked_over_budget(mine)
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
    study.enqueue_trial({MICRO: 1, GC: False})
    study.enqueue_trial({MICRO: 2, GC: False})  # runs ok in the replay table (micro-batch 4 would OOM)
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
