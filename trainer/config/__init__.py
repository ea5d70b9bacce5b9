"""The typed, validated training config: one place for every default.

Keys are verl's keys (``python -m verl.trainer.main_ppo``) for every concept verl
has; keys verl lacks live under ``ppotune.``. The package is pure Python (no torch)
so the tuner can validate a trial's config before launching anything.

A config is built from defaults <- YAML file <- dotted ``key=value`` overrides, then
checked: unknown keys, wrong types and contradictions raise :class:`ConfigError`
naming the key.

Modules: ``schema`` (the dataclasses: every field, its default and its documentation), ``keys`` (the config as
nested and dotted dicts, the follow-keys, the tables naming keys), ``rules`` (validation: one small rule per
concern, run in a fixed order), ``io`` (YAML and overrides -> a typed config), ``errors`` (:class:`ConfigError`).
Import from here: ``from trainer.config import load_config``.
"""

from __future__ import annotations

from trainer.config.errors import ConfigError
from trainer.config.io import (
    apply_overrides,
    config_from_dict,
    effective_config,
    load_config,
    parse_override,
    read_yaml_mapping,
)
from trainer.config.keys import (
    FOLLOWS,
    FSDP_SECTIONS,
    PRECISIONS,
    config_to_dict,
    flatten,
    follow,
    resolve_follows,
    unflatten,
    verl_override_key,
)
from trainer.config.keys import RETIRED as RETIRED
from trainer.config.keys import VERL_UNDECLARED as VERL_UNDECLARED
from trainer.config.rules import VLLM_INSTALL, rollout_name, validate_config
from trainer.config.schema import CRITIC_ESTIMATORS as CRITIC_ESTIMATORS
from trainer.config.schema import ActorConfig as ActorConfig
from trainer.config.schema import ActorRolloutRefConfig as ActorRolloutRefConfig
from trainer.config.schema import AlgorithmConfig as AlgorithmConfig
from trainer.config.schema import CriticConfig as CriticConfig
from trainer.config.schema import CriticModelConfig as CriticModelConfig
from trainer.config.schema import DataConfig as DataConfig
from trainer.config.schema import FSDPConfig as FSDPConfig
from trainer.config.schema import KLCtrlConfig as KLCtrlConfig
from trainer.config.schema import MixedPrecisionConfig as MixedPrecisionConfig
from trainer.config.schema import ModelConfig as ModelConfig
from trainer.config.schema import OptimConfig as OptimConfig
from trainer.config.schema import PPOConfig, need_critic, need_reference_policy, world_size
from trainer.config.schema import PPOTuneSection as PPOTuneSection
from trainer.config.schema import RefConfig as RefConfig
from trainer.config.schema import RolloutConfig as RolloutConfig
from trainer.config.schema import SyntheticDataConfig as SyntheticDataConfig
from trainer.config.schema import TinyModelConfig as TinyModelConfig
from trainer.config.schema import TrainerSection as TrainerSection
from trainer.config.schema import WrapPolicyConfig as WrapPolicyConfig

# The names the single module declared; the section dataclasses, RETIRED and VERL_UNDECLARED (``X as X``
# above) are importable from here too, as they were.
__all__ = [
    "ConfigError",
    "PPOConfig",
    "load_config",
    "config_from_dict",
    "config_to_dict",
    "apply_overrides",
    "parse_override",
    "flatten",
    "unflatten",
    "world_size",
    "need_critic",
    "need_reference_policy",
    "FOLLOWS",
    "follow",
    "resolve_follows",
    "effective_config",
    "validate_config",
    "rollout_name",
    "VLLM_INSTALL",
    "read_yaml_mapping",
    "FSDP_SECTIONS",
    "PRECISIONS",
    "verl_override_key",
]
