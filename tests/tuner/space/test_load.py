"""Search spaces: parsing, safe expressions, conditions, constraints, grid, memory dominance."""

from __future__ import annotations

import copy
import random
import textwrap
from pathlib import Path

import optuna
import pytest
import yaml

from support import REPO  # noqa: E402
from tuner.space import (
    LOG2_PREFIX,
    Expr,
    ExprError,  # noqa: F401  (part of the module's error surface)
    SpaceError,
    base_flat_config,
    decode_trial,
    from_params,
    load_space,
    space_from_dict,
)

SHIPPED = sorted((REPO / "search_spaces").glob("*.yaml"))

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
DYN = "actor_rollout_ref.actor.use_dynamic_bsz"
BUDGET = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
STRATEGY = "actor_rollout_ref.actor.strategy"
CKPT = "actor_rollout_ref.model.enable_gradient_checkpointing"


@pytest.fixture(scope="module")
def base_flat():
    """configs/tiny_cpu.yaml on 2 processes: per-GPU mini-batch 8 * 1 / 2 = 4."""
    return base_flat_config(REPO / "configs" / "tiny_cpu.yaml", nproc=2)[1]


def write(tmp_path: Path, text: str, name: str = "space.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# --------------------------------------------------------------------------- shipped spaces
@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_space_is_valid_against_the_demo_config(path, base_flat):
    space = load_space(path)
    report = space.validate(base_flat)
    assert report["size"] > 0
    assert report["accepted"] == report["sampled"] > 0, report["first_refusal"]
    # every shipped space can be sampled by Optuna and yields a config the trainer accepts
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(5):
        trial = study.ask()
        cand = space.suggest(trial, base_flat)
        assert set(from_params(trial.params)) == set(cand.params)
        for k in space.knobs:  # a power-of-two knob's value is 2 ** the exponent Optuna holds
            if k.exponents is not None and k.key in cand.params:
                assert cand.params[k.key] == 1 << trial.params[k.param] == from_params(trial.params)[k.key]
        assert all(k in cand.overrides for k in cand.params)
        study.tell(trial, [1.0, 1.0])


def test_shipped_spaces_are_all_there():
    assert {p.name for p in SHIPPED} >= {"default.yaml", "memory_tight.yaml", "rollout_vllm.yaml", "tiny_cpu.yaml"}


def test_tiny_cpu_space_fits_the_tiny_demo(base_flat):
    space = load_space(REPO / "search_spaces" / "tiny_cpu.yaml")
    grid = list(space.grid(base_flat))
    micro = {c.params[MICRO] for c in grid if MICRO in c.params}
    budgets = {c.params[BUDGET] for c in grid if BUDGET in c.params}
    assert micro == {1, 2, 4}
    assert min(budgets) >= 96
    assert len(grid) == space.size(base_flat)


# --------------------------------------------------------------------------- expressions
@pytest.mark.parametrize(
    "text,expected",
    [
        ("2 * a.b", 8),
        ("a.b // 3 + a.b % 3", 2),
        ("a.b / 8", 0.5),
        ("min(a.b, 2) + max(1, a.b)", 6),
        ("a.b <= 4 and not c.d", True),
        ("c.d == false", True),
        ("e.f == 'fsdp2' or e.f == \"fsdp\"", True),
        ("1 < a.b < 8", True),
        ("-a.b", -4),
    ],
)
def test_expressions_evaluate(text, expected):
    env = {"a.b": 4, "c.d": False, "e.f": "fsdp"}
    expr = Expr(text)
    assert expr(env.__getitem__) == expected
    assert expr.names <= set(env)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "a.b.__class__",  # parses as a dotted name, but it is not a config key (checked at load)
        "(lambda: 1)()",
        "a.b if c.d else 1",
        "[1, 2]",
        "a.b ** 2",
        "open('x')",
        "a.b[0]",
        "",
        "a.b <=",
    ],
)
def test_unsafe_or_bad_expressions_are_refused(text):
    if text == "a.b.__class__":
        with pytest.raises(SpaceError, match="unknown key"):
            space_from_dict({"knobs": {MICRO: {"type": "pow2", "low": 1, "high": 4}}, "constraints": [text]})
        return
    with pytest.raises(ValueError):
        Expr(text)


# --------------------------------------------------------------------------- loading errors
@pytest.mark.parametrize(
    "text,key",
    [
        ("knobs:\n  a: {type: bool\n", "malformed YAML at line"),
        ("knobs:\n  actor_rollout_ref.actor.no_such_knob: {type: bool}\n", "actor_rollout_ref.actor.no_such_knob"),
        ("# nothing here\n", "knobs: empty space"),
        ("knobs: {}\n", "knobs: empty space"),
        (f"knobs:\n  {MICRO}: {{type: pow2, low: 3, high: 8}}\n", f"{MICRO}.low: must be a power of two"),
        (f"knobs:\n  {MICRO}: {{type: int, low: 4, high: 1}}\n", f"{MICRO}.low"),
        (f"knobs:\n  {MICRO}: {{type: range, low: 1, high: 4}}\n", f"{MICRO}.type"),
        (f"knobs:\n  {MICRO}: {{type: bool, memory: up}}\n", f"{MICRO}.memory"),
        (f"knobs:\n  {STRATEGY}: {{type: categorical, choices: [fsdp, fsdp2], order: [fsdp]}}\n", f"{STRATEGY}.order"),
        (f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4, when: 'x.y == 1'}}\n", f"{MICRO}.when: unknown key 'x.y'"),
        (f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4, when: '{DYN} =='}}\n", f"{MICRO}.when: bad expression"),
        (
            f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4, when: 'not {DYN}'}}\n  {DYN}: {{type: bool}}\n",
            f"{MICRO}.when: names knob '{DYN}', which comes later",
        ),
        (f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4}}\nderived:\n  data.no_key: 2 * {MICRO}\n", "data.no_key"),
        (
            f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4}}\nconstraints:\n  - '{MICRO} ** 2 > 1'\n",
            "constraints[0]: bad expression",
        ),
        (f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4}}\nsearch: 1\n", "search: unknown section"),
    ],
)
def test_bad_spaces_name_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(SpaceError) as e:
        load_space(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: ")
    assert key in msg


def test_impossible_constraint_names_it(tmp_path, base_flat):
    path = write(
        tmp_path,
        f"""
        knobs:
          {MICRO}: {{type: pow2, low: 1, high: 4}}
          {CKPT}: {{type: bool}}
        constraints:
          - {CKPT} or not {CKPT}
          - {MICRO} > data.train_batch_size
    """,
    )
    with pytest.raises(SpaceError, match=r"constraints\[1\]: no configuration satisfies"):
        load_space(path).validate(base_flat)


def test_jointly_impossible_constraints(tmp_path, base_flat):
    path = write(
        tmp_path,
        f"""
        knobs:
          {MICRO}: {{type: pow2, low: 1, high: 4}}
        constraints:
          - {MICRO} >= 4
          - {MICRO} <= 2
    """,
    )
    with pytest.raises(SpaceError, match="constraints: no configuration satisfies all constraints together"):
        load_space(path).validate(base_flat)


def test_knob_value_of_the_wrong_type_is_refused(tmp_path, base_flat):
    path = write(tmp_path, f"knobs:\n  {CKPT}: {{type: pow2, low: 1, high: 4}}\n")
    with pytest.raises(SpaceError, match=f"{CKPT}: value 1 does not fit"):
        load_space(path).validate(base_flat)


def test_space_the_trainer_refuses_entirely(tmp_path, base_flat):
    # 8 does not divide the per-GPU mini-batch of 4 (the trainer's own rule, no space constraint)
    path = write(tmp_path, f"knobs:\n  {MICRO}: {{type: pow2, low: 8, high: 16}}\n")
    with pytest.raises(SpaceError, match=f"{MICRO}: the trainer config refuses every sampled configuration"):
        load_space(path).validate(base_flat)


# --------------------------------------------------------------------------- semantics
COND = f"""
knobs:
  {DYN}: {{type: bool}}
  {MICRO}:
    type: pow2
    low: 1
    high: 8
    memory: increasing
    when: not {DYN}
  {BUDGET}: {{type: int, low: 96, high: 288, step: 96, memory: increasing, when: {DYN}}}
  {STRATEGY}: {{type: categorical, choices: [fsdp, fsdp2], memory: increasing, order: [fsdp2, fsdp]}}
  {CKPT}: {{type: bool, memory: decreasing}}
derived:
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu:
    expr: 2 * {BUDGET}
    when: {DYN}
constraints:
  - actor_rollout_ref.actor.ppo_mini_batch_size * actor_rollout_ref.rollout.n // trainer.n_gpus_per_node % {MICRO} == 0
"""


@pytest.fixture
def cond_space(tmp_path):
    return load_space(write(tmp_path, COND))


def test_conditions_constraints_and_size(cond_space, base_flat):
    grid = list(cond_space.grid(base_flat))
    # no dyn: micro {1,2,4} (8 does not divide 4) x 2 x 2; dyn: budget 3 x 2 x 2
    assert len(grid) == 3 * 4 + 3 * 4 == cond_space.size(base_flat)
    for c in grid:
        if c.params[DYN]:
            assert MICRO not in c.params and BUDGET in c.params
            assert c.overrides["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"] == 2 * c.params[BUDGET]
        else:
            assert BUDGET not in c.params and MICRO in c.params
            assert "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu" not in c.overrides
    assert len({cond_space.identity(c.effective) for c in grid}) == len(grid)


def test_constraint_over_an_inactive_knob_is_vacuous(cond_space, base_flat):
    flat = dict(base_flat)
    flat[MICRO] = 3  # the base value would fail the divisibility rule, but the knob is inactive
    cand = cond_space.complete({DYN: True, BUDGET: 96, STRATEGY: "fsdp", CKPT: False}, flat)
    assert cand.violated is None
    cand = cond_space.complete({DYN: False, MICRO: 8, STRATEGY: "fsdp", CKPT: False}, base_flat)
    assert cand.violated and cand.violated.startswith("constraints[0]")


def test_suggest_is_define_by_run_with_dotted_param_names(cond_space, base_flat):
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=1))
    seen_dyn = set()
    for _ in range(20):
        trial = study.ask()
        cand = cond_space.suggest(trial, base_flat)
        assert from_params(trial.params) == cand.params
        seen_dyn.add(trial.params[DYN])
        assert (LOG2_PREFIX + MICRO in trial.params) != trial.params[DYN]
        assert MICRO not in trial.params  # a power-of-two knob is its exponent, under its own name
        study.tell(trial, [1.0, 1.0])
    assert seen_dyn == {False, True}
    dists = study.trials[0].distributions
    assert isinstance(dists[DYN], optuna.distributions.CategoricalDistribution)
    assert dists[DYN].choices == (False, True)


def test_suggest_follows_enqueued_params(cond_space, base_flat):
    study = optuna.create_study(directions=["maximize", "minimize"])
    values = {DYN: False, MICRO: 4, STRATEGY: "fsdp2", CKPT: True}
    study.enqueue_trial(cond_space.to_params(values))
    trial = study.ask()
    cand = cond_space.suggest(trial, base_flat)
    assert cand.params == values and trial.params[LOG2_PREFIX + MICRO] == 2


def test_baseline_params_are_the_base_values_in_the_domain(cond_space, base_flat):
    values = {DYN: False, MICRO: 2, STRATEGY: "fsdp", CKPT: False}
    assert cond_space.baseline_values(base_flat) == values
    # what the study enqueues: the Optuna params, the micro-batch as its exponent
    assert cond_space.baseline_params(base_flat) == {DYN: False, LOG2_PREFIX + MICRO: 1, STRATEGY: "fsdp", CKPT: False}
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.TPESampler(seed=0))
    study.enqueue_trial(cond_space.baseline_params(base_flat))
    trial = study.ask()
    cand = cond_space.suggest(trial, base_flat)
    assert cand.params == values and cand.effective[MICRO] == 2


# --------------------------------------------------------------------------- powers of two as exponents
def test_pow2_knobs_are_suggested_as_ordered_exponents(tmp_path, base_flat):
    """type pow2 and a categorical list of contiguous powers of two: an IntDistribution over the exponent
    under ``log2:<key>``; every value of the domain reachable; the values (not exponents) everywhere else."""
    crit = "critic.ppo_micro_batch_size_per_gpu"
    space = load_space(
        write(
            tmp_path,
            f"""
        knobs:
          {MICRO}: {{type: pow2, low: 1, high: 8, memory: increasing}}
          {crit}: {{type: categorical, choices: [4, 1, 2], memory: increasing}}
          {STRATEGY}: {{type: categorical, choices: [fsdp, fsdp2]}}
    """,
        )
    )
    assert space.knob(MICRO).exponents == (0, 3) and space.knob(crit).exponents == (0, 2)
    assert space.knob(STRATEGY).exponents is None and space.knob(STRATEGY).param == STRATEGY
    assert space.knob(MICRO).param == LOG2_PREFIX + MICRO
    assert "Optuna param log2:" in space.knob(MICRO).describe()
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        cand = space.suggest(trial, base_flat)
        assert cand.params[MICRO] == 1 << trial.params[LOG2_PREFIX + MICRO]
        assert cand.overrides[MICRO] == cand.effective[MICRO] == cand.params[MICRO]
        assert cand.params[crit] in (1, 2, 4)
        seen.add(cand.params[MICRO])
        study.tell(trial, [1.0, 1.0])
    assert seen == {1, 2, 4, 8}
    dist = study.trials[0].distributions[LOG2_PREFIX + MICRO]
    assert isinstance(dist, optuna.distributions.IntDistribution) and (dist.low, dist.high) == (0, 3)
    # round trip, for every value of the domain
    for v in (1, 2, 4, 8):
        params = space.to_params({MICRO: v, STRATEGY: "fsdp"})
        assert params == {LOG2_PREFIX + MICRO: v.bit_length() - 1, STRATEGY: "fsdp"}
        assert from_params(params) == {MICRO: v, STRATEGY: "fsdp"}
    with pytest.raises(KeyError):
        space.to_params({"ppotune.tiny.hidden_size": 64})
    # the identity of a config is its values: unchanged by the encoding
    a = space.complete({MICRO: 4, crit: 2, STRATEGY: "fsdp"}, base_flat)
    study.enqueue_trial(space.to_params(a.params))
    trial = study.ask()
    b = space.suggest(trial, base_flat)
    assert space.identity(b.effective) == space.identity(a.effective)
    assert ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "4") in space.identity(a.effective)


def test_a_pow2_list_with_gaps_stays_categorical(tmp_path, base_flat):
    """[1, 2, 8]: an exponent range 0..3 would hold 4, which the user left out; it stays a categorical."""
    space = load_space(write(tmp_path, f"knobs:\n  {MICRO}: {{type: categorical, choices: [1, 2, 8]}}\n"))
    knob = space.knob(MICRO)
    assert knob.exponents is None and knob.param == MICRO
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(30):
        trial = study.ask()
        seen.add(space.suggest(trial, base_flat).params[MICRO])
        study.tell(trial, [1.0, 1.0])
    assert seen == {1, 2, 8}
    assert isinstance(study.trials[0].distributions[MICRO], optuna.distributions.CategoricalDistribution)
    # a single power of two, or a list with a non-power, is not an exponent range either way round
    assert space_from_dict({"knobs": {MICRO: {"type": "categorical", "choices": [3, 6]}}}).knob(MICRO).exponents is None
    assert space_from_dict({"knobs": {MICRO: {"type": "pow2", "low": 4, "high": 4}}}).knob(MICRO).exponents == (2, 2)


def test_decoded_trial_has_values_and_an_ordered_distribution(cond_space, base_flat):
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.enqueue_trial(cond_space.to_params({DYN: False, MICRO: 8, STRATEGY: "fsdp", CKPT: True}))
    trial = study.ask()
    cond_space.suggest(trial, base_flat)
    study.tell(trial, [1.0, 1.0])
    raw = study.trials[0]
    t = decode_trial(raw)
    assert t.params[MICRO] == 8 and LOG2_PREFIX + MICRO not in t.params
    assert t.distributions[MICRO] == optuna.distributions.IntDistribution(1, 8, log=True)
    assert raw.params[LOG2_PREFIX + MICRO] == 3  # the stored trial is untouched
    plain = optuna.trial.create_trial(
        params={MICRO: 2}, distributions={MICRO: optuna.distributions.CategoricalDistribution([1, 2])}, values=[1, 1]
    )
    assert decode_trial(plain) is plain  # a study from before exponents reads as it is


def test_a_study_written_with_categorical_pow2_params_is_refused_clearly(cond_space):
    old = optuna.trial.create_trial(
        params={MICRO: 2},
        distributions={MICRO: optuna.distributions.CategoricalDistribution([1, 2, 4, 8])},
        values=[1, 1],
    )
    msg = cond_space.foreign_params([old])
    assert msg and "log2:" in msg and "--study" in msg
    new = optuna.trial.create_trial(
        params={LOG2_PREFIX + MICRO: 1},
        distributions={LOG2_PREFIX + MICRO: optuna.distributions.IntDistribution(0, 3)},
        values=[1, 1],
    )
    assert cond_space.foreign_params([new]) is None


def test_memory_dominance(cond_space, base_flat):
    def eff(micro=2, strategy="fsdp2", ckpt=True, budget=None):
        params = {DYN: budget is not None, STRATEGY: strategy, CKPT: ckpt}
        params.update({BUDGET: budget} if budget is not None else {MICRO: micro})
        return cond_space.complete(params, base_flat).effective

    oom = eff()
    assert cond_space.at_least_as_hungry(eff(micro=4), oom)  # bigger micro-batch
    assert cond_space.at_least_as_hungry(eff(strategy="fsdp"), oom)  # order: fsdp2 < fsdp
    assert cond_space.at_least_as_hungry(eff(ckpt=False), oom)  # checkpointing decreases memory
    assert cond_space.at_least_as_hungry(eff(micro=4, strategy="fsdp", ckpt=False), oom)
    assert cond_space.at_least_as_hungry(oom, oom)
    assert not cond_space.at_least_as_hungry(eff(micro=1), oom)
    assert not cond_space.at_least_as_hungry(eff(micro=4), eff(ckpt=False))  # mixed directions
    # a different set of active knobs is never comparable (dynamic bsz vs micro-batches)
    assert not cond_space.at_least_as_hungry(eff(budget=288), oom)


def test_memory_none_knob_must_be_equal(tmp_path, base_flat):
    space = load_space(
        write(
            tmp_path,
            f"""
        knobs:
          {MICRO}: {{type: pow2, low: 1, high: 4, memory: increasing}}
          {STRATEGY}: {{type: categorical, choices: [fsdp, fsdp2]}}
    """,
        )
    )
    a = space.complete({MICRO: 4, STRATEGY: "fsdp"}, base_flat).effective
    b = space.complete({MICRO: 1, STRATEGY: "fsdp2"}, base_flat).effective
    c = space.complete({MICRO: 1, STRATEGY: "fsdp"}, base_flat).effective
    assert not space.at_least_as_hungry(a, b)
    assert space.at_least_as_hungry(a, c)


def test_null_follow_keys_are_resolved_in_conditions(tmp_path, base_flat):
    # critic.use_dynamic_bsz is null in the base config: it follows the actor's
    space = load_space(
        write(
            tmp_path,
            f"""
        knobs:
          {DYN}: {{type: bool}}
          critic.ppo_micro_batch_size_per_gpu: {{type: pow2, low: 1, high: 4, when: not critic.use_dynamic_bsz}}
    """,
        )
    )
    assert base_flat["critic.use_dynamic_bsz"] is None
    grid = list(space.grid(base_flat))
    assert sorted(len(c.params) for c in grid) == [1, 2, 2, 2]


def test_float_knob_domain_and_sampling(tmp_path, base_flat):
    key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    space = load_space(
        write(tmp_path, f"knobs:\n  {key}: {{type: float, low: 0.3, high: 0.9, step: 0.1, memory: increasing}}\n")
    )
    knob = space.knob(key)
    assert knob.domain() == [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert knob.contains(0.5) and not knob.contains(0.55)
    cand = space.sample(base_flat, random.Random(0))
    assert cand.params[key] in knob.domain()


# --------------------------------------------------------------------------- the CLI
def test_space_check_cli_prints_size_and_knobs(cli):
    r = cli("space", "check", "configs/tiny_cpu.yaml", "--space", "search_spaces/tiny_cpu.yaml", "--nproc", "2")
    assert r.returncode == 0, r.stderr
    assert "size: 52 distinct configs" in r.stdout
    assert MICRO in r.stdout and "knobs (6)" in r.stdout
    assert f"(Optuna param {LOG2_PREFIX}{MICRO}: 0..2)" in r.stdout  # what the dashboard will show
    assert "outside the space" not in r.stdout  # the base's micro-batch 2 is in the pow2 domain


@pytest.mark.parametrize(
    "text,key",
    [
        ("knobs:\n  x: [1\n", "space: malformed YAML at line 3"),
        ("knobs:\n  actor_rollout_ref.actor.nope: {type: bool}\n", "actor_rollout_ref.actor.nope: unknown knob key"),
        ("description: nothing\n", "knobs: empty space"),
        (
            f"knobs:\n  {MICRO}: {{type: pow2, low: 1, high: 4}}\nconstraints:\n  - {MICRO} > 64\n",
            "constraints[0]: no configuration satisfies",
        ),
    ],
)
def test_space_check_cli_bad_space_exit_2_one_line(cli, tmp_path, text, key):
    path = write(tmp_path, text, "bad.yaml")
    r = cli("space", "check", "configs/tiny_cpu.yaml", "--space", path, "--nproc", "2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert str(path) in lines[0] and key in lines[0]


def test_speed_hints_are_read_checked_and_scored():
    """``speed``: how throughput is expected to move along a knob's order (a prior for local steps): +1 per knob
    moved the way it expects, -1 the other way, 0 without a hint; a bad value is one line naming the key."""
    space = space_from_dict(
        {
            "knobs": {
                MICRO: {"type": "pow2", "low": 1, "high": 8, "memory": "increasing", "speed": "increasing"},
                CKPT: {"type": "bool", "memory": "decreasing", "speed": "decreasing"},
                STRATEGY: {"type": "categorical", "choices": ["fsdp", "fsdp2"]},
            }
        },
        source="s.yaml",
    )
    here = {MICRO: 2, CKPT: True, STRATEGY: "fsdp"}
    assert space.expected_speed(here, {**here, MICRO: 4}) == 1
    assert space.expected_speed(here, {**here, MICRO: 1}) == -1
    assert space.expected_speed(here, {**here, CKPT: False}) == 1
    assert space.expected_speed(here, {**here, STRATEGY: "fsdp2"}) == 0
    assert space.expected_speed(here, {**here, MICRO: 4, CKPT: False}) == 2
    assert "speed=increasing" in space.knobs[0].describe()
    with pytest.raises(SpaceError, match=r"s\.yaml: actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu\.speed: "):
        space_from_dict({"knobs": {MICRO: {"type": "pow2", "low": 1, "high": 8, "speed": "faster"}}}, source="s.yaml")


def test_a_study_resumes_across_speed_hints_but_not_across_another_space():
    """The study keeps the space it was created with; a knob's advisory fields (``speed``, ``help``) change no
    config of the space, so adding them (as the shipped spaces did) does not refuse a resume."""
    from tuner.space import comparable_space
    from tuner.study.opening import incompatible as _incompatible

    old = yaml.safe_load((REPO / "search_spaces" / "tiny_cpu.yaml").read_text())
    for spec in old["knobs"].values():
        if isinstance(spec, dict):
            spec.pop("speed", None)
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.set_user_attr("space", old)
    now = yaml.safe_load((REPO / "search_spaces" / "tiny_cpu.yaml").read_text())
    assert now != old and comparable_space(now) == comparable_space(old)
    assert _incompatible(study, {"space": now}) is None
    other = copy.deepcopy(now)
    other["knobs"][MICRO]["high"] = 2  # fewer configs: another space
    assert "different space" in _incompatible(study, {"space": other})
