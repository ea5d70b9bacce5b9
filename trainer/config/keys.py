"""The config as plain data and dotted keys, and the tables that name keys.

A config is also a nested dict (:func:`config_to_dict`) and a flat one keyed ``"a.b.c"`` (:func:`flatten`);
:data:`FOLLOWS` says which null keys read as another key's value. The other tables name keys other modules
need: the FSDP sections, the precision spellings, the keys verl's YAML does not declare, the retired keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from trainer.config.schema import CRITIC_ESTIMATORS

__all__ = [
    "config_to_dict",
    "flatten",
    "unflatten",
    "FOLLOWS",
    "follow",
    "resolve_follows",
    "FSDP_SECTIONS",
    "PRECISIONS",
    "VERL_UNDECLARED",
    "verl_override_key",
    "RETIRED",
    "absent_role",
]


def config_to_dict(cfg: Any) -> dict:
    """A config (or one section) as a nested dict of plain values."""
    return dataclasses.asdict(cfg)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b.c": value}. Lists are leaves."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def unflatten(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


#: Keys whose ``None`` default means "the value of another key" (verl's null defaults): key -> the key it follows.
FOLLOWS: dict[str, str] = {
    "critic.strategy": "actor_rollout_ref.actor.strategy",
    "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "critic.forward_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "critic.model.path": "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
}


def follow(flat: Mapping[str, Any], key: str) -> Any:
    """The effective value of ``key`` in a flat config: a null follow-key reads as the key it follows."""
    value = flat[key]
    while value is None and key in FOLLOWS:
        key = FOLLOWS[key]
        value = flat[key]
    return value


def resolve_follows(flat: Mapping[str, Any]) -> dict:
    """A copy of a flat config with every null follow-key (:data:`FOLLOWS`) filled in."""
    out = dict(flat)
    for key in FOLLOWS:
        out[key] = follow(flat, key)
    return out


#: The FSDP sections (verl's spelling): the actor's, the reference model's and the critic's.
FSDP_SECTIONS = ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")

#: verl's precision spellings (PrecisionType) that the ppotune engine runs -> torch dtype name.
PRECISIONS = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}

#: Sections verl's FSDP engine reads but its YAML does not declare: Hydra adds them with ``+key=value``.
VERL_UNDECLARED = ("mixed_precision", "enable_sleep_mode")


def verl_override_key(key: str) -> str:
    """``key`` as a verl Hydra override spells it: ``+`` in front of a key verl's YAML does not declare."""
    return ("+" + key) if any(part in VERL_UNDECLARED for part in key.split(".")) else key


#: Keys that are gone, with what to use instead (an old config gets this line, not "unknown key").
RETIRED = {
    "dtype": "verl's FSDP engine computes in fsdp_config.mixed_precision.param_dtype (bf16 | fp32); set that",
}


def absent_role(flat: Mapping[str, Any], key: str) -> Optional[str]:
    """Why ``key`` acts on nothing in the config ``flat`` (dotted keys): it belongs to a role the run does not
    build (verl's need_critic, need_reference_policy), or None. A flat config without the deciding keys keeps
    every role."""
    if key.startswith("critic.") and "critic.enable" in flat:
        enable, estimator = flat["critic.enable"], flat.get("algorithm.adv_estimator", "gae")
        if enable is False:
            return "no critic (critic.enable=false)"
        if enable is None and estimator not in CRITIC_ESTIMATORS:
            return f"no critic: algorithm.adv_estimator={estimator} reads no values"
    if key.startswith("actor_rollout_ref.ref.") and "actor_rollout_ref.actor.use_kl_loss" in flat:
        if not flat["actor_rollout_ref.actor.use_kl_loss"] and not flat.get("algorithm.use_kl_in_reward", False):
            return "no reference model: neither algorithm.use_kl_in_reward nor actor_rollout_ref.actor.use_kl_loss"
    return None
