"""The size knobs a base config uses and their ladders (tuner.fit.ladder): pure, no process."""

from __future__ import annotations

import pytest

from support import TINY_BASE
from trainer.config import config_to_dict, load_config
from trainer.contracts import PHASES
from tuner.fit.ladder import UTILIZATION_LADDER, size_knobs
from tuner.memory_model import flat_config


def _knobs(on_gpu: bool = False, **over) -> dict:
    flat = flat_config(config_to_dict(load_config(TINY_BASE, over)))
    return {k.key: k for k in size_knobs(flat, on_gpu=on_gpu)}


def test_fixed_micro_batches_divide_their_rows():
    # tiny_cpu.yaml: 16 prompts x 1 response on 2 ranks = 8 rows per GPU; mini-batch 8 -> 4 per GPU
    got = _knobs()
    assert [k.role for k in got.values()] == [
        "old log-prob",
        "ref log-prob",
        "critic values",
        "critic update",
        "actor update",
    ]
    assert got["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"].ladder == (1, 2, 4)
    assert got["critic.ppo_micro_batch_size_per_gpu"].ladder == (1, 2, 4)
    assert got["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"].ladder == (1, 2, 4, 8)
    values = got["critic.forward_micro_batch_size_per_gpu"]
    assert values.phases == ("values",) and values.base == 2  # null in the config: it follows the update's
    assert got["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"].base_rung == 2  # base 4


def test_token_budgets_are_whole_worst_case_sequences():
    got = _knobs(**{"actor_rollout_ref.actor.use_dynamic_bsz": True})
    seq = 64 + 32
    actor = got["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
    assert actor.kind == "token_budget" and actor.ladder == (seq, 2 * seq, 4 * seq)
    assert actor.base == 512 and actor.base_rung == 2  # 384 is the largest rung at or below 512
    # the log-prob passes follow the actor's use_dynamic_bsz, as verl's config does
    assert got["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"].ladder == tuple(k * seq for k in (1, 2, 4, 8))
    assert "critic.forward_max_token_len_per_gpu" in got


def test_roles_the_run_does_not_build_have_no_knob():
    grpo = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,
        "actor_rollout_ref.rollout.n": 2,
    }
    got = _knobs(**grpo)
    assert not any(k.startswith("critic.") for k in got)  # no critic
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu" not in got  # no KL: no reference model
    # 16 prompts x 2 responses / 2 ranks: 16 rows; mini-batch 8 x 2 / 2 = 8
    assert got["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"].ladder == (1, 2, 4, 8, 16)
    assert got["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"].ladder == (1, 2, 4, 8)


@pytest.mark.parametrize("on_gpu, phases", [(False, PHASES), (True, ("update_weights", "gen"))])
def test_a_vllm_engine_overlaps_every_pass_on_a_cpu(on_gpu, phases):
    vllm = {
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.free_cache_engine": True,
        "actor_rollout_ref.rollout.enable_sleep_mode": True,
    }
    got = _knobs(on_gpu=on_gpu, **vllm)
    engine = got["actor_rollout_ref.rollout.gpu_memory_utilization"]
    assert engine.ladder == UTILIZATION_LADDER and engine.ladder[0] == 0.1 and engine.ladder[-1] == 0.95
    assert engine.phases == tuple(phases)
    others = [k for k in got.values() if k is not engine]
    assert all(engine.overlaps(k) for k in others) is (not on_gpu)


def test_a_knob_round_trips_as_data():
    for knob in _knobs().values():
        assert type(knob).from_dict(knob.to_dict()) == knob
