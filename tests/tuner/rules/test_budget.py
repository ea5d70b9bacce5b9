"""When a search stops because it cannot work (tuner.rules.budget.FailureRule): the baseline failed, or the same
error came back --max-failures-in-a-row times. The rule alone, then the loop over a replay runner with real
Optuna studies (tests/e2e/test_fail_fast.py runs it with real trials)."""

from __future__ import annotations

import optuna
import pytest

from support import search_over, tiny_setup
from trainer.contracts import DIRECTIONS, ExitCode, Status
from tuner.rules.budget import FailureRule, error_signature
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
