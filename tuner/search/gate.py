"""The memory gate: the study's calibrated memory model (:mod:`tuner.memory_model`) judging a candidate before
it is launched. A candidate predicted over the memory limit by more than the model's leave-one-out error is
recorded ``predicted_oom`` and not run (:func:`tuner.rules.candidates.judge_candidate`)."""

from __future__ import annotations

from typing import Callable, Optional

import optuna
from optuna.trial import TrialState

from trainer.contracts import Status, TrialRecord
from tuner.rules import candidates as decide

__all__ = ["MemoryGate", "MEMORY_MODEL_ATTR"]

#: The study user attribute holding the calibrated memory model (``tuner.memory_model.MemoryModel.to_dict``).
MEMORY_MODEL_ATTR = "memory_model"


class MemoryGate:
    """The study's memory model, refitted when a measured trial is added (``enabled``: ``--no-memory-model`` off)."""

    def __init__(self, study: optuna.Study, *, limit_gb: float, enabled: bool = True):
        self.study = study
        self.limit_gb = limit_gb
        self.enabled = enabled
        self._model = None
        self._key: tuple = ()

    def predictor(self, trials: list) -> Optional[Callable[[dict], Optional[decide.LimitCheck]]]:
        """The memory model's judgement of a candidate's flat config (``decide.LimitCheck``), or None while
        the study has no calibrated model (fewer than ``MIN_LOO_SAMPLES`` measured trials with per-phase
        peaks: no stated error, so no gate). Refitted when a measured trial is added, and stored in the study
        attribute ``memory_model`` (the report's predicted-vs-measured section reads it)."""
        if not self.enabled:
            return None
        self._refit(trials)
        model = self._model
        if model is None or model.gate_error is None:
            return None
        limit = self.limit_gb

        def predict(flat: dict) -> Optional[decide.LimitCheck]:
            try:
                pred = model.predict(flat)
            except (KeyError, ValueError, TypeError):  # a config the model has no terms for: launch it
                return None
            return decide.LimitCheck(
                peak_gb=pred.peak_gb, limit_gb=limit, error=model.gate_error, trials=model.num_samples
            )

        return predict

    def _refit(self, trials: list) -> None:
        from tuner import memory_model as mm

        key = tuple(
            t.number
            for t in trials
            if t.state == TrialState.COMPLETE and TrialRecord.from_user_attrs(t.user_attrs).status == Status.OK
        )
        if key == self._key:
            return
        self._key = key
        measured = set(key)
        samples = mm.samples_from_trials(
            [t for t in trials if t.number in measured], self.study.user_attrs.get("base_config") or {}
        )
        device_gb = (self.study.user_attrs.get("device") or {}).get("memory_total_gb")
        try:
            self._model = mm.MemoryModel.calibrate(samples, device_memory_gb=device_gb) if samples else None
        except ValueError:  # a shape or config the model cannot read: no gate, as before it existed
            self._model = None
        if self._model is not None and self._model.gate_error is not None:
            self.study.set_user_attr(MEMORY_MODEL_ATTR, self._model.to_dict())
