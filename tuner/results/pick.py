"""Which trial ``ppotune export`` recommends: the decision alone, no file written.

:func:`choose` takes a study and a ``--pick`` and returns a :class:`Choice`: the chosen trial, the
runner-up, the ranking and why the pick does (or does not) rest on a confirmation. The report shows the
same choice (:mod:`tuner.results.analysis`), export writes it out (:mod:`tuner.results.export`) and
why.md explains it (:mod:`tuner.results.why`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pandas as pd

from trainer.contracts import DEFAULT_HEADROOM, Status, StorageError
from tuner.results.view import StudyView
from tuner.rules.finalists import CONFIRMATION_ATTR, entry_of, rank_confirmed
from tuner.study.frame import Fit, headroom_filter, measured_feasible, pareto_mask
from tuner.study.selection import PICKS, rank_trials
from tuner.trials.probe import WORST_CASE_ATTR, ProbeResult

__all__ = ["PICKS", "Choice", "NoFit", "choose", "pct", "trial_row", "worst_case_text"]


class NoFit(StorageError):
    """No feasible trial satisfies the request (message is the one line the user sees)."""


@dataclasses.dataclass
class Choice:
    pick: str
    headroom: float
    device_gb: Optional[float]
    device_label: str
    limit_gb: Optional[float]  # peak memory must be <= this; None = no filter
    chosen: int  # trial number
    runner_up: Optional[int]
    ranking: list[int]  # feasible trials under the limit, best first by ``pick`` (confirmed: the confirmed ones)
    front: list[int]  # the feasible Pareto front under the limit
    warning: Optional[str] = None
    confirmation: Optional[dict] = None  # the study's ``confirmation`` attribute (tuner.rules.finalists.aggregate)
    confirmed: Optional[dict] = None  # the chosen config's confirmed figures (an entry of it), if it has them
    unconfirmed: Optional[str] = None  # why the pick does not rest on a confirmation (None: it does)
    left_out: list = dataclasses.field(default_factory=list)  # (number, why): confirmed configs not eligible
    worst_case: Optional[dict] = None  # the pick's worst-case probe (ProbeResult.to_dict), if it was probed


def pct(f: float) -> str:
    """A headroom as the user typed it in percent: 0.1 -> ``10%``."""
    return f"{f * 100:g}%"


def trial_row(view: StudyView, number: int) -> pd.Series:
    """Trial ``number``'s row of the study's table."""
    df = view.trials
    return df.loc[df["number"] == number].iloc[0]


def choose(view: StudyView, *, pick: str = "max-throughput", headroom: float = DEFAULT_HEADROOM) -> Choice:
    """The trial ``pick`` selects among feasible trials with peak <= (1 - headroom) x device memory.

    - ``max-throughput``: the fastest (ties: less memory);
    - ``min-memory``: the smallest peak (ties: faster);
    - ``knee``: the Pareto point furthest above the chord joining the front's ends, both
      objectives scaled to [0, 1] over the front (no point above it: the faster end).

    ``max-throughput`` on a study holding a confirmation (``ppotune search --confirm R``, on by default)
    ranks the confirmed configs instead, by the median of their paired throughput ratios to the baseline
    (:func:`tuner.rules.finalists.rank_confirmed`; still only trials under the limit, a confirmed peak over it or a
    failed re-run leaves a config out); without one, or with no eligible confirmed config, the single
    trials as above, and ``Choice.unconfirmed`` says why. Raises :class:`NoFit` when nothing qualifies.
    """
    _check_request(pick, headroom)
    df = view.trials
    fit = _fit(view, headroom)
    front_mask = pareto_mask(df, among=fit.mask)
    confirmation = view.attrs.get(CONFIRMATION_ATTR) or None
    ranking, unconfirmed, left_out = _by_confirmation(
        confirmation, pick, rank_trials(df, fit.mask, front_mask, pick), fit.limit_gb
    )
    probes = {int(k): ProbeResult.from_dict(v) for k, v in (view.attrs.get(WORST_CASE_ATTR) or {}).items()}
    ranking, left_out = _without_broken_worst_cases(ranking, probes, fit.limit_gb, left_out)
    chosen = ranking[0]
    return Choice(
        pick=pick,
        headroom=headroom,
        device_gb=fit.device_gb,
        device_label=fit.device_label,
        limit_gb=fit.limit_gb,
        chosen=chosen,
        runner_up=_runner_up(view, ranking),
        ranking=ranking,
        front=[int(n) for n in df.loc[front_mask, "number"]],
        warning=fit.warning,
        confirmation=confirmation,
        confirmed=entry_of(confirmation, chosen),
        unconfirmed=unconfirmed,
        left_out=left_out,
        worst_case=probes[chosen].to_dict() if chosen in probes else None,
    )


def _check_request(pick: str, headroom: float) -> None:
    if pick not in PICKS:
        raise ValueError(f"pick must be one of {PICKS}, got {pick!r}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"memory headroom must be in [0, 1), got {headroom}")


def _fit(view: StudyView, headroom: float) -> Fit:
    """The trials a pick may take (:func:`~tuner.study.frame.headroom_filter`); :class:`NoFit` when there
    are none: no trial, no feasible one, or none under the limit."""
    df = view.trials
    if df.empty:
        raise NoFit(f"study {view.name!r} has no trials")
    feasible = measured_feasible(df)
    if not feasible.any():
        counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().items())
        raise NoFit(f"no feasible trial in study {view.name!r} ({counts})")
    fit = headroom_filter(df, view.attrs, headroom)
    if not fit.mask.any():
        smallest = df.loc[feasible, "peak_memory_gb"].min()
        raise NoFit(
            f"no feasible trial keeps {pct(headroom)} of {fit.device_gb:.1f} GB free (smallest peak: {smallest:.1f} GB)"
        )
    return fit


def _by_confirmation(
    confirmation: Optional[dict], pick: str, ranking: list[int], limit_gb: Optional[float]
) -> tuple[list[int], Optional[str], list]:
    """(the ranking, why it is unconfirmed or None, confirmed configs left out): the confirmed configs'
    ranking where ``pick`` and the study allow it, else the single trials' and why."""
    if pick != "max-throughput":
        return ranking, f"--pick {pick} ranks the search's single trials (the confirmation ranks by throughput)", []
    if not confirmation:
        why = "the study holds no confirmation (ppotune search --confirm 0, or the search has not got there)"
        return ranking, why, []
    confirmed, left_out = rank_confirmed(confirmation, eligible=ranking, limit_gb=limit_gb)
    if confirmed:
        return [e["number"] for e in confirmed], None, left_out
    return ranking, "no confirmed config is eligible: " + "; ".join(f"#{n} {why}" for n, why in left_out), left_out


def _without_broken_worst_cases(
    ranking: list[int], probes: dict[int, ProbeResult], limit_gb: Optional[float], left_out: list
) -> tuple[list[int], list]:
    """The ranking less the configs whose probe (every prompt and response at its maximum) breaks the
    limit: such a config is never recommended, the next one is taken. :class:`NoFit` when none is left."""
    broken = {n: probes[n] for n in ranking if n in probes and not _worst_case_holds(probes[n], limit_gb)}
    left_out = left_out + [(n, f"worst case {worst_case_text(p, limit_gb)}") for n, p in broken.items()]
    ranking = [n for n in ranking if n not in broken]
    if not ranking:
        raise NoFit(
            "every config under the limit breaks it in its worst case (ppotune probe): "
            + "; ".join(f"#{n} {why}" for n, why in left_out)
        )
    return ranking, left_out


def _runner_up(view: StudyView, ranking: list[int]) -> Optional[int]:
    """The best-ranked config after the first whose knobs differ from it (a re-run of the pick is no runner-up)."""
    params = {n: view.trial(n).params for n in ranking}
    return next((n for n in ranking[1:] if params[n] != params[ranking[0]]), None)


def _worst_case_holds(probe: ProbeResult, limit_gb: Optional[float]) -> bool:
    """False when the probe ran out of memory or peaked over the limit. A probe that failed otherwise (a
    crash, a hang) measured nothing: why.md says so, it does not decide."""
    if probe.status == Status.OOM:
        return False
    return not (probe.fits and limit_gb is not None and (probe.peak_memory_gb or 0.0) > limit_gb)


def worst_case_text(probe: ProbeResult, limit_gb: Optional[float]) -> str:
    """A probe's outcome in a few words: ``peak 75 GB > 72 GB``, ``ran out of memory in phase gen``."""
    if probe.status == Status.OOM:
        return f"ran out of memory in phase {probe.oom_phase or '?'}"
    if not probe.fits:
        return f"not measured (probe {probe.status.value}: {probe.error or 'no result'})"
    over = f" > {limit_gb:.3g} GB" if limit_gb is not None and (probe.peak_memory_gb or 0.0) > limit_gb else ""
    return f"peak {probe.peak_memory_gb:.3g} GB{over}"
