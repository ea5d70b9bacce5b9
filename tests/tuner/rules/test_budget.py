"""When a search stops because it cannot work (tuner.rules.budget.FailureRule): the baseline failed, or the same
error came back --max-failures-in-a-row times. The rule alone, then the loop over a replay runner with real
Optuna studies (tests/e2e/test_fail_fast.py runs it with real trials)."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from support import search_over, tiny_setup
from tests.tuner.rules.test_candidates import frozen
from trainer.contracts import CONSTRAINT_KEY, DIRECTIONS, ExitCode, Status, TrialRecord
from tuner.rules.budget import (
    FailureRule,
    after_search_s,
    error_signature,
    over_budget,
    search_stop_reason,
)
from tuner.trials.runners import ReplayRunner

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
GC = "actor_rollout_ref.model.enable_gradient_checkpointing"
SPACE = f"""
knobs:
  {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
  {GC}: {{type: bool, memory: decreasing}}
"""
CRASH = "rank 1 exited with signal 9 (SIGKILL) in phase gen"


def seen(rule: FailureRule, number: int, status: Status, error: str | None = None, **kw):
    return rule.seen(
        number=number, status=status, error=error, launched=kw.get("launched", True), baseline=kw.get("baseline", False)
    )


@pytest.mark.parametrize("status", [Status.CRASH, Status.INVALID, Status.HANG])
def test_a_failed_baseline_stops_at_once(status):
    halt = seen(FailureRule(), 0, status, "config: data.train_files: missing column 'reward_model'", baseline=True)
    assert halt is not None and halt.reason.startswith(
        f"the baseline trial #0 (the base config as written) ended {status}"
    )
    assert halt.exit_code == (ExitCode.USAGE if status is Status.INVALID else ExitCode.ERROR)


@pytest.mark.parametrize("status", [Status.OK, Status.OOM])
def test_a_baseline_that_ran_or_ran_out_of_memory_goes_on(status):
    assert seen(FailureRule(), 0, status, baseline=True) is None  # an OOM is information: smaller configs may fit


def test_the_same_error_three_times_in_a_row_stops():
    rule = FailureRule(3)
    assert seen(rule, 1, Status.CRASH, CRASH) is None
    assert seen(rule, 2, Status.CRASH, CRASH.replace("rank 1", "rank 0")) is None  # numbers aside, the same error
    halt = seen(rule, 3, Status.CRASH, CRASH)
    assert halt.reason.startswith("3 trials in a row (the last #3) ended crash with the same error: rank 1 exited")
    assert halt.reason.endswith("(--max-failures-in-a-row 3)") and halt.exit_code == ExitCode.ERROR


def test_anything_else_in_between_starts_the_count_again():
    rule = FailureRule(2)
    assert seen(rule, 1, Status.CRASH, CRASH) is None
    assert seen(rule, 2, Status.OK) is None  # a measured trial
    assert seen(rule, 3, Status.CRASH, CRASH) is None
    assert seen(rule, 4, Status.CRASH, "another error") is None  # a different error
    assert seen(rule, 5, Status.DUPLICATE, launched=False) is None  # not launched: not watched
    assert seen(rule, 6, Status.CRASH, "another error") is not None


def test_zero_never_stops_on_a_streak_and_invalid_is_the_users_input():
    assert all(seen(FailureRule(0), n, Status.CRASH, CRASH) is None for n in range(1, 10))
    rule = FailureRule(2)
    seen(rule, 1, Status.INVALID, "config: x: bad")
    assert seen(rule, 2, Status.INVALID, "config: x: bad").exit_code == ExitCode.USAGE


#: what a rank records when vLLM's share holds no sequence (trainer.contracts.MemoryMessage.error over vLLM's
#: vllm/v1/core/kv_cache_planning.py::_check_enough_kv_cache_memory)
UNDERSIZED = (
    "rank 0 failed in phase gen: config: actor_rollout_ref.rollout.gpu_memory_utilization too small: vLLM's share of "
    "the device holds no sequence: ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)


def test_a_vllm_share_too_small_is_a_bound_never_a_streak_nor_a_failed_baseline():
    rule = FailureRule(2)
    assert seen(rule, 0, Status.INVALID, UNDERSIZED, baseline=True) is None  # a larger share may run
    assert all(seen(rule, n, Status.INVALID, UNDERSIZED) is None for n in range(1, 6))


def test_error_signature_is_the_first_clause_with_numbers_blanked():
    assert error_signature(Status.CRASH, "rank 1 died\nlater") == error_signature(Status.CRASH, "rank 12 died")
    assert error_signature(Status.CRASH, "rank 1 died") != error_signature(Status.HANG, "rank 1 died")
    assert error_signature(Status.CRASH, "rank 1 died") != error_signature(Status.CRASH, "rank 1 hung")
    # what the other ranks said after the cause varies with who noticed first (measured: gloo's error or SIGTERM)
    a = "rank(s) [1] exited without a status (killed by a signal?); ranks' exit code -9; rank 0 failed: RuntimeError"
    b = "rank(s) [1] exited without a status (killed by a signal?); ranks' exit code -9; rank 0 failed: signal 15"
    assert error_signature(Status.CRASH, a) == error_signature(Status.CRASH, b)


# --------------------------------------------------------------------------- the loop, replayed
@pytest.fixture(scope="module")
def setup():
    return tiny_setup(SPACE)


def _study(setup, *, baseline: bool):
    space, _, flat = setup
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS))
    if baseline:
        study.enqueue_trial(space.baseline_params(flat), user_attrs={"baseline": True})
    return study, storage


def test_the_loop_stops_on_a_crashed_baseline_and_starts_nothing_else(setup):
    study, storage = _study(setup, baseline=True)
    search = search_over(setup, study, storage, ReplayRunner({}), trials=6, sampler="grid")  # every run: crash
    search.run()
    assert search.halt is not None and search.halt.reason.startswith("the baseline trial #0 (the base config")
    assert "replay: this config was never recorded" in search.halt.reason
    assert [t.number for t in study.get_trials()] == [0]


def test_the_loop_stops_after_the_same_error_n_times(setup):
    study, storage = _study(setup, baseline=False)
    search = search_over(setup, study, storage, ReplayRunner({}), trials=6, sampler="grid", max_failures_in_a_row=3)
    search.run()
    assert search.halt.reason.startswith("3 trials in a row (the last #2) ended crash with the same error")
    assert len(study.get_trials()) == 3


def test_without_the_rule_the_loop_runs_its_budget(setup):
    study, storage = _study(setup, baseline=False)
    search = search_over(setup, study, storage, ReplayRunner({}), trials=4, sampler="grid", max_failures_in_a_row=0)
    search.run()
    assert search.halt is None and len(study.get_trials()) == 4


class _Undersized:
    """Every trial refused by vLLM for too small a share (what a real trial's classification gives it)."""

    name = "undersized"

    def run(self, request, stop):
        from tuner.trials.launch import classify
        from tuner.trials.runners import TrialOutcome

        status, error = classify(1, {"status": "error", "error": UNDERSIZED})
        return TrialOutcome(status, TrialRecord(error=error, duration_s=5.0))


def test_the_loop_tells_a_vllm_share_too_small_as_an_infeasible_point_and_goes_on(setup):
    study, storage = _study(setup, baseline=True)
    search = search_over(setup, study, storage, _Undersized(), trials=4, sampler="grid", max_failures_in_a_row=2)
    search.run()
    assert search.halt is None and len(study.get_trials()) == 4
    for t in study.get_trials():  # COMPLETE with penalized values: the sampler learns the bound
        assert t.state == TrialState.COMPLETE and t.user_attrs["status"] == "invalid"
        assert t.constraints[CONSTRAINT_KEY] > 0


def test_stop_reason():
    ok = [frozen(i, "ok", {}) for i in range(3)]
    kw = dict(elapsed_s=1.0, timeout_s=None)
    assert search_stop_reason(ok, budget=4, **kw) is None
    assert "holds 3 counted" in search_stop_reason(ok, budget=3, **kw)
    dup = [*ok, frozen(3, "duplicate", {}, duplicate_of=0)]
    assert search_stop_reason(dup, budget=4, **kw) is None  # a duplicate is not counted
    assert "--timeout" in search_stop_reason(ok, budget=9, **{**kw, "timeout_s": 0.5})
    rejected = [*ok, frozen(3, "inferred_oom", {}, inferred_from=0), frozen(4, "invalid", {}, duration_s=0.0)]
    assert search_stop_reason(rejected, budget=4, **kw) is None  # rejected before launch: not counted
    launched_invalid = [*ok, frozen(3, "invalid", {}, duration_s=7.5, returncode=2)]
    assert "holds 4 counted" in search_stop_reason(launched_invalid, budget=4, **kw)  # exit 2 counts


# --------------------------------------------------------------------------- the budget across workers
def _t(number, state, **ua):
    t = create_trial(state=state, values=[1.0, 1.0] if state == TrialState.COMPLETE else None, user_attrs=ua)
    t.number = number
    return t


def test_over_budget_counts_what_is_below_and_may_still_count():
    R, C, W, F = TrialState.RUNNING, TrialState.COMPLETE, TrialState.WAITING, TrialState.FAIL
    two_done = [_t(0, C, status="ok"), _t(1, C, status="ok")]
    assert not over_budget([*two_done, _t(2, R)], 2, budget=3)
    # another worker's trial numbered below ours took the last slot in the same moment
    assert over_budget([*two_done, _t(2, R), _t(3, R)], 3, budget=3)
    # ...but not one numbered above ours: that one is the one over the budget
    assert not over_budget([*two_done, _t(2, R), _t(3, R)], 2, budget=3)
    # an enqueued retry below ours holds its slot: it counts once popped
    assert over_budget([*two_done, _t(2, W, retry_of=0), _t(3, R)], 3, budget=3)
    # what can never count again does not hold a slot
    for gone in (
        _t(2, F, status="interrupted"),
        _t(2, F, status="duplicate", duplicate_of=0),
        _t(2, F, status="over_budget"),
        _t(2, C, status="ok", confirm_of=0),
        _t(2, W, confirm_of=0),
    ):
        assert not over_budget([*two_done, gone, _t(3, R)], 3, budget=3), gone.user_attrs


def test_timeout_leaves_the_confirmation_its_time():
    ok = [frozen(i, "ok", {}, duration_s=d) for i, d in enumerate((10.0, 30.0, 20.0))]
    rerun = frozen(3, "ok", {}, duration_s=500.0, confirm_of=0)  # a re-run's seconds are not the search's
    assert after_search_s([*ok, rerun], runs=4, timeout_s=1000.0) == 80.0  # 4 x the median 20 s
    assert after_search_s(ok, runs=40, timeout_s=1000.0) == 500.0  # at most half of the timeout
    assert after_search_s(ok, runs=0, timeout_s=1000.0) == 0.0
    assert after_search_s([], runs=4, timeout_s=1000.0) == 0.0  # nothing measured yet
    kw = dict(budget=9, timeout_s=100.0)
    assert search_stop_reason(ok, elapsed_s=70.0, reserve_s=20.0, **kw) is None
    why = search_stop_reason(ok, elapsed_s=81.0, reserve_s=20.0, **kw)
    assert why == "--timeout 100 s: ~20 s of it left for the confirmation and the probes"
