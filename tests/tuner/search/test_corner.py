"""The speed hints' corner and its walk down (tuner.search.corner), on the recorded grid's space
(benchmarks/data/grid_space.yaml) with every launch answered from a table: which configs the search launches right
after the baseline, and when it hands over to TPE."""

from __future__ import annotations

import optuna
import pytest

from support import REPO, search_over, tiny_setup
from tests.tuner.space.test_load import BUDGET as TOKENS
from tests.tuner.space.test_load import CKPT as GC
from tests.tuner.space.test_load import DYN, STRATEGY
from trainer.contracts import DIRECTIONS, Status, TrialRecord
from tuner.search.corner import CORNER_LAUNCHES, hint_position
from tuner.search.policy import build_sampler
from tuner.study.opening import enqueue_first_trials
from tuner.trials.runners import Recorded, ReplayRunner

RMPAD = "actor_rollout_ref.model.use_remove_padding"


@pytest.fixture(scope="module")
def grid():
    from trainer.config import config_from_dict, config_to_dict, flatten
    from tuner.space import base_flat_config, load_space

    space = load_space(REPO / "benchmarks" / "data" / "grid_space.yaml")
    base = base_flat_config(str(REPO / "benchmarks" / "data" / "grid_base.yaml"), nproc=1)[0]
    nested = config_to_dict(config_from_dict(base))
    return space, nested, flatten(nested)


def table_of(space, flat, fits) -> dict:
    """Every config of the space: OK with a throughput that follows the hints where ``fits(params)``, else OOM."""
    table = {}
    for i, cand in enumerate(space.grid(flat)):
        p = cand.params
        thr = 100.0 * (1.0 + hint_position(space, p))
        ok = fits(p)
        table[space.identity(cand.effective)] = [
            Recorded(Status.OK if ok else Status.OOM, thr if ok else None, 0.1 if ok else None, 5.0, i)
        ]
    # the baseline trial runs the base config as it is: the grid's config with its knob values
    base = space.complete(space.baseline_values(flat), flat)
    table.setdefault(space.identity(flat), table[space.identity(base.effective)])
    return table


def launched(study, space, flat) -> list:
    """(effective config, status) of the study's launched trials, in order."""
    from tuner.rules import candidates as decide

    out = []
    for t in sorted(study.get_trials(), key=lambda t: t.number):
        r = TrialRecord.from_user_attrs(t.user_attrs)
        if r.status is not None and r.status.launched:
            out.append((decide.effective_of(t, flat), r.status))
    return out


def run(grid, fits, *, trials: int, seed: int = 0, study=None, storage=None, **options):
    space, nested, flat = grid
    if study is None:
        storage = optuna.storages.InMemoryStorage()
        sampler = build_sampler("tpe", seed=seed, n_trials=trials)
        study = optuna.create_study(storage=storage, directions=list(DIRECTIONS), sampler=sampler)
        enqueue_first_trials(study, space, flat)  # the baseline first, as ppotune search does
    search = search_over((space, nested, flat), study, storage, ReplayRunner(table_of(space, flat, fits)),
                         trials=trials, sampler="tpe", **options)  # fmt: skip
    search.run()
    return study, storage


def test_the_hints_position_counts_a_notch_of_a_long_knob_as_a_share_of_its_levels(grid):
    space, _, flat = grid
    top = max((c for c in space.grid(flat)), key=lambda c: hint_position(space, c.params))
    assert top.params[DYN] is True and top.params[RMPAD] is True and top.params[GC] is False
    assert top.params[TOKENS] == max(space.knob(TOKENS).domain())
    levels = len(space.knob(TOKENS).domain())
    down = {**top.params, TOKENS: sorted(space.knob(TOKENS).domain())[-2]}
    assert hint_position(space, down) == pytest.approx(hint_position(space, top.params) - 1.0 / (levels - 1))
    assert hint_position(space, {**top.params, GC: True}) == pytest.approx(hint_position(space, top.params) - 1.0)


def test_after_the_baseline_the_search_walks_from_the_corner_down_the_memory_knobs_until_one_fits(grid):
    """Token budgets above 2048 run out of memory: the baseline, the corner (every hint at its fast end), then one
    notch of the token budget at a time (never the unordered strategy, never checkpointing while a notch of the
    budget is left), and the first config that fits ends the walk."""
    space, _, flat = grid
    limit = 2048

    def fits(p):
        return not p.get(DYN) or p[TOKENS] <= limit

    study, _ = run(grid, fits, trials=12)
    runs = launched(study, space, flat)
    walk = runs[1 : 1 + CORNER_LAUNCHES]
    first = walk[0][0]
    assert first[DYN] is True and first[GC] is False and first[RMPAD] is True
    assert first[TOKENS] == max(space.knob(TOKENS).domain())
    tokens = [eff[TOKENS] for eff, _ in walk[: [s for _, s in walk].index(Status.OK) + 1]]
    assert tokens == sorted((t for t in space.knob(TOKENS).domain() if t >= limit), reverse=True)
    assert {eff[STRATEGY] for eff, _ in walk[: len(tokens)]} == {first[STRATEGY]}
    assert [s for _, s in walk[: len(tokens)]] == [Status.OOM] * (len(tokens) - 1) + [Status.OK]


def test_the_walk_stops_after_its_launches_when_nothing_on_it_fits(grid):
    """Only the baseline fits on the walk's path: it launches CORNER_LAUNCHES configs after the baseline, each less
    memory-hungry than the one before, then hands over (the search goes on and finds configs that fit)."""
    space, _, flat = grid

    def fits(p):
        return not p.get(DYN)

    study, _ = run(grid, fits, trials=CORNER_LAUNCHES + 6)
    runs = launched(study, space, flat)
    walk = runs[1 : 1 + CORNER_LAUNCHES]
    assert all(s == Status.OOM for _, s in walk)
    for (a, _), (b, _) in zip(walk, walk[1:]):
        assert space.at_least_as_hungry(a, b) and not space.at_least_as_hungry(b, a)
    assert any(s == Status.OK for _, s in runs[1 + CORNER_LAUNCHES :])


def test_a_resumed_search_continues_the_walk_and_no_corner_turns_it_off(grid):
    """The walk is read back from the study: a second search process over the same study takes its next step
    (not the corner again); ``corner=False`` (``--no-corner``) never walks."""
    space, _, flat = grid

    def fits(p):
        return not p.get(DYN) or p[TOKENS] <= 1024

    study, storage = run(grid, fits, trials=3)  # the baseline, the corner, one notch down
    before = launched(study, space, flat)
    assert [s for _, s in before[1:]] == [Status.OOM, Status.OOM]
    run(grid, fits, trials=4, study=study, storage=storage)
    after = launched(study, space, flat)
    assert after[3][0][TOKENS] < before[2][0][TOKENS] and space.at_least_as_hungry(before[2][0], after[3][0])

    off, _ = run(grid, fits, trials=3, corner=False, seed=3)
    corner = max(space.grid(flat), key=lambda c: hint_position(space, c.params))
    assert all(space.identity(eff) != space.identity(corner.effective) for eff, _ in launched(off, space, flat))


def test_a_space_too_large_to_enumerate_builds_its_corner_and_walks_down_from_it():
    """search_spaces/default.yaml (over a million configs, on the tiny demo's base): the corner is built knob by knob,
    valid, at least as far toward every hint as any of 300 random configs; with the actor's and the critic's token
    budgets together over 48k tokens running out of memory, the walk goes down from it one strictly less hungry notch
    at a time until one fits."""
    import random

    from tuner.search.corner import built_corner

    setup = tiny_setup((REPO / "search_spaces" / "default.yaml").read_text())
    space, _, flat = setup
    assert space.size(flat, limit=200_000) > 100_000
    corner = built_corner(space, flat)
    assert corner is not None and corner.violated is None and corner.error is None
    rng = random.Random(0)
    drawn = [c for c in (space.sample(flat, rng) for _ in range(300)) if c is not None]
    assert hint_position(space, corner.params) >= max(hint_position(space, c.params) for c in drawn)

    class Formula(ReplayRunner):
        def run(self, request, stop):
            ident = dict(request.identity)  # the tuner's values (the trainer's config may clamp a budget)
            budgets = int(ident[TOKENS]) + int(ident["critic.ppo_max_token_len_per_gpu"])
            fits = ident[DYN] != "True" or budgets <= 32768 + 16384  # the actor's and the critic's budgets add up
            thr = 100.0
            got = Recorded(Status.OK if fits else Status.OOM, thr if fits else None, 0.1 if fits else None, 5.0, 0)
            self.table[request.identity] = [got]
            return super().run(request, stop)

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(
        storage=storage, directions=list(DIRECTIONS), sampler=build_sampler("tpe", seed=0, n_trials=8)
    )
    enqueue_first_trials(study, space, flat)
    search_over(setup, study, storage, Formula({}), trials=8, sampler="tpe").run()
    runs = launched(study, space, flat)
    assert space.identity(runs[1][0]) == space.identity(corner.effective)
    walk = runs[1 : [s for _, s in runs].index(Status.OK, 1) + 1]
    assert len(walk) >= 2 and walk[-1][1] == Status.OK and all(s == Status.OOM for _, s in walk[:-1])
    for (a, _), (b, _) in zip(walk, walk[1:]):
        assert space.at_least_as_hungry(a, b) and not space.at_least_as_hungry(b, a)
