"""When the sampler stalls the search proposes itself (tuner.search.stall), and stops only when every config is
measured or ruled out: the policy alone on hand-built trials, then the loop over a replay runner (no process)."""

from __future__ import annotations

import random

import optuna
import pytest

from support import search_over, tiny_setup
from tests.tuner.rules.test_candidates import GC, MICRO, SPACE, frozen
from tests.tuner.search.test_policy import _policy
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner.rules import candidates as decide
from tuner.rules.budget import count_progress
from tuner.search.stall import STALL_AFTER, propose_itself
from tuner.trials.runners import Recorded, ReplayRunner


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(SPACE)


def _known(space, flat, trials):
    return decide.known_configs(trials, space, flat)


def test_it_proposes_a_neighbour_of_the_best_then_a_boundary_config_then_says_nothing_is_left(setup):
    space, _, flat = setup
    policy = _policy(space, flat)
    trials = [
        frozen(0, "ok", {MICRO: 1, GC: False}, throughput=100.0),
        frozen(1, "ok", {MICRO: 1, GC: True}, throughput=80.0),
    ]
    got = propose_itself(policy, trials, _known(space, flat, trials))
    # the best (1, no GC) has one unmeasured neighbour: micro-batch 2
    assert got.rule == "neighbour" and got.point.params == {MICRO: 2, GC: False} and not got.launch_anyway
    # micro-batch 2 with checkpointing ran out of memory: (2, no GC), (4, GC) and (4, no GC) are at least as hungry
    trials.append(frozen(2, "oom", {MICRO: 2, GC: True}, values=[0.0, 64.0], constraint=1.5))
    trials.append(frozen(3, "inferred_oom", {MICRO: 2, GC: False}, values=[0.0, 64.0], inferred_from=2))
    got = propose_itself(policy, trials, _known(space, flat, trials))
    # nothing open is left; (2, no GC) is one step from a config that ran and only that one OOM rules it out
    assert got.rule == "boundary" and got.point.params == {MICRO: 2, GC: False} and got.launch_anyway
    # launched, and it ran out of memory too: now two OOMs rule out micro-batch 4, and nothing is left to doubt
    trials[3] = frozen(3, "oom", {MICRO: 2, GC: False}, values=[0.0, 64.0], constraint=1.5)
    got = propose_itself(policy, trials, _known(space, flat, trials))
    assert got.point is None
    assert got.stop == "every config of the space is measured or ruled out (4 launched, 2 ruled out by an OOM)"


def test_a_config_in_the_study_is_never_proposed_again_and_the_seeded_order_comes_last(setup):
    space, _, flat = setup
    policy = _policy(space, flat)
    # the only measured config is an OOM: no neighbour of a measured config, no boundary: the seeded grid order
    trials = [frozen(0, "oom", {MICRO: 4, GC: False}, values=[0.0, 64.0], constraint=1.5)]
    got = propose_itself(policy, trials, _known(space, flat, trials))
    order = [c for _, c in policy.shuffled_grid() if c.params != {MICRO: 4, GC: False}]
    assert got.rule == "seeded" and got.point.params == order[0].params


def test_a_stalled_search_launches_the_noisy_boundary_and_walks_past_it(setup):
    """The sampler proposes configs an OOM rules out until it stalls; the search launches the one config at the
    boundary that one OOM rules out (two steps from the incumbent: no local step would revisit it), it fits (the
    OOM was noise), and the configs beyond it are measured in turn: the search stops with every config measured,
    its budget not spent."""
    space, trial_base, flat = setup
    table = {}
    for i, cand in enumerate(space.grid(flat)):
        micro, gc = cand.params[MICRO], cand.params[GC]
        thr = 100.0 * micro * (1.2 if gc else 1.0)  # checkpointing faster here: the incumbent is (1, GC)
        table[space.identity(cand.effective)] = [Recorded(Status.OK, thr, 1.0 + micro, 10.0, i)]
    # micro-batch 2 with checkpointing ran out of memory once (in this recording, always): noise at the boundary
    table[space.identity(space.complete({MICRO: 2, GC: True}, flat).effective)] = [
        Recorded(Status.OOM, None, None, 3.0, 99, "update_actor")
    ]
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), sampler=optuna.samplers.RandomSampler(0))
    for micro, gc in [(1, False), (1, True), (2, True)] + [(2, False)] * (STALL_AFTER + 2):
        study.enqueue_trial(space.to_params({MICRO: micro, GC: gc}))
    runner = ReplayRunner(table, rng=random.Random(0))
    search = search_over(setup, study, storage, runner, trials=20, sampler="random")
    search.run()
    recs = [TrialRecord.from_user_attrs(t.user_attrs) for t in study.get_trials()]
    launched = {(r.overrides[MICRO], r.overrides[GC]): r.status for r in recs if r.status in (Status.OK, Status.OOM)}
    assert launched == {
        (1, False): Status.OK,
        (1, True): Status.OK,
        (2, True): Status.OOM,
        (2, False): Status.OK,  # the boundary, launched although an OOM ruled it out
        (4, True): Status.OK,  # beyond it: the OOM was contradicted
        (4, False): Status.OK,
    }
    stalled = STALL_AFTER + 2
    assert [r.status for r in recs[3 : 3 + stalled]] == [Status.INFERRED_OOM] * stalled
    assert (recs[3 + stalled].overrides[MICRO], recs[3 + stalled].overrides[GC], recs[3 + stalled].status) == (
        2,
        False,
        Status.OK,
    )
    assert search.stopped_reason == "every config of the space is measured or ruled out (6 launched)"
    assert count_progress(study.get_trials()) == runner.launched == 6 < 20


def test_an_inference_whose_oom_was_contradicted_is_proposed_again(setup):
    space, _, flat = setup
    policy = _policy(space, flat)
    trials = [
        frozen(0, "oom", {MICRO: 2, GC: True}, values=[0.0, 64.0], constraint=1.5),
        frozen(1, "inferred_oom", {MICRO: 4, GC: True}, values=[0.0, 64.0], inferred_from=0),
        # (2, no GC) is at least as hungry as #0 and ran: #0's OOM was noise and rules nothing out any more
        frozen(2, "ok", {MICRO: 2, GC: False}, throughput=200.0),
        frozen(3, "ok", {MICRO: 4, GC: False}, throughput=400.0),
        frozen(4, "ok", {MICRO: 1, GC: False}, throughput=100.0),
        frozen(5, "ok", {MICRO: 1, GC: True}, throughput=80.0),
    ]
    got = propose_itself(policy, trials, _known(space, flat, trials))
    # the best (4, no GC)'s one step left is (4, GC): held only as an inference that nothing supports now
    assert got.rule == "neighbour" and got.point.params == {MICRO: 4, GC: True} and not got.launch_anyway
