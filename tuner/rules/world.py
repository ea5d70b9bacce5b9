"""Tuning on a few GPUs for a job on many: the production world size and the trial's (pure; no torch).

Production runs ``trainer.nnodes x trainer.n_gpus_per_node`` GPUs; a trial runs on one node, ``--nproc``
GPUs. What a GPU holds depends on both:

* the per-GPU batch: a global size (``data.train_batch_size``, ``ppo_mini_batch_size``, in prompts) is
  split over the world, so a trial on fewer GPUs with the production's global sizes would run a larger
  batch per GPU than production does. A trial therefore runs the global sizes scaled by
  ``trial world / target world`` (so sequences per GPU, micro-batches per mini-batch and the token budgets
  are production's), and a config whose scaled size is not a whole number is refused: the trial could not
  hold the production's per-GPU batch;
* the sharded state: FSDP splits parameters, gradients and optimizer state over the world, so they shrink
  per GPU as the world grows. A trial measures them at its own world; ``tuner.memory_model`` projects
  them to the target's (the report and why.md show both).

Export writes the production sizes back (:func:`production_overrides`), never the trial's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping, Optional

__all__ = ["GLOBAL_BATCH_KEYS", "WorldPlan", "plan_world", "trial_overrides", "production_overrides"]

#: The global batch sizes (in prompts) that a trial scales by trial world / target world.
GLOBAL_BATCH_KEYS = (
    "data.train_batch_size",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.ppo_mini_batch_size",
)


@dataclass(frozen=True)
class WorldPlan:
    """The production world, the trial's, and the global sizes each runs (``key -> (production, trial)``)."""

    target_nodes: int
    target_gpus_per_node: int
    trial_world: int
    sizes: dict = field(default_factory=dict)

    @property
    def target_world(self) -> int:
        return self.target_nodes * self.target_gpus_per_node

    @property
    def scaled(self) -> bool:
        return self.trial_world != self.target_world

    def to_dict(self) -> dict:
        return {
            "nnodes": self.target_nodes,
            "n_gpus_per_node": self.target_gpus_per_node,
            "world": self.target_world,
            "trial_world": self.trial_world,
            "sizes": {k: list(v) for k, v in self.sizes.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WorldPlan":
        return cls(
            target_nodes=int(d["nnodes"]),
            target_gpus_per_node=int(d["n_gpus_per_node"]),
            trial_world=int(d["trial_world"]),
            sizes={k: tuple(v) for k, v in (d.get("sizes") or {}).items()},
        )

    def describe(self) -> str:
        """One line: what the trials ran against what production runs."""
        if not self.scaled:
            return f"trials run the production world ({self.target_world} GPUs)"
        leaf = [k.rsplit(".", 1)[-1] for k in self.sizes]
        name = {k: n if leaf.count(n) == 1 else f"{k.split('.', 1)[0]}.{n}" for k, n in zip(self.sizes, leaf)}
        sizes = ", ".join(f"{name[k]} {p} -> {t}" for k, (p, t) in self.sizes.items() if p != t)
        return (
            f"trials run {self.trial_world} GPUs for a {self.target_nodes} x {self.target_gpus_per_node} = "
            f"{self.target_world}-GPU job: global batch sizes scaled by {self.trial_world}/{self.target_world} "
            f"({sizes}), so each GPU runs the production's per-GPU batch"
        )


def plan_world(
    production: Mapping[str, Any],
    *,
    trial_world: int,
    target_nodes: Optional[int] = None,
    target_gpus_per_node: Optional[int] = None,
    source: str = "config",
) -> WorldPlan:
    """The plan for trials of ``trial_world`` GPUs tuning a job with ``production``'s flat config (its
    ``trainer.nnodes x n_gpus_per_node`` unless ``target_*`` say otherwise).

    Raises ``ValueError`` (one line, naming ``source`` and the key) when a global size does not scale to a
    whole number of prompts, or when the trial world is larger than the target's."""
    nodes = int(target_nodes if target_nodes is not None else production.get("trainer.nnodes") or 1)
    gpus = int(target_gpus_per_node if target_gpus_per_node is not None else production["trainer.n_gpus_per_node"])
    if nodes < 1 or gpus < 1:
        raise ValueError(f"{source}: the target world must be at least 1 x 1 (got {nodes} x {gpus})")
    target = nodes * gpus
    if trial_world > target:
        raise ValueError(
            f"{source}: trials of {trial_world} GPUs for a {target}-GPU job: the trial world cannot exceed the "
            "target's (--nproc / --target-nodes / --target-gpus-per-node)"
        )
    ratio = Fraction(trial_world, target)
    sizes = {}
    for key in GLOBAL_BATCH_KEYS:
        value = production.get(key)
        if value is None:  # e.g. critic.ppo_mini_batch_size: follows the actor's
            continue
        scaled = value * ratio
        if scaled.denominator != 1 or scaled < 1:
            raise ValueError(
                f"{source}: {key}: {value} x {trial_world}/{target} (trial world / target world) = {float(scaled):g} "
                f"is not a whole number of prompts: a {trial_world}-GPU trial cannot run the {target}-GPU job's "
                "per-GPU batch (pick --nproc so that it divides)"
            )
        sizes[key] = (int(value), int(scaled))
    return WorldPlan(target_nodes=nodes, target_gpus_per_node=gpus, trial_world=trial_world, sizes=sizes)


def trial_overrides(plan: WorldPlan) -> dict:
    """What a trial sets: one node of ``trial_world`` GPUs and the scaled global sizes."""
    out = {"trainer.nnodes": 1, "trainer.n_gpus_per_node": plan.trial_world}
    out.update({k: t for k, (_, t) in plan.sizes.items()})
    return out


def production_overrides(plan: WorldPlan) -> dict:
    """What the production job sets: its world and its own global sizes (export writes these)."""
    out = {"trainer.nnodes": plan.target_nodes, "trainer.n_gpus_per_node": plan.target_gpus_per_node}
    out.update({k: p for k, (p, _) in plan.sizes.items()})
    return out
