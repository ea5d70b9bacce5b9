"""A verl run file: the user's verl config as Hydra overrides, and how to run it (``ppotune:``); see
:mod:`trainer.verl_engine.adapter` for the run itself. Torch-free."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from trainer.config import ConfigError, flatten, read_yaml_mapping
from trainer.summary import MIN_MEASURED_STEPS
from trainer.verl_engine.overrides import override_key
from trainer.verl_engine.schedule import PER_STEP_KEYS, Schedule, Setting, is_per_step

__all__ = ["RUN_OPTIONS", "RunSpec", "load_run", "DEFAULT_SWEEP_SETTINGS"]

DEFAULT_SWEEP_SETTINGS = 4  # settings of the per-step knobs one verl run of a search measures at most

#: what a run file's ``ppotune:`` section may say
RUN_OPTIONS = frozenset(
    {
        "python",
        "steps",
        "warmup",
        "memory_limit_gb",
        "device",
        "precision",
        "min_measured_steps",
        "front",
        "worst_case",
        "sweep",
        "sweep_settings",
    }
)


# --------------------------------------------------------------------------- the run file
@dataclass
class RunSpec:
    """One verl run: the user's overrides and how to run them."""

    overrides: list[str]
    python: str = sys.executable
    steps: int = 3
    warmup: int = 1
    memory_limit_gb: Optional[float] = None
    device: str = "auto"
    precision: Optional[float] = None  # stop once the 90% interval is within +/- this share of the median
    min_measured_steps: int = MIN_MEASURED_STEPS
    front: list = field(default_factory=list)  # [trial, throughput low, peak GB] points that prune this run
    worst_case: bool = False  # the worst-case probe: generated full-length prompts, EOS ignored
    # an in-run sweep: settings of the per-step knobs (trainer.verl_engine.schedule), each run for ``steps`` steps
    # (its first ``max(1, warmup)`` unmeasured) in this order, in one verl run
    sweep: list = field(default_factory=list)
    # a search: how many settings of the per-step knobs one verl run may measure (1: a verl run per trial)
    sweep_settings: int = DEFAULT_SWEEP_SETTINGS
    source: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    def get(self, key: str) -> Optional[str]:
        """The last value the overrides give ``key`` (as written), or None."""
        for o in reversed(self.overrides):
            if override_key(o) == key:
                return o.split("=", 1)[1]
        return None

    @property
    def schedule(self) -> Optional[Schedule]:
        """The in-run sweep's schedule, or None for a run of one setting."""
        if not self.sweep:
            return None
        warmup = max(1, self.warmup)
        return Schedule([Setting(dict(k), steps=self.steps - warmup, warmup=warmup) for k in self.sweep])

    @property
    def total_steps(self) -> int:
        return self.schedule.total_steps if self.sweep else self.steps

    @property
    def nproc(self) -> int:
        return int(self.get("trainer.n_gpus_per_node") or 8) * int(self.get("trainer.nnodes") or 1)


def _as_overrides(data: Any, source: str) -> list[str]:
    if isinstance(data, list):
        bad = [o for o in data if not isinstance(o, str) or "=" not in o]
        if bad:
            raise ConfigError("overrides", f"each override is key=value, got {bad[0]!r}", source=source)
        return list(data)
    if isinstance(data, dict):
        return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in flatten(data).items()]
    raise ConfigError("overrides", "a list of key=value strings or a mapping of verl keys", source=source)


def load_run(path: Optional[str | Path], extra: list[str] = (), **flags: Any) -> RunSpec:
    """Run file + ``key=value`` overrides + flags (``python``, ``steps``, ``warmup``, ``memory_limit_gb``,
    ``device``, ``nproc``; None = not given) -> a checked :class:`RunSpec`."""
    source = str(path) if path is not None else None
    data = read_yaml_mapping(path, what="a run file (overrides: [...], ppotune: {...})") if path is not None else {}
    run_opts = data.pop("ppotune", None) or {}
    if not isinstance(run_opts, dict):
        raise ConfigError("ppotune", "must be a mapping", source=source)
    unknown = set(run_opts) - RUN_OPTIONS
    if unknown:
        raise ConfigError(f"ppotune.{sorted(unknown)[0]}", "unknown key", source=source)
    overrides = _as_overrides(data.get("overrides", {k: v for k, v in data.items() if k != "overrides"}), source)
    overrides += _as_overrides(list(extra), source)
    nproc = flags.pop("nproc", None)
    if nproc is not None:
        overrides.append(f"trainer.n_gpus_per_node={int(nproc)}")
    opts = {**run_opts, **{k: v for k, v in flags.items() if v is not None}}
    spec = RunSpec(overrides=overrides, source=source, **opts)
    spec.python = os.path.abspath(spec.python)  # not resolve(): a venv's python is a symlink that must stay one
    if not Path(spec.python).is_file() or not os.access(spec.python, os.X_OK):
        raise ConfigError(
            "ppotune.python", f"no executable interpreter at {spec.python} (--engine-python)", source=source
        )
    if spec.steps < 1:
        raise ConfigError("ppotune.steps", f"must be >= 1, got {spec.steps}", source=source)
    if not 0 <= spec.warmup < spec.steps:
        raise ConfigError("ppotune.warmup", f"must be in [0, steps={spec.steps}), got {spec.warmup}", source=source)
    if spec.memory_limit_gb is not None and spec.memory_limit_gb <= 0:
        raise ConfigError("ppotune.memory_limit_gb", "must be > 0", source=source)
    if spec.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("ppotune.device", f"must be auto, cpu or cuda, got {spec.device!r}", source=source)
    _check_measuring(spec)
    return spec


def _check_measuring(spec: RunSpec) -> None:
    """The run options that decide when a run has measured enough (as ``trainer.config``'s rules for ours)."""
    if spec.precision is not None and not 0 < spec.precision < 1:
        raise ConfigError("ppotune.precision", f"must be in (0, 1) or null, got {spec.precision}", source=spec.source)
    if not isinstance(spec.min_measured_steps, int) or spec.min_measured_steps < 2:
        raise ConfigError("ppotune.min_measured_steps", "must be an integer >= 2", source=spec.source)
    good = isinstance(spec.front, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 3 and all(isinstance(x, (int, float)) for x in p) for p in spec.front
    )
    if not good:
        raise ConfigError("ppotune.front", "must be a list of [trial, throughput, peak GB] triples", source=spec.source)
    if not isinstance(spec.worst_case, bool):
        raise ConfigError("ppotune.worst_case", "must be true or false", source=spec.source)
    _check_sweep(spec)


def _check_sweep(spec: RunSpec) -> None:
    """An in-run sweep's settings: mappings of per-step knobs only (trainer.verl_engine.schedule.PER_STEP_KEYS)."""
    if not isinstance(spec.sweep, list) or not all(isinstance(k, dict) for k in spec.sweep):
        raise ConfigError("ppotune.sweep", "must be a list of mappings of per-step verl keys", source=spec.source)
    for knobs in spec.sweep:
        other = sorted(k for k in knobs if not is_per_step(k))
        if other:
            raise ConfigError(
                "ppotune.sweep",
                f"{other[0]} is not a per-step knob (verl reads it once, at start-up): "
                f"only {', '.join(PER_STEP_KEYS)} change within a run",
                source=spec.source,
            )
    if not isinstance(spec.sweep_settings, int) or spec.sweep_settings < 1:
        raise ConfigError("ppotune.sweep_settings", "must be an integer >= 1 (1: no in-run sweeps)", source=spec.source)
    if spec.sweep and spec.steps - max(1, spec.warmup) < 1:
        raise ConfigError("ppotune.steps", "an in-run sweep measures each setting after a warm-up step: >= 2")
