"""A search of verl trials (``--engine verl``): its decision base, how its trials run, and its world plan.

One node for many (:mod:`tuner.rules.world`), as for ppotune's own engine: production runs verl's
``trainer.nnodes x trainer.n_gpus_per_node`` (or ``--target-nodes x --target-gpus-per-node``); a trial runs one
node of ``--nproc`` GPUs with the global batch sizes scaled to production's per-GPU batch. The production job's
overrides (the user's, plus its world and sizes where the target flags change them) are the study's
``engine_overrides`` and what export writes; a trial appends the trial world (:attr:`VerlEngine.world`).

The calibrated memory model serves a verl search as it serves ours: ppotune's plugin inside verl
(:mod:`trainer.verl_engine.plugin`) records each pass's peak, the token lengths' percentiles and the actor's shape.
"""

from __future__ import annotations

from typing import Optional, Sequence

from trainer.config import flatten
from trainer.launch.preflight import preflight_verl
from trainer.verl_engine.overrides import hydra_value, override_key
from tuner.rules.world import WorldPlan, plan_world, production_overrides, trial_overrides
from tuner.trials.runners import VerlEngine

__all__ = ["check_verl_space", "verl_search", "world_overrides"]


def check_verl_space(space) -> None:
    """ValueError (one line naming the space and the key) for a space a verl search cannot run: ``fixed:`` keys (verl
    takes its settings from the run file) and keys verl 0.9.1 does not read (:data:`tuner.space.registry.VERL_NO_OPS`:
    every trial would measure noise, and the export would hand production a knob that does nothing)."""
    from tuner.space.registry import verl_no_op_problem

    if space.fixed:
        raise ValueError(
            f"{space.source}: fixed: --engine verl takes its settings from the verl run file; "
            f"put {', '.join(space.fixed)} there"
        )
    why = verl_no_op_problem([k.key for k in space.knobs] + [d.key for d in space.derived])
    if why:
        raise ValueError(f"{space.source}: {why}")


def world_overrides(values: dict) -> list[str]:
    """``key=value`` overrides (Hydra spelling) of a flat mapping, e.g. :func:`tuner.rules.world.trial_overrides`."""
    return [f"{k}={hydra_value(v)}" for k, v in values.items()]


def _with_values(overrides: list[str], values: dict) -> tuple:
    """``overrides`` with ``values`` set: an override of one of those keys takes the value where it stands, the
    others are appended (so the run file's lines stay the user's, in order)."""
    out, todo = [], dict(values)
    for o in overrides:
        key = override_key(o)
        if key in values:
            o = f"{o.split('=', 1)[0]}={hydra_value(values[key])}"
            todo.pop(key, None)
        out.append(o)
    return (*out, *world_overrides(todo))


def verl_search(
    base_config: str,
    *,
    python: Optional[str],
    nproc: Optional[int],
    steps: int,
    warmup: int,
    memory_limit_gb: Optional[float],
    target_nodes: Optional[int] = None,
    target_gpus_per_node: Optional[int] = None,
    extra: Sequence[str] = (),
) -> tuple[dict, VerlEngine, WorldPlan]:
    """(the decision base: verl's config at the trial's world read into ppotune's typed config, how trials run, the
    world plan). verl composes the production config first (its world and global sizes, whatever the run file
    leaves to verl's defaults), then the trial's, with the keys a run on its device adds (the CPU keys on a CPU:
    :func:`trainer.verl_engine.adapter.run_device`). The one reading of a run file: ``search`` (and ``--dry-run``)
    and ``space check`` call it. ``extra``: Hydra overrides after the run file's (``-o``). Raises ValueError
    (ConfigError: one line naming file and key)."""
    from trainer.verl_engine import adapter

    spec = adapter.load_run(
        base_config, list(extra), python=python, steps=steps, warmup=warmup, memory_limit_gb=memory_limit_gb
    )
    preflight_verl(spec.get, source=base_config)  # its data, model and tokenizer, before verl composes
    production = flatten(adapter.compose_verl(spec))
    plan = plan_world(
        production,
        trial_world=nproc or int(production["trainer.n_gpus_per_node"]),
        target_nodes=target_nodes,
        target_gpus_per_node=target_gpus_per_node,
        source=base_config,
    )
    # production's own world and sizes where the target flags say otherwise than the run file
    prod = {k: v for k, v in production_overrides(plan).items() if production.get(k) != v}
    base = _with_values(spec.overrides, prod)
    world = trial_overrides(plan)
    trial = tuple(world_overrides({k: v for k, v in world.items() if {**production, **prod}.get(k) != v}))
    spec.overrides = [*base, *trial]
    nested = adapter.decision_base(spec)
    engine = VerlEngine(
        python=spec.python,
        base_overrides=base,
        steps=steps,
        warmup=warmup,
        memory_limit_gb=memory_limit_gb,
        world=trial,
        sweep_settings=spec.sweep_settings,
    )
    return nested, engine, plan
