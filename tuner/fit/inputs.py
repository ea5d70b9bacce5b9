"""What a fit is about, checked before anything is launched or written: the base config at the trial's world, its
size knobs and ladders, the memory a worst-case step must fit and the cap every probe runs under.

The memory: ``--memory-limit-gb`` when given (a real cap, as for a search), else the device's (a GPU's memory, or
on a CPU the host's memory shared by the processes). Each probe runs under a real cap at the headroom's limit,
``(1 - headroom) x`` that memory (GPU: the allocator's fraction; CPU: RLIMIT_DATA above the post-start level; verl:
each of its worker processes), so a value whose worst-case step would eat into the headroom runs out of memory
for real, in the pass that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DEFAULT_HEADROOM
from trainer.launch.preflight import preflight
from tuner.fit.ladder import size_knobs
from tuner.memory_model import flat_config
from tuner.rules.world import WorldPlan, plan_world, trial_overrides
from tuner.trials.memory import gpu_info, nvml_available, visible_gpus
from tuner.trials.probe import probe_config
from tuner.trials.runners import VerlEngine

__all__ = ["FitInputs", "fit_inputs", "device_of", "ladder_space"]


@dataclass(frozen=True)
class FitInputs:
    """A fit, validated."""

    base_path: str
    engine: str  # ppotune | verl
    verl: Optional[VerlEngine]  # how verl probes run (--engine verl), else None
    plan: WorldPlan
    base_nested: dict  # the decision base: the base config at the trial's world (what the study records)
    trial_base: dict  # one complete probe config, under the headroom's cap, before its knobs are set
    knobs: tuple  # (SizeKnob, ...) in the order their passes run
    memory_gb: float  # what a worst-case step must fit: the cap, else the device's memory per process
    headroom: float
    device: dict  # kind, name, memory_total_gb

    @property
    def limit_gb(self) -> float:
        """The worst case's limit: ``(1 - headroom) x memory``, the cap each probe runs under."""
        return (1.0 - self.headroom) * self.memory_gb

    @property
    def on_gpu(self) -> bool:
        return self.device["kind"] == "cuda"

    @property
    def start(self) -> dict:
        """Each knob's first rung: the base config's with ppotune's engine (the model calibrates on it), the top of
        the ladder through verl (no model: the largest value may well fit)."""
        if self.engine == "verl":
            return {k.key: len(k.ladder) - 1 for k in self.knobs}
        return {k.key: k.base_rung for k in self.knobs}


def device_of(want: str, *, nproc: int) -> dict:
    """The device the probes run on: kind, name, and its memory per process (a GPU's; a CPU host's shared by the
    ``nproc`` processes of a probe)."""
    if want != "cpu" and nvml_available():
        gpus = visible_gpus()
        name, total = gpu_info(gpus[0]) if gpus else (None, None)
        return {"kind": "cuda", "name": name, "memory_total_gb": total}
    per_process = psutil.virtual_memory().total / float(1 << 30) / max(1, nproc)
    return {"kind": "cpu", "name": "cpu", "memory_total_gb": per_process}


def ladder_space(knobs: tuple) -> dict:
    """The knobs' ladders as a search space (a categorical knob each): what the fit's study records, so that its
    trials read like any study's (report, optuna-dashboard)."""
    spec = {k.key: {"type": "categorical", "choices": list(k.ladder), "memory": "increasing"} for k in knobs}
    return {"description": "ppotune fit: each size knob's ladder", "knobs": spec}


def _ppotune_base(base_path: str, overrides: dict, nproc: Optional[int]) -> tuple[dict, WorldPlan]:
    from tuner.space import base_flat_config

    production = base_flat_config(base_path, extra=overrides)[1]
    plan = plan_world(production, trial_world=nproc or production["trainer.n_gpus_per_node"], source=base_path)
    nested = base_flat_config(base_path, extra={**overrides, **trial_overrides(plan)})[0]
    return nested, plan


def fit_inputs(
    base_path: str,
    *,
    engine: str = "ppotune",
    overrides: Optional[dict] = None,
    nproc: Optional[int] = None,
    memory_limit_gb: Optional[float] = None,
    headroom: float = DEFAULT_HEADROOM,
    engine_python: Optional[str] = None,
) -> FitInputs:
    """The fit of ``base_path``, checked (``ValueError``: one line naming the file and the key)."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"--memory-headroom must be in [0, 1), got {headroom:g}")
    if memory_limit_gb is not None and memory_limit_gb <= 0:
        raise ValueError(f"--memory-limit-gb must be > 0, got {memory_limit_gb:g}")
    verl = None
    if engine == "verl":
        from tuner.trials.verl import verl_search

        nested, verl, plan = verl_search(
            base_path, python=engine_python, nproc=nproc, steps=1, warmup=0, memory_limit_gb=None
        )
    else:
        nested, plan = _ppotune_base(base_path, dict(overrides or {}), nproc)
    flat = flatten(nested)
    world = int(flat["trainer.n_gpus_per_node"])
    device = device_of(flat.get("ppotune.device", "auto"), nproc=world)
    memory = float(memory_limit_gb or device["memory_total_gb"] or 0.0)
    if memory <= 0:
        raise ValueError("--memory-limit-gb: the device's memory is unknown here; pass the cap a step must fit")
    limit = (1.0 - headroom) * memory
    if verl is not None:  # verl's worker processes are capped by the run file's ppotune section
        verl = VerlEngine(verl.python, verl.base_overrides, 1, 0, memory_limit_gb=limit, world=verl.world)
    capped = config_from_dict(apply_overrides(nested, {"ppotune.memory_limit_gb": limit}), source=base_path)
    if verl is None:
        preflight(capped, source=base_path)  # the data files, model and tokenizer every probe reads
    trial_base = probe_config(config_to_dict(capped))
    knobs = tuple(size_knobs(flat_config(trial_base), on_gpu=device["kind"] == "cuda"))
    return FitInputs(
        base_path=str(Path(base_path)),
        engine=engine,
        verl=verl,
        plan=plan,
        base_nested=nested,
        trial_base=trial_base,
        knobs=knobs,
        memory_gb=memory,
        headroom=headroom,
        device=device,
    )
