"""The search's policy (tuner.search.policy) with no process: the grid's seeded order, local steps from the
incumbent, its neighbours."""

from __future__ import annotations

import optuna

from support import search_over, tiny_setup
from tests.tuner.rules.test_candidates import GC, MICRO, NOISY_SPACE, REF, SPACE, frozen
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner.rules import candidates as decide
from tuner.search.policy import Pick, build_sampler
from tuner.search.stall import STALL_AFTER
from tuner.trials.runners import Recorded, ReplayRunner


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
    assert decide.judge_candidate(near, number=5, **args).status == Status.INFERRED_OOM
    inferred = frozen(2, "inferred_oom", dict(near.overrides), values=[0.0, 64.0], constraint=1.5, inferred_from=1)
    trials.append(inferred)
    revisitable = decide.inferred_only(trials, space, flat)
    assert revisitable == {space.identity(near.effective)}
    # held only as an inferred OOM, one step from the incumbent: launched when proposed again; two steps: not
    assert decide.judge_candidate(near, number=6, revisitable=revisitable, **args).launch
    assert decide.judge_candidate(
        far, number=7, revisitable=revisitable | {space.identity(far.effective)}, **args
    ).status == (Status.INFERRED_OOM)
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
