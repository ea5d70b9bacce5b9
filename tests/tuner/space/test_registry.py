"""Only execution knobs are searched, in range: a space that would change the algorithm is refused in one line
(unless a knob is marked ``algorithm: true``, and then the report and why.md say so first), and knob ranges are
checked at load (micro-batch >= 1, fractions in (0, 1], token budgets that hold the longest sequence)."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from support import REPO, make_demo_study
from tuner.space import SpaceError, base_flat_config, space_from_dict
from tuner.space.registry import EXECUTION_KNOBS, algorithm_knobs, range_problem

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
BUDGET = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
DYN = "actor_rollout_ref.actor.use_dynamic_bsz"
CHANGES = "not a per-GPU execution knob: varying it changes the algorithm; set it in the base config"


@pytest.fixture(scope="module")
def base_flat():
    """configs/tiny_cpu.yaml on 2 processes: prompts up to 64 tokens, responses up to 32: the longest is 96."""
    return base_flat_config(REPO / "configs" / "tiny_cpu.yaml", nproc=2)[1]


def load(text: str):
    return space_from_dict(yaml.safe_load(textwrap.dedent(text)), source="space.yaml")


@pytest.mark.parametrize(
    "knob",
    [
        "data.train_batch_size: {type: pow2, low: 8, high: 32}",
        "actor_rollout_ref.actor.ppo_mini_batch_size: {type: pow2, low: 4, high: 8}",
        "actor_rollout_ref.actor.clip_ratio: {type: float, low: 0.1, high: 0.3, step: 0.1}",
        "actor_rollout_ref.actor.optim.lr: {type: categorical, choices: [1.0e-6, 1.0e-5]}",
        "algorithm.kl_ctrl.kl_coef: {type: categorical, choices: [0.001, 0.01]}",
        "actor_rollout_ref.actor.ppo_epochs: {type: int, low: 1, high: 2}",
        "actor_rollout_ref.rollout.n: {type: int, low: 1, high: 4}",
    ],
)
def test_a_knob_that_changes_the_algorithm_is_refused(knob):
    with pytest.raises(SpaceError) as e:
        load(f"knobs:\n  {knob}\n")
    key = knob.split(":")[0]
    assert str(e.value) == f"space.yaml: {key}: {CHANGES} " + (
        "(the keys a space may vary: tuner/space/registry.py; `algorithm: true` on the knob compares algorithms on "
        "purpose)"
    )


def test_a_derived_key_that_changes_the_algorithm_is_refused():
    with pytest.raises(SpaceError, match=rf"space.yaml: critic.ppo_mini_batch_size: {CHANGES}"):
        load(f"""
            knobs:
              {MICRO}: {{type: pow2, low: 1, high: 4}}
            derived:
              critic.ppo_mini_batch_size: 2 * {MICRO}
        """)


def test_an_algorithm_knob_marked_on_purpose_loads_and_is_said():
    space = load("""
        knobs:
          actor_rollout_ref.actor.clip_ratio: {type: categorical, choices: [0.1, 0.2], algorithm: true}
    """)
    assert space.knobs[0].algorithm and "algorithm knob" in space.knobs[0].describe()
    assert algorithm_knobs(space.to_dict()) == ["actor_rollout_ref.actor.clip_ratio"]
    with pytest.raises(SpaceError, match="algorithm: must be true or false"):
        load("knobs:\n  actor_rollout_ref.actor.clip_ratio: {type: categorical, choices: [0.1], algorithm: yes-ish}\n")


@pytest.mark.parametrize(
    ("knob", "key", "says"),
    [
        (f"{MICRO}: {{type: int, low: 0, high: 4}}", f"{MICRO}.low", "0 is below 1 (a micro-batch holds"),
        (
            "critic.ppo_micro_batch_size_per_gpu: {type: categorical, choices: [0, 2]}",
            "critic.ppo_micro_batch_size_per_gpu.choices",
            "0 is below 1",
        ),
        (
            "actor_rollout_ref.rollout.gpu_memory_utilization: {type: float, low: 0.0, high: 0.8, step: 0.4}",
            "actor_rollout_ref.rollout.gpu_memory_utilization.low",
            "0.0 is not a fraction in (0, 1]",
        ),
        (
            "actor_rollout_ref.rollout.gpu_memory_utilization: {type: float, low: 0.5, high: 1.5, step: 0.5}",
            "actor_rollout_ref.rollout.gpu_memory_utilization.high",
            "1.5 is not a fraction in (0, 1]",
        ),
        (
            "actor_rollout_ref.rollout.max_num_seqs: {type: int, low: 0, high: 8}",
            "actor_rollout_ref.rollout.max_num_seqs.low",
            "0 is below 1",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.fsdp_size: {type: categorical, choices: [-1, 0]}",
            "actor_rollout_ref.actor.fsdp_config.fsdp_size.choices",
            "0: a shard group is -1",
        ),
    ],
)
def test_ranges_are_checked_at_load(knob, key, says):
    with pytest.raises(SpaceError) as e:
        load(f"knobs:\n  {knob}\n")
    assert str(e.value).startswith(f"space.yaml: {key}: {says}"), str(e.value)


def test_a_token_budget_below_the_longest_sequence_is_refused_against_the_base(base_flat):
    space = load(f"""
        knobs:
          {DYN}: {{type: bool}}
          {BUDGET}: {{type: pow2, low: 32, high: 256, when: {DYN}}}
    """)
    with pytest.raises(SpaceError) as e:
        space.validate(base_flat)
    assert str(e.value) == (
        f"space.yaml: {BUDGET}.low: 32 tokens is below the longest sequence the data admits (96 = "
        "data.max_prompt_length + data.max_response_length): verl refuses such a budget; raise low to 96 or more, "
        f"or add the constraint `{BUDGET} >= data.max_prompt_length + data.max_response_length`"
    )


def test_a_token_budget_the_space_itself_bounds_is_accepted(base_flat):
    """The shipped spaces start their budgets low and rule the short ones out with a constraint: accepted, and
    none of their candidates runs a budget below the longest sequence."""
    space = load(f"""
        knobs:
          {DYN}: {{type: bool}}
          {BUDGET}: {{type: pow2, low: 32, high: 256, when: {DYN}}}
        constraints:
          - {BUDGET} >= data.max_prompt_length + data.max_response_length
    """)
    assert space.validate(base_flat)["accepted"] > 0
    budgets = {c.effective[BUDGET] for c in space.grid(base_flat) if c.effective[DYN]}
    assert budgets == {128, 256}


def test_every_shipped_space_varies_execution_knobs_only():
    for path in sorted((REPO / "search_spaces").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        varied = list(raw["knobs"]) + list(raw.get("derived") or {})
        assert all(k in EXECUTION_KNOBS for k in varied), (path.name, [k for k in varied if k not in EXECUTION_KNOBS])


def test_range_problem_reads_the_kind():
    assert range_problem(MICRO, 1) is None and range_problem(MICRO, 0)
    assert range_problem(BUDGET, 96, longest=96) is None and range_problem(BUDGET, 95, longest=96)
    assert range_problem("actor_rollout_ref.rollout.gpu_memory_utilization", 1.0) is None
    assert range_problem("actor_rollout_ref.rollout.gpu_memory_utilization", float("nan"))
    assert range_problem("data.train_batch_size", 0) is None  # not an execution knob: refused elsewhere


def test_space_check_refuses_an_algorithm_knob_in_one_line(cli, tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("knobs:\n  data.train_batch_size: {type: pow2, low: 8, high: 32}\n")
    r = cli("space", "check", "configs/tiny_cpu.yaml", "--space", path, "--nproc", "2")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"data.train_batch_size: {CHANGES}" in r.stderr


# --------------------------------------------------------------------------- what the report and why.md say first
@pytest.fixture
def algorithm_study(tmp_path):
    """The demo study (tests/support.py) whose space marks one knob ``algorithm: true``."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = make_demo_study(storage)
    space = dict(study.user_attrs["space"])
    knobs = dict(space["knobs"])
    knobs[MICRO] = {**knobs[MICRO], "algorithm": True}
    study.set_user_attr("space", {**space, "knobs": knobs})
    return storage


def test_report_and_why_say_first_that_the_trials_ran_different_algorithms(algorithm_study, tmp_path, cli):
    r = cli("report", "--storage", algorithm_study, "--out", tmp_path / "report", timeout=300)
    assert r.returncode == 0, r.stderr
    first = (tmp_path / "report" / "summary.md").read_text().splitlines()[:3]
    assert first[2].startswith(f"**The compared trials ran different algorithms: the space varied {MICRO}"), first
    html = (tmp_path / "report" / "report.html").read_text()
    assert html.index("The compared trials ran different algorithms") < html.index("class='sub'")
    r = cli("export", "--storage", algorithm_study, "--out", tmp_path / "export", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "warning: The compared trials ran different algorithms" in r.stderr
    why = (tmp_path / "export" / "why.md").read_text().splitlines()
    assert why[0].startswith("# Why trial #") and why[2].startswith("**The compared trials ran different algorithms")
    config = (tmp_path / "export" / "best_config.yaml").read_text().splitlines()
    assert config[1].startswith("# The compared trials ran different algorithms")


def test_a_study_of_execution_knobs_says_nothing_of_the_kind(tmp_path, cli):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    make_demo_study(storage)
    r = cli("export", "--storage", storage, "--out", tmp_path / "export", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "different algorithms" not in (tmp_path / "export" / "why.md").read_text() + r.stderr
