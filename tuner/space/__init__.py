"""Search spaces: YAML -> knobs (Optuna distributions), derived keys, constraints, memory hints.

A space file looks like::

    description: actor micro-batch or token budget, and gradient checkpointing
    fixed:                                   # set for every trial, the baseline's too (the base config + these)
      actor_rollout_ref.rollout.name: vllm
    knobs:                                   # in order: a `when` may name earlier knobs only
      actor_rollout_ref.actor.use_dynamic_bsz: {type: bool}
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu:
        type: pow2                           # int | pow2 | float | categorical | bool
        low: 1
        high: 16
        memory: increasing                   # increasing | decreasing | none (default)
        speed: increasing                    # the same values: the expected throughput (a prior)
        when: not actor_rollout_ref.actor.use_dynamic_bsz
      actor_rollout_ref.actor.strategy:
        type: categorical
        choices: [fsdp, fsdp2]
        memory: increasing
        order: [fsdp2, fsdp]                 # memory order, least hungry first (default: choices)
    derived:                                 # key: expression, or {expr: ..., when: ...}
      actor_rollout_ref.ref.log_prob_max_token_len_per_gpu: 2 * actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    constraints:
      - actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu <= data.train_batch_size

Every knob, derived key and name in an expression is a dotted key of
:class:`trainer.config.PPOConfig` (verl's keys). Expressions are parsed with :mod:`ast`
and evaluated by walking a whitelist (numbers, strings, true/false/null, dotted keys,
``+ - * / // %``, comparisons, and/or/not, ``min``/``max``); nothing is ``eval``-ed.

Semantics:

* A knob whose values are exactly the powers of two ``2**lo .. 2**hi`` (``type: pow2``, or a
  categorical list such as ``[1, 2, 4, 8]``) is suggested to Optuna as the ordered integer
  exponent ``lo .. hi`` under the param name ``log2:<dotted key>``, so TPE learns that 32
  neighbours 64; the value it stands for (``2**exponent``) is what configs, overrides, exports
  and reports hold. A power-of-two list with gaps (``[1, 2, 8]``) stays categorical: an exponent
  range would hold values the user left out on purpose, each a wasted proposal. Every mapping
  between Optuna params and knob values goes through :meth:`Space.to_params` and
  :func:`from_params` (and :func:`decode_trial` for a whole trial).
* A knob whose ``when`` is false is *inactive*: it is not an Optuna param and the
  trial keeps the base config's value.
* A constraint that names an inactive knob is vacuously true (a micro-batch rule does
  not reject dynamic-bsz configs).
* ``memory`` says how memory moves as the value grows (bool: False < True;
  categorical: ``order``). It drives the inferred-OOM rule: a candidate at least as
  memory-hungry as a known OOM on every monotone knob, and equal on the others, is not
  launched.
* ``speed`` says how throughput is expected to move as the value grows (same order). A prior,
  not a rule: local steps (tuner.search.loop) try the neighbours it favours first; nothing is skipped.

The package, by job (``from tuner.space import X`` is the way in; the modules below are its parts):

* :mod:`tuner.space.load`: YAML / dict -> :class:`Space`, every section checked; ``comparable_space``,
  ``base_flat_config``
* :mod:`tuner.space.model`: the :class:`Space` (one point, two configs compared, ``validate`` against a base config)
* :mod:`tuner.space.grid`: its enumeration (``grid``, ``size``, ``neighbours``, ``sample``; ``GRID_LIMIT``)
* :mod:`tuner.space.knob`: one :class:`Knob` (its spec parsed, its values, memory and speed hints)
* :mod:`tuner.space.params`: Optuna params <-> knob values (``log2:<key>``, ``from_params``, ``decode_trial``)
* :mod:`tuner.space.expr`: the expression language (:class:`Expr`)
* :mod:`tuner.space.parts`: :class:`Derived`, :class:`Constraint`, :class:`Candidate`
* :mod:`tuner.space.keys`: :class:`SpaceError`, ``CONFIG_KEYS``
* :mod:`tuner.commands.space`: ``ppotune space check`` (not imported here: a command module, loaded when it runs)
"""

from __future__ import annotations

from tuner.space.expr import Expr, ExprError
from tuner.space.grid import GRID_LIMIT
from tuner.space.keys import CONFIG_KEYS, SpaceError
from tuner.space.knob import KNOB_TYPES, MEMORY_HINTS, Knob
from tuner.space.load import ADVISORY_KNOB_KEYS, base_flat_config, comparable_space, load_space, space_from_dict
from tuner.space.model import Space
from tuner.space.params import LOG2_PREFIX, decode_trial, from_params
from tuner.space.parts import Candidate, Constraint, Derived

__all__ = [
    "SpaceError",
    "comparable_space",
    "Expr",
    "Knob",
    "Candidate",
    "Space",
    "load_space",
    "LOG2_PREFIX",
    "from_params",
    "decode_trial",
    # imported by other modules too
    "ExprError",
    "GRID_LIMIT",
    "space_from_dict",
    "base_flat_config",
    # the rest of what the single module held
    "CONFIG_KEYS",
    "KNOB_TYPES",
    "MEMORY_HINTS",
    "ADVISORY_KNOB_KEYS",
    "Derived",
    "Constraint",
]
