"""An in-run sweep of verl's per-step knobs: which setting runs at which step, and what the plugin puts into a worker
call for it. Torch-free: the adapter writes it, :mod:`trainer.verl_engine.plugin` (inside verl's processes) reads it.

verl 0.9.1 reads a pass's micro-batching per call, from the batch when the driver put it there
(``workers/engine_workers.py``: ``TrainingWorker.train_batch`` / ``infer_batch`` fill ``use_dynamic_bsz``,
``micro_batch_size_per_gpu`` and ``max_token_len_per_gpu`` from the engine config only when the batch lacks them;
the micro-batches are cut per call, ``workers/engine/utils.py:prepare_micro_batches``). So one verl run can measure
several settings of those keys, a few steps each: the plugin puts the current setting's values into each
worker-group call of its pass, and tags each step's metrics with the setting. A setting's first step is not measured
(the step after a change is a warm-up, as the run's first).

Each setting runs on the batches a run of its own would: the plugin replays the dataloader's order from its start at
each setting (:meth:`Schedule.replay`): the data sets a step's tokens and so its throughput, and a later setting
measured on later batches reads unlike its run alone (benchmarks/README.md, "verl in-run sweeps").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "PER_STEP_KEYS",
    "PASS_OF_CALL",
    "Setting",
    "Schedule",
    "is_per_step",
    "SETTING_METRIC",
    "LOG_ENV",
    "SWEEP_ENV",
    "RUN_ENV",
    "CALL_KEY",
    "WINDOW_METRIC",
    "ROLLOUT_PHASES",
]

LOG_ENV = "PPOTUNE_VERL_PHASE_LOG"  # the phase log: one JSON line per worker call and rank (trainer.verl_engine.plugin)
SWEEP_ENV = "PPOTUNE_VERL_SWEEP"  # an in-run sweep's schedule (Schedule as JSON)
#: names one trial's verl run in the environment of all its processes (Ray's workers inherit the driver's): how the
#: adapter finds them wherever they went, and what keeps two trials' weight-sync sockets apart (plugin.worker)
RUN_ENV = "PPOTUNE_VERL_RUN"
CALL_KEY = "ppotune_call"  # the batch key a worker call's "step:pass" travels in

#: the verl keys a run may change at a step boundary: {key: (the pass, the batch key its worker call reads)}
PER_STEP_KEYS: dict[str, tuple[str, str]] = {
    "actor_rollout_ref.actor.use_dynamic_bsz": ("update_actor", "use_dynamic_bsz"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("update_actor", "micro_batch_size_per_gpu"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("update_actor", "max_token_len_per_gpu"),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": ("old_log_prob", "use_dynamic_bsz"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": ("old_log_prob", "micro_batch_size_per_gpu"),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": ("old_log_prob", "max_token_len_per_gpu"),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": ("ref", "use_dynamic_bsz"),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": ("ref", "micro_batch_size_per_gpu"),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": ("ref", "max_token_len_per_gpu"),
}
#: the worker-group methods the trainer calls for each measured pass (verl 0.9.1, v0 and v1 trainers alike)
PASS_OF_CALL: dict[str, str] = {
    "compute_log_prob": "old_log_prob",
    "compute_ref_log_prob": "ref",
    "infer_batch": "values",
    "train_mini_batch": "update_critic",
    "update_actor": "update_actor",
}
#: the metric each step's row carries: the index of the setting it ran
SETTING_METRIC = "ppotune/setting"
#: the prefix of a phase's wall-clock windows in a step's row: ``<prefix><phase>/<k>/start`` and ``.../end``
#: (``time.time()`` seconds, the clock the tuner samples memory on: the same host), one pair per separate window
WINDOW_METRIC = "ppotune/window/"
#: the phases the driver records beside the passes (plugin.driver): the rollout awake, and its weight sync
ROLLOUT_PHASES = ("generation", "weight_sync")


def is_per_step(key: str) -> bool:
    return key in PER_STEP_KEYS


@dataclass(frozen=True)
class Setting:
    """One setting of the per-step knobs: ``knobs`` (verl keys: values), measured for ``steps`` steps after
    ``warmup`` unmeasured ones."""

    knobs: dict
    steps: int
    warmup: int = 1

    def batch_keys(self, pass_name: str) -> dict[str, Any]:
        """What a worker call of ``pass_name`` gets in its batch under this setting."""
        return {bk: self.knobs[k] for k, (p, bk) in PER_STEP_KEYS.items() if p == pass_name and k in self.knobs}


@dataclass
class Schedule:
    """The settings of one run, in the order they run (rising memory: an OOM ends the run)."""

    settings: list[Setting] = field(default_factory=list)

    @property
    def total_steps(self) -> int:
        return sum(s.warmup + s.steps for s in self.settings)

    def at(self, step: int) -> Optional[tuple[int, bool]]:
        """(the setting's index, whether the step is measured) of a 1-based global ``step``; None past the end."""
        first = 1
        for i, s in enumerate(self.settings):
            if step < first + s.warmup + s.steps:
                return i, step >= first + s.warmup
            first += s.warmup + s.steps
        return None

    def replay(self, n: int, batch_size: int) -> list[int]:
        """Positions in a sampler's order of ``n`` items that give each setting the batches a run of its own gets:
        the first ``warmup + steps`` batches for each setting in turn, then the order on (cycled) to at least
        ``n`` positions, so a trainer that reads past the schedule still gets data."""
        out = [p for s in self.settings for p in range((s.warmup + s.steps) * batch_size)]
        out += range(len(out), max(n, len(out)))
        return [p % n for p in out] if n else []

    def to_json(self) -> str:
        return json.dumps({"settings": [asdict(s) for s in self.settings]})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        data = json.loads(text)
        return cls([Setting(dict(s["knobs"]), int(s["steps"]), int(s["warmup"])) for s in data["settings"]])

    @classmethod
    def read(cls, path: str | Path) -> "Schedule":
        return cls.from_json(Path(path).read_text())
