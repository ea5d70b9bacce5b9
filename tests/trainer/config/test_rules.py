"""verl's critic-free advantage estimators in the typed config: accepted with the keys GRPO recipes set, verl's
names and defaults, the critic's keys checked only when there is a critic, and a GRPO verl run file read into
the decision base."""

import re
from pathlib import Path

import pytest
import yaml

from trainer.config import ConfigError, PPOConfig, load_config, need_critic, need_reference_policy
from trainer.config.rules import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES

BASE = "configs/tiny_cpu.yaml"
REPO = Path(__file__).resolve().parents[3]
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
VERL_PY = REPO / ".venv-verl" / "bin" / "python"
#: a GRPO recipe on the embedded task: 4 prompts x 4 responses, the KL as a loss, none in the reward
GRPO = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=false",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
]


def _verl_site() -> Path:
    found = sorted((REPO / ".venv-verl" / "lib").glob("python3.*/site-packages/verl"))
    if not found:
        pytest.skip("verl venv not installed (.venv-verl)")
    return found[0]


@pytest.mark.parametrize("estimator", [e for e in ADV_ESTIMATORS if e != "gae"])
def test_every_critic_free_estimator_is_accepted_without_a_critic(estimator):
    cfg = load_config(BASE, [*GRPO, f"algorithm.adv_estimator={estimator}"])
    assert not need_critic(cfg) and need_reference_policy(cfg)


def test_the_critic_and_the_reference_model_as_verl_decides():
    assert need_critic(PPOConfig()) and not need_reference_policy(PPOConfig())  # verl's defaults: gae, no KL
    cfg = load_config(BASE, [*GRPO, "critic.enable=true"])
    assert need_critic(cfg)  # verl runs (and trains) a critic whose values no estimator reads
    cfg = load_config(BASE, [*GRPO, "actor_rollout_ref.actor.use_kl_loss=false"])
    assert not need_reference_policy(cfg)


def test_critic_keys_are_checked_only_with_a_critic():
    """verl's own critic defaults (micro-batch null, a model path that is not there) do not refuse a GRPO run."""
    unusable = ["critic.ppo_micro_batch_size_per_gpu=null", "critic.model.path=/nonexistent"]
    cfg = load_config(BASE, [*GRPO, *unusable])
    assert cfg.critic.ppo_micro_batch_size_per_gpu is None
    with pytest.raises(ConfigError) as e:
        load_config(BASE, [*GRPO, *unusable, "critic.enable=true"])
    assert e.value.key == "critic.ppo_micro_batch_size_per_gpu"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["critic.enable=false"], "critic.enable"),  # gae reads the values
        ([*GRPO, "algorithm.adv_estimator=gdpo"], "algorithm.adv_estimator"),  # verl's, not run by ours
        (
            [*GRPO, "algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1", f"{MICRO}=1"],
            "actor_rollout_ref.rollout.n",
        ),
        ([*GRPO, "actor_rollout_ref.actor.kl_loss_type=full"], "actor_rollout_ref.actor.kl_loss_type"),
        ([*GRPO, "actor_rollout_ref.actor.loss_agg_mode=seq-sum"], "actor_rollout_ref.actor.loss_agg_mode"),
        ([*GRPO, "actor_rollout_ref.actor.loss_scale_factor=0"], "actor_rollout_ref.actor.loss_scale_factor"),
    ],
)
def test_refused_with_the_key_named(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(BASE, overrides)
    assert e.value.key == key


def test_names_and_defaults_are_verls():
    """The estimator names are verl 0.9.1's registry names, the KL and aggregation spellings its own, and each
    default the value of verl's YAML (read from verl's files, not imported)."""
    site = _verl_site()
    core = (site / "trainer" / "ppo" / "core_algos.py").read_text()
    registered = set(re.findall(r'^\s+[A-Z_]+ = "(\w+)"$', core.split("class AdvantageEstimator")[1], re.M))
    assert set(ADV_ESTIMATORS) <= registered
    for name in KL_ESTIMATORS:
        assert f'"{name.rstrip("+")}"' in core.split("def kl_penalty_forward")[1]
    actor_py = (site / "workers" / "config" / "actor.py").read_text()
    assert all(f'"{m}"' in actor_py.split("valid_loss_agg_modes")[1] for m in LOSS_AGG_MODES)
    ppo = yaml.safe_load((site / "trainer" / "config" / "ppo_trainer.yaml").read_text())
    actor = yaml.safe_load((site / "trainer" / "config" / "actor" / "actor.yaml").read_text())
    critic = yaml.safe_load((site / "trainer" / "config" / "critic" / "critic.yaml").read_text())
    ours = PPOConfig()
    a, alg = ours.actor_rollout_ref.actor, ours.algorithm
    assert (alg.adv_estimator, alg.norm_adv_by_std_in_grpo, alg.use_kl_in_reward, alg.kl_penalty) == (
        ppo["algorithm"]["adv_estimator"],
        ppo["algorithm"]["norm_adv_by_std_in_grpo"],
        ppo["algorithm"]["use_kl_in_reward"],
        ppo["algorithm"]["kl_penalty"],
    )
    for key in ("use_kl_loss", "kl_loss_coef", "kl_loss_type", "loss_agg_mode", "loss_scale_factor"):
        assert getattr(a, key) == actor[key], key
    assert ours.critic.enable == critic["enable"]
    assert ours.actor_rollout_ref.rollout.n == 1


def test_a_grpo_verl_run_file_is_read_into_the_decision_base(tmp_path):
    """``ppotune search --engine verl`` reads the run (composed by verl's Hydra) into the typed config for its
    decisions: a GRPO run with verl's own critic defaults is accepted, its estimator and KL loss kept."""
    _verl_site()
    from trainer.verl_engine import adapter

    train = tmp_path / "train.parquet"
    train.write_bytes(b"")  # the decision base checks it exists; nothing reads it
    run = tmp_path / "run.yaml"
    overrides = [
        "actor_rollout_ref.model.path=tiny",
        f"data.train_files={train}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "trainer.n_gpus_per_node=1",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    ]
    run.write_text(yaml.safe_dump({"overrides": overrides}))
    spec = adapter.load_run(run, python=str(VERL_PY))
    nested = adapter.decision_base(spec, device="cpu")
    assert nested["algorithm"]["adv_estimator"] == "grpo" and nested["critic"]["enable"] is None
    assert nested["actor_rollout_ref"]["actor"]["use_kl_loss"] is True
    assert nested["actor_rollout_ref"]["rollout"]["n"] == 4
