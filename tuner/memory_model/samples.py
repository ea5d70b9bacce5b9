"""Calibration samples: what the study's measured trials say about memory.

A sample is one ``ok`` trial with per-phase peaks (``memory["by_phase_gb"]``, on the memory objective's
basis), the actor's shape (``model_shape``) and the token lengths it saw (``lengths``), together with the
effective config it ran: the study's ``base_config`` (flattened) updated with the trial's ``overrides``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from trainer.config import flatten
from trainer.contracts import PHASES, Status, TrialRecord
from trainer.verl_engine.schedule import ROLLOUT_PHASES
from tuner.memory_model.shape import ModelShape
from tuner.memory_model.workload import Lengths

__all__ = ["Sample", "sample_from_attrs", "samples_from_trials", "CPU_SOURCES"]

#: ``TrialRecord.memory_source`` values of a CPU measurement (resident memory); others are a GPU's
CPU_SOURCES = ("rss_above_start", "rss", "psutil")
#: verl's rollout phases (the plugin's windows) as the model's phases: what the device held while vLLM's servers
#: were awake is the generation phase, the weight sync's the push
_ROLLOUT_AS = dict(zip(ROLLOUT_PHASES, ("gen", "update_weights")))


@dataclass(frozen=True)
class Sample:
    """One measured trial, as the calibration reads it."""

    config: dict  # the flat effective config the trial ran
    shape: ModelShape
    lengths: Lengths
    by_phase_gb: dict  # {phase: GB}, the recorded per-phase peaks
    peak_gb: float  # the memory objective
    on_gpu: bool
    number: Optional[int] = None  # the trial's number, for the report


def sample_from_attrs(attrs: Mapping[str, Any], base_flat: Mapping[str, Any], *, number: Optional[int] = None):
    """A :class:`Sample` from a trial's user attrs (``TrialRecord`` fields) and the flat base config; None
    unless the trial is ``ok`` with per-phase peaks, a model shape, token lengths and a peak (a failed or
    replayed trial has no such figures)."""
    rec = TrialRecord.from_user_attrs(attrs)
    by_phase = (rec.memory or {}).get("by_phase_gb") or {}
    lengths = Lengths.from_record(rec.lengths)
    if rec.status is not Status.OK or not by_phase or not rec.model_shape or lengths is None:
        return None
    if rec.peak_memory_gb is None or rec.memory_source in (None, "replay"):
        return None
    on_gpu = rec.memory_source not in CPU_SOURCES
    phases = {p: float(v) for p, v in by_phase.items() if p in PHASES and v is not None}
    if on_gpu:
        # a verl trial's allocator peaks cover its training passes only; vLLM's servers are measured in the
        # rollout's windows (what the device held): those are the generation and push phases, so the objective's
        # offset over the largest phase does not carry vLLM a second time beside the engine's own term
        held = (rec.memory or {}).get("external_by_phase_gb") or {}
        for window, phase in _ROLLOUT_AS.items():
            if phase not in phases and held.get(window) is not None:
                phases[phase] = float(held[window])
    return Sample(
        config={**base_flat, **(rec.overrides or {})},
        shape=ModelShape.from_dict(rec.model_shape),
        lengths=lengths,
        by_phase_gb=phases,
        peak_gb=float(rec.peak_memory_gb),
        on_gpu=on_gpu,
        number=number,
    )


def samples_from_trials(trials: Iterable[Any], base_config: Mapping[str, Any]) -> list[Sample]:
    """Samples from Optuna ``FrozenTrial`` objects and the study's ``base_config`` user attr (nested, as
    ``ppotune search`` stores it; a flat one works too): every trial :func:`sample_from_attrs` accepts."""
    base = flatten(dict(base_config))
    got = (sample_from_attrs(t.user_attrs, base, number=t.number) for t in trials)
    return [s for s in got if s is not None]
