"""The search's decisions with no process at all: tuner.rules.candidates (the search's loop, policy and budget:
tests/tuner/search/)."""

from __future__ import annotations

import textwrap

import pytest
from optuna.trial import TrialState, create_trial

from support import tiny_setup
from trainer.contracts import CONSTRAINT_KEY, PHASES, Status, TrialRecord
from tuner.rules import candidates as decide

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
    v = decide.judge_candidate(cand, number=0, space=space, trial_base=trial_base, trial_flat=flat, known={})
    assert v.launch and v.status is None
    assert v.config["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == 4
    assert v.config["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] is False


def test_judge_invalid_duplicate_and_inferred_oom(setup):
    space, trial_base, flat = setup
    # the per-GPU mini-batch of the tiny config (8 x 1 / 2 = 4) is not divisible by 8
    bad = space.complete({MICRO: 8, GC: True}, flat)
    v = decide.judge_candidate(bad, number=5, space=space, trial_base=trial_base, trial_flat=flat, known={})
    assert v.status == Status.INVALID and v.reason.startswith("config:") and MICRO in v.reason
    assert v.constraint == decide.INVALID_CONSTRAINT

    oom = frozen(1, "oom", {MICRO: 2, GC: False}, values=[0.0, 64.0], constraint=1.5, oom_phase="gen")
    ok = frozen(2, "ok", {MICRO: 1, GC: True}, values=[321.0, 2.5], constraint=-0.9)
    known = decide.known_configs([oom, ok], space, flat)
    assert len(known) == 2
    same = space.complete({MICRO: 1, GC: True}, flat)
    v = decide.judge_candidate(same, number=7, space=space, trial_base=trial_base, trial_flat=flat, known=known)
    # a duplicate of a finished trial is answered with the twin's values and constraint
    assert v.status == Status.DUPLICATE and v.source == 2 and v.values == (321.0, 2.5) and v.constraint == -0.9
    hungrier = space.complete({MICRO: 4, GC: False}, flat)  # bigger micro-batch, no checkpointing
    v = decide.judge_candidate(hungrier, number=8, space=space, trial_base=trial_base, trial_flat=flat, known=known)
    assert v.status == Status.INFERRED_OOM and v.source == 1 and v.constraint == 1.5  # its OOM's
    lighter = space.complete({MICRO: 4, GC: True}, flat)  # checkpointing on: not comparable to the OOM
    assert decide.judge_candidate(
        lighter, number=9, space=space, trial_base=trial_base, trial_flat=flat, known=known
    ).launch
    # a --confirm re-run repeats a measured config on purpose
    assert decide.judge_candidate(
        same, number=10, space=space, trial_base=trial_base, trial_flat=flat, known=known, is_confirm=True
    ).launch


def test_a_duplicate_of_a_running_or_failed_twin_has_no_values(setup):
    space, trial_base, flat = setup
    running = create_trial(state=TrialState.RUNNING, user_attrs={"overrides": {MICRO: 1, GC: True}})
    running.number = 3
    crash = frozen(4, "crash", {MICRO: 2, GC: True})
    known = decide.known_configs([running, crash], space, flat)
    for values, twin in (({MICRO: 1, GC: True}, 3), ({MICRO: 2, GC: True}, 4)):
        v = decide.judge_candidate(
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


# --------------------------------------------------------------------------- a noisy OOM is evidence, not a verdict
REF = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
NOISY_SPACE = SPACE + f"  {REF}: {{type: pow2, low: 1, high: 4, memory: increasing}}\n"


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
        return decide.judge_candidate(
            hungry, number=9, space=space, trial_base=trial_base, trial_flat=flat, known=known
        )

    assert judged(oom, best).status == Status.INFERRED_OOM  # the OOM stands: nothing contradicts it
    fitted = frozen(2, "ok", {MICRO: 2, GC: False, REF: 1}, values=[200.0, 1.0], throughput=200.0)  # hungrier, ran
    assert judged(oom, best, fitted).launch
    # a fitted config that is not at least as hungry (checkpointing on) contradicts nothing
    lighter = frozen(3, "ok", {MICRO: 4, GC: True, REF: 4}, values=[200.0, 1.0], throughput=200.0)
    assert judged(oom, best, lighter).status == Status.INFERRED_OOM
