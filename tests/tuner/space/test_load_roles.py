"""A knob whose role the base config does not build is not searched: critic knobs drop out of a critic-free
(GRPO-style) job, reference-model knobs out of a job with no KL; ``space check`` says which and why."""

import subprocess
import sys

import optuna
import yaml

from trainer.config import unflatten
from tuner.space.load import base_flat_config, load_space

SPACE = "search_spaces/default.yaml"
BASE = "configs/tiny_cpu.yaml"
GRPO = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.rollout.n": 4,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "data.train_batch_size": 4,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
}


def _critic_knobs(space) -> set:
    return {k.key for k in space.knobs if k.key.startswith("critic.")}


def test_critic_knobs_drop_out_without_a_critic():
    space = load_space(SPACE)
    assert _critic_knobs(space), "the space must have critic knobs for this test to mean anything"
    _, gae = base_flat_config(BASE)
    _, grpo = base_flat_config(BASE, extra=GRPO)
    assert space.dropped(gae) == []
    dropped = dict(space.dropped(grpo))
    assert set(dropped) == _critic_knobs(space)
    assert all("adv_estimator=grpo" in why for why in dropped.values())
    # the search never suggests them: every trial's params leave the critic alone
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        cand = space.suggest(study.ask(), grpo)
        assert not set(cand.params) & _critic_knobs(space)
    assert not space.active_keys(grpo) & _critic_knobs(space)
    assert space.active_keys(gae) & _critic_knobs(space)


def test_critic_enable_keeps_them():
    space = load_space(SPACE)
    _, flat = base_flat_config(BASE, extra={**GRPO, "critic.enable": True})
    assert space.dropped(flat) == []


def test_reference_knobs_drop_out_without_a_kl():
    space = load_space(SPACE)
    ref = {k.key for k in space.knobs if k.key.startswith("actor_rollout_ref.ref.")}
    assert ref
    _, flat = base_flat_config(BASE, extra={**GRPO, "actor_rollout_ref.actor.use_kl_loss": False})
    assert set(dict(space.dropped(flat))) == ref | _critic_knobs(space)


def test_space_check_says_which_knobs_dropped_and_why(tmp_path):
    base = tmp_path / "grpo.yaml"
    base.write_text(yaml.safe_dump(unflatten(GRPO)))
    r = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "space", "check", SPACE, "--base", str(base)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "dropped (" in r.stdout and "no critic: algorithm.adv_estimator=grpo reads no values" in r.stdout
