"""A search started from a fit (tuner.fit.bounds, ``ppotune search --from-fit``): no process."""

from __future__ import annotations

import json

import pytest

from support import REPO
from tuner.fit.bounds import bounded_space, fitted_params, read_fit
from tuner.space import base_flat_config, load_space, space_from_dict


def test_fitted_sizes_cap_the_space_and_are_tried_after_the_baseline():
    space = load_space(REPO / "benchmarks" / "data" / "grid_space.yaml")
    flat = base_flat_config(REPO / "benchmarks" / "data" / "grid_base.yaml")[1]
    fitted = {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 12, "critic.ppo_micro_batch_size_per_gpu": 16}
    bounded, notes = bounded_space(space, fitted)
    micro = bounded.knob("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    assert micro.domain() == [1, 2, 4, 8]  # a power-of-two knob capped at the largest power of two <= 12
    assert notes == ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu <= 12 (the fit's)"]  # critic: derived
    assert bounded.size(flat) < space.size(flat)
    # the token budget (not fitted: the fit ran fixed micro-batches) keeps its range
    budget = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    assert bounded.knob(budget).domain() == space.knob(budget).domain()
    params = fitted_params(bounded, {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 8}, flat)
    assert params == bounded.to_params({**bounded.baseline_values(flat), micro.key: 8})
    assert fitted_params(bounded, {"critic.ppo_micro_batch_size_per_gpu": 8}, flat) == {}  # not a knob of it


def test_every_kind_of_knob_is_capped():
    raw = {
        "knobs": {
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": {
                "type": "int",
                "low": 96,
                "high": 960,
                "step": 96,
                "memory": "increasing",
            },
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": {
                "type": "categorical",
                "choices": [2, 6, 12],
                "memory": "increasing",
            },
            "actor_rollout_ref.rollout.gpu_memory_utilization": {
                "type": "float",
                "low": 0.3,
                "high": 0.9,
                "step": 0.1,
                "memory": "increasing",
            },
            "critic.ppo_micro_batch_size_per_gpu": {"type": "pow2", "low": 1, "high": 8, "memory": "none"},
        }
    }
    fitted = {
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 500,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.55,
        "critic.ppo_micro_batch_size_per_gpu": 2,
    }
    bounded, notes = bounded_space(space_from_dict(raw), fitted)
    assert bounded.knob("actor_rollout_ref.actor.ppo_max_token_len_per_gpu").domain()[-1] == 480  # on the step grid
    assert bounded.knob("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu").domain() == [2]  # smallest
    assert bounded.knob("actor_rollout_ref.rollout.gpu_memory_utilization").domain()[-1] == 0.5
    assert bounded.knob("critic.ppo_micro_batch_size_per_gpu").domain()[-1] == 8  # memory: none: left alone
    assert len(notes) == 3


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "fit.json: --from-fit: No such file"),
        ("{", "fit.json: --from-fit: not JSON"),
        ({"values": {}}, "fit.json: values: missing"),
        ({"values": {"critic.ppo_micro_batch_size_per_gpu": "8"}}, "values.critic.ppo_micro_batch_size_per_gpu"),
    ],
)
def test_a_bad_fit_dir_is_one_line_naming_the_file(tmp_path, content, needle):
    if content is not None:
        (tmp_path / "fit.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError) as got:
        read_fit(tmp_path)
    assert needle in str(got.value) and str(tmp_path) in str(got.value) and "\n" not in str(got.value)
