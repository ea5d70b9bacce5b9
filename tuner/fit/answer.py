"""A fit's answer, knob by knob: the value, its measured worst-case peak, the next value up and why it does not fit,
the memory model's figure beside each measurement. What ``fit.yaml``'s header, ``why.md``, ``fit.json`` and the
report show (:mod:`tuner.results.fit_files` writes them). Pure: read from a :class:`~tuner.fit.boundary.FitState`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from tuner.fit.boundary import FITS, OOM, OVER, PREDICTED, TOO_SMALL, FitState, KnobFit, Observation

__all__ = ["KnobAnswer", "knob_answers", "answer_values"]


@dataclass(frozen=True)
class KnobAnswer:
    """One row of the fit's table."""

    key: str
    role: str
    value: Any  # the largest value that fits (None: not even the smallest does)
    base: Any  # the base config's value
    peak_gb: Optional[float]  # its passes' measured worst-case peak at ``value`` (objective basis)
    predicted_gb: Optional[float]  # the memory model's figure for the same, when it had one
    next_value: Any  # the next value up (None: the top of the ladder)
    next_why: str  # why the next value up does not fit (measured OOM / over, or predicted), or "top of the ladder"
    next_verdict: Optional[str]  # oom | over | predicted | None
    next_peak_gb: Optional[float]  # measured peak over the limit, when that is why
    next_predicted_gb: Optional[float]  # the model's figure for the next value up, when it had one
    probes: int  # probes that measured this knob
    ladder: tuple = ()  # every value it could take
    floor_value: Any = None  # the largest value too small (a vLLM share that holds no sequence), None: none seen

    def to_dict(self) -> dict:
        return asdict(self)


def answer_values(state: FitState) -> dict:
    """``{key: value}`` of the answer (knobs with no fitting value left out)."""
    return {f.key: f.knob.ladder[f.lo] for f in state.fits if f.lo >= 0}


def _measured(f: KnobFit) -> Optional[Observation]:
    """The latest fitting observation at the knob's value that has a figure (else the latest fitting one)."""
    here = [o for o in f.at(f.lo) if o.verdict == FITS]
    with_peak = [o for o in here if o.peak_gb is not None]
    return (with_peak or here or [None])[-1]


def _why(f: KnobFit, limit_gb: float) -> tuple[str, Optional[str], Optional[float], Optional[float]]:
    """(why the next value up does not fit, its verdict, its measured peak, the model's figure)."""
    if f.hi >= len(f.knob.ladder):
        return "top of the ladder", None, None, None
    fails = [o for o in f.at(f.hi) if o.verdict not in (FITS, TOO_SMALL)]
    if not fails:
        return "not measured", None, None, None
    last = fails[-1]
    pred = next((o.predicted_gb for o in reversed(fails) if o.predicted_gb is not None), None)
    if last.verdict == PREDICTED:
        return (
            f"predicted {last.predicted_gb:.3f} GB, over the {limit_gb:.3f} GB limit by more than the memory model's "
            f"error ({last.error:.0%}): not probed",
            PREDICTED,
            None,
            last.predicted_gb,
        )
    if last.verdict == OVER:
        where = f" in {last.phase}" if last.phase else ""
        return (
            f"measured {last.peak_gb:.3f} GB{where} > the {limit_gb:.3f} GB limit (probe #{last.probe})",
            OVER,
            (last.peak_gb),
            pred,
        )
    ooms = [o for o in fails if o.verdict == OOM]
    runs = len([o for o in f.at(f.hi) if o.probe is not None])
    where = f" in {last.phase}" if last.phase else ""
    expected = " (the model put it over the limit)" if last.expected else ""
    probes = ", ".join(f"#{o.probe}" for o in ooms)
    return (
        f"out of memory{where} under the {limit_gb:.3f} GB cap, {len(ooms)} of {runs} probes ({probes}){expected}",
        OOM,
        None,
        pred,
    )


def _none_fits(f: KnobFit, why: str) -> str:
    """Why no value of the knob fits: the smallest fails, or none is left between the floor and what fails."""
    if f.floor < 0:
        return f"not even {f.knob.ladder[0]} fits: {why}"
    small = f"vLLM's share holds no sequence at {f.knob.ladder[f.floor]} or below"
    return small if f.hi >= len(f.knob.ladder) else f"{small}, and {f.knob.ladder[f.hi]} does not fit: {why}"


def knob_answers(state: FitState, *, limit_gb: float) -> list[KnobAnswer]:
    """The table: one row per knob, in the order their passes run."""
    rows = []
    for f in state.fits:
        got = _measured(f) if f.lo >= 0 else None
        why, verdict, next_peak, next_pred = _why(f, limit_gb)
        rows.append(
            KnobAnswer(
                key=f.key,
                role=f.knob.role,
                value=f.knob.ladder[f.lo] if f.lo >= 0 else None,
                base=f.knob.base,
                peak_gb=got.peak_gb if got is not None else None,
                predicted_gb=got.predicted_gb if got is not None else None,
                next_value=f.knob.ladder[f.hi] if f.hi < len(f.knob.ladder) else None,
                next_why=why if f.lo >= 0 or not f.impossible else _none_fits(f, why),
                next_verdict=verdict,
                next_peak_gb=next_peak,
                next_predicted_gb=next_pred,
                probes=len({o.probe for o in f.observations if o.probe is not None}),
                ladder=tuple(f.knob.ladder),
                floor_value=f.knob.ladder[f.floor] if f.floor >= 0 else None,
            )
        )
    return rows
