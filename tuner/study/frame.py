"""A study as a table: one row per trial (:func:`trials_frame`), the measured feasible trials, the Pareto front
(max throughput, min peak memory; defined once, by :func:`pareto_mask`) and the headroom filter a
recommendation keeps (:func:`headroom_filter`).

Read by the after-search stages (which configs to confirm and probe), by export and the report (through
:mod:`tuner.results.view`) and by ``ppotune search``'s summary: the one place these rules live.

Every trial is checked against the schema first (:func:`tuner.study.schema.read_trial`): one that does not fit
(wrong types, non-finite figures, an unknown status, overrides outside the study's space) is left out of the
table, and ``df.attrs["skipped"]`` says which and why.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import optuna
import pandas as pd

from trainer.contracts import DEFAULT_HEADROOM, PHASES, Status, TrialRecord
from tuner.space import from_params
from tuner.study.schema import override_keys_of, read_trial

__all__ = [
    "MEMORY_FIELDS",
    "PARAM_PREFIX",
    "TIME_PREFIX",
    "MEM_PREFIX",
    "trials_frame",
    "pareto_mask",
    "pareto_front",
    "measured_feasible",
    "device_memory_gb",
    "knob_columns",
    "missing",
    "value_or_zero",
    "Fit",
    "headroom_filter",
]

#: trial user_attr ``memory`` fields, external (outside the trial) first
MEMORY_FIELDS = (
    "external_peak_gb",
    "device_used_peak_gb",
    "allocated_peak_gb",
    "reserved_peak_gb",
    "rss_peak_gb",
)
#: column prefixes of :func:`trials_frame`: a knob, a phase's median seconds, a memory field
PARAM_PREFIX = "params."
TIME_PREFIX = "time."
MEM_PREFIX = "mem."


def device_memory_gb(study_attrs: dict) -> tuple[Optional[float], str]:
    """The memory a config must fit: the cap the trials ran under, else the device's.

    Returns (GB or None, a label saying which). On CPU a cap is a data-size rlimit
    per rank on top of what the process maps after import, which no RSS figure can be
    held against; there the machine's RAM is the bound (the trials that finished under
    the cap have fit it by construction).
    """
    cap = study_attrs.get("memory_limit_gb")
    dev = study_attrs.get("device") or {}
    total = dev.get("memory_total_gb")
    name = dev.get("name") or dev.get("kind") or "device"
    if cap is not None and dev.get("kind") != "cpu":
        return float(cap), f"memory cap {float(cap):g} GB (--memory-limit-gb)"
    if total is not None:
        label = f"{name} memory {float(total):.1f} GB"
        if cap is not None:
            label += f" (the CPU cap of {float(cap):g} GB per rank is an rlimit, not comparable with RSS)"
        return float(total), label
    return None, "device memory unknown"


def knob_columns(df: pd.DataFrame) -> list[str]:
    """The knob names (dotted config keys) present in a :func:`trials_frame`."""
    return [c[len(PARAM_PREFIX) :] for c in df.columns if c.startswith(PARAM_PREFIX)]


def _num(v: Any) -> Optional[float]:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def missing(v: Any) -> bool:
    """None, NaN or pd.NA: a value the trial does not have."""
    if v is None or v is pd.NA:
        return True
    return isinstance(v, float) and math.isnan(v)


def value_or_zero(v: Any) -> float:
    """A float, 0.0 where :func:`missing`."""
    return 0.0 if missing(v) else float(v)


def _status(t: optuna.trial.FrozenTrial, record: TrialRecord) -> str:
    """The trial's :class:`Status` value; without one (still running, or a status this
    reader does not know), what Optuna's state says."""
    if record.status is not None:
        return record.status.value
    if t.state == optuna.trial.TrialState.FAIL:
        return Status.CRASH.value  # a trial the tuner never classified (e.g. a stale heartbeat)
    return t.state.name.lower()  # "running", "waiting"


def trials_frame(study: optuna.Study) -> pd.DataFrame:
    """One row per trial, whatever its state (inferred OOMs and failures included).

    Columns: number, state, status (a :class:`Status` value, or ``running``/``waiting``),
    baseline, feasible, pareto, throughput, throughput_cv, throughput_ci_low/high (its 90% interval),
    measured_steps, step_s, peak_memory_gb,
    memory_source, ``mem.<field>`` (:data:`MEMORY_FIELDS`), ``time.<phase>`` (:data:`PHASES`),
    duration_s, value_throughput / value_memory (the objective values Optuna holds,
    penalized for OOM), inferred_from, confirm_of, duplicate_of, notes, error,
    datetime_start/complete, and ``params.<dotted key>`` for every knob (its value: a power-of-two
    knob's Optuna param ``log2:<key>`` is decoded, see :func:`tuner.space.from_params`).
    A trial that does not fit the schema is left out; ``df.attrs["skipped"]`` lists them with the reason.
    """
    rows, skipped = [], []
    keys = override_keys_of(study.user_attrs.get("space"))
    for t in study.get_trials(deepcopy=False):
        attrs, why = read_trial(t, override_keys=keys)
        if attrs is None:
            skipped.append(f"trial #{t.number} skipped: {why}")
            continue
        rows.append(_row(t, TrialRecord.from_user_attrs(attrs)))
    return _table(rows, skipped)


def _row(t: optuna.trial.FrozenTrial, rec: TrialRecord) -> dict:
    """One trial's row of :func:`trials_frame` (its user attributes already checked and typed)."""
    status = _status(t, rec)
    values = t.values if t.values is not None and len(t.values) >= 2 else (None, None)
    feasible = (
        t.state == optuna.trial.TrialState.COMPLETE
        and rec.status is not None
        and rec.status.feasible
        and all(c <= 0.0 for c in t.constraints.values())
    )
    throughput = _num(rec.throughput)
    peak = _num(rec.peak_memory_gb)
    if feasible:
        throughput = throughput if throughput is not None else _num(values[0])
        peak = peak if peak is not None else _num(values[1])
    duration = _num(rec.duration_s)
    launched = rec.status is None or rec.status.launched
    if duration is None and launched and t.datetime_start and t.datetime_complete:
        duration = (t.datetime_complete - t.datetime_start).total_seconds()
    row = {
        "number": t.number,
        "state": t.state.name,
        "status": status,
        "baseline": bool(rec.baseline),
        "feasible": feasible,
        "throughput": throughput,
        "throughput_cv": _num(rec.throughput_cv),
        "throughput_ci_low": _num((rec.throughput_ci or [None, None])[0]),
        "throughput_ci_high": _num((rec.throughput_ci or [None, None])[-1]),
        "measured_steps": _num(rec.measured_steps),
        "step_s": _num(rec.step_s),
        "peak_memory_gb": peak,
        "memory_source": rec.memory_source or rec.memory.get("external_source"),
        "value_throughput": _num(values[0]),
        "value_memory": _num(values[1]),
        "duration_s": duration,
        "inferred_from": rec.inferred_from,
        "confirm_of": rec.confirm_of,
        # the tuner records a re-sampled config without re-running it (values copied)
        "duplicate_of": rec.duplicate_of,
        "notes": "; ".join(str(n) for n in rec.notes),
        "error": rec.error,
        "datetime_start": t.datetime_start,
        "datetime_complete": t.datetime_complete,
    }
    for f in MEMORY_FIELDS:
        row[MEM_PREFIX + f] = _num(rec.memory.get(f))
    for p in PHASES:
        row[TIME_PREFIX + p] = _num(rec.timing_s.get(p))
    for k, v in sorted(from_params(t.params).items()):  # knob values, not Optuna's exponents
        row[PARAM_PREFIX + k] = v
    return row


def _table(rows: list[dict], skipped: list[str]) -> pd.DataFrame:
    """The rows as :func:`trials_frame`'s table: the Pareto column, params last, typed columns, by number."""
    df = pd.DataFrame(rows)
    df.attrs["skipped"] = skipped
    if df.empty:
        return df
    df["pareto"] = pareto_mask(df)
    # params last, everything else in the order above
    front = [c for c in df.columns if not c.startswith(PARAM_PREFIX)]
    params = sorted(c for c in df.columns if c.startswith(PARAM_PREFIX))
    df = df[front + params]
    for c in ("inferred_from", "confirm_of", "duplicate_of"):
        df[c] = df[c].astype("Int64")
    # text columns hold None when absent (pandas >= 3 would make them NaN, which is truthy)
    for c in ("memory_source", "error"):
        df[c] = df[c].astype(object).where(df[c].notna(), None)
    df = df.sort_values("number").reset_index(drop=True)
    df.attrs["skipped"] = skipped
    return df


def measured_feasible(df: pd.DataFrame) -> pd.Series:
    """Feasible trials with both objectives measured, each config once (duplicates and ``--confirm``
    re-runs left out: a re-run's figures are aggregated in the study attribute ``confirmation``)."""
    if df.empty:
        return pd.Series(dtype=bool)
    return (
        df["feasible"].astype(bool)
        & df["throughput"].notna()
        & df["peak_memory_gb"].notna()
        & df["duplicate_of"].isna()
        & df["confirm_of"].isna()
    )


def pareto_mask(df: pd.DataFrame, among: Optional[pd.Series] = None) -> pd.Series:
    """The Pareto front: :func:`measured_feasible` trials no other one dominates in
    (max throughput, min peak memory). Ties are all on the front.

    ``among`` restricts the candidates further (e.g. to those under a headroom).
    """
    mask = pd.Series(False, index=df.index)
    cand = measured_feasible(df)
    if among is not None:
        cand &= among.astype(bool)
    if not cand.any():
        return mask
    thr = df.loc[cand, "throughput"].to_numpy(dtype=float)
    mem = df.loc[cand, "peak_memory_gb"].to_numpy(dtype=float)
    # [i, j]: trial j is at least as good as trial i on both objectives, and better on one
    no_worse = (thr[None, :] >= thr[:, None]) & (mem[None, :] <= mem[:, None])
    better = (thr[None, :] > thr[:, None]) | (mem[None, :] < mem[:, None])
    mask.loc[cand] = ~(no_worse & better).any(axis=1)
    return mask


def pareto_front(df: pd.DataFrame) -> list[int]:
    """The trial numbers on a :func:`trials_frame`'s Pareto front, fastest first."""
    if df.empty:
        return []
    front = df.loc[df["pareto"]].sort_values(["throughput", "number"], ascending=[False, True])
    return [int(n) for n in front["number"]]


@dataclasses.dataclass(frozen=True)
class Fit:
    """Which trials a recommendation may take: measured feasible ones that keep the headroom free."""

    mask: pd.Series  # over the trials frame's rows
    limit_gb: Optional[float]  # peak memory must be <= this; None = no filter (device memory unknown)
    device_gb: Optional[float]
    device_label: str
    warning: Optional[str] = None


def headroom_filter(df: pd.DataFrame, attrs: dict, headroom: float = DEFAULT_HEADROOM) -> Fit:
    """:func:`~tuner.results.view.measured_feasible` trials with peak <= (1 - headroom) x the device memory
    (:func:`~tuner.results.view.device_memory_gb`): the one filter export, the report and the search's
    ``--confirm`` finalists share."""
    device_gb, device_label = device_memory_gb(attrs)
    feasible = measured_feasible(df)
    if device_gb is None:
        why = "device memory unknown (no device.memory_total_gb or memory_limit_gb in the study): no headroom filter"
        return Fit(feasible, None, None, device_label, why)
    limit = (1.0 - headroom) * device_gb
    return Fit(feasible & (df["peak_memory_gb"] <= limit + 1e-9), limit, device_gb, device_label)
