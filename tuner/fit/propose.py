"""The memory model's part in ``ppotune fit``: where it puts each knob's boundary, and what it rules out.

The model (:class:`tuner.memory_model.MemoryModel`) is calibrated on the fit's own probes (each one a worst-case
step with its per-pass peaks) and predicts every rung of every open interval at the worst case, the other knobs at
their known fits. Its proposal for a knob is the largest rung predicted within the limit (the boundary it
proposes); a rung predicted over the limit by more than the model's stated error (from
:data:`tuner.memory_model.MIN_LOO_SAMPLES` probes on) is ruled out without a probe, and the fit's table says so
with the figure and the error. Pure: :func:`proposals` takes any predictor; :func:`model_predictor` makes one
from a calibrated model and the fit's base config.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

from trainer.contracts import PHASES
from tuner.fit.boundary import PREDICTED, FitState, KnobFit, Observation
from tuner.fit.ladder import SizeKnob

__all__ = ["Predictor", "proposals", "model_predictor", "knob_values"]

#: rungs of every knob -> predicted peak per phase (GB, on the memory objective's basis)
Predictor = Callable[[Mapping[str, int]], Mapping[str, float]]


def knob_values(knobs: list[SizeKnob], rungs: Mapping[str, int]) -> dict:
    """``{key: value}`` of the knobs at ``rungs``."""
    return {k.key: k.ladder[rungs[k.key]] for k in knobs}


def _own(f: KnobFit, by_phase: Mapping[str, float]) -> float:
    return max((by_phase.get(p, 0.0) for p in f.knob.phases), default=0.0)


def proposals(
    state: FitState,
    predict: Predictor,
    *,
    start: Mapping[str, int],
    limit_gb: float,
    error: Optional[float] = None,
) -> tuple[dict, list[tuple[str, Observation]]]:
    """(each open knob's proposed rung, the rungs ruled out by prediction: ``(key, Observation)`` not yet
    recorded). ``error``: the model's stated relative error (None: it rules nothing out)."""
    held = {f.key: f.lo if f.lo >= 0 else max(start.get(f.key, 0), f.floor + 1) for f in state.fits}
    out, ruled = {}, []
    for f in state.fits:
        if f.settled or f.pending_repeat:
            continue
        predicted = {r: _own(f, predict({**held, f.key: r})) for r in range(f.low + 1, f.hi)}
        within = [r for r, gb in predicted.items() if gb <= limit_gb]
        out[f.key] = max(within) if within else f.low + 1
        if error is not None:
            over = [r for r, gb in predicted.items() if r > out[f.key] and gb / (1.0 + error) > limit_gb]
            if over:
                r = min(over)
                ruled.append((f.key, Observation(r, PREDICTED, predicted_gb=predicted[r], error=error)))
    return out, ruled


def model_predictor(model, base_flat: Mapping, knobs: list[SizeKnob]) -> Predictor:
    """A :data:`Predictor` from a calibrated :class:`tuner.memory_model.MemoryModel`: the base config with the knobs
    at the rungs, predicted at the worst case; each phase plus the model's objective offset (what NVML sees beyond
    the allocator), as the probes' peaks are judged."""

    def predict(rungs: Mapping[str, int]) -> dict:
        pred = model.predict({**base_flat, **knob_values(knobs, rungs)}, worst_case=True)
        return {p: pred.by_phase_gb[p] + model.objective_offset_gb for p in PHASES if p in pred.by_phase_gb}

    return predict
