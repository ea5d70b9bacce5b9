"""What a space may name and how it says no: :data:`CONFIG_KEYS`, every dotted key of
:class:`trainer.config.PPOConfig` (a knob, a derived or fixed key, a name in an expression), and
:class:`SpaceError`, the one-line error of a bad space."""

from __future__ import annotations

from trainer.config import ConfigError, PPOConfig, config_to_dict, flatten

__all__ = ["SpaceError", "CONFIG_KEYS"]


class SpaceError(ConfigError):
    """Bad search space. ``str()`` is one line naming the file and the key (as ConfigError)."""


def _config_keys() -> frozenset[str]:
    return frozenset(flatten(config_to_dict(PPOConfig())))


CONFIG_KEYS = _config_keys()
