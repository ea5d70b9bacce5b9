"""tuner.rules.world: a trial on a few GPUs keeps the production job's per-GPU batch (pure, fast)."""

from __future__ import annotations

import pytest

from tuner.rules.world import WorldPlan, plan_world, production_overrides, trial_overrides

PROD = {
    "trainer.nnodes": 8,
    "trainer.n_gpus_per_node": 8,
    "data.train_batch_size": 1024,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "critic.ppo_mini_batch_size": None,  # follows the actor's
    "actor_rollout_ref.rollout.n": 4,
}


def per_gpu(flat: dict, world: int) -> tuple[float, float]:
    n = flat["actor_rollout_ref.rollout.n"]
    return (
        flat["data.train_batch_size"] * n / world,
        flat["actor_rollout_ref.actor.ppo_mini_batch_size"] * n / world,
    )


def test_trial_on_one_node_keeps_the_production_per_gpu_batch():
    plan = plan_world(PROD, trial_world=8)
    assert (plan.target_world, plan.trial_world, plan.scaled) == (64, 8, True)
    trial = {**PROD, **trial_overrides(plan)}
    assert trial["trainer.nnodes"] == 1 and trial["trainer.n_gpus_per_node"] == 8
    assert trial["data.train_batch_size"] == 128 and trial["actor_rollout_ref.actor.ppo_mini_batch_size"] == 32
    assert per_gpu(trial, 8) == per_gpu(PROD, 64) == (64.0, 16.0)
    # export writes the production's sizes back, never the trial's
    assert {**trial, **production_overrides(plan)} == {**PROD, "trainer.nnodes": 8, "trainer.n_gpus_per_node": 8}
    assert "scaled by 8/64" in plan.describe()


def test_target_options_override_the_base_config_and_round_trip():
    plan = plan_world(PROD, trial_world=2, target_nodes=1, target_gpus_per_node=4)
    assert plan.target_world == 4 and plan.sizes["data.train_batch_size"] == (1024, 512)
    assert WorldPlan.from_dict(plan.to_dict()) == plan
    same = plan_world({**PROD, "trainer.nnodes": 1}, trial_world=8)
    assert not same.scaled and trial_overrides(same)["data.train_batch_size"] == 1024


@pytest.mark.parametrize(
    "trial_world, target, key",
    [
        (3, (1, 7), "data.train_batch_size"),  # 1024 x 3/7 is not whole
        (1, (64, 8), "actor_rollout_ref.actor.ppo_mini_batch_size"),  # 256 / 512 < 1 prompt
    ],
)
def test_a_size_that_does_not_scale_to_whole_prompts_is_refused_naming_the_key(trial_world, target, key):
    with pytest.raises(ValueError) as e:
        plan_world(
            PROD, trial_world=trial_world, target_nodes=target[0], target_gpus_per_node=target[1], source="b.yaml"
        )
    assert str(e.value).startswith(f"b.yaml: {key}: ") and "\n" not in str(e.value)


def test_a_trial_world_larger_than_the_target_is_refused():
    with pytest.raises(ValueError, match="cannot exceed"):
        plan_world(PROD, trial_world=16, target_nodes=1, target_gpus_per_node=8)
